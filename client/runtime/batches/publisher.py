"""The baseline's side of batch sync: publish each step's batch to the server, off the training thread.

``publish`` only queues an already copied batch (``twinstep.runtime.batches.wire.capture``)
and wakes one named daemon thread, which encodes it and sends it with the
unary ``PublishBatch`` RPC.  Fail-open as everything on the training side:
the queue is bounded (steps and bytes; the oldest batch is dropped, counted
and warned once), an RPC has a deadline, a server that is away is retried
with backoff for a while and then the batch is dropped and counted; nothing
ever raises into training, and ``close`` is bounded by its timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import grpc

from twinstep._retry import Backoff, Retry, retry_on
from twinstep.runtime.batches import wire
from twinstep.runtime.transport.ledger import at_fork_in_child
from twinstep.runtime.transport.security import ClientSecurity
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

logger = logging.getLogger("twinstep")

#: Batches queued before the oldest is dropped (a candidate behind by more asks the server, which holds more).
MAX_QUEUED = 256
MAX_QUEUED_BYTES = 1 << 30
#: Deadline of one PublishBatch, and how long a batch is retried while the server is away.
_RPC_TIMEOUT = 30.0
_RETRY_FOR = 60.0
_BACKOFF = Backoff(0.2, 5.0)
#: gRPC's default 4 MiB would refuse larger batches; the server accepts up to batch_max_bytes (48 MiB).
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass
class PublishStats:
    """Counters of one publisher (read from any thread)."""

    published: int = 0
    """Batches the server took."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Batches not delivered, by reason: queue_full, refused, unreachable, shutdown."""
    bytes_sent: int = 0


class BatchPublisher:
    """Publishes one baseline rank's batches; see the module docstring."""

    def __init__(self, target: str, security: ClientSecurity, session: str, run: str, rank: int) -> None:
        self._target = target
        self._security = security
        self._session, self._run, self._rank = session, run, rank
        self.stats = PublishStats()
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, Any, int]] = deque()  # (step, captured batch, bytes)
        self._queued_bytes = 0
        self._closing = False
        self._stop = threading.Event()  # set by close(): ends a retry's wait at once
        self._busy = False
        self._warned: set[str] = set()
        self._thread: threading.Thread | None = None
        at_fork_in_child(self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        # A data-loader worker must not publish with its parent's thread and queue.
        self._cond = threading.Condition()
        self._queue = deque()
        self._closing = True
        self._stop = threading.Event()
        self._stop.set()
        self._thread = None

    def publish(self, step: int, captured: Any) -> None:
        """Queue one copied batch; never blocks. Beyond the bounds the oldest queued batch is dropped."""
        size = wire.nbytes(captured)
        with self._cond:
            if self._closing:
                self._drop("shutdown", step, "the monitor is closed")
                return
            self._queue.append((step, captured, size))
            self._queued_bytes += size
            # Drop from the old end: the newest batch is the one a candidate in step asks for next.
            while len(self._queue) > 1 and (len(self._queue) > MAX_QUEUED or self._queued_bytes > MAX_QUEUED_BYTES):
                old_step, _, old_size = self._queue.popleft()
                self._queued_bytes -= old_size
                self._drop("queue_full", old_step, f"more than {MAX_QUEUED} batches waited to be sent")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run_loop, name="twinstep-batch-publisher", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def close(self, timeout: float) -> None:
        """Send what is queued, within ``timeout`` seconds; what is left is dropped and counted."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._stop.set()
            self._cond.notify_all()
            while (self._queue or self._busy) and self._thread is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.1))
            for step, _, _ in self._queue:
                self._drop("shutdown", step, f"not sent within {timeout:.0f} s of close()")
            self._queue.clear()
            self._queued_bytes = 0

    # -- the publisher thread --------------------------------------------------------------------

    def _run_loop(self) -> None:
        channel = self._security.channel(self._target, CHANNEL_OPTIONS)
        stub = pb_grpc.TwinstepStub(channel)
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closing:
                        self._cond.wait(1.0)
                    if not self._queue:
                        return
                    step, captured, size = self._queue.popleft()
                    self._queued_bytes -= size
                    self._busy = True
                try:
                    self._send(stub, step, captured)
                except Exception as error:  # a bug here must not stop publishing, nor reach training
                    self._drop("error", step, f"{type(error).__name__}: {error}")
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        finally:
            channel.close()

    def _send(self, stub: pb_grpc.TwinstepStub, step: int, captured: Any) -> None:
        message = pb.PublishedBatch(session=self._session, run=self._run, rank=self._rank, step=step,
                                    value=wire.to_proto(captured))
        retry = Retry(_BACKOFF, retryable=retry_on(_RETRYABLE), timeout=_RETRY_FOR, stop=self._stop)
        while True:
            try:
                stub.PublishBatch(message, timeout=_RPC_TIMEOUT, metadata=self._security.metadata())
                with self._cond:
                    self.stats.published += 1
                    self.stats.bytes_sent += message.ByteSize()
                return
            except grpc.RpcError as error:
                # Once closing, each batch left has one try; close() cutting a wait short gives it that try.
                if not self._closing and (retry.again(error) or retry.ended == "stopped"):
                    continue
                code = error.code() if hasattr(error, "code") else None
                reason = "unreachable" if retry.retryable(error) else "refused"
                self._drop(reason, step, f"{code.name if code else 'error'}: "
                           f"{error.details() if hasattr(error, 'details') else error}")
                return

    def _drop(self, reason: str, step: int, detail: str) -> None:
        """Count a batch not delivered; warn once per reason (a candidate waiting for it will time out)."""
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("twinstep: the batch of step %d (run %r rank %d) was not published (%s: %s); training "
                           "continues, a candidate syncing batches will not get it; later drops of this kind are "
                           "counted (Monitor.batch_stats)", step, self._run, self._rank, reason, detail)
