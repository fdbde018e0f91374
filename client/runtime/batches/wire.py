"""A training batch as it travels for batch sync: captured, encoded, decoded into the candidate's framework.

A batch is what a training feeds its model for one step: a tensor, or a dict,
list or tuple (nested) of tensors, arrays and plain values.  :func:`capture`
copies it on the training thread (the only work done there: the training may
reuse its buffers once the call returns); :func:`to_proto` encodes the copy on
a background thread (integer and boolean tensors zstd-compressed: token ids
shrink about 3x; floats travel raw, where zstd saves little); :func:`from_proto`
rebuilds it on the candidate, each tensor in the baseline's dtype and shape,
as a tensor of the candidate's framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from twinstep.wire import codec
from twinstep.errors import BatchSyncError
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.runtime.values import HostValue, UnsupportedValue, to_framework, to_host

#: Deepest nesting of containers (the server refuses deeper batches).
MAX_DEPTH = 32
_COMPRESSED = frozenset({"int8", "int16", "int32", "int64", "uint8", "bool"})


class _Tuple(tuple):
    """A captured tuple (kept apart from a captured list)."""


def capture(batch: Any, depth: int = 0) -> Any:
    """A private copy of ``batch``: its tensors and arrays as HostValues, containers as dicts, lists and tuples.

    UnsupportedValue (a TypeError) names what cannot travel.
    """
    if depth > MAX_DEPTH:
        raise UnsupportedValue(f"a batch nested deeper than {MAX_DEPTH} containers")
    if batch is None or isinstance(batch, (bool, int, float, str)):
        return batch
    if isinstance(batch, Mapping):
        out = {}
        for key, item in batch.items():
            if not isinstance(key, str):
                raise UnsupportedValue(f"a batch dict with a {type(key).__qualname__} key ({key!r}): keys must be text")
            out[key] = capture(item, depth + 1)
        return out
    if isinstance(batch, tuple):
        return _Tuple(capture(item, depth + 1) for item in batch)
    if isinstance(batch, list):
        return [capture(item, depth + 1) for item in batch]
    return to_host(batch)  # a tensor or an array (or a numpy scalar)


def nbytes(captured: Any) -> int:
    """Storage bytes of a captured batch's tensors."""
    if isinstance(captured, HostValue):
        return captured.nbytes
    if isinstance(captured, dict):
        return sum(nbytes(v) for v in captured.values())
    if isinstance(captured, (list, tuple)):
        return sum(nbytes(v) for v in captured)
    return 0


def to_proto(captured: Any) -> pb.BatchValue:
    """The wire form of a captured batch (runs on the publisher's thread)."""
    if isinstance(captured, HostValue):
        kind, data, raw = codec.encode(captured.storage, compress=captured.dtype in _COMPRESSED)
        return pb.BatchValue(tensor=pb.BatchTensor(dtype=codec.DTYPE_TO_WIRE[captured.dtype], shape=captured.shape,
                                                   codec=kind, raw_nbytes=raw, data=data))
    if isinstance(captured, dict):
        return pb.BatchValue(dict=pb.BatchDict(keys=list(captured), values=[to_proto(v) for v in captured.values()]))
    if isinstance(captured, _Tuple):
        return pb.BatchValue(tuple=pb.BatchValues(items=[to_proto(v) for v in captured]))
    if isinstance(captured, list):
        return pb.BatchValue(list=pb.BatchValues(items=[to_proto(v) for v in captured]))
    if captured is None:
        return pb.BatchValue(none=True)
    if isinstance(captured, bool):
        return pb.BatchValue(bool_value=captured)
    if isinstance(captured, int):
        return pb.BatchValue(int_value=captured)
    if isinstance(captured, float):
        return pb.BatchValue(float_value=captured)
    return pb.BatchValue(string_value=str(captured))


def from_proto(value: pb.BatchValue, framework: str, to_device: Any = None, depth: int = 0) -> Any:
    """The batch as the candidate's framework holds it; BatchSyncError for one that does not decode.

    ``to_device``: applied to each tensor built (moves it to the candidate's device), or None.
    """
    if depth > MAX_DEPTH:
        raise BatchSyncError(f"the baseline's batch is nested deeper than {MAX_DEPTH} containers")
    kind = value.WhichOneof("kind")
    if kind == "tensor":
        tensor = framework_tensor(value.tensor, framework)
        return to_device(tensor) if to_device is not None else tensor
    if kind == "dict":
        if len(value.dict.keys) != len(value.dict.values):
            raise BatchSyncError("the baseline's batch has a dict whose keys and values do not pair up")
        return {k: from_proto(v, framework, to_device, depth + 1) for k, v in zip(value.dict.keys, value.dict.values)}
    if kind == "list":
        return [from_proto(v, framework, to_device, depth + 1) for v in value.list.items]
    if kind == "tuple":
        return tuple(from_proto(v, framework, to_device, depth + 1) for v in value.tuple.items)
    if kind == "none":
        return None
    if kind in ("int_value", "float_value", "bool_value", "string_value"):
        return getattr(value, kind)
    raise BatchSyncError("the baseline's batch has an empty node (neither tensor, container nor value)")


def host_value(tensor: pb.BatchTensor) -> HostValue:
    """One tensor of a batch as a HostValue; BatchSyncError if its bytes do not decode as announced."""
    name = codec.WIRE_TO_DTYPE.get(tensor.dtype)
    if name is None:
        raise BatchSyncError(f"the baseline's batch holds a tensor of unknown dtype {tensor.dtype}")
    shape = tuple(int(d) for d in tensor.shape)
    if tensor.codec not in (pb.RAW, pb.ZSTD):
        raise BatchSyncError(f"a tensor of the baseline's batch uses codec {tensor.codec}; batches travel RAW or ZSTD")
    try:
        array = codec.decode(tensor.codec, tensor.data, tensor.raw_nbytes, name, shape)
    except codec.PayloadError as error:
        raise BatchSyncError(f"a tensor of the baseline's batch does not decode: {error}") from None
    if name == "bfloat16":  # decode widens it to float32, exactly: back to its bit pattern
        return HostValue(name, (np.ascontiguousarray(array).view(np.uint32) >> 16).astype(np.uint16).view(np.int16))
    return HostValue(name, array)


def framework_tensor(tensor: pb.BatchTensor, framework: str) -> Any:
    return to_framework(host_value(tensor), framework)
