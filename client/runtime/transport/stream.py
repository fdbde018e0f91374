"""Background gRPC stream from one training process to the comparison server.

Modelled on OpenTelemetry's BatchProcessor and OTLP exporter: ``submit`` runs on
the training thread and only appends to a bounded deque; one named daemon
worker owns the connection.  When the server is unreachable, slow or gone the
outbox keeps the newest steps and drops the oldest (counted per reason), one
warning is logged, and the worker reconnects with jittered backoff.  Steps
stay in the outbox until the server acknowledges them, so a reconnect resends
what the broken stream may have lost and the server skips what it already has.

A sharded server's front answers the hello with the address of the shard that
compares this run and rank (``Welcome.stream_to``): the worker streams there
instead, and comes back to the front when that shard cannot be reached.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc

from twinstep._retry import Backoff, Retry
from twinstep.runtime.capture.recorder import StepBatch
from twinstep.runtime.transport.base import POLL_SECONDS, ClientStats, Sender
from twinstep.runtime.transport.ledger import DropLedger, at_fork_in_child
from twinstep.runtime.transport.security import ClientSecurity, explain
from twinstep.runtime.transport.messages import COMPRESSIONS, DEFAULT_PIECE_BYTES, TensorEncoder, encoded_pieces, step_message
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

# Status codes that no retry can fix: the server understood and refused us.
_FATAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
# A server bug (INTERNAL) while it took a step: that step is dropped rather than resent forever.
_SERVER_ERROR_CODES = frozenset({grpc.StatusCode.INTERNAL})
#: At close, how long a run that never reached the server waits for its last connection attempt.
_LAST_ATTEMPT_S = 1.0
#: Redirects followed at once, one after another, before a sharded server is suspected of a loop; beyond
#: this many in a row (with no Welcome that lets this run stream between them) each waits the usual backoff.
MAX_REDIRECTS = 8
_STREAM_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Twinstep'].full_name}/Stream"


def _to_wire(message: pb.ClientMessage | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def check_target(target: str) -> None:
    """Raise ValueError naming what is wrong with a server address, before any connection is tried.

    Accepts ``host:port`` (``[::1]:port`` for IPv6) and gRPC's ``unix:PATH``.
    """
    if target.startswith("unix:") and len(target) > len("unix:"):
        return
    hint = "expected host:port, e.g. 127.0.0.1:50051"
    if not target:
        raise ValueError(f"the server address is empty; {hint}")
    if "://" in target:
        raise ValueError(f"server address {target!r} has a URL scheme; twinstep speaks gRPC to host:port "
                         f"({target.split('://', 1)[1].rstrip('/')!r}?)")
    if any(c.isspace() for c in target):
        raise ValueError(f"server address {target!r} contains white space; {hint}")
    host, sep, port = target.rpartition(":")
    if not sep or not host:
        raise ValueError(f"server address {target!r} has no {'host' if sep else 'port'}; {hint}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"server address {target!r}: an IPv6 host goes in brackets, e.g. [::1]:50051")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"server address {target!r}: port {port!r} is not a number from 1 to 65535")


@dataclass(kw_only=True)
class StreamConfig:
    """Connection and buffering settings of one training process."""

    target: str
    """Server address, host:port."""
    max_queue_steps: int = 256
    """Steps held while the server is behind or away; the oldest are dropped beyond this."""
    max_queue_bytes: int = 1 << 30
    """Bytes held (tensor mode); the oldest steps are dropped beyond this."""
    max_message_bytes: int = 256 << 20
    """Largest message sent; larger steps are dropped with reason "oversized"."""
    compression: str = "auto"
    """Lossless tensor compression: "zstd", "none", or "auto" (zstd, but a dtype it
    shrinks by under 10% goes uncompressed: on fast links the CPU matters more)."""
    piece_bytes: int = DEFAULT_PIECE_BYTES
    """Tensors travel in messages of at most this many bytes of storage each."""
    backoff_initial: float = 0.5
    """First reconnect delay in seconds; doubles up to ``backoff_max``, with jitter."""
    backoff_max: float = 10.0
    token: str | None = None
    """Bearer token sent with the stream (TWINSTEP_TOKEN)."""
    tls_ca: str | None = None
    """PEM file of the CA (or self-signed certificate) to trust; None: the system's CAs."""
    tls_client_cert: str | None = None
    """PEM client certificate and key, for mutual TLS."""
    tls_client_key: str | None = None
    insecure: bool = False
    """Plaintext to a non-loopback server (see twinstep.runtime.transport.security for the loopback rule)."""

    @property
    def security(self) -> ClientSecurity:
        return ClientSecurity(token=self.token, tls_ca=self.tls_ca, tls_client_cert=self.tls_client_cert,
                              tls_client_key=self.tls_client_key, insecure=self.insecure)

    def __post_init__(self) -> None:
        check_target(self.target)
        self.security.validate()
        if self.max_queue_steps < 1:
            raise ValueError("max_queue_steps must be at least 1")
        if not 0 < self.backoff_initial <= self.backoff_max:
            raise ValueError(f"backoff_initial must be above 0 and at most backoff_max ({self.backoff_max}), "
                             f"got {self.backoff_initial}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(map(repr, COMPRESSIONS))}, got {self.compression!r}")
        if not 1024 <= self.piece_bytes <= self.max_message_bytes // 2:
            raise ValueError(f"piece_bytes must be between 1024 and half of max_message_bytes, got {self.piece_bytes}")


