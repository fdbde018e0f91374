"""Hooks and statistics for ``paddle.nn.Layer`` models (dynamic graph)."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import numpy as np
import paddle

from twinstep.capture.base import CaptureBackend, RemovableHandle

_DTYPE_NAMES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float64": "float64",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "bool": "bool",
}


def _dtype_name(tensor: paddle.Tensor) -> str | None:
    return _DTYPE_NAMES.get(str(tensor.dtype).rsplit(".", 1)[-1])


class PaddleBackend(CaptureBackend):
    framework = "paddle"

    def framework_version(self) -> str:
        return paddle.__version__

    def named_modules(self, model: paddle.nn.Layer) -> Iterator[tuple[str, paddle.nn.Layer]]:
        return model.named_sublayers(include_self=True)

    def named_parameters(self, model: paddle.nn.Layer) -> Iterator[tuple[str, paddle.Tensor, str, str]]:
        seen: set[int] = set()
        for layer_name, layer in model.named_sublayers(include_self=True):
            for local, param in layer.named_parameters(include_sublayers=False):
                if id(param) in seen or param.stop_gradient:
                    continue
                seen.add(id(param))
                name = f"{layer_name}.{local}" if layer_name else local
                yield name, param, layer_name, type(layer).__name__

    def add_output_hook(self, module: paddle.nn.Layer, hook: Callable[[Any, Any, Any], None]) -> RemovableHandle:
        def post_hook(layer: paddle.nn.Layer, inputs: Any, output: Any) -> None:
            hook(layer, inputs, output)

        return RemovableHandle(module.register_forward_post_hook(post_hook).remove)

    def output_tensors(self, output: Any) -> list[paddle.Tensor]:
        found: list[paddle.Tensor] = []
        _collect(output, found)
        return found

    def add_grad_hook(self, tensor: paddle.Tensor, hook: Callable[[paddle.Tensor], None]) -> bool:
        if tensor.stop_gradient or not paddle.is_grad_enabled():
            return False

        def grad_hook(grad: paddle.Tensor) -> None:
            hook(grad)

        tensor.register_hook(grad_hook)
        return True

    def grad(self, parameter: paddle.Tensor) -> paddle.Tensor | None:
        return parameter.grad

    def describe(self, tensor: paddle.Tensor) -> tuple[str, tuple[int, ...]]:
        return _dtype_name(tensor) or "float32", tuple(tensor.shape)

    def device_stats(self, tensor: paddle.Tensor) -> paddle.Tensor:
        with paddle.no_grad():
            x = tensor.detach()
            if x.size == 0:
                return paddle.zeros([7], dtype="float64")
            name = _dtype_name(x)
            if name in ("float16", "bfloat16"):
                x = x.astype("float32")
            elif name not in ("float32", "float64"):
                x = x.astype("float64")
            flat = x.reshape([-1])
            # Paddle's float32 reductions are accurate to ~1e-8 relative at 16M
            # elements; dtype="float64" would convert the tensor first (20x slower).
            total = paddle.sum(flat).astype("float64")
            sum_sq = paddle.sum(flat * flat).astype("float64")
            lo = paddle.min(flat).astype("float64")
            hi = paddle.max(flat).astype("float64")
            if not flat.place.is_cpu_place():
                nan = paddle.isnan(flat).astype("float64").sum()
                inf = paddle.isinf(flat).astype("float64").sum()
            elif bool(paddle.isfinite(total)):
                nan = inf = paddle.zeros([], dtype="float64")
                if not bool(paddle.isfinite(sum_sq)):  # squares beyond float32's range
                    wide = flat.astype("float64")
                    sum_sq = paddle.sum(wide * wide)
            else:
                # Rare path: moments and extrema over the finite elements only.
                nan = paddle.isnan(flat).astype("float64").sum()
                inf = paddle.isinf(flat).astype("float64").sum()
                total, sum_sq, lo, hi = _finite_moments(paddle.masked_select(flat, paddle.isfinite(flat)))
            abs_max = paddle.maximum(-lo, hi)
            return paddle.stack([total, sum_sq, lo, hi, abs_max, nan, inf])

    def stats_to_host(self, handles: list[paddle.Tensor]) -> np.ndarray:
        if not handles:
            return np.zeros((0, 7), dtype=np.float64)
        return paddle.stack(handles).numpy().astype(np.float64, copy=False)

    def host_copy(self, tensor: paddle.Tensor) -> np.ndarray:
        # .numpy() is one device-to-host copy; bfloat16 arrives as its uint16 bits.
        return tensor.detach().numpy()

    def storage_array(self, copy: np.ndarray) -> np.ndarray:
        return copy

    def add_input_hook(self, module: paddle.nn.Layer, hook: Callable[[Any, tuple], tuple | None]) -> RemovableHandle:
        return RemovableHandle(module.register_forward_pre_hook(hook).remove)

    def to_numpy(self, tensor: paddle.Tensor) -> np.ndarray:
        t = tensor.detach()
        if _dtype_name(t) == "bfloat16":
            t = t.astype("float32")
        return t.numpy().copy()

    def from_numpy(self, array: np.ndarray, like: paddle.Tensor) -> paddle.Tensor:
        return paddle.to_tensor(np.ascontiguousarray(array), dtype=like.dtype, place=like.place)

    def float32_matmul_precision(self) -> str:
        # Paddle multiplies float32 matrices with TF32 on Ampere and newer GPUs unless
        # NVIDIA_TF32_OVERRIDE=0 (the seeds' advice for alignment runs).
        if not paddle.is_compiled_with_cuda() or not paddle.device.get_device().startswith("gpu"):
            return "fp32"
        return "fp32" if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0" else "tf32"

    def loss_tensor(self, loss: Any) -> paddle.Tensor | None:
        if loss is None or isinstance(loss, paddle.Tensor):
            return loss
        return paddle.to_tensor(float(loss), dtype="float64")


def _collect(value: Any, found: list[paddle.Tensor]) -> None:
    if isinstance(value, paddle.Tensor):
        if _dtype_name(value) is not None:
            found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, found)
    elif isinstance(value, dict):
        for key in value:
            _collect(value[key], found)
    elif hasattr(value, "to_tuple"):  # paddleformers ModelOutput
        _collect(value.to_tuple(), found)


def _finite_moments(finite: paddle.Tensor) -> tuple[paddle.Tensor, ...]:
    if finite.size == 0:
        zero = paddle.zeros([], dtype="float64")
        return zero, zero, zero, zero
    wide = finite.astype("float64")  # rare path: precision over speed
    return paddle.sum(wide), paddle.sum(wide * wide), paddle.min(wide), paddle.max(wide)
