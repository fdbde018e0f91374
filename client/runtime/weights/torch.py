"""Loading values into a ``torch.nn.Module``'s parameters (weight sync)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch


def load(values: Sequence[tuple[torch.Tensor, np.ndarray, str]]) -> None:
    """Copy each (parameter, storage array in its shape, the array's dtype name) into the parameter.

    Every value is staged as a tensor of the parameter's dtype first (bfloat16
    rebuilt from its bit pattern; a cast where the dtypes differ), so a failure
    leaves every parameter as it was; the copies run only once all are staged.
    """
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for param, array, dtype in values:
        source = _tensor(array, dtype)
        if source.dtype != param.dtype:
            source = source.to(param.dtype)
        if tuple(source.shape) != tuple(param.shape):
            raise ValueError(f"a value of shape {list(source.shape)} for a parameter of shape {list(param.shape)}")
        staged.append((param, source))
    with torch.no_grad():
        for param, source in staged:
            param.copy_(source)


def _tensor(array: np.ndarray, dtype: str) -> Any:
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))
