"""Hooks and statistics for ``paddle.nn.Layer`` models (dynamic graph)."""

from __future__ import annotations

import functools
import inspect
import math
import os
from typing import Any, Callable, Iterator

import numpy as np
import paddle

from twinstep.wire import stats
from twinstep.runtime.capture.base import CallInputs, CaptureBackend, RemovableHandle, UnsupportedTensor
from twinstep.runtime.capture.buffers import HostBufferPool, pooled_copy
from twinstep.runtime.capture.paddle import layout as _layout
from twinstep.runtime.capture.paddle.sketch import PaddleSketcher
from twinstep.wire.sketch import SketchSpec

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


_NFIELDS = len(stats.DEVICE_FIELDS)
_ZERO_ROW = (0.0,) * _NFIELDS
#: From this many elements paddle.sum beats numpy's pairwise sum per byte; below, its fixed cost loses.
_PADDLE_SUM_MIN = 1 << 15
#: Elements from which statistics are handed to the offload pool (twinstep.runtime.capture.offload).
_OFFLOAD_MIN = 1 << 14
_HOST_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
# Keyword arguments reach post-hooks from paddle 3.2 (with_kwargs); 3.0 and 3.1 pass them to
# pre-hooks only, so there a pre-hook hands them to the post-hook.
_POST_HOOK_KWARGS = "with_kwargs" in inspect.signature(paddle.nn.Layer.register_forward_post_hook).parameters
_PRE_HOOK_KWARGS = "with_kwargs" in inspect.signature(paddle.nn.Layer.register_forward_pre_hook).parameters
# dtype objects -> neutral names; str(dtype) costs microseconds on the hot path.
_DTYPE_OBJECTS = {getattr(paddle, name): name for name in _DTYPE_NAMES if hasattr(paddle, name)}


def _dtype_name(tensor: paddle.Tensor) -> str | None:
    dtype = tensor.dtype
    name = _DTYPE_OBJECTS.get(dtype)
    return name if name is not None else _DTYPE_NAMES.get(str(dtype).rsplit(".", 1)[-1])


