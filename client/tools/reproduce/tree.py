"""A module call's arguments and outputs as JSON structure plus named arrays, and back.

Nodes: ``{"tensor": NAME}`` (an array of the bundle), ``{"list": [...]}``,
``{"tuple": [...]}``, ``{"dict": {key: node}}`` (string keys), ``{"value": x}``
for JSON values (None, booleans, numbers, strings), and ``{"missing": TEXT}``
for anything else (a cache object, a dataclass): replayed as None, and listed
among what the bundle lacks.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from twinstep.tools.reproduce.frameworks import Framework

_MAX_DEPTH = 16


class Flattener:
    """Collects the arrays of one or more trees, naming them ``PREFIX.N``."""

    def __init__(self, framework: Framework) -> None:
        self.framework = framework
        self.arrays: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, str] = {}
        self.missing: list[str] = []
        self.nbytes = 0
        self._counts: dict[str, int] = {}

    def flatten(self, value: Any, prefix: str, where: str, depth: int = 0) -> dict[str, Any]:
        if self.framework.is_tensor(value):
            number = self._counts.get(prefix, 0)
            self._counts[prefix] = number + 1
            name = f"{prefix}.{number}"
            array, dtype = self.framework.to_numpy(value)
            self.arrays[name] = array
            self.dtypes[name] = dtype
            self.nbytes += array.nbytes
            return {"tensor": name}
        if depth >= _MAX_DEPTH:
            return self._missing(value, where, "nested too deep")
        if isinstance(value, (list, tuple)):
            kind = "tuple" if isinstance(value, tuple) else "list"
            return {kind: [self.flatten(v, prefix, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]}
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {"dict": {k: self.flatten(v, prefix, f"{where}[{k!r}]", depth + 1) for k, v in value.items()}}
        if value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
            return {"value": value}
        return self._missing(value, where, "not a tensor, container or plain value")

    def _missing(self, value: Any, where: str, why: str) -> dict[str, Any]:
        text = f"{where}: a {type(value).__module__}.{type(value).__qualname__} ({why}); replayed as None"
        self.missing.append(text)
        return {"missing": text}


def rebuild(node: Any, arrays: dict[str, np.ndarray], dtypes: dict[str, str], framework: Framework) -> Any:
    """The value a node stands for, with tensors of ``framework`` (raises ValueError for a malformed node)."""
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"malformed node {node!r}")
    (kind, body), = node.items()
    if kind == "tensor":
        if body not in arrays:
            raise ValueError(f"node names array {body!r}, which the bundle does not hold")
        return framework.from_numpy(arrays[body], dtypes.get(body, str(arrays[body].dtype)))
    if kind in ("list", "tuple"):
        items = [rebuild(v, arrays, dtypes, framework) for v in body]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: rebuild(v, arrays, dtypes, framework) for k, v in body.items()}
    if kind == "value":
        return body
    if kind == "missing":
        return None
    raise ValueError(f"unknown node kind {kind!r}")


def tensor_names(node: Any) -> list[str]:
    """The arrays of a tree, in order (depth first)."""
    if not isinstance(node, dict) or len(node) != 1:
        return []
    (kind, body), = node.items()
    if kind == "tensor":
        return [body]
    if kind in ("list", "tuple"):
        return [name for v in body for name in tensor_names(v)]
    if kind == "dict":
        return [name for v in body.values() for name in tensor_names(v)]
    return []


def flat_tensors(value: Any, framework: Framework) -> list[tuple[np.ndarray, str]]:
    """Every tensor of an output, depth first, as (array, dtype)."""
    if framework.is_tensor(value):
        return [framework.to_numpy(value)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flat_tensors(v, framework)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in flat_tensors(v, framework)]
    found = getattr(value, "to_tuple", None)  # a transformers ModelOutput
    if callable(found):
        return [t for v in found() for t in flat_tensors(v, framework)]
    return []
