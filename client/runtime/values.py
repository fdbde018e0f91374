"""Values a training hands to twinstep by name or as a batch, as host arrays and back.

``Monitor.record`` and ``Monitor.publish_batch`` take what a training has at
hand: numpy arrays and scalars, torch, paddle and MindSpore tensors (on any device),
python ints, floats and bools, and rectangular (nested) lists or tuples of
them.  :func:`to_host` turns one into a :class:`HostValue`: a private copy in
the storage layout of the wire (``twinstep.wire.codec``), its dtype kept exactly
(an int64 stays int64; bfloat16 travels as its 16-bit pattern, since numpy has
no bfloat16), so integers compare exactly on the server and a batch reaches
the candidate as the baseline had it.  :func:`to_framework` builds the
candidate's tensor from one.

torch and paddle are imported only when a value of theirs is seen (or asked
for), so a torch job never loads paddle.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from twinstep.wire import codec

#: numpy dtypes that travel as they are (dtype name -> twinstep dtype name).
_NUMPY_NAMES = {"float32": "float32", "float16": "float16", "float64": "float64", "int8": "int8",
                "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8", "bool": "bool"}
_FLOATS = frozenset({"float32", "float16", "bfloat16", "float64"})
_INT64 = (-(1 << 63), (1 << 63) - 1)


class UnsupportedValue(TypeError):
    """A value twinstep cannot carry (an object, a ragged list, a dtype the wire has no name for)."""


@dataclass(frozen=True)
class HostValue:
    """A value's private host copy: its twinstep dtype and its wire storage array (C order)."""

    dtype: str
    """"int64", "float32", "bfloat16", ... (twinstep.wire.codec.DTYPE_TO_WIRE's names)."""
    storage: np.ndarray
    """The elements as the wire stores them: bfloat16 as its bit pattern (int16 here), others as is."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.storage.shape)

    @property
    def nbytes(self) -> int:
        return int(self.storage.nbytes)

    @property
    def exact(self) -> bool:
        """Integers and booleans: compared value by value, with no tolerance."""
        return self.dtype not in _FLOATS

    def widened(self) -> np.ndarray:
        """The values as float64 (integers of up to 2**53 exactly; bfloat16 and float16 exactly)."""
        if self.dtype == "bfloat16":
            return bfloat16_to_float32(self.storage).astype(np.float64)
        return self.storage.astype(np.float64)


def to_host(value: Any) -> HostValue:
    """A private host copy of ``value``; UnsupportedValue (a TypeError) naming what is wrong."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _from_torch(value, torch)
    paddle = sys.modules.get("paddle")
    if paddle is not None and isinstance(value, paddle.Tensor):
        return _from_paddle(value)
    mindspore = sys.modules.get("mindspore")
    if mindspore is not None and isinstance(value, mindspore.Tensor):
        return _from_mindspore(value, mindspore)
    if isinstance(value, bool) or isinstance(value, np.bool_):
        return HostValue("bool", np.array(bool(value)))
    if isinstance(value, int) and not isinstance(value, bool):
        if not _INT64[0] <= value <= _INT64[1]:
            raise UnsupportedValue(f"the integer {value} does not fit int64")
        return HostValue("int64", np.array(value, dtype=np.int64))
    if isinstance(value, float):
        return HostValue("float64", np.array(value, dtype=np.float64))
    if isinstance(value, (np.ndarray, np.generic)):
        return _from_numpy(np.asarray(value))
    if isinstance(value, (list, tuple)):
        return _from_sequence(value)
    raise UnsupportedValue(f"cannot record a {type(value).__module__}.{type(value).__qualname__}: give a number, "
                           "a numpy array, a torch, paddle or mindspore tensor, or a (nested) list of numbers")


def _from_numpy(array: np.ndarray) -> HostValue:
    if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 (jax, some tokenizers)
        return HostValue("bfloat16", np.array(array.view(np.int16), order="C", copy=True))
    name = _NUMPY_NAMES.get(array.dtype.name)
    if name is None:
        raise UnsupportedValue(f"arrays of dtype {array.dtype} have no twinstep dtype (supported: "
                               f"{', '.join(sorted(codec.DTYPE_TO_WIRE))}); cast it first")
    storage = np.array(array, dtype=array.dtype.newbyteorder("=") if array.dtype.byteorder == ">" else array.dtype,
                       order="C", copy=True)
    return HostValue(name, storage)


def _from_sequence(value: list | tuple) -> HostValue:
    flat = _flatten(value)
    if any(isinstance(v, float) for v in flat):
        dtype: type = np.float64
    elif flat and all(isinstance(v, (bool, np.bool_)) for v in flat):
        dtype = np.bool_
    else:
        dtype = np.int64
    try:
        array = np.array(value, dtype=dtype)
    except (ValueError, OverflowError) as error:
        raise UnsupportedValue(f"a list that is not a rectangular array of numbers ({error})") from None
    return HostValue(_NUMPY_NAMES[array.dtype.name], array)


def _flatten(value: Any, out: list | None = None) -> list:
    out = [] if out is None else out
    for item in value:
        if isinstance(item, (list, tuple)):
            _flatten(item, out)
        elif isinstance(item, (int, float, np.integer, np.floating, np.bool_)):
            out.append(item)
        else:
            raise UnsupportedValue(f"a list holding a {type(item).__qualname__}: lists must hold numbers only")
    return out


