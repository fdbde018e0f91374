"""The server side of one client Stream: an outbox drained by the RPC's handler.

gRPC's sync API yields responses from the handler thread while a reader
thread consumes requests, so anything (a halt from another session thread, a
credit) can reach the client at any time without holding a lock across a send.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import grpc

from twinstep.server.ingest.pieces import PieceCollector
from twinstep.v1 import twinstep_pb2 as pb


@dataclass
class StreamEnd:
    """The outbox is finished: end the response stream normally."""


@dataclass
class StreamFailure:
    code: grpc.StatusCode
    details: str


class Connection:
    def __init__(self, peer: str, max_pending_bytes: int = 1 << 30) -> None:
        self.peer = peer
        # Tensor pieces of the step this stream is sending, until its records complete it.
        self.pieces = PieceCollector(max_pending_bytes)
        self.session: str | None = None
        self.run: str | None = None
        self.rank = 0
        self.closed_cleanly = False
        self.close_reason = ""
        self.stream_id = 0
        """Numbered by its session from 1 when it joins: how the journal names this stream."""
        self._cond = threading.Condition()
        self._out: deque[pb.ServerMessage] = deque()
        self._credit: tuple[int, int] | None = None  # latest unsent (max_step, acked); older ones are stale
        self._last_credit: tuple[int, int] | None = None
        self._end: StreamEnd | StreamFailure | None = None

    @property
    def label(self) -> str:
        return f"{self.session}/{self.run}/rank{self.rank}"

    def send(self, message: pb.ServerMessage) -> None:
        with self._cond:
            if self._end is None:
                self._out.append(message)
                self._cond.notify()

    def set_credit(self, max_step: int, acked_step: int) -> None:
        value = (max_step, acked_step)
        with self._cond:
            if value != self._last_credit and self._end is None:
                self._credit = value
                self._last_credit = value
                self._cond.notify()

    def finish(self) -> None:
        with self._cond:
            if self._end is None:
                self._end = StreamEnd()
            self._cond.notify()

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        with self._cond:
            if self._end is None or isinstance(self._end, StreamEnd):
                self._end = StreamFailure(code, details)
            self._cond.notify()

    def next(self, timeout: float) -> pb.ServerMessage | StreamEnd | StreamFailure | None:
        """Next message to send, the end of the stream, or None after ``timeout``."""
        with self._cond:
            if not self._out and self._credit is None and self._end is None:
                self._cond.wait(timeout)
            if isinstance(self._end, StreamFailure):
                return self._end
            if self._out:
                return self._out.popleft()
            if self._credit is not None:
                (max_step, acked), self._credit = self._credit, None
                return pb.ServerMessage(credit=pb.Credit(max_step=max_step, acked_step=acked))
            return self._end