class StreamClient(Sender):
    """The thread sender: owns the outbox and the worker thread of one training process.

    Also the sender process's client (:mod:`twinstep.runtime.transport.sidecar_main`).
    """

    def __init__(
        self,
        hello: pb.Hello,
        config: StreamConfig,
        on_command: Callable[[pb.Command], None],
        current_step: Callable[[], int],
    ) -> None:
        self._hello = hello
        self._config = config
        self._on_command = on_command
        self._current_step = current_step
        self._ledger = DropLedger()
        self._warn_once = self._ledger.warn
        self.stats = ClientStats(self._ledger)
        self._modules: list[pb.ModuleInfo] = []
        self._parameters: list[pb.ParameterInfo] = []
        self._init_state()
        self._encoder = TensorEncoder(config.compression, config.piece_bytes)
        at_fork_in_child(self._after_fork_in_child)

    def _init_state(self) -> None:
        self._cond = threading.Condition()
        self._steps: deque[StepBatch] = deque()  # oldest first; the first _sent are on the wire
        self._bytes = 0
        self._sent = 0
        self._control: deque[pb.ClientMessage] = deque()
        self._manifest_sent = (0, 0)
        self._health: pb.CaptureHealth | None = None  # the latest capture-health snapshot (cumulative)
        self._health_pending = False  # the server has not seen the latest snapshot on this stream
        self._setup: pb.Setup | None = None  # the latest training set-up (docs/preflight.md)
        self._setup_pending = False  # the server has not seen it on this stream
        self._credit = -1  # highest step we may send; -1 until the server welcomes us
        self._welcomed = False
        # The server's error budgets per phase for capture="lossy" (Welcome.lossy).
        self._lossy: dict[str, pb.LossyBound] = {}
        self._max_step_tensor_bytes = 0  # the server's bound on one step's tensor pieces (0: none stated)
        self._closing = False  # finish sending, then say Close
        self._close_message: pb.ClientMessage | None = None
        self._stopped = threading.Event()  # give up now
        self._finished = threading.Event()  # Close went out and the server ended the stream
        self._wake = threading.Event()  # interrupts the reconnect backoff when closing
        self._worker: threading.Thread | None = None
        self._call: grpc.Future | None = None
        self._forked_child = False
        # The step on the wire when the server failed with INTERNAL: dropped if the server does not have it.
        self._server_error: tuple[int, str] | None = None
        # Where the current attempt streams, as logged: the address given, or a shard of it.
        self._where = self._config.target

    def _after_fork_in_child(self) -> None:
        # A forked child (e.g. a data-loader worker) must not share the parent's
        # lock, queue or connection; it gets an inert client of its own.
        self._init_state()
        self._ledger.after_fork()
        self._forked_child = True
        self._closing = True
        self._stopped.set()

    @property
    def pending_steps(self) -> int:
        """Steps queued or sent but not yet acknowledged by the server."""
        with self._cond:
            return len(self._steps)

    def _gone(self) -> bool:
        return self._stopped.is_set()

    # -- training thread ----------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._worker is None and not self._stopped.is_set():
                self._worker = threading.Thread(target=self._run, name="twinstep-sender", daemon=True)
                self._worker.start()

    def add_manifest(self, modules: list[pb.ModuleInfo], parameters: list[pb.ParameterInfo]) -> None:
        if not modules and not parameters:
            return
        with self._cond:
            self._modules.extend(modules)
            self._parameters.extend(parameters)
            self._cond.notify_all()

    def submit(self, batch: StepBatch) -> bool:
        """Queue a step for sending; O(1) unless old steps must be dropped. Never blocks."""
        with self._cond:
            if self.stats.rejected:
                self._ledger.drop("server_rejected", batch.step)
                return False
            if self._closing or self._stopped.is_set():
                self._ledger.drop("forked_child" if self._forked_child else "already_shutdown", batch.step)
                return False
            self._steps.append(batch)
            self._bytes += batch.nbytes
            # Drop from the old end: the newest steps are the ones still comparable.
            while len(self._steps) > 1 and (
                len(self._steps) > self._config.max_queue_steps or self._bytes > self._config.max_queue_bytes
            ):
                old = self._steps.popleft()
                self._bytes -= old.nbytes
                if self._sent > 0:
                    self._sent -= 1  # already on the wire, only its acknowledgement is lost
                else:
                    self._ledger.drop("queue_full", old.step)
            self._cond.notify_all()
        return True

    def send_health(self, health: pb.CaptureHealth) -> None:
        with self._cond:
            self._health = health
            self._health_pending = True
            self._cond.notify_all()

    def send_setup(self, setup: pb.Setup) -> None:
        with self._cond:
            self._setup = setup
            self._setup_pending = True
            self._cond.notify_all()

    def mark_missing(self, step: int, reason: str, detail: str = "", *, dropped: bool = False) -> None:
        """As Sender's; ``dropped``: the sender process's training side dropped (and counted) it."""
        self._ledger.mark_missing(step, reason, detail, dropped=dropped)
        with self._cond:
            self._cond.notify_all()

    def _send_control(self, message: pb.ClientMessage) -> None:
        with self._cond:
            self._control.append(message)
            self._cond.notify_all()

    def _health_message(self) -> pb.ClientMessage:
        """The capture health, this sender's missing steps and drop counts, in one message (caller holds the lock)."""
        health = pb.CaptureHealth()
        if self._health is not None:
            health.CopyFrom(self._health)
        self._ledger.report(health)
        return pb.ClientMessage(health=health)

    def close(self, reason: str, last_step: int, timeout: float) -> None:
        """Send what is queued, say Close, and stop; bounded by ``timeout`` seconds."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._close_message = pb.ClientMessage(
                close=pb.Close(reason=reason, last_step=last_step, dropped=self._ledger.reported_counts())
            )
            worker = self._worker
            self._cond.notify_all()
        self._wake.set()
        if worker is not None:
            started = time.monotonic()
            if self.stats.failed_before_reached and not self.stats.reached:
                # Never reached, and tried: one last attempt, not the flush a connected run gets.  If that
                # attempt reaches the server after all, the queue is flushed within ``timeout`` as usual.
                worker.join(min(timeout, _LAST_ATTEMPT_S))
                if worker.is_alive() and self.stats.reached:
                    worker.join(max(0.0, timeout - (time.monotonic() - started)))
            else:
                worker.join(timeout)
        self._stopped.set()
        with self._cond:
            call = self._call
            for batch in list(self._steps)[max(self._sent, 0):]:
                self._ledger.drop("shutdown", batch.step)
            self._steps.clear()
            self._cond.notify_all()
        if call is not None:
            call.cancel()
        if worker is not None:
            worker.join(1.0)

    # -- worker thread --------------------------------------------------------

    def _run(self) -> None:
        # Reconnects until closed (no deadline): jittered, doubling up to backoff_max; close() cuts a wait short.
        #
        # A sharded server's front answers the hello with Welcome.stream_to, the shard that compares this run
        # and rank: the attempt ends and the next one, at once, streams there (same hello, token, TLS trust,
        # channel options).  The address given stays the front: a shard that cannot be reached sends the next
        # attempt back to the front (which redirects again, to where the shard is now); a shard stream that
        # broke after its Welcome is retried on the shard once first (a restarted shard may keep its port).
        initial = self._config.backoff_initial
        retry = Retry(Backoff(initial, self._config.backoff_max), stop=self._wake)
        # While closing with steps queued: short waits (at most 1 s), until close()'s timeout sets _stopped.
        flush = Retry(Backoff(min(initial, 1.0), 1.0), stop=self._stopped)
        final_attempt = False
        options = [
            # Tensor-mode steps are large: raise gRPC's 4 MiB default both ways.
            ("grpc.max_send_message_length", self._config.max_message_bytes),
            ("grpc.max_receive_message_length", 64 << 20),
            # Detect a vanished server on an idle stream within ~30 s.
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
        ]
        security = self._config.security
        front = self._config.target
        target = front
        redirects = 0  # in a row: attempts answered by a redirect, one after another
        while not self._stopped.is_set():
            attempt_done = threading.Event()
            redirect = ""
            welcomed = False
            self._where = target if target == front else f"{target} (shard of {front})"
            try:
                with security.channel(target, options=options) as channel:
                    # Tensor pieces arrive serialized (see messages.py); everything else is a message.
                    stream = channel.stream_stream(
                        _STREAM_METHOD, request_serializer=_to_wire, response_deserializer=pb.ServerMessage.FromString
                    )
                    call = stream(self._requests(attempt_done), metadata=security.metadata() or None)
                    with self._cond:
                        self._call = call
                    for response in call:
                        if response.WhichOneof("body") == "welcome":
                            if response.welcome.stream_to:
                                redirect = response.welcome.stream_to
                                call.cancel()  # nothing but the hello went out on it
                                break
                            welcomed = True
                        if self._handle(response):
                            retry.reset()
                            flush.reset()
                if self._finished.is_set():
                    return
            except grpc.RpcError as error:
                code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
                details = error.details() if hasattr(error, "details") else str(error)
                if code in _FATAL_CODES:
                    self._reject(f"{code.name}: {details}")
                    return
                if self._finished.is_set() or (self._closing and self._stopped.is_set()):
                    return
                # A server failure on a step is warned with the step's name; then reconnect as for a lost server.
                reached = self.stats.reached
                if not reached:
                    self.stats.failed_before_reached = True
                if not (code in _SERVER_ERROR_CODES and self._suspect(f"{code.name}: {details}")):
                    self._warn_once(
                        "unreachable",
                        "twinstep: %s the comparison server at %s (%s: %s); training continues, up to %d steps "
                        "are kept and older ones dropped; %s in the background",
                        "lost contact with" if reached else "cannot reach",
                        self._where,
                        code.name,
                        details + explain(details, security.uses_tls(target), reached=reached),
                        self._config.max_queue_steps,
                        "reconnecting" if reached else "trying again",
                    )
            except Exception:  # a bug here must not take the training down
                logger.exception("twinstep: sender failed; reconnecting")
            finally:
                attempt_done.set()
                with self._cond:
                    self._call = None
                    self._welcomed = False
                    self._credit = -1
                    self._sent = 0
                    self._manifest_sent = (0, 0)
                    self._health_pending = self._health is not None  # told again, with the missing steps
                    self._setup_pending = self._setup is not None
                    self._ledger.resend()
                    self.stats.connected = False
                    self._cond.notify_all()
            if redirect:
                redirects += 1
                target = redirect
                if redirects <= MAX_REDIRECTS:
                    continue  # at once: a redirect is not a lost server
                self._warn_once(
                    "redirect_loop",
                    "twinstep: the comparison server at %s sent this run on %d times in a row without accepting it "
                    "(last to %s); following with backoff",
                    front, redirects, redirect,
                )
            else:
                redirects = 0
                if welcomed:
                    self._warn_once.forget("redirect_loop")
                else:
                    target = front  # a shard that cannot be reached: the front says where it is now
            if self._closing:
                if not self.stats.reached:
                    return  # never reached: nothing to flush into; close() ends at once
                if not self._steps and final_attempt:
                    return  # nothing left to deliver but the goodbye: one more try was enough
                final_attempt = True
                # Steps are still queued: keep trying until close()'s timeout ends the flush (a server
                # restarting or a link coming back within it loses nothing).
                flush.again()
            else:
                retry.again()
            self.stats.reconnects += 1

    def _handle(self, response: pb.ServerMessage) -> bool:
        """Apply one server message; True when it shows a healthy stream."""
        kind = response.WhichOneof("body")
        if kind == "welcome":
            if response.welcome.stream_to:
                return False  # a redirect (see _run): nothing here is this run's stream
            with self._cond:
                first_contact = not self.stats.reached
                self._welcomed = True
                self.stats.connected = self.stats.reached = True
                last = response.welcome.last_step_received
                self._lossy = dict(response.welcome.lossy)
                self._max_step_tensor_bytes = response.welcome.max_step_tensor_bytes
                self._ack(last)
                self._drop_server_error()
                self._cond.notify_all()
            if self._warn_once.forget("unreachable"):
                logger.warning("twinstep: %s to %s", "connected" if first_contact else "reconnected", self._where)
            return True
        if kind == "credit":
            with self._cond:
                self._credit = response.credit.max_step
                self._ack(response.credit.acked_step)
                self._cond.notify_all()
            return True
        if kind == "command":
            command = response.command
            if command.kind in (pb.Command.HALT_PREPARE, pb.Command.STEP_QUERY):  # where training is now
                ack = pb.HaltAck(request_id=command.request_id, current_step=self._current_step())
                self._send_control(pb.ClientMessage(halt_ack=ack))
            self._on_command(command)
            with self._cond:
                self._cond.notify_all()
            return True
        if kind == "event":
            _log_event(response.event)
        return False

    def _ack(self, acked_step: int) -> None:
        """Forget queued steps the server holds (caller holds the lock)."""
        while self._steps and self._steps[0].step <= acked_step:
            old = self._steps.popleft()
            self._bytes -= old.nbytes
            if self._sent > 0:
                self._sent -= 1

    def _requests(self, attempt_done: threading.Event) -> Iterator[pb.ClientMessage | bytes]:
        yield pb.ClientMessage(hello=self._hello)
        while True:
            with self._cond:
                message, batch = self._next_locked(attempt_done)
                if message is None and batch is None:
                    return
            if batch is not None:
                message = step_message(batch, self._hello.rank, self._ledger.reported_counts())
                # Checked before any piece goes out: pieces not followed by their records would break the stream.
                size = message.ByteSize() + 16
                if size > self._config.max_message_bytes:
                    self._warn_once(
                        "oversized",
                        "twinstep: the records of step %d take %d bytes, over the %d byte message limit; dropped "
                        "(capture fewer modules)",
                        batch.step,
                        size,
                        self._config.max_message_bytes,
                    )
                    self._ledger.drop("oversized", batch.step)
                    continue
                if self._too_big_for_server(batch):
                    self._ledger.drop("oversized", batch.step)
                    continue
                pieces = 0
                for piece in self._tensor_pieces(batch):
                    pieces += 1
                    yield piece
                    yield from self._control_messages()  # a halt answer need not wait for a large step
                message.step.tensor_pieces = pieces
                self.stats.steps_sent += 1
            yield message
            if message.WhichOneof("body") == "close":
                self._finished.set()
                return

    def _too_big_for_server(self, batch: StepBatch) -> bool:
        """Tensors the server would refuse to hold for one step (it would end the stream): dropped here instead."""
        limit = self._max_step_tensor_bytes
        if not limit or not batch.tensors:
            return False
        # Encoded pieces are at most their storage plus zstd's worst case (~0.4%) and a header each.
        size = sum(h.nbytes + h.nbytes // 200 + 64 for h in batch.tensors)
        if size <= limit:
            return False
        self._warn_once(
            "oversized_tensors",
            "twinstep: the tensors of step %d take about %d bytes, over the %d bytes the server holds for one step; "
            "steps like it are dropped (capture fewer modules, use capture='lossy', or raise the server's window_bytes)",
            batch.step, size, limit,
        )
        return True

    def _tensor_pieces(self, batch: StepBatch) -> Iterator[bytes]:
        """The step's tensor pieces; a tensor that fails to encode is skipped with a warning, never the stream."""
        encoder = self._encoder
        raw, wire = encoder.raw_bytes, encoder.wire_bytes
        try:
            yield from encoded_pieces(batch, encoder, self._lossy)
        except Exception:
            self._warn_once("encode", "twinstep: could not encode a tensor of step %d; its tensors are not sent",
                            batch.step, exc_info=True)
            for host in batch.tensors:  # what was sent stays; nothing more of this step is tried
                if host.wire is None:
                    host.wire = []
        finally:
            self.stats.tensor_bytes += encoder.raw_bytes - raw
            self.stats.tensor_wire_bytes += encoder.wire_bytes - wire

    def _control_messages(self) -> Iterator[pb.ClientMessage]:
        while True:
            with self._cond:
                if not self._control:
                    return
                message = self._control.popleft()
            yield message

    def _next_locked(self, attempt_done: threading.Event) -> tuple[pb.ClientMessage | None, StepBatch | None]:
        """The next thing to send, waiting for one; (None, None) ends the request stream."""
        while True:
            if attempt_done.is_set() or self._stopped.is_set():
                return None, None
            if self._control and self._welcomed:  # not to a front that only says where to stream
                return self._control.popleft(), None
            if self._welcomed:
                sent_modules, sent_params = self._manifest_sent
                if sent_modules < len(self._modules) or sent_params < len(self._parameters):
                    self._manifest_sent = (len(self._modules), len(self._parameters))
                    manifest = pb.Manifest(
                        modules=self._modules[sent_modules:], parameters=self._parameters[sent_params:]
                    )
                    return pb.ClientMessage(manifest=manifest), None
                if self._setup_pending and self._setup is not None:  # before any step: preflight comes first
                    self._setup_pending = False
                    return pb.ClientMessage(setup=self._setup), None
                if self._health_pending or self._ledger.unreported:
                    self._health_pending = False
                    return self._health_message(), None
                if self._sent < len(self._steps):
                    batch = self._steps[self._sent]
                    # Closing ignores credit: the server's own window bounds its memory.
                    if batch.step <= self._credit or self._closing:
                        self._sent += 1
                        return None, batch
                elif self._closing and self._close_message is not None:
                    message, self._close_message = self._close_message, None
                    return message, None
            self._cond.wait(POLL_SECONDS)

    # -- bookkeeping ----------------------------------------------------------

    def _suspect(self, why: str) -> bool:
        """The server failed (INTERNAL) with steps on the wire: the first it lacks is the one it failed on.

        Remembered here and dropped once a Welcome says what the server holds
        (it takes steps in order), so a step that trips a server bug is not
        resent forever.  False when no step was on the wire.
        """
        with self._cond:
            if self._sent <= 0 or not self._steps:
                return False
            step = self._steps[0].step
            self._server_error = (step, why)
        self._warn_once("server_error", "twinstep: the comparison server failed while taking step %d (%s); "
                        "steps it fails on are dropped and counted, training continues", step, why)
        return True

    def _drop_server_error(self) -> None:
        """After a Welcome's acknowledgement: drop the step the server failed on, if it still lacks it.

        Caller holds the lock.
        """
        if self._server_error is None:
            return
        (step, why), self._server_error = self._server_error, None
        if self._steps and self._steps[0].step == step:
            old = self._steps.popleft()
            self._bytes -= old.nbytes
            self._ledger.drop("server_error", step, detail=why)

    def _reject(self, why: str) -> None:
        with self._cond:
            self.stats.rejected = why
            unsent = list(self._steps)[max(self._sent, 0):]
            self._steps.clear()
            self._sent = 0
            for batch in unsent:
                self._ledger.drop("server_rejected", batch.step)
            self._stopped.set()
            self._cond.notify_all()
        logger.error("twinstep: the comparison server refused this run (%s); capture stops, training continues", why)


def _log_event(event: pb.Event) -> None:
    kind = event.WhichOneof("body")
    if kind == "divergence":
        d = event.divergence
        logger.warning(
            "twinstep: divergence at step %d, %s of %r (%s %.3g > %.3g)",
            d.step,
            d.phase,
            d.module,
            d.metric,
            d.value,
            d.tolerance,
        )
    elif kind == "alert":
        logger.warning("twinstep: %s", event.alert.message)
