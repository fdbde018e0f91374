"""PyTorch's probe: torch's own global hooks where it has them, two reversible patches where it does not.

- module calls: ``torch.nn.modules.module.register_module_forward_pre_hook``
  (removed once the model is found, so later forwards pay nothing);
- optimizer steps: ``torch.optim.optimizer.register_optimizer_step_post_hook``
  (every ``torch.optim.Optimizer`` subclass runs it);
- optimizer construction: ``torch.optim.Optimizer.__init__`` wrapped (torch has no hook for it);
- the loss: ``torch.autograd.backward`` wrapped (``Tensor.backward`` calls it).
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
from torch.nn.modules import module as _module
from torch.optim import optimizer as _optimizer

from twinstep.runtime.autoattach.base import Patch, Probe
from twinstep.runtime.autoattach.installer import AutoAttach

#: Wrappers whose forward runs the model's: class name -> the attribute holding the model.
WRAPPERS = {"DistributedDataParallel": "module", "DataParallel": "module", "FullyShardedDataParallel": "module",
            "OptimizedModule": "_orig_mod"}


class TorchProbe(Probe):
    framework = "torch"

    def __init__(self) -> None:
        self.installer = AutoAttach(self)
        installer = self.installer

        def forward_pre_hook(module: torch.nn.Module, args: Any) -> None:
            installer.on_forward(module)

        def step_post_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            installer.on_step_end(optimizer)

        def wrap_init(init: Any) -> Any:
            @functools.wraps(init)
            def __init__(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
                init(optimizer, *args, **kwargs)
                if patch_init.active:
                    installer.on_optimizer(optimizer)

            return __init__

        def wrap_backward(backward: Any) -> Any:
            @functools.wraps(backward)
            def wrapper(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
                if patch_backward.active:
                    installer.on_backward(tensors, grad_tensors)
                return backward(tensors, grad_tensors, *args, **kwargs)

            return wrapper

        self._forward = _module.register_module_forward_pre_hook(forward_pre_hook)
        self._step = _optimizer.register_optimizer_step_post_hook(step_post_hook)
        patch_init = Patch(torch.optim.Optimizer, "__init__", wrap_init)
        patch_backward = Patch(torch.autograd, "backward", wrap_backward)
        self._patches = [patch_init, patch_backward]

    def remove_discovery(self) -> None:
        self._forward.remove()

    def remove(self) -> None:
        self._forward.remove()
        self._step.remove()
        for patch in self._patches:
            patch.remove()

    def grad_enabled(self) -> bool:
        return torch.is_grad_enabled()

    def parameters(self, module: torch.nn.Module) -> Iterator[torch.Tensor]:
        return module.parameters()

    def optimizer_parameters(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        for group in optimizer.param_groups:
            yield from group["params"]

    def unwrap(self, module: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
        wrappers = []
        while type(module).__name__ in WRAPPERS and isinstance(getattr(module, WRAPPERS[type(module).__name__], None),
                                                               torch.nn.Module):
            wrappers.append(type(module).__name__)
            module = getattr(module, WRAPPERS[type(module).__name__])
        return module, wrappers

    def numel(self, parameter: torch.Tensor) -> int:
        return parameter.numel()

    def scalar_loss(self, tensors: Any, gradient: Any) -> torch.Tensor | None:
        if gradient is not None:  # a backward from a given gradient: not a loss
            return None
        found = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if not found or not all(isinstance(t, torch.Tensor) and t.numel() == 1 for t in found):
            return None
        total = found[0].detach()
        for t in found[1:]:
            total = total + t.detach()
        return total.reshape(())