class PaddleBackend(CaptureBackend):
    framework = "paddle"
    tensor_type = paddle.Tensor

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
        inputs = self.call_reader()
        if _POST_HOOK_KWARGS:
            def post_hook_kwargs(layer: paddle.nn.Layer, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
                hook(layer, inputs(layer, args, kwargs), output)

            return RemovableHandle(module.register_forward_post_hook(post_hook_kwargs, with_kwargs=True).remove)
        if not _PRE_HOOK_KWARGS:  # no paddle in the supported range lacks both
            def post_hook(layer: paddle.nn.Layer, args: tuple, output: Any) -> None:
                hook(layer, args, output)

            return RemovableHandle(module.register_forward_post_hook(post_hook).remove)
        return _keywords_through_pre_hook(module, hook, inputs)

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
        name = _dtype_name(tensor)
        if name is None:
            raise UnsupportedTensor(tensor.dtype)
        return name, tuple(tensor.shape)

    def device_stats(self, tensor: paddle.Tensor) -> tuple[float, ...] | paddle.Tensor:
        x = tensor.detach()  # detached: nothing below records autograd history
        if 0 in x.shape:
            return _ZERO_ROW
        name = _dtype_name(x)
        if name in ("float16", "bfloat16"):
            x = x.astype("float32")  # float16 squares overflow; numpy has no bfloat16
        elif name not in ("float32", "float64"):
            x = x.astype("float64")  # integers and bool: exact in float64
        if x.place.is_cpu_place():
            return _host_row(x)
        return _device_row(x)

    def host_stats_task(self, tensor: paddle.Tensor) -> Callable[[], tuple[float, ...]] | None:
        x = tensor.detach()
        if not x.place.is_cpu_place() or math.prod(x.shape) < _OFFLOAD_MIN:
            return None
        name = _dtype_name(x)
        if name in ("float16", "bfloat16"):
            x = x.astype("float32")  # a private float32 copy: float16 squares overflow and numpy has no bfloat16
        elif name not in ("float32", "float64"):
            return None
        return functools.partial(stats.host_row, np.from_dlpack(x))  # the view keeps x's memory alive

    def host_copy_task(self, tensor: paddle.Tensor, pool: HostBufferPool) -> Callable[[], tuple[Any, Any]] | None:
        x = tensor.detach()
        if not x.place.is_cpu_place() or math.prod(x.shape) < _OFFLOAD_MIN:
            return None
        try:
            view = np.from_dlpack(x)  # here, on the training thread: the worker runs numpy only
        except Exception:
            return None
        if view.dtype not in _HOST_FLOATS:
            return None

        return pooled_copy(view, pool)

    def copy_stats_task(self, copy: np.ndarray) -> Callable[[], tuple[float, ...]] | None:
        if not isinstance(copy, np.ndarray) or copy.dtype not in _HOST_FLOATS or copy.size < _OFFLOAD_MIN:
            return None  # float16, bfloat16 bits, integers: computed in the hook from the tensor
        return functools.partial(stats.host_row, copy)

    def identity(self, tensor: paddle.Tensor) -> Any:
        # Paddle hands each hook its own Python handle of one gradient: the buffer, its view and
        # dtype identify the tensor (the recorder holds the first handle, so the address stays its).
        try:
            return (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.strides), str(tensor.dtype))
        except Exception:  # no buffer yet, or an old paddle: the handle alone
            return id(tensor)

    def is_host(self, tensor: paddle.Tensor) -> bool:
        return tensor.place.is_cpu_place()

    def stats_to_host(self, handles: list[tuple[float, ...] | paddle.Tensor]) -> np.ndarray:
        on_device = [i for i, handle in enumerate(handles) if isinstance(handle, paddle.Tensor)]
        if not on_device:  # CPU training: every row is already on the host
            return np.array(handles, dtype=np.float64).reshape(len(handles), _NFIELDS)
        rows = np.zeros((len(handles), _NFIELDS), dtype=np.float64)
        by_place: dict[str, list[int]] = {}
        for i, handle in enumerate(handles):
            if isinstance(handle, paddle.Tensor):
                by_place.setdefault(str(handle.place), []).append(i)
            else:
                rows[i] = handle
        for indices in by_place.values():
            # One device-to-host copy per device and step, whatever the number of records.
            rows[indices] = paddle.stack([handles[i] for i in indices]).numpy()
        return rows

    def host_copy(self, tensor: paddle.Tensor, pool: HostBufferPool | None = None) -> tuple[np.ndarray, Any]:
        x = tensor.detach()
        if pool is not None and x.place.is_cpu_place():
            try:
                view = np.from_dlpack(x)  # zero-copy; bfloat16 has no numpy dtype and lands below
            except Exception:
                view = None
            if view is not None and view.nbytes:
                buffer = pool.take(view.nbytes)
                copy = buffer.view(view.dtype).reshape(view.shape)
                np.copyto(copy, view)
                return copy, buffer
        # .numpy() is one device-to-host copy into fresh memory; bfloat16 arrives as its uint16 bits.
        return x.numpy(), None

    def on_accelerator(self, model: paddle.nn.Layer) -> bool:
        return any(not p.place.is_cpu_place() for p in model.parameters())

    def storage_array(self, copy: np.ndarray) -> np.ndarray:
        return copy

    def add_input_hook(self, module: paddle.nn.Layer,
                       hook: Callable[[Any, tuple, dict[str, Any]], tuple[tuple, dict[str, Any]] | None],
                       ) -> RemovableHandle:
        if _PRE_HOOK_KWARGS:
            return RemovableHandle(module.register_forward_pre_hook(hook, with_kwargs=True).remove)

        def positional(layer: paddle.nn.Layer, args: tuple) -> tuple | None:
            replaced = hook(layer, args, {})
            return None if replaced is None else replaced[0]

        return RemovableHandle(module.register_forward_pre_hook(positional).remove)

    def to_numpy(self, tensor: paddle.Tensor) -> np.ndarray:
        t = tensor.detach()
        if _dtype_name(t) == "bfloat16":
            t = t.astype("float32")
        return t.numpy().copy()

    def from_numpy(self, array: np.ndarray, like: paddle.Tensor) -> paddle.Tensor:
        return paddle.to_tensor(np.ascontiguousarray(array), dtype=like.dtype, place=like.place)

    def inplace_version(self, tensor: Any) -> int | None:
        return getattr(tensor, "inplace_version", None)  # absent on some static-graph variables

    def make_sketcher(self, spec: SketchSpec) -> PaddleSketcher:
        return PaddleSketcher(spec)

    def float32_matmul_precision(self) -> str:
        # Paddle multiplies float32 matrices with TF32 on Ampere and newer GPUs unless
        # NVIDIA_TF32_OVERRIDE=0 (porting guides' advice for alignment runs).
        if not paddle.is_compiled_with_cuda() or not paddle.device.get_device().startswith("gpu"):
            return "fp32"
        return "fp32" if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0" else "tf32"

    def loss_tensor(self, loss: Any) -> paddle.Tensor | None:
        if loss is None or isinstance(loss, paddle.Tensor):
            return loss
        return paddle.to_tensor(float(loss), dtype="float64")

    # -- parallel layouts (twinstep.runtime.capture.paddle.layout) ----------------------------------

    def module_split(self, module: paddle.nn.Layer, layout: Any) -> Any:
        return _layout.module_split(module, layout)

    def parameter_split(self, parameter: paddle.Tensor, layout: Any) -> Any:
        return _layout.parameter_split(parameter, layout)

    def has_parameters(self, module: paddle.nn.Layer) -> bool:
        return bool(module.parameters())

    def detect_layout(self, model: paddle.nn.Layer) -> Any:
        return _layout.detect(model)


