"""A hand-driven client stream, for sending exactly the messages a test wants (including bad ones)."""

from __future__ import annotations

import queue
import threading

import grpc
import numpy as np

from twinstep.wire import codec, stats
from twinstep._version import PROTOCOL_VERSION
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

_END = object()


class RawStream:
    def __init__(self, address: str, serializer=None) -> None:
        self.channel = grpc.insecure_channel(address)
        self._requests: queue.Queue = queue.Queue()
        if serializer is None:
            self.call = pb_grpc.TwinstepStub(self.channel).Stream(iter(self._requests.get, _END))
        else:
            method = self.channel.stream_stream(
                "/twinstep.v1.Twinstep/Stream",
                request_serializer=serializer,
                response_deserializer=pb.ServerMessage.FromString,
            )
            self.call = method(iter(self._requests.get, _END))
        self.responses: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.responses.put(response)
            self.responses.put(None)
        except grpc.RpcError as error:
            self.responses.put(error)

    def send(self, message) -> "RawStream":
        self._requests.put(message)
        return self

    def close(self) -> None:
        self._requests.put(_END)

    def next(self, timeout: float = 10.0):
        return self.responses.get(timeout=timeout)

    def error(self, timeout: float = 10.0) -> grpc.RpcError:
        """The status that ended the stream (fails if it ended fine)."""
        while True:
            item = self.responses.get(timeout=timeout)
            if isinstance(item, grpc.RpcError):
                return item
            assert item is not None, "stream ended without an error"

    def wait_end(self, timeout: float = 10.0) -> None:
        while True:
            item = self.responses.get(timeout=timeout)
            if item is None:
                return
            if isinstance(item, grpc.RpcError):
                raise item


def hello(session: str, run: str, *, baseline: bool = False, framework: str = "torch", rank: int = 0,
          world_size: int = 1, version: int = PROTOCOL_VERSION) -> pb.ClientMessage:
    return pb.ClientMessage(hello=pb.Hello(
        protocol_version=version, session=session, run=run, baseline=baseline, framework=framework,
        framework_version="test", rank=rank, world_size=world_size, capture="stats",
    ))


def manifest(*modules: tuple[int, str, str]) -> pb.ClientMessage:
    return pb.ClientMessage(manifest=pb.Manifest(modules=[pb.ModuleInfo(id=i, name=n, type=t) for i, n, t in modules]))


def step(number: int, records: list[tuple[int, np.ndarray]], *, rank: int = 0,
         phase: int = pb.FORWARD) -> pb.ClientMessage:
    """A StepRecords of FORWARD records (module id, values), statistics computed exactly; no tensors
    (``step_with_pieces`` sends them too)."""
    message = pb.StepRecords(rank=rank, step=number)
    for target, values in records:
        values = np.asarray(values, dtype=np.float32)
        table = stats.of_array(values)
        message.phase.append(phase)
        message.target.append(target)
        message.call_index.append(0)
        message.slot.append(0)
        message.dtype.append(pb.FLOAT32)
        message.ndim.append(values.ndim)
        message.dims.extend(values.shape)
        for name in stats.FIELDS:
            getattr(message.stats, name).append(table[name][0].item())
    return pb.ClientMessage(step=message)


def pieces(number: int, records: list[tuple[int, np.ndarray]], *, per_piece: int = 1 << 20) -> list[pb.ClientMessage]:
    """TensorPiece messages of ``records`` (as in ``step``), each tensor cut into pieces of ``per_piece`` elements."""
    out = []
    for index, (_, values) in enumerate(records):
        flat = np.asarray(values, dtype=np.float32).reshape(-1)
        for offset in range(0, flat.size, per_piece):
            part = flat[offset : offset + per_piece]
            kind, data, raw = codec.encode(part)
            out.append(pb.ClientMessage(tensor=pb.TensorPiece(
                step=number, record=index, offset=offset, numel=part.size, codec=kind, raw_nbytes=raw, data=data,
            )))
    return out


def step_with_pieces(number: int, records: list[tuple[int, np.ndarray]], *, per_piece: int = 1 << 20) -> list[pb.ClientMessage]:
    """A step as a tensor-mode client sends it: its pieces, then its records announcing them."""
    sent = pieces(number, records, per_piece=per_piece)
    records_message = step(number, records)
    records_message.step.tensor_pieces = len(sent)
    return sent + [records_message]
