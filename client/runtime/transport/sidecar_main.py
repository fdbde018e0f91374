"""The sender process of ``sender="process"``: runs a StreamClient on tensors in shared memory.

Started by :class:`twinstep.runtime.transport.sidecar.SidecarClient` with one end of a
socket pair; it never imports a framework.  It ends when the training process
says close or goes away (end of stream on the socket).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import weakref
from typing import Any, Callable

import numpy as np

from twinstep.runtime.capture.buffers import HostTensor
from twinstep.runtime.capture.recorder import StepBatch
from twinstep.runtime.transport import frames
from twinstep.runtime.transport.shared_memory import map_shared
from twinstep.runtime.transport.stream import StreamClient, StreamConfig
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

_STATE_EVERY_S = 0.02
# How long answering a halt may wait for the training process to say its current step.
_ASK_STEP_TIMEOUT_S = 1.0
_LOST_PARENT_TIMEOUT_S = 2.0


class SenderProcess:
    """One training process's stream, fed from the control socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._regions: dict[int, Any] = {}
        self._current_step = 0
        self._received = 0  # batch frames taken in
        self._asked: dict[int, tuple[threading.Event, list[int]]] = {}
        self._asks = 0
        self._client: StreamClient | None = None
        self._done = threading.Event()
        self._reader = frames.FrameReader(sock)
        # Each returns True when it was the last frame.
        self._handlers: dict[type[frames.Frame], Callable[[Any], bool | None]] = {
            frames.Start: self._on_start,
            frames.Segment: self._on_segment,
            frames.StepAnswer: self._on_step_answer,
            frames.Forget: self._on_forget,
            frames.Manifest: self._on_manifest,
            frames.Missing: self._on_missing,
            frames.Health: self._on_health,
            frames.Setup: self._on_setup,
            frames.Batch: self._on_batch,
            frames.Close: self._on_close,
        }

    def reply(self, frame: frames.Frame) -> None:
        try:
            with self._send_lock:
                frames.send(self._sock, frames.encode(frame))
        except OSError:
            self._done.set()  # the training process is gone

    def run(self) -> None:
        """Serve frames until Close or the end of the socket; FrameError for a frame out of place."""
        closed = False
        try:
            while not closed:
                frame = self._reader.read()
                if frame is None:
                    break
                handler = self._handlers.get(type(frame))
                if handler is None:
                    raise frames.FrameError(f"a {type(frame).__name__} frame, which only the sender process sends")
                if self._client is None and not isinstance(frame, (frames.Start, frames.Segment)):
                    raise frames.FrameError(f"a {type(frame).__name__} frame before Start")
                closed = bool(handler(frame))
        finally:
            if not closed and self._client is not None:  # the training process went away
                self._client.close("lost", -1, _LOST_PARENT_TIMEOUT_S)
            self._done.set()

    def _on_start(self, frame: frames.Start) -> None:
        if frame.version != frames.VERSION:
            raise frames.FrameError(f"the training process speaks frame version {frame.version}, this sender process "
                                    f"{frames.VERSION} (two twinstep installations?)")
        if self._client is not None:
            raise frames.FrameError("a second Start frame")
        self._client = StreamClient(pb.Hello.FromString(frame.hello), StreamConfig(**frame.config), self._on_command,
                                    self._live_step)
        self._client.start()
        threading.Thread(target=self._report_state, name="twinstep-sidecar-state", daemon=True).start()

    def _on_segment(self, frame: frames.Segment) -> None:
        self._regions[frame.number] = map_shared(self._reader.fds.popleft(), frame.nbytes)

    def _on_step_answer(self, frame: frames.StepAnswer) -> None:
        waiting = self._asked.get(frame.token)
        if waiting is not None:
            waiting[1].append(frame.step)
            waiting[0].set()

    def _on_forget(self, frame: frames.Forget) -> None:
        region = self._regions.pop(frame.number, None)
        if region is not None:
            _close_quietly(region)

    def _on_manifest(self, frame: frames.Manifest) -> None:
        assert self._client is not None
        self._client.add_manifest([pb.ModuleInfo.FromString(m) for m in frame.modules],
                                  [pb.ParameterInfo.FromString(p) for p in frame.parameters])

    def _on_missing(self, frame: frames.Missing) -> None:
        assert self._client is not None
        self._client.mark_missing(frame.step, frame.reason, frame.detail, dropped=frame.dropped)

    def _on_health(self, frame: frames.Health) -> None:
        assert self._client is not None
        self._client.send_health(pb.CaptureHealth.FromString(frame.health))

    def _on_setup(self, frame: frames.Setup) -> None:
        assert self._client is not None
        self._client.send_setup(pb.Setup.FromString(frame.setup))

    def _on_batch(self, frame: frames.Batch) -> None:
        assert self._client is not None
        self._current_step = frame.current_step
        self._client.submit(self._batch(frame))
        self._received += 1

    def _on_close(self, frame: frames.Close) -> bool:
        assert self._client is not None
        self._client.close(frame.reason, frame.last_step, frame.timeout)
        self.reply(frames.Closed(self._state()))
        return True

    def _batch(self, frame: frames.Batch) -> StepBatch:
        hosts = []
        for tensor in frame.tensors:
            if isinstance(tensor, frames.SharedTensor):
                array = np.frombuffer(self._regions[tensor.number], dtype=np.dtype(tensor.np_dtype),
                                      count=int(np.prod(tensor.shape)))
                host = HostTensor(list(tensor.records), tensor.dtype, array.reshape(tensor.shape), tensor.number,
                                  tensor.nbytes)
            else:
                host = HostTensor(list(tensor.records), tensor.dtype, tensor.array, None, tensor.nbytes)
            hosts.append(host)
        batch = StepBatch(**frame.state, tensors=hosts, release=self._release)
        # A step dropped here before it was encoded still gives its buffers back.
        weakref.finalize(batch, self._release_unencoded, hosts).atexit = False
        return batch

    def _release(self, host: HostTensor) -> None:
        """Encoded: the training process may reuse the buffer."""
        number, host.buffer, host.copy = host.buffer, None, None
        if number is not None:
            self.reply(frames.Release((number,)))

    def _release_unencoded(self, hosts: list[HostTensor]) -> None:
        """A batch is gone: give back the buffers of its tensors never encoded."""
        numbers = tuple(h.buffer for h in hosts if h.buffer is not None)
        for host in hosts:
            host.buffer = host.copy = None
        if numbers:
            self.reply(frames.Release(numbers))

    def _live_step(self) -> int:
        """The training's current step, asked of the training process (the last batch's, if it does not answer)."""
        self._asks += 1
        token, answered, value = self._asks, threading.Event(), []
        self._asked[token] = (answered, value)
        try:
            self.reply(frames.AskStep(token))
            answered.wait(_ASK_STEP_TIMEOUT_S)
        finally:
            del self._asked[token]
        return value[0] if value else self._current_step

    def _on_command(self, command: pb.Command) -> None:
        self.reply(frames.ServerCommand(command.SerializeToString()))

    def _state(self) -> frames.SenderState:
        client = self._client
        assert client is not None
        stats = client.stats
        return frames.SenderState(
            dropped=stats.dropped, steps_sent=stats.steps_sent, tensor_bytes=stats.tensor_bytes,
            tensor_wire_bytes=stats.tensor_wire_bytes, reconnects=stats.reconnects, connected=stats.connected,
            rejected=stats.rejected, credit=client.credit, welcomed=client.welcomed, pending=client.pending_steps,
            received=self._received, reached=stats.reached, failed_before_reached=stats.failed_before_reached,
        )

    def _report_state(self) -> None:
        last = None
        while not self._done.wait(_STATE_EVERY_S):
            state = self._state()
            if state != last:
                self.reply(frames.State(state))
                last = state


class _ForwardLogs(logging.Handler):
    """The sender's log records go to the training process's ``twinstep`` logger, under the user's logging setup."""

    def __init__(self, sender: SenderProcess) -> None:
        super().__init__(logging.INFO)
        self._sender = sender
        self._formatter = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + self._formatter.formatException(record.exc_info)
            self._sender.reply(frames.Log(record.levelno, text))
        except Exception:
            self.handleError(record)


def _close_quietly(region: Any) -> None:
    try:
        region.close()
    except BufferError:  # a numpy view still reads it; the mapping goes with the view
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    sender = SenderProcess(sock)
    twinstep_logger = logging.getLogger("twinstep")
    twinstep_logger.addHandler(_ForwardLogs(sender))
    twinstep_logger.setLevel(logging.INFO)
    twinstep_logger.propagate = False
    try:
        sender.run()
    except frames.FrameError as error:
        logger.error("twinstep: the sender process stops: %s", error)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