def _from_torch(tensor: Any, torch: Any) -> HostValue:
    names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
             torch.float64: "float64", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32",
             torch.int64: "int64", torch.uint8: "uint8", torch.bool: "bool"}
    name = names.get(tensor.dtype)
    if name is None:
        raise UnsupportedValue(f"torch tensors of dtype {tensor.dtype} have no twinstep dtype; cast it first")
    with torch.no_grad():
        t = tensor.detach()
        if t.layout is not torch.strided:
            t = t.to_dense()
        t = t.to("cpu").contiguous()
        if name == "bfloat16":
            t = t.view(torch.int16)
        # A copy: the training may change its tensor in place once the call returns.
        return HostValue(name, np.array(t.numpy(), order="C", copy=True))


def _from_paddle(tensor: Any) -> HostValue:
    name = str(tensor.dtype).rsplit(".", 1)[-1]
    if name not in codec.DTYPE_TO_WIRE:
        raise UnsupportedValue(f"paddle tensors of dtype {tensor.dtype} have no twinstep dtype; cast it first")
    array = tensor.detach().numpy()  # a host copy; bfloat16 arrives as its uint16 bit pattern
    if name == "bfloat16":
        array = array.view(np.int16)
    return HostValue(name, np.array(array, order="C", copy=True))


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (16-bit integers) widened to float32, exactly."""
    return (np.ascontiguousarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _from_mindspore(tensor: Any, mindspore: Any) -> HostValue:
    if tensor.dtype == mindspore.bfloat16:  # numpy has no bfloat16: widened exactly, then its upper 16 bits
        bits = (tensor.astype(mindspore.float32).asnumpy().view(np.uint32) >> 16).astype(np.uint16)
        return HostValue("bfloat16", bits.view(np.int16).copy())
    array = tensor.asnumpy()  # a view of a CPU tensor's memory: copied below
    name = _NUMPY_NAMES.get(array.dtype.name)
    if name is None:
        raise UnsupportedValue(f"mindspore tensors of dtype {tensor.dtype} have no twinstep dtype; cast it first")
    return HostValue(name, np.array(array, order="C", copy=True))


def to_framework(value: HostValue, framework: str) -> Any:
    """The value as a host tensor of ``framework`` ("torch", "paddle", "mindspore" or "numpy"), in its own dtype."""
    if framework == "torch":
        import torch

        if value.dtype == "bfloat16":
            return torch.from_numpy(value.storage.copy()).view(torch.bfloat16)
        return torch.from_numpy(value.storage.copy())
    if framework == "paddle":
        import paddle

        if value.dtype == "bfloat16":  # widened exactly, then narrowed without rounding
            return paddle.to_tensor(bfloat16_to_float32(value.storage), dtype="bfloat16", place=paddle.CPUPlace())
        return paddle.to_tensor(value.storage, dtype=value.dtype, place=paddle.CPUPlace())
    if framework == "mindspore":
        import mindspore

        if value.dtype == "bfloat16":  # widened exactly, then narrowed without rounding
            return mindspore.Tensor(bfloat16_to_float32(value.storage)).astype(mindspore.bfloat16)
        return mindspore.Tensor(value.storage.copy())
    if framework == "numpy":
        return bfloat16_to_float32(value.storage) if value.dtype == "bfloat16" else value.storage.copy()
    raise ValueError(f"unknown framework {framework!r} (torch, paddle, mindspore or numpy)")


#: Elements widened to float64 at a time by statistics_row (8 MiB of temporaries, whatever the value's size).
_CHUNK = 1 << 20


def statistics_row(value: HostValue) -> tuple[float, ...]:
    """twinstep.wire.stats.DEVICE_FIELDS of a value, computed the same way by every run, so equal values give
    bit-equal rows (integers up to 2**53: exactly, whatever the order): float64 sums over chunks,
    non-finite elements counted apart, m2 from the deviations in a second pass."""
    flat = value.storage.reshape(-1)
    total = sum_sq = 0.0
    lo, hi = math.inf, -math.inf
    nan = inf = finite_count = 0
    for x in _finite_chunks(value.dtype, flat):
        if isinstance(x, tuple):  # the non-finite elements of a chunk
            nan, inf = nan + x[0], inf + x[1]
            continue
        finite_count += x.size
        total += math.fsum(x.tolist()) if x.size <= 4096 else float(x.sum())
        sum_sq += float(np.dot(x, x))
        lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
    if not finite_count:
        return (0.0, 0.0, 0.0, 0.0, 0.0, float(nan), float(inf), 0.0)
    mean = total / finite_count
    m2 = 0.0
    for x in _finite_chunks(value.dtype, flat):
        if not isinstance(x, tuple):
            deviation = x - mean
            m2 += float(np.dot(deviation, deviation))
    return (total, sum_sq, lo, hi, max(-lo, hi), float(nan), float(inf), m2)


def _finite_chunks(dtype: str, flat: np.ndarray):
    """The finite elements as float64, _CHUNK at a time; after a chunk with others, (NaN count, Inf count)."""
    for start in range(0, max(flat.size, 1), _CHUNK):
        x = _widen(dtype, flat[start:start + _CHUNK])
        if not x.size:
            continue
        finite = np.isfinite(x)
        if not finite.all():
            nan = int(np.isnan(x).sum())
            yield (nan, int(x.size - int(finite.sum())) - nan)
            x = x[finite]
        if x.size:
            yield x


def _widen(dtype: str, storage: np.ndarray) -> np.ndarray:
    return bfloat16_to_float32(storage).astype(np.float64) if dtype == "bfloat16" else storage.astype(np.float64)
