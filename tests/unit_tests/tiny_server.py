"""A tiny real gRPC server for the sender tests: it records what a client sends and fails where told.

Not the comparison server: each test states exactly what the server does, so
a sender's behaviour (drops, resends, what it tells in-band) is observed on
the wire without depending on the server's own policies.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc


@dataclass
class Recorded:
    steps: list[int] = field(default_factory=list)
    """Every step message received, in order (resends included)."""
    health: pb.CaptureHealth | None = None
    close: pb.Close | None = None
    streams: int = 0


class TinyServicer(pb_grpc.TwinstepServicer):
    """Welcomes every stream with the highest step it holds, grants all credit, aborts with
    INTERNAL on receiving a step listed in ``fail_on`` (a stand-in for a server bug one step triggers)."""

    def __init__(self, fail_on: frozenset[int] = frozenset()) -> None:
        self.fail_on = fail_on
        self.seen = Recorded()
        self.lock = threading.Lock()
        self.closed = threading.Event()

    def held(self) -> list[int]:
        """Steps taken in (each once, in order)."""
        with self.lock:
            return sorted(set(s for s in self.seen.steps if s not in self.fail_on))

    def Stream(self, request_iterator, context):  # noqa: N802 (gRPC's name)
        next(request_iterator)  # Hello
        with self.lock:
            self.seen.streams += 1
            held = max((s for s in self.seen.steps if s not in self.fail_on), default=-1)
        yield pb.ServerMessage(welcome=pb.Welcome(last_step_received=held))
        yield pb.ServerMessage(credit=pb.Credit(max_step=1 << 40, acked_step=held))
        for message in request_iterator:
            kind = message.WhichOneof("body")
            with self.lock:
                if kind == "step":
                    self.seen.steps.append(message.step.step)
                elif kind == "health":
                    self.seen.health = message.health
                elif kind == "close":
                    self.seen.close = message.close
            if kind == "step":
                if message.step.step in self.fail_on:
                    context.abort(grpc.StatusCode.INTERNAL, f"a bug on step {message.step.step}")
                yield pb.ServerMessage(credit=pb.Credit(max_step=1 << 40, acked_step=message.step.step))
            elif kind == "close":
                self.closed.set()
                return


class TinyServer:
    def __init__(self, servicer: TinyServicer) -> None:
        self.servicer = servicer
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_TwinstepServicer_to_server(servicer, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=0.2).wait(5)
