"""One run's operations of one module call (``StepRecords.ops``), validated and decoded for comparison."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from twinstep.wire.codec import WIRE_TO_DTYPE
from twinstep.server.errors import invalid
from twinstep.wire.stats import DEVICE_FIELDS, FIELDS
from twinstep.v1 import twinstep_pb2 as pb

MAX_CALLS = 4096
MAX_EXTERNALS = 16384
MAX_TEXT = 1000
MAX_NDIM = 64


@dataclass(frozen=True)
class OpTensor:
    dtype: str
    shape: tuple[int, ...]
    stats: dict[str, float]
    """twinstep.wire.stats.FIELDS (count from the shape)."""
    values: np.ndarray | None


@dataclass(frozen=True)
class OpCall:
    index: int
    op: str
    api: str
    file: str
    line: int
    code: str
    inputs: tuple[int, ...]
    output: OpTensor


@dataclass(frozen=True)
class OpTrace:
    run: str
    rank: int
    step: int
    zoom_id: int
    module: str
    calls: tuple[OpCall, ...]
    externals: tuple[OpTensor, ...]
    dropped: int
    error: str

    def tensor(self, reference: int) -> OpTensor:
        """An input: a call's output (reference >= 0) or an external tensor."""
        return self.calls[reference].output if reference >= 0 else self.externals[-1 - reference]


def decode_trace(message: pb.OpTrace, run: str, rank: int, step: int) -> OpTrace:
    """Validate a step's OpTrace; raises InputError naming the first problem ("step N: ops call i ...")."""
    where = f"step {step}: ops"
    if len(message.calls) > MAX_CALLS or len(message.externals) > MAX_EXTERNALS:
        raise invalid(f"{where} has {len(message.calls)} calls and {len(message.externals)} external tensors; "
                      f"at most {MAX_CALLS} and {MAX_EXTERNALS}")
    if max([len(message.module), len(message.error)], default=0) > MAX_TEXT:
        raise invalid(f"{where}: module name and error must be at most {MAX_TEXT} characters")
    externals = tuple(_tensor(t, f"{where} external {i}") for i, t in enumerate(message.externals))
    calls = []
    for i, call in enumerate(message.calls):
        at = f"{where} call {i}"
        if max(len(call.op), len(call.api), len(call.file), len(call.code)) > MAX_TEXT or not call.op:
            raise invalid(f"{at}: needs an op name, and texts of at most {MAX_TEXT} characters")
        for ref in call.inputs:
            if not (-len(externals) <= ref < i):
                raise invalid(f"{at}: input {ref} names neither an earlier call nor one of "
                              f"{len(externals)} external tensors")
        calls.append(OpCall(i, call.op, call.api, call.file, call.line, call.code, tuple(call.inputs),
                            _tensor(call.output, at)))
    return OpTrace(run, rank, step, message.zoom_id, message.module, tuple(calls), externals,
                   message.calls_dropped, message.error)


def _tensor(message: pb.OpTensor, at: str) -> OpTensor:
    dtype = WIRE_TO_DTYPE.get(message.dtype)
    if dtype is None:
        raise invalid(f"{at}: unknown dtype {message.dtype}")
    shape = tuple(message.shape)
    if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
        raise invalid(f"{at}: shape {list(shape)[:8]} is not a tensor's")
    count = math.prod(shape)
    if len(message.stats) != len(DEVICE_FIELDS):
        raise invalid(f"{at}: {len(message.stats)} statistics, expected {len(DEVICE_FIELDS)}")
    values = None
    if message.values:
        if len(message.values) != 4 * count:
            raise invalid(f"{at}: {len(message.values)} bytes of values for {count} float32 elements")
        values = np.frombuffer(message.values, dtype="<f4")
    stats = {"count": float(count), **dict(zip(DEVICE_FIELDS, message.stats))}
    assert tuple(stats) == FIELDS
    return OpTensor(dtype, shape, stats, values)
