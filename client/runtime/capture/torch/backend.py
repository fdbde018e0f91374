"""Hooks and statistics for ``torch.nn.Module`` models."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Iterator

import numpy as np
import torch

from twinstep.wire import stats
from twinstep.runtime.capture.base import CaptureBackend, RemovableHandle, UnsupportedTensor
from twinstep.runtime.capture.buffers import HostBufferPool
from twinstep.runtime.capture.torch import layout as _layout
from twinstep.runtime.capture.torch.sketch import TorchSketcher
from twinstep.wire.sketch import SketchSpec

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
logger = logging.getLogger("twinstep")
_NFIELDS = len(stats.DEVICE_FIELDS)
_ZERO_ROW = (0.0,) * _NFIELDS
#: From this many elements torch's sum and aminmax beat numpy's per byte (sum by 2x,
#: aminmax by ~15%: one pass for both); below, their dispatch cost loses.
_TORCH_REDUCE_MIN = 1 << 15
#: Elements from which statistics are handed to the offload pool (twinstep.runtime.capture.offload): below,
#: the hand-off (a queue append and a wake-up, ~5 us) costs more than the pass itself.
_OFFLOAD_MIN = 1 << 14


class TorchBackend(CaptureBackend):
    framework = "torch"
    tensor_type = torch.Tensor
    _copies_in_flight = False  # a non-blocking device-to-host copy since the last fence
    # DTensors (and the asynchronous results of torch's collectives) are read through their local shard.
    has_shards = True
    plain_types = frozenset({torch.Tensor, torch.nn.Parameter})

    def __init__(self) -> None:
        self._layouts = _layout.TorchLayouts()

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
        inputs = self.call_reader()

        def forward_hook(mod: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
            hook(mod, inputs(mod, args, kwargs), output)

        # with_kwargs (torch >= 2.0): transformers passes hidden_states to attention by keyword.
        return RemovableHandle(module.register_forward_hook(forward_hook, with_kwargs=True).remove)

    def output_tensors(self, output: Any) -> list[torch.Tensor]:
        if isinstance(output, torch.Tensor):
            return [output]  # any dtype: one twinstep cannot read is counted as a failure, not skipped
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
        name = _DTYPE_NAMES.get(tensor.dtype)
        if name is None:
            raise UnsupportedTensor(tensor.dtype)
        return name, tuple(tensor.shape)

    def device_stats(self, tensor: torch.Tensor) -> tuple[float, ...] | torch.Tensor:
        x = tensor.detach()  # detached: nothing below records autograd history
        if x.numel() == 0:
            return _ZERO_ROW
        if x.layout is not torch.strided:
            x = x.to_dense()  # sparse gradients (rare): statistics count the implicit zeros
        if not x.is_floating_point():
            x = x.to(torch.float64)  # integers and bool: exact in float64
        elif x.dtype in _WIDEN:
            x = x.float()  # float16 squares overflow; numpy has no bfloat16
        if x.is_cpu:
            return _host_row(x)
        return _device_row(x)

    def host_stats_task(self, tensor: torch.Tensor) -> Callable[[], tuple[float, ...]] | None:
        x = tensor.detach()
        if not x.is_cpu or x.layout is not torch.strided or not x.is_floating_point() or x.numel() < _OFFLOAD_MIN:
            return None
        if x.dtype in _WIDEN:
            x = x.float()  # a private float32 copy: float16 squares overflow and numpy has no bfloat16
        return functools.partial(stats.host_row, _view(_in_memory_order(x)))

    def host_copy_task(self, tensor: torch.Tensor, pool: HostBufferPool) -> Callable[[], tuple[Any, Any]] | None:
        x = tensor.detach()
        if not x.is_cpu or x.layout is not torch.strided or not x.is_floating_point() or x.numel() < _OFFLOAD_MIN:
            return None
        return functools.partial(self.host_copy, x, pool)  # torch's copy_ is thread-safe and releases the GIL

    def copy_stats_task(self, copy: torch.Tensor) -> Callable[[], tuple[float, ...]] | None:
        return self.host_stats_task(copy)

    def is_host(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cpu

    def stats_to_host(self, handles: list[tuple[float, ...] | torch.Tensor]) -> np.ndarray:
        lazy = [i for i, handle in enumerate(handles) if isinstance(handle, torch.Tensor)]
        if not lazy:  # CPU training: every row is already on the host
            return np.array(handles, dtype=np.float64).reshape(len(handles), _NFIELDS)
        rows = np.zeros((len(handles), _NFIELDS), dtype=np.float64)
        by_device: dict[torch.device, list[int]] = {}
        for i, handle in enumerate(handles):
            if isinstance(handle, torch.Tensor):
                by_device.setdefault(handle.device, []).append(i)
            else:
                rows[i] = handle
        for indices in by_device.values():
            # One device-to-host copy per device and step, whatever the number of records.
            rows[indices] = torch.stack([handles[i] for i in indices]).cpu().numpy()
        return rows

    def host_copy(self, tensor: torch.Tensor, pool: HostBufferPool | None = None) -> tuple[torch.Tensor, Any]:
        with torch.no_grad():
            t = tensor.detach()
            nbytes = t.numel() * t.element_size()
            if pool is None or nbytes == 0:
                return t.to("cpu", copy=True, memory_format=torch.contiguous_format), None
            buffer = pool.take(nbytes)
            copy = buffer.view(t.dtype).view(t.shape)
            # From an accelerator into pinned memory the copy is asynchronous: host_copies_fence waits for it.
            copy.copy_(t, non_blocking=t.device.type == "cuda")
            if t.device.type == "cuda":
                self._copies_in_flight = True
            return copy, buffer

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        # Pinned (page-locked) memory only where a CUDA device copies into it asynchronously.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def on_accelerator(self, model: torch.nn.Module) -> bool:
        return any(p.device.type != "cpu" for p in model.parameters())

    def wrap_host(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array)  # shares the array's memory

    def host_copies_fence(self) -> Callable[[], None] | None:
        if not self._copies_in_flight:
            return None
        self._copies_in_flight = False
        event = torch.cuda.Event()
        event.record()  # on the current stream, where the hooks enqueued their copies
        return event.synchronize

    def storage_array(self, copy: torch.Tensor) -> np.ndarray:
        copy = copy.contiguous()
        if copy.dtype == torch.bfloat16:
            return copy.view(torch.int16).numpy().view(np.uint16)
        return copy.numpy()

    def add_input_hook(self, module: torch.nn.Module,
                       hook: Callable[[Any, tuple, dict[str, Any]], tuple[tuple, dict[str, Any]] | None],
                       ) -> RemovableHandle:
        return RemovableHandle(module.register_forward_pre_hook(hook, with_kwargs=True).remove)

    def to_numpy(self, tensor: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            t = self.local_shard(tensor).detach()
            return (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy().copy()

    def from_numpy(self, array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=like.device, dtype=like.dtype)

    def inplace_version(self, tensor: Any) -> int | None:
        return tensor._version

    def make_sketcher(self, spec: SketchSpec) -> TorchSketcher:
        return TorchSketcher(spec)

    def float32_matmul_precision(self) -> str:
        # torch's switch for cuBLAS matmuls ("high"/"medium" allow TF32); NVIDIA_TF32_OVERRIDE=0
        # (porting guides' advice for alignment runs) turns TF32 off below the framework.
        if not torch.cuda.is_available() or os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
            return "fp32"
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"

    def loss_tensor(self, loss: Any) -> torch.Tensor | None:
        if loss is None or isinstance(loss, torch.Tensor):
            return loss
        return torch.tensor(float(loss), dtype=torch.float64)

    # -- parallel layouts (twinstep.runtime.capture.torch.layout) -----------------------------------

    def local_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        return _layout.local_shard(tensor)

    def tensor_placement(self, tensor: torch.Tensor) -> Any:
        return self._layouts.tensor_placement(tensor)

    def module_split(self, module: torch.nn.Module, layout: Any) -> Any:
        return self._layouts.module_split(module, layout)

    def parameter_split(self, parameter: torch.Tensor, layout: Any) -> Any:
        return self._layouts.parameter_split(parameter, layout)

    def has_parameters(self, module: torch.nn.Module) -> bool:
        return next(module.parameters(), None) is not None

    def detect_layout(self, model: torch.nn.Module) -> Any:
        return self._layouts.detect(model)


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, found)
    elif isinstance(value, dict):
        for key in value:
            _collect(value[key], found)
    elif hasattr(value, "to_tuple"):  # transformers ModelOutput
        _collect(value.to_tuple(), found)


# -- statistics ----------------------------------------------------------------
#
# CPU tensors: twinstep.wire.stats.host_row on a zero-copy numpy view: one compiled
# pass (twinstep.runtime.kernels) once it has loaded; before that, row-wise sums of
# squares in numpy, with torch's cascade sum and aminmax (one pass for both)
# for large tensors, where they beat numpy's, and numpy for small ones (each
# torch op costs ~3 us of dispatch, numpy's less).  torch.var_mean (Welford)
# is stable but ~10x a memcpy on CPU.  Figures: benchmarks/stats_kernels.py.
#
# Other devices: everything stays on the device (_device_row); stats_to_host
# copies all records of a step at once.


def _host_row(x: torch.Tensor) -> tuple[float, ...]:
    if x.numel() < _TORCH_REDUCE_MIN:
        return stats.host_row(_view(x))
    x = _in_memory_order(x)
    return stats.host_row(_view(x), lambda: float(x.sum()), lambda: _extrema(x))


def _in_memory_order(x: torch.Tensor) -> torch.Tensor:
    """A permuted dense tensor (a transposed gradient) as the contiguous view of its memory.

    Statistics ignore the order of the elements; contiguous data takes the fast kernels.
    """
    if x.is_contiguous():
        return x
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    permuted = x.permute(order)
    return permuted if permuted.is_contiguous() else x


def _extrema(x: torch.Tensor) -> tuple[float, float]:
    lo, hi = torch.aminmax(x)
    return float(lo), float(hi)


def _view(x: torch.Tensor) -> np.ndarray:
    try:
        return x.numpy()  # shares memory, strides included
    except RuntimeError:  # a lazy negation or conjugation bit: materialise it (rare)
        return x.resolve_neg().resolve_conj().numpy()


def _device_row(x: torch.Tensor) -> torch.Tensor:
    """Statistics as a float64 device vector, with no host synchronisation.

    Same definitions as the CPU path without its branches: non-finite
    elements are replaced by the finite mean, which moves neither the extrema
    nor the deviations, and m2 always comes from the shifted pass.  One
    temporary of the tensor's size (float32 for narrower floats) plus a bool
    mask; reductions accumulate in the tensor's dtype, so finite float32 values
    whose sum or squares pass 3e38 give an Inf row there.
    """
    if not x.is_floating_point():
        x = x.to(torch.float64)
    elif x.dtype in _WIDEN:
        x = x.float()
    finite = torch.isfinite(x)
    n_finite = finite.sum()
    nan = torch.isnan(x).sum()
    inf = x.numel() - n_finite - nan
    count = n_finite.clamp(min=1)
    y = torch.where(finite, x, 0)
    shift = y.sum() / count
    torch.where(finite, x, shift, out=y)
    del finite
    lo, hi = torch.aminmax(y)
    y.sub_(shift)
    dsum = y.sum().double()
    dsum_sq = y.square_().sum().double()  # in place: vector_norm would drift on some devices
    del y
    count = count.double()
    m2 = (dsum_sq - dsum * dsum / count).clamp(min=0)
    total = shift.double() * n_finite + dsum
    sum_sq = m2 + total * total / count
    lo, hi = lo.double(), hi.double()
    return torch.stack([total, sum_sq, lo, hi, torch.maximum(-lo, hi), nan.double(), inf.double(), m2])
