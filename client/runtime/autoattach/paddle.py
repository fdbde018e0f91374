"""PaddlePaddle's probe: reversible patches, as paddle has no global module or optimizer hooks.

- module calls: ``paddle.nn.Layer.__call__`` wrapped (restored once the model is found);
- optimizer construction: the ``__init__`` of ``paddle.optimizer.Optimizer`` and of every
  subclass that has its own wrapped (AdamW, SGD, ... do not call ``Optimizer.__init__``),
  and of subclasses defined later (``__init_subclass__``); each new optimizer's ``step``
  and ``minimize`` are wrapped on the instance (AdamW defines its own ``step``);
- the loss: ``paddle.Tensor.backward`` wrapped.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Iterator

import paddle

from twinstep.runtime.autoattach.base import Patch, Probe
from twinstep.runtime.autoattach.installer import AutoAttach

#: paddle's parallel wrappers: their forward runs the model held in ``_layers``.
WRAPPERS = frozenset({"DataParallel", "TensorParallel", "PipelineParallel", "PipelineParallelWithInterleave",
                      "ShardingParallel", "SegmentParallel"})


class PaddleProbe(Probe):
    framework = "paddle"

    def __init__(self) -> None:
        self.installer = AutoAttach(self)
        installer = self.installer

        def wrap_call(call: Any) -> Any:
            @functools.wraps(call)
            def __call__(layer: paddle.nn.Layer, *args: Any, **kwargs: Any) -> Any:
                if patch_call.active:
                    installer.on_forward(layer)
                return call(layer, *args, **kwargs)

            return __call__

        seen: weakref.WeakSet = weakref.WeakSet()  # optimizers registered (a subclass's __init__ may call its base's)

        def wrap_init(init: Any) -> Any:
            @functools.wraps(init)
            def __init__(optimizer: Any, *args: Any, **kwargs: Any) -> None:
                init(optimizer, *args, **kwargs)
                if not self._steps_active:
                    return
                try:
                    if optimizer in seen:
                        return
                    seen.add(optimizer)
                    self._wrap_steps(optimizer)
                except Exception as error:  # the optimizer is built: twinstep lets go, the training goes on
                    installer.give_up(f"wrapping {type(optimizer).__name__}.step failed: {error!r}")
                    return
                installer.on_optimizer(optimizer)

            return __init__

        def wrap_init_subclass(init_subclass: Any) -> Any:
            def __init_subclass__(cls: type, **kwargs: Any) -> None:
                super(paddle.optimizer.Optimizer, cls).__init_subclass__(**kwargs)
                if self._steps_active and "__init__" in cls.__dict__:
                    self._patches.append(Patch(cls, "__init__", wrap_init))

            return classmethod(__init_subclass__)

        def wrap_backward(backward: Any) -> Any:
            @functools.wraps(backward)
            def wrapper(tensor: paddle.Tensor, grad_tensor: Any = None, *args: Any, **kwargs: Any) -> Any:
                if patch_backward.active:
                    installer.on_backward(tensor, grad_tensor)
                return backward(tensor, grad_tensor, *args, **kwargs)

            return wrapper

        self._steps_active = True
        patch_call = Patch(paddle.nn.Layer, "__call__", wrap_call)
        patch_backward = Patch(paddle.Tensor, "backward", wrap_backward)
        self._discovery = patch_call
        self._patches = [patch_call, patch_backward]
        self._patches += [Patch(cls, "__init__", wrap_init) for cls in _classes(paddle.optimizer.Optimizer)
                          if "__init__" in cls.__dict__]
        self._patches.append(Patch(paddle.optimizer.Optimizer, "__init_subclass__", wrap_init_subclass))

    def _wrap_steps(self, optimizer: Any) -> None:
        """End twinstep's step when this optimizer's ``step()`` or ``minimize()`` returns."""
        installer = self.installer
        inside = [False]  # minimize calling step (or the reverse) ends one step, not two

        for name in ("step", "minimize"):
            method = getattr(optimizer, name, None)
            if method is None:
                continue

            def make(method: Any) -> Any:
                @functools.wraps(method)
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    if inside[0] or not self._steps_active:
                        return method(*args, **kwargs)
                    inside[0] = True
                    try:
                        result = method(*args, **kwargs)
                    finally:
                        inside[0] = False
                    installer.on_step_end(optimizer)
                    return result

                return wrapper

            setattr(optimizer, name, make(method))

    def remove_discovery(self) -> None:
        self._discovery.remove()

    def remove(self) -> None:
        self._steps_active = False  # the instance wrappers call straight through from now on
        for patch in reversed(self._patches):
            patch.remove()

    def grad_enabled(self) -> bool:
        return paddle.is_grad_enabled()

    def parameters(self, module: paddle.nn.Layer) -> Iterator[paddle.Tensor]:
        return iter(module.parameters())

    def optimizer_parameters(self, optimizer: Any) -> Iterator[paddle.Tensor]:
        for entry in getattr(optimizer, "_parameter_list", None) or ():
            if isinstance(entry, dict):
                yield from entry.get("params", ())
            else:
                yield entry

    def unwrap(self, module: paddle.nn.Layer) -> tuple[paddle.nn.Layer, list[str]]:
        wrappers = []
        while type(module).__name__ in WRAPPERS and isinstance(getattr(module, "_layers", None), paddle.nn.Layer):
            wrappers.append(type(module).__name__)
            module = module._layers
        return module, wrappers

    def numel(self, parameter: paddle.Tensor) -> int:
        return math.prod(parameter.shape)

    def scalar_loss(self, tensor: Any, gradient: Any) -> paddle.Tensor | None:
        if gradient is not None or not isinstance(tensor, paddle.Tensor) or math.prod(tensor.shape) != 1:
            return None
        return tensor.detach().reshape([])


def _classes(root: type) -> list[type]:
    """``root`` and every subclass of it defined so far."""
    found, stack = [], [root]
    while stack:
        cls = stack.pop()
        if cls not in found:
            found.append(cls)
            stack.extend(cls.__subclasses__())
    return found
