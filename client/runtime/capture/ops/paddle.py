"""paddle: wrappers around its public APIs for the duration of one module call, restored exactly after.

Paddle has no function mode; like PaDiff's and msprobe's API hooks, the
functions of ``paddle``, ``paddle.nn.functional``, ``paddle.linalg`` (and
``paddle.incubate.nn.functional`` where present) and the methods and
arithmetic operators of ``paddle.Tensor`` are replaced by wrappers that call
the original and tell the builder.  Unlike those tools, the wrappers live only
while the captured call runs (about a thousand attribute writes each way,
~1 ms), calls from other threads pass straight through, and a call made
inside another wrapped call (a functional built from other functionals) is
not recorded, as torch's mode does not see it either.  Code that bound an API
to a name of its own before the capture (``from paddle import matmul``) is
not seen.
"""

from __future__ import annotations

import functools
import importlib
import os
import types
from typing import Any

import paddle

from twinstep.runtime.capture.base import RemovableHandle
from twinstep.runtime.capture.ops.trace import OpTraceBuilder, child_module_hooks

_NAMESPACES = ("paddle", "paddle.nn.functional", "paddle.linalg", "paddle.incubate.nn.functional")
#: Tensor dunders that are operations (the rest: object protocol, printing, conversion to Python).
_OPERATORS = frozenset({
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__div__", "__rdiv__", "__matmul__", "__rmatmul__", "__pow__", "__rpow__", "__neg__", "__abs__",
    "__getitem__", "__floordiv__", "__mod__",
})
#: Functions that are not tensor operations or that twinstep's own reads rely on.
_SKIP = frozenset({"in_dynamic_mode", "is_tensor", "is_grad_enabled", "no_grad", "enable_grad", "set_grad_enabled",
                   "get_default_dtype", "set_default_dtype", "get_flags", "set_flags", "seed", "get_device",
                   "set_device", "is_compiled_with_cuda", "numpy", "tolist", "item", "register_hook",
                   "data_ptr", "_md5sum", "value", "get_tensor", "_is_initialized", "place", "is_dense"})
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType,
              types.WrapperDescriptorType, types.BuiltinMethodType)


class PaddleInterceptor:
    framework_dir = os.path.dirname(paddle.__file__)

    def __init__(self) -> None:
        self._restore: list[tuple[Any, str, Any]] = []  # (owner, name, original attribute in its __dict__)

    def start(self, builder: OpTraceBuilder) -> None:
        if self._restore:
            return
        try:
            for prefix in _NAMESPACES:
                try:
                    namespace = importlib.import_module(prefix)
                except ImportError:
                    continue
                for name, original in list(vars(namespace).items()):
                    if name.startswith("_") or name in _SKIP or not isinstance(original, _FUNCTIONS):
                        continue
                    self._replace(namespace, name, original, _wrapper(original, f"{prefix}.{name}", builder))
            tensor = paddle.Tensor
            for name, original in list(vars(tensor).items()):
                if (name.startswith("_") and name not in _OPERATORS) or name in _SKIP \
                        or not isinstance(original, _FUNCTIONS):
                    continue
                self._replace(tensor, name, original, _wrapper(original, f"paddle.Tensor.{name}", builder))
        except Exception:
            self.stop()
            raise

    def _replace(self, owner: Any, name: str, original: Any, wrapper: Any) -> None:
        setattr(owner, name, wrapper)
        self._restore.append((owner, name, original))

    def stop(self) -> None:
        restore, self._restore = self._restore, []
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)

    def child_hooks(self, module: paddle.nn.Layer, builder: OpTraceBuilder) -> list[RemovableHandle]:
        handles = []
        for name, child in module.named_children():
            enter, leave = child_module_hooks(name, builder)
            handles.append(RemovableHandle(_first_pre_hook(child, enter).remove))
            handles.append(RemovableHandle(child.register_forward_post_hook(leave).remove))
        return handles


def _wrapper(original: Any, api: str, builder: OpTraceBuilder) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if builder.passes_through():
            return original(*args, **kwargs)
        builder.busy += 1
        try:
            result = original(*args, **kwargs)
        finally:
            builder.busy -= 1
        builder.on_call(api, args, kwargs, result)
        return result

    try:
        functools.update_wrapper(wrapper, original)
    except (AttributeError, TypeError):
        pass
    return wrapper


def _first_pre_hook(layer: paddle.nn.Layer, hook: Any) -> Any:
    """A forward pre-hook that runs before the others (paddle before 3.1 has no ``prepend``)."""
    try:
        return layer.register_forward_pre_hook(hook, prepend=True)
    except TypeError:
        handle = layer.register_forward_pre_hook(hook)
        hooks = getattr(layer, "_forward_pre_hooks", None)
        if hasattr(hooks, "move_to_end") and getattr(handle, "_hook_id", None) in hooks:
            hooks.move_to_end(handle._hook_id, last=False)
        return handle
