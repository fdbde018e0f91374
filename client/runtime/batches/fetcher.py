"""The candidate's side of batch sync: fetch the baseline's batch of a step, waiting a bounded time for it.

This is the one place where twinstep makes a training wait on purpose (the
user asked for it: ``Monitor.baseline_batch``, ``attach(sync_batches=True)``).
The wait is a loop of short ``GetBatch`` calls (the server holds each for at
most a few seconds), so a halt, a server restart or the overall deadline is
noticed within seconds.  What cannot be had raises :class:`BatchSyncError`
saying why and what to do; nothing else of batch sync raises into training.
"""

from __future__ import annotations

import time
from typing import Callable

import grpc

from twinstep._retry import Backoff, Retry, retry_on
from twinstep.runtime.batches.publisher import CHANNEL_OPTIONS
from twinstep.errors import BatchSyncError
from twinstep.runtime.transport.security import ClientSecurity
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

#: Longest the server is asked to hold one GetBatch.
POLL_SECONDS = 2.0
#: Allowance on top of the server's wait for the RPC's own deadline (transfer of a large batch).
_TRANSFER_SECONDS = 30.0
_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
#: While the server is away: a try about every half second (the training is waiting for this batch).
_BACKOFF = Backoff(0.5, 0.5)


class Interrupted(Exception):
    """The wait was interrupted (the run is halting)."""


class BatchFetcher:
    """Fetches one candidate rank's batches; used from the training thread."""

    def __init__(self, target: str, security: ClientSecurity, session: str, run: str, rank: int) -> None:
        self._security = security
        self._target = target
        self._session, self._run, self._rank = session, run, rank
        self._channel = security.channel(target, CHANNEL_OPTIONS)
        self._stub = pb_grpc.TwinstepStub(self._channel)
        self.fetched = 0
        self.waited_seconds = 0.0
        """Time spent waiting for batches, over every fetch."""

    def fetch(self, step: int, timeout: float, interrupted: Callable[[], bool]) -> pb.PublishedBatch:
        """The baseline's batch of ``step`` for this rank; BatchSyncError when it cannot be had in ``timeout`` s."""
        start = time.monotonic()
        retry = Retry(_BACKOFF, retryable=retry_on(_RETRY_CODES), timeout=timeout)
        waiting_for = "the server did not answer"
        try:
            while True:
                if interrupted():
                    raise Interrupted()
                wait = min(POLL_SECONDS, retry.remaining())
                request = pb.BatchRequest(session=self._session, run=self._run, rank=self._rank, step=step,
                                          wait_seconds=wait)
                try:
                    reply = self._stub.GetBatch(request, timeout=wait + _TRANSFER_SECONDS,
                                                metadata=self._security.metadata())
                except grpc.RpcError as error:
                    code = error.code() if hasattr(error, "code") else None
                    details = error.details() if hasattr(error, "details") else str(error)
                    if not retry.retryable(error):
                        raise BatchSyncError(f"twinstep: no baseline batch for step {step} of rank {self._rank} "
                                             f"(session {self._session!r}): {details}") from None
                    waiting_for = f"the server at {self._target} is unreachable ({code.name})"
                    # No wait past the deadline: then the timeout below is raised at once.
                    retry_now = retry.again(error)
                else:
                    if reply.ready:
                        self.fetched += 1
                        return reply.batch
                    waiting_for = reply.waiting_for
                    retry_now = True
                if not retry_now or retry.remaining() <= 0:
                    raise BatchSyncError(
                        f"twinstep: the baseline's batch of step {step} (rank {self._rank}, session "
                        f"{self._session!r}) did not come within {timeout:g} s: {waiting_for}. Is the baseline "
                        "running and publishing (Monitor.publish_batch, attach(publish_batches=True))? Raise "
                        "batch_timeout if it is only slow, or stop syncing batches (sync_batches=False).")
        finally:
            self.waited_seconds += time.monotonic() - start

    def close(self) -> None:
        self._channel.close()
