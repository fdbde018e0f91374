"""Canonical operation names: one word for one operation, whichever framework spells it.

torch's function mode sees ``Tensor.div`` for ``a / b``, paddle's hooks see
``Tensor.__truediv__``; both are "divide" here, so the server aligns the two
runs' operation sequences by these names.  A name not listed is its own
canonical name, without dunder underscores or an in-place suffix
(``masked_fill_`` -> "masked_fill").
"""

from __future__ import annotations

_GROUPS: dict[str, tuple[str, ...]] = {
    "add": ("add", "__add__", "__radd__", "__iadd__"),
    "subtract": ("sub", "subtract", "__sub__", "__rsub__", "__isub__", "rsub"),
    "multiply": ("mul", "multiply", "__mul__", "__rmul__", "__imul__"),
    "divide": ("div", "divide", "true_divide", "__truediv__", "__rtruediv__", "__itruediv__", "__div__", "__rdiv__"),
    "matmul": ("matmul", "__matmul__", "__rmatmul__", "mm", "bmm"),
    "pow": ("pow", "__pow__", "__rpow__", "square"),
    "negative": ("neg", "negative", "__neg__"),
    "reshape": ("reshape", "view", "view_as", "reshape_as"),
    "transpose": ("transpose", "permute", "t", "swapaxes", "swapdims", "moveaxis", "movedim"),
    "concat": ("cat", "concat", "concatenate"),
    "split": ("split", "chunk", "tensor_split", "unbind"),
    "getitem": ("__getitem__",),
    "cast": ("to", "float", "half", "double", "bfloat16", "type", "type_as", "astype", "cast"),
    "expand": ("expand", "expand_as", "broadcast_to"),
    "clip": ("clamp", "clip", "clamp_min", "clamp_max"),
    "abs": ("abs", "__abs__"),
    "sqrt": ("sqrt",),
    "rsqrt": ("rsqrt",),
    "softmax": ("softmax", "_softmax"),
    "mean": ("mean",),
    "sum": ("sum",),
    "embedding": ("embedding",),
    "linear": ("linear",),
    "where": ("where",),
    "masked_fill": ("masked_fill",),
}
_CANONICAL = {spelling: name for name, spellings in _GROUPS.items() for spelling in spellings}


def canonical(api_name: str) -> str:
    """The canonical name of a framework function or method called ``api_name`` (its last dotted part)."""
    short = api_name.rsplit(".", 1)[-1]
    found = _CANONICAL.get(short)
    if found is not None:
        return found
    stripped = short.strip("_") if short.startswith("__") else short
    if stripped.endswith("_") and not stripped.startswith("_"):
        stripped = stripped[:-1]  # in place: the same operation
    return _CANONICAL.get(stripped, stripped or short)
