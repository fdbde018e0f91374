"""The sender process of ``sender="process"``: runs a StreamClient on tensors in shared memory.

Started by :class:`twinstep.transport.sidecar.SidecarClient` with one end of a
socket pair; it never imports a framework.  It ends when the training process
says close or goes away (end of stream on the socket).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import weakref
from typing import Any

import numpy as np

from twinstep.capture.buffers import HostTensor
from twinstep.capture.recorder import StepBatch
from twinstep.transport.shared_memory import map_shared
from twinstep.transport.sidecar import FrameReader, encode_frame, send_frame
from twinstep.transport.stream import StreamClient, StreamConfig
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

_STATE_EVERY_S = 0.02
# How long answering a halt may wait for the training process to say its current step.
_ASK_STEP_TIMEOUT_S = 1.0
_LOST_PARENT_TIMEOUT_S = 2.0


class Sender:
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

    def reply(self, message: tuple) -> None:
        try:
            with self._send_lock:
                send_frame(self._sock, encode_frame(message))
        except OSError:
            self._done.set()  # the training process is gone

    def run(self) -> None:
        reader = FrameReader(self._sock)
        closed = False
        try:
            while not closed:
                message = reader.read()
                if message is None:
                    break
                closed = self._handle(message, reader)
        finally:
            if not closed and self._client is not None:  # the training process went away
                self._client.close("lost", -1, _LOST_PARENT_TIMEOUT_S)
            self._done.set()

    def _handle(self, message: tuple, reader: FrameReader) -> bool:
        kind = message[0]
        if kind == "start":
            _, hello, config = message
            self._client = StreamClient(pb.Hello.FromString(hello), StreamConfig(**config), self._on_command,
                                        self._live_step)
            self._client.start()
            threading.Thread(target=self._report_state, name="twinstep-sidecar-state", daemon=True).start()
        elif kind == "segment":
            _, number, nbytes = message
            self._regions[number] = map_shared(reader.fds.popleft(), nbytes)
        elif kind == "step":
            _, token, step = message
            waiting = self._asked.get(token)
            if waiting is not None:
                waiting[1].append(step)
                waiting[0].set()
        elif kind == "forget":
            region = self._regions.pop(message[1], None)
            if region is not None:
                _close_quietly(region)
        elif kind == "manifest" and self._client is not None:
            self._client.add_manifest([pb.ModuleInfo.FromString(m) for m in message[1]],
                                      [pb.ParameterInfo.FromString(p) for p in message[2]])
        elif kind == "missing" and self._client is not None:
            _, step, reason, detail = message
            self._client.mark_missing(step, reason, detail)
        elif kind == "health" and self._client is not None:
            self._client.send_health(pb.CaptureHealth.FromString(message[1]))
        elif kind == "batch" and self._client is not None:
            _, state, tensors, self._current_step = message
            self._client.submit(self._batch(state, tensors))
            self._received += 1
        elif kind == "close" and self._client is not None:
            _, reason, last_step, timeout = message
            self._client.close(reason, last_step, timeout)
            self.reply(("closed", self._state()))
            return True
        return False

    def _batch(self, state: dict[str, Any], tensors: list[tuple]) -> StepBatch:
        hosts, numbers = [], []
        for records, dtype, nbytes, kind, payload in tensors:
            if kind == "shared":
                number, np_dtype, shape = payload
                array = np.frombuffer(self._regions[number], dtype=np.dtype(np_dtype), count=int(np.prod(shape)))
                host = HostTensor(records, dtype, array.reshape(shape), number, nbytes)
                numbers.append(number)
            else:
                host = HostTensor(records, dtype, payload, None, nbytes)
            hosts.append(host)
        batch = StepBatch(**state, tensors=hosts, release=self._release)
        # A step dropped here before it was encoded still gives its buffers back.
        weakref.finalize(batch, self._release_unencoded, hosts).atexit = False
        return batch

    def _release(self, host: HostTensor) -> None:
        """Encoded: the training process may reuse the buffer."""
        number, host.buffer, host.copy = host.buffer, None, None
        if number is not None:
            self.reply(("release", [number]))

    def _release_unencoded(self, hosts: list[HostTensor]) -> None:
        """A batch is gone: give back the buffers of its tensors never encoded."""
        numbers = [h.buffer for h in hosts if h.buffer is not None]
        for host in hosts:
            host.buffer = host.copy = None
        if numbers:
            self.reply(("release", numbers))

    def _live_step(self) -> int:
        """The training's current step, asked of the training process (the last batch's, if it does not answer)."""
        self._asks += 1
        token, answered, value = self._asks, threading.Event(), []
        self._asked[token] = (answered, value)
        try:
            self.reply(("ask_step", token))
            answered.wait(_ASK_STEP_TIMEOUT_S)
        finally:
            del self._asked[token]
        return value[0] if value else self._current_step

    def _on_command(self, command: pb.Command) -> None:
        self.reply(("command", command.SerializeToString()))

    def _state(self) -> dict[str, Any]:
        client = self._client
        assert client is not None
        stats = client.stats
        return {"dropped": dict(stats.dropped), "steps_sent": stats.steps_sent, "tensor_bytes": stats.tensor_bytes,
                "tensor_wire_bytes": stats.tensor_wire_bytes, "reconnects": stats.reconnects,
                "connected": stats.connected, "rejected": stats.rejected, "credit": client.credit,
                "welcomed": client.welcomed, "pending": client.pending_steps, "received": self._received}

    def _report_state(self) -> None:
        last = None
        while not self._done.wait(_STATE_EVERY_S):
            state = self._state()
            if state != last:
                self.reply(("state", state))
                last = state


class _ForwardLogs(logging.Handler):
    """The sender's log records go to the training process's ``twinstep`` logger, under the user's logging setup."""

    def __init__(self, sender: Sender) -> None:
        super().__init__(logging.INFO)
        self._sender = sender
        self._formatter = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + self._formatter.formatException(record.exc_info)
            self._sender.reply(("log", record.levelno, text))
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
    sender = Sender(sock)
    twinstep_logger = logging.getLogger("twinstep")
    twinstep_logger.addHandler(_ForwardLogs(sender))
    twinstep_logger.setLevel(logging.INFO)
    twinstep_logger.propagate = False
    sender.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