def _keywords_through_pre_hook(module: paddle.nn.Layer, hook: Callable[[Any, Any, Any], None],
                               inputs: CallInputs) -> RemovableHandle:
    """paddle 3.0 and 3.1: a pre-hook hands each call's keywords to its post-hook.

    One stack per layer: a call pushes its keywords and its post-hook pops them, so a layer
    that runs again inside its own forward (recursion, or a shared layer reached again through
    a child) pairs every post-hook with its own call.  A call that raises runs no post-hook and
    leaves its entry below the later calls' (which still pair up); only an enclosing call of
    the same layer that catches that error would then read the failed call's keywords.
    """
    pending: list[dict[str, Any] | None] = []  # keywords of this layer's running calls, innermost last

    def pre_hook(layer: paddle.nn.Layer, args: tuple, kwargs: dict[str, Any]) -> None:
        pending.append(kwargs or None)

    def post_hook(layer: paddle.nn.Layer, args: tuple, output: Any) -> None:
        hook(layer, inputs(layer, args, pending.pop() if pending else None), output)

    pre = module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    post = module.register_forward_post_hook(post_hook)

    def remove() -> None:
        pre.remove()
        post.remove()

    return RemovableHandle(remove)


def _collect(value: Any, found: list[paddle.Tensor]) -> None:
    if isinstance(value, paddle.Tensor):
        found.append(value)  # any dtype: one twinstep cannot read is counted as a failure, not skipped
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, found)
    elif isinstance(value, dict):
        for key in value:
            _collect(value[key], found)
    elif hasattr(value, "to_tuple"):  # paddleformers ModelOutput
        _collect(value.to_tuple(), found)


# -- statistics ----------------------------------------------------------------
#
# CPU tensors: twinstep.wire.stats.host_row on a zero-copy DLPack view (each paddle
# op costs 5-15 us of dispatch, and paddle has no single-pass min/max or
# drift-free sum of squares: paddle.dot and paddle.linalg.norm are slow,
# x*x writes a full-size temporary, paddle.var cancels), with paddle.sum for
# large tensors, where it is twice as fast as numpy's.  Figures:
# benchmarks/stats_kernels.py.
#
# Other places: paddle ops only, no host synchronisation (_device_row).


def _host_row(x: paddle.Tensor) -> tuple[float, ...]:
    view = np.from_dlpack(x)  # shares x's memory; strided tensors give strided views
    if view.size < _PADDLE_SUM_MIN:
        return stats.host_row(view)
    return stats.host_row(view, lambda: float(paddle.sum(x).item()))


def _device_row(x: paddle.Tensor) -> paddle.Tensor:
    """Statistics as a float64 device vector, with no host synchronisation.

    As in the torch backend: non-finite elements are replaced by the finite
    mean (which moves neither the extrema nor the deviations) and m2 always
    comes from the shifted pass.  Reductions accumulate in the tensor's dtype,
    so finite float32 values whose sum or squares pass 3e38 give an Inf row.
    """
    finite = paddle.isfinite(x)
    n_finite = finite.astype("float64").sum()
    nan = paddle.isnan(x).astype("float64").sum()
    inf = float(math.prod(x.shape)) - n_finite - nan
    count = paddle.clip(n_finite, min=1.0)
    zero = paddle.zeros([], dtype=x.dtype)
    shift = paddle.where(finite, x, zero).sum() / count.astype(x.dtype)
    y = paddle.where(finite, x, shift)
    del finite
    lo = paddle.min(y).astype("float64")
    hi = paddle.max(y).astype("float64")
    y.subtract_(shift)  # in place: one temporary of the tensor's size in all
    dsum = y.sum().astype("float64")
    dsum_sq = y.multiply_(y).sum().astype("float64")
    del y
    m2 = paddle.clip(dsum_sq - dsum * dsum / count, min=0.0)
    total = shift.astype("float64") * n_finite + dsum
    sum_sq = m2 + total * total / count
    return paddle.stack([total, sum_sq, lo, hi, paddle.maximum(-lo, hi), nan, inf, m2])
