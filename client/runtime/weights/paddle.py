"""Loading values into a ``paddle.nn.Layer``'s parameters (weight sync)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import paddle


def load(values: Sequence[tuple[paddle.Tensor, np.ndarray, str]]) -> None:
    """Copy each (parameter, storage array in its shape, the array's dtype name) into the parameter.

    A value of the parameter's own dtype goes in as its storage array (paddle
    takes bfloat16 as its uint16 bit pattern), bit for bit; another dtype is
    cast by paddle.  Every value is staged first, so a failure leaves every
    parameter as it was; ``set_value`` runs only once all are staged.
    """
    staged: list[tuple[paddle.Tensor, Any]] = []
    for param, array, dtype in values:
        if list(array.shape) != list(param.shape):
            raise ValueError(f"a value of shape {list(array.shape)} for a parameter of shape {list(param.shape)}")
        if dtype == _dtype_name(param):
            staged.append((param, np.ascontiguousarray(array)))
        else:
            staged.append((param, paddle.to_tensor(np.ascontiguousarray(array)).astype(param.dtype)))
    for param, value in staged:
        param.set_value(value)


def _dtype_name(param: paddle.Tensor) -> str:
    return str(param.dtype).rsplit(".", 1)[-1]
