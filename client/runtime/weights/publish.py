"""A baseline's side of weight sync: copy the initial parameters at attach, upload them in the background.

``attach(..., share_weights=True)`` on the baseline (rank 0 only: every rank
of a data-parallel run holds the same values).  The copy is taken on the
training thread inside ``attach``, before the first step can change a
parameter; it costs one host copy of the model (its size in memory, held
until the upload is done) and its time: 0.24 to 0.51 s for 400 MiB of CPU
float32 parameters on a shared 2-core machine (benchmarks/weight_sync.py).  A daemon thread uploads it in pieces (twinstep.wire.weight_pieces),
retrying while the server is unreachable, and never touches the training:
a failed upload logs one warning, and candidates waiting for the weights are
told by the server.  ``close`` waits for the upload at most its timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterator

import grpc
import numpy as np

from twinstep._retry import Backoff, Retry, retry_unless, status_code
from twinstep.runtime.capture.base import CaptureBackend
from twinstep.wire.codec import DTYPE_TO_WIRE
from twinstep.runtime.transport.security import ClientSecurity, explain
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc
from twinstep.wire.weight_pieces import pieces

logger = logging.getLogger("twinstep")

#: Longest the uploader keeps trying to reach the server.
GIVE_UP_SECONDS = 600.0
_BACKOFF = Backoff(0.5, 10.0)
#: Refusals no retry can change; any other error is retried.
_FATAL = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED})


class WeightPublisher:
    """The baseline's initial parameters: copied now, uploaded by one daemon thread."""

    def __init__(self, model: Any, backend: CaptureBackend, *, session: str, run: str, target: str,
                 security: ClientSecurity, compress: bool = False) -> None:
        started = time.monotonic()
        self._header = pb.WeightsHeader(session=session, run=run, framework=backend.framework)
        self._arrays: list[np.ndarray] | None = []
        for pid, (name, param, owner, owner_type) in enumerate(backend.named_parameters(model)):
            dtype, shape = backend.describe(param)
            copy, _ = backend.host_copy(param)
            self._arrays.append(backend.storage_array(copy))
            self._header.parameters.add(id=pid, name=name, module=owner, module_type=owner_type, shape=shape,
                                        dtype=DTYPE_TO_WIRE[dtype])
        self.nbytes = sum(a.nbytes for a in self._arrays)
        self.copy_seconds = time.monotonic() - started
        self._target = target
        self._security = security
        self._compress = compress
        self._stop = threading.Event()
        self._warned = False
        self._call: Any = None
        self._lock = threading.Lock()
        self.done = threading.Event()
        """Set once the upload ended: published, refused or given up."""
        self.published = False
        self._thread = threading.Thread(target=self._run, name="twinstep-weights", daemon=True)
        self._thread.start()

    def close(self, timeout: float) -> None:
        """Wait for the upload at most ``timeout`` seconds, then cancel it (the process is about to end)."""
        if not self.done.wait(max(0.0, timeout)):
            logger.warning("twinstep: the upload of the initial weights (%.1f MiB) did not finish before close; "
                           "candidates that wait for them will not get them", self.nbytes / 2**20)
        self._stop.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        self._thread.join(timeout=1.0)

    # -- the upload thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._upload_with_retries()
        except Exception:  # a bug here must not reach the training; the candidates learn it from the server
            logger.exception("twinstep: the upload of the initial weights failed")
        finally:
            self._arrays = None  # the copy is the model's size: give it back
            self.done.set()

    def _upload_with_retries(self) -> None:
        retry = Retry(_BACKOFF, retryable=retry_unless(_FATAL), timeout=GIVE_UP_SECONDS, stop=self._stop,
                      on_retry=self._warn_once)
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                with self._security.channel(self._target) as channel:
                    call = pb_grpc.TwinstepStub(channel).PublishWeights.future(
                        self._messages(), timeout=max(1.0, retry.remaining()),
                        metadata=self._security.metadata(), wait_for_ready=True)
                    with self._lock:
                        self._call = call
                    if self._stop.is_set():
                        call.cancel()
                    reply = call.result()
                self.published = True
                seconds = time.monotonic() - started
                logger.info("twinstep: shared %d initial parameters (%.1f MiB) with the server in %.2f s (%.0f MiB/s)",
                            reply.parameters, reply.bytes / 2**20, seconds, reply.bytes / 2**20 / max(seconds, 1e-9))
                return
            except grpc.FutureCancelledError:  # close() cancelled the upload
                return
            except grpc.RpcError as error:
                code = status_code(error)
                if code == grpc.StatusCode.CANCELLED and self._stop.is_set():
                    return
                if retry.again(error):  # a refusal, the deadline or close() says no; close() ends a wait at once
                    continue
                if retry.ended != "stopped":
                    logger.warning("twinstep: the server refused the initial weights (%s: %s); candidates with "
                                   "init_from_baseline will not get them", code.name if code else "error",
                                   _details(error))
                return
            finally:
                with self._lock:
                    self._call = None

    def _warn_once(self, error: BaseException | None, delay: float) -> None:
        """Before the first retry: one warning (the later ones are silent until the upload ends)."""
        if self._warned or error is None:
            return
        self._warned = True
        details = _details(error)
        logger.warning("twinstep: cannot share the initial weights yet (%s%s); retrying in the background",
                       details, explain(details, self._security.uses_tls(self._target)))

    def _messages(self) -> Iterator[pb.WeightsUpload]:
        yield pb.WeightsUpload(header=self._header)
        for pid, array in enumerate(self._arrays or ()):
            for piece in pieces(pid, array, compress=self._compress):
                if self._stop.is_set():
                    return
                yield pb.WeightsUpload(piece=piece)


def _details(error: BaseException) -> str:
    return (error.details() if hasattr(error, "details") else "") or str(error)
