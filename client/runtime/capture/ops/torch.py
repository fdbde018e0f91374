"""torch: a ``TorchFunctionMode`` for the duration of one module call.

Why a function mode and not a dispatch mode: it sees the calls as the code
wrote them (``F.softmax``, ``torch.matmul``, ``Tensor.__getitem__``, ``a / b``),
the level paddle's API hooks see, so both runs' sequences share canonical
names and the source line is the user's.  A dispatch mode sees ATen operators
after decomposition and autograd (``aten::_softmax``, ``aten::mm``, views and
copies the code never wrote), which paddle has no counterpart for.  Inside its
handler torch disables the mode, so a function implemented with other torch
functions is one call, as on the paddle side.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from twinstep.runtime.capture.base import RemovableHandle
from twinstep.runtime.capture.ops.trace import OpTraceBuilder, child_module_hooks


def api_name(func: Any) -> str:
    """torch's name of a function the mode saw: "torch.matmul", "torch.Tensor.div", "torch.nn.functional.gelu"."""
    name = getattr(func, "__name__", None) or type(func).__name__
    qualified = getattr(func, "__qualname__", "") or name
    if qualified.startswith(("TensorBase.", "Tensor.")):
        return "torch.Tensor." + name
    module = getattr(func, "__module__", None) or "torch"
    if module.startswith("torch._C") or qualified.startswith("_VariableFunctionsClass"):
        module = "torch"
    return f"{module}.{name}"


class _Mode(TorchFunctionMode):
    def __init__(self, builder: OpTraceBuilder) -> None:
        super().__init__()
        self.builder = builder

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        builder = self.builder
        if builder.passes_through():
            return func(*args, **kwargs)
        builder.busy += 1
        try:
            result = func(*args, **kwargs)
        finally:
            builder.busy -= 1
        builder.on_call(api_name(func), args, kwargs, result)
        return result


class TorchInterceptor:
    framework_dir = os.path.dirname(torch.__file__)

    def __init__(self) -> None:
        self._mode: _Mode | None = None

    def start(self, builder: OpTraceBuilder) -> None:
        self._mode = _Mode(builder)
        self._mode.__enter__()

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)

    def child_hooks(self, module: torch.nn.Module, builder: OpTraceBuilder) -> list[RemovableHandle]:
        handles = []
        for name, child in module.named_children():
            enter, leave = child_module_hooks(name, builder)
            # First before every other pre-hook, last after every other hook: what they do is inside the child.
            handles.append(RemovableHandle(child.register_forward_pre_hook(enter, prepend=True).remove))
            handles.append(RemovableHandle(child.register_forward_hook(leave).remove))
        return handles
