"""Loading values into a ``mindspore.nn.Cell``'s parameters (weight sync).

``Parameter.set_data`` accepts a value of another shape without a word (2.10
replaces the parameter's shape with it), so every shape is checked here first.
"""

from __future__ import annotations

from typing import Any, Sequence

import mindspore
import numpy as np


def load(values: Sequence[tuple[Any, np.ndarray, str]]) -> None:
    """Copy each (parameter, storage array in its shape, the array's dtype name) into the parameter.

    Every value is staged as a tensor of the parameter's dtype first (bfloat16
    rebuilt from its bit pattern, exactly; a cast where the dtypes differ), so a
    failure leaves every parameter as it was; ``set_data`` runs only once all
    are staged.
    """
    staged: list[tuple[Any, mindspore.Tensor]] = []
    for param, array, dtype in values:
        if tuple(array.shape) != tuple(param.shape):
            raise ValueError(f"a value of shape {list(array.shape)} for a parameter of shape {list(param.shape)}")
        staged.append((param, _tensor(array, dtype, param.dtype)))
    for param, value in staged:
        param.set_data(value)


def _tensor(array: np.ndarray, dtype: str, target: Any) -> mindspore.Tensor:
    """A MindSpore tensor of ``target`` dtype holding the array's values (a copy: the array is not kept)."""
    if dtype == "bfloat16":  # numpy has no bfloat16: widen its bits to float32, which holds every value exactly
        bits = np.ascontiguousarray(array).view(np.uint16).astype(np.uint32) << 16
        return mindspore.Tensor(bits.view(np.float32)).astype(target)
    return mindspore.Tensor(np.array(array, copy=True), dtype=target)
