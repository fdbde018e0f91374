"""Hooks and statistics for ``torch.nn.Module`` models."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import numpy as np
import torch

from twinstep.capture.base import CaptureBackend, RemovableHandle

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
_WIDEN = (torch.float16, torch.bfloat16)


class TorchBackend(CaptureBackend):
    framework = "torch"

    def framework_version(self) -> str:
        return torch.__version__

    def named_modules(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
        return model.named_modules()

    def named_parameters(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, str, str]]:
        seen: set[int] = set()
        for module_name, module in model.named_modules():
            for local, param in module.named_parameters(recurse=False):
                if id(param) in seen or not param.requires_grad:
                    continue
                seen.add(id(param))
                name = f"{module_name}.{local}" if module_name else local
                yield name, param, module_name, type(module).__name__

    def add_output_hook(self, module: torch.nn.Module, hook: Callable[[Any, Any, Any], None]) -> RemovableHandle:
        def forward_hook(mod: torch.nn.Module, args: Any, output: Any) -> None:
            hook(mod, args, output)

        return RemovableHandle(module.register_forward_hook(forward_hook).remove)

    def output_tensors(self, output: Any) -> list[torch.Tensor]:
        if isinstance(output, torch.Tensor):
            return [output] if output.dtype in _DTYPE_NAMES else []
        found: list[torch.Tensor] = []
        _collect(output, found)
        return found

    def add_grad_hook(self, tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> bool:
        if not (tensor.requires_grad and torch.is_grad_enabled()):
            return False

        def grad_hook(grad: torch.Tensor) -> None:
            hook(grad)

        tensor.register_hook(grad_hook)
        return True

    def grad(self, parameter: torch.Tensor) -> torch.Tensor | None:
        return parameter.grad

    def describe(self, tensor: torch.Tensor) -> tuple[str, tuple[int, ...]]:
        return _DTYPE_NAMES[tensor.dtype], tuple(tensor.shape)

    def device_stats(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = tensor.detach()
            if x.numel() == 0:
                return torch.zeros(7, dtype=torch.float64, device=x.device)
            if not x.is_floating_point():
                x = x.to(torch.float64)
            elif x.dtype in _WIDEN:
                x = x.float()
            flat = x.reshape(-1)
            # torch reduces float32 by cascade summation: ~1e-7 relative error even
            # at 16M elements, at a tenth of the cost of a float64 sum (which
            # converts the tensor first).  torch.dot/vector_norm are faster but
            # drift by 1e-4..1e-3 at that size: never use them here.
            total = flat.sum().to(torch.float64)
            sum_sq = (flat * flat).sum().to(torch.float64)
            lo, hi = torch.aminmax(flat)
            lo = lo.to(torch.float64)
            hi = hi.to(torch.float64)
            abs_max = torch.maximum(-lo, hi)
            if flat.is_cuda:
                # Counting on the device avoids a host sync per tensor.
                nan = torch.isnan(flat).sum().to(torch.float64)
                inf = torch.isinf(flat).sum().to(torch.float64)
            elif bool(torch.isfinite(total)):
                # A finite sum proves there is no NaN/Inf: skip two full passes.
                nan = inf = torch.zeros((), dtype=torch.float64)
                if not bool(torch.isfinite(sum_sq)):  # squares beyond float32's range
                    wide = flat.to(torch.float64)
                    sum_sq = (wide * wide).sum()
            else:
                # Rare path: moments and extrema cover the finite elements only,
                # the counts cover the rest (see twinstep.stats).
                nan = torch.isnan(flat).sum().to(torch.float64)
                inf = torch.isinf(flat).sum().to(torch.float64)
                total, sum_sq, lo, hi = _finite_moments(flat[torch.isfinite(flat)])
                abs_max = torch.maximum(-lo, hi)
            return torch.stack([total, sum_sq, lo, hi, abs_max, nan, inf])

    def stats_to_host(self, handles: list[torch.Tensor]) -> np.ndarray:
        if not handles:
            return np.zeros((0, 7), dtype=np.float64)
        return torch.stack(handles).cpu().numpy()

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)

    def storage_array(self, copy: torch.Tensor) -> np.ndarray:
        copy = copy.contiguous()
        if copy.dtype == torch.bfloat16:
            return copy.view(torch.int16).numpy().view(np.uint16)
        return copy.numpy()

    def add_input_hook(self, module: torch.nn.Module, hook: Callable[[Any, tuple], tuple | None]) -> RemovableHandle:
        return RemovableHandle(module.register_forward_pre_hook(hook).remove)

    def to_numpy(self, tensor: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            t = tensor.detach()
            return (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy().copy()

    def from_numpy(self, array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=like.device, dtype=like.dtype)

    def float32_matmul_precision(self) -> str:
        # torch's switch for cuBLAS matmuls ("high"/"medium" allow TF32); NVIDIA_TF32_OVERRIDE=0
        # (the seeds' advice for alignment runs) turns TF32 off below the framework.
        if not torch.cuda.is_available() or os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
            return "fp32"
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"

    def loss_tensor(self, loss: Any) -> torch.Tensor | None:
        if loss is None or isinstance(loss, torch.Tensor):
            return loss
        return torch.tensor(float(loss), dtype=torch.float64)


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if value.dtype in _DTYPE_NAMES:
            found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, found)
    elif isinstance(value, dict):
        for key in value:
            _collect(value[key], found)
    elif hasattr(value, "to_tuple"):  # transformers ModelOutput
        _collect(value.to_tuple(), found)


def _finite_moments(finite: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if finite.numel() == 0:
        zero = torch.zeros((), dtype=torch.float64)
        return zero, zero, zero, zero
    wide = finite.to(torch.float64)  # rare path: precision over speed
    lo, hi = torch.aminmax(wide)
    return wide.sum(), (wide * wide).sum(), lo, hi
