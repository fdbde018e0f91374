"""Hooks and statistics for ``mindspore.nn.Cell`` models (PyNative mode).

MindSpore differs from torch and paddle in three ways that shape this module:

- Gradients are returned by ``value_and_grad``, never stored on parameters, so
  parameter gradients are taken where the optimizer receives them: a removable
  forward pre-hook on the optimizer cell (``attach(optimizer=...)``) keeps the
  gradients of its last call, one per parameter, until the step boundary reads them.
- ``Tensor.asnumpy()`` of a CPU tensor is a zero-copy view of its memory (measured
  on 2.10: two calls share memory, and a parameter's view shows the optimizer's
  update), so host statistics read the tensor in place, with numpy only.
- The in-place counter ``Tensor._version`` does not move when an optimizer or
  ``ops.assign`` writes a parameter (2.10), so it cannot prove a tensor unchanged:
  :meth:`inplace_version` says "not tracked" and the recorder then reads every
  record in its hook (or at the step boundary), never late.

Graph mode (``GRAPH_MODE``) runs no Python hook: :func:`check_pynative` refuses
it at attach.  A cell whose ``construct`` is compiled with ``jit`` is captured as
one module (see :meth:`MindSporeBackend.named_modules`), and a step whose model
ran without a single hook call has its loss record fail with the reason.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable, Iterator

import mindspore
import numpy as np

from twinstep.wire import stats
from twinstep.runtime.capture.base import CaptureBackend, RemovableHandle, UnsupportedTensor
from twinstep.runtime.capture.buffers import HostBufferPool, pooled_copy
from twinstep.runtime.capture.mindspore.sketch import MindSporeSketcher
from twinstep.wire.sketch import SketchSpec

_NAMES = ("float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
# dtype objects -> neutral names (mindspore.float32 is Float32 and prints so).
_DTYPE_NAMES = {getattr(mindspore, "bool_" if name == "bool" else name): name for name in _NAMES
                if hasattr(mindspore, "bool_" if name == "bool" else name)}
_NFIELDS = len(stats.DEVICE_FIELDS)
_ZERO_ROW = (0.0,) * _NFIELDS
#: Elements from which statistics are handed to the offload pool (as in the torch and paddle backends).
_OFFLOAD_MIN = 1 << 14
_HOST_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
logger = logging.getLogger("twinstep")


class GraphModeError(RuntimeError):
    """The model runs compiled (GRAPH_MODE or jit): no Python hook runs, so nothing could be captured."""


def check_pynative() -> None:
    """Raise :class:`GraphModeError` unless MindSpore runs in PyNative mode (where hooks run)."""
    if mindspore.get_context("mode") != mindspore.PYNATIVE_MODE:
        raise GraphModeError(
            "twinstep captures MindSpore models in PyNative mode only: GRAPH_MODE compiles the whole network "
            "and runs no Python hook, so nothing would be captured. Call "
            "mindspore.set_context(mode=mindspore.PYNATIVE_MODE) before attach (jit-compiled cells inside a "
            "PyNative model are captured as one module: their outputs, not their insides; docs/mindspore.md)")


def _dtype_name(tensor: mindspore.Tensor) -> str | None:
    return _DTYPE_NAMES.get(tensor.dtype)


def _is_cpu(tensor: mindspore.Tensor) -> bool:
    device = getattr(tensor, "device", None)  # "CPU", "Ascend:0"; absent before 2.4: the context decides
    if device is None:
        device = mindspore.get_context("device_target")
    return str(device).upper().startswith("CPU")


class MindSporeBackend(CaptureBackend):
    framework = "mindspore"
    tensor_type = mindspore.Tensor
    forward_name = "construct"

    def __init__(self) -> None:
        check_pynative()
        # id(parameter) -> (parameter, its gradient of the optimizer's last call); the parameter is held
        # so its id cannot be reused by another object while the entry lives.
        self._grads: dict[int, tuple[Any, Any]] = {}
        self._hook_calls = 0  # output hooks run since the last step boundary (0 after a step: compiled)
        self._told_compiled = False

    def framework_version(self) -> str:
        return mindspore.__version__

    def named_modules(self, model: mindspore.nn.Cell) -> Iterator[tuple[str, mindspore.nn.Cell]]:
        """Every cell, except those inside a cell whose ``construct`` is compiled with ``jit``.

        MindSpore compiles the hooks of the cells a compiled ``construct`` calls into its
        graph, and twinstep's hooks do not compile ("Unsupported statement 'Try'"): the
        training would fail.  The compiled cell itself runs its hooks in Python, so it is
        captured as one module (its output, its output gradient, its parameters).
        """
        compiled: list[str] = []
        for name, cell in model.cells_and_names():
            if any(prefix == "" or name.startswith(prefix + ".") for prefix in compiled):
                continue
            yield name, cell
            if getattr(cell.construct, "__wrapped_by_jit__", False):
                compiled.append(name)
        if compiled and not self._told_compiled:
            self._told_compiled = True
            logger.warning("twinstep: MindSpore cells compiled with jit are captured as one module each, their "
                           "inside not hooked: %s", ", ".join(repr(n or "(model)") for n in compiled))

    def named_parameters(self, model: mindspore.nn.Cell) -> Iterator[tuple[str, Any, str, str]]:
        seen: set[int] = set()
        for cell_name, cell in model.cells_and_names():
            for local, param in cell.parameters_and_names(expand=False):
                if id(param) in seen or not param.requires_grad:
                    continue
                seen.add(id(param))
                local = local.rsplit(".", 1)[-1]
                name = f"{cell_name}.{local}" if cell_name else local
                yield name, param, cell_name, type(cell).__name__

    def add_output_hook(self, module: mindspore.nn.Cell, hook: Callable[[Any, Any, Any], None]) -> RemovableHandle:
        inputs = self.call_reader()

        def forward_hook(cell: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
            self._hook_calls += 1
            hook(cell, inputs(cell, args, kwargs), output)

        self._watching_outputs = True
        # with_kwargs (MindSpore >= 2.7, the oldest supported): a cell called by keyword has its input recorded.
        return RemovableHandle(module.register_forward_hook(forward_hook, with_kwargs=True).remove)

    def output_tensors(self, output: Any) -> list[mindspore.Tensor]:
        if isinstance(output, mindspore.Tensor):
            return [output]
        found: list[mindspore.Tensor] = []
        _collect(output, found)
        return found

    def add_grad_hook(self, tensor: mindspore.Tensor, hook: Callable[[mindspore.Tensor], None]) -> bool:
        if isinstance(tensor, mindspore.Parameter) or _dtype_name(tensor) not in ("float32", "float16", "bfloat16",
                                                                                   "float64"):
            return False
        # MindSpore 2.10 marks a tensor no gradient reaches (stop_gradient, no parameter upstream) with
        # _requires_grad False, and register_hook raises there; 2.7 leaves it None for every tensor.
        if getattr(tensor, "_requires_grad", None) is False:
            return False

        def grad_hook(grad: mindspore.Tensor) -> None:
            hook(grad)  # returns None: the gradient flows on unchanged

        try:
            tensor.register_hook(grad_hook)  # fires only when a grad function differentiates through the tensor
        except RuntimeError:
            return False  # "The tensor requires grad is false": no gradient flows here
        return True

    # -- parameter gradients: where the optimizer receives them ------------------------

    def watch_optimizer(self, optimizer: Any) -> RemovableHandle | None:
        """Keep the gradients each call of ``optimizer(grads)`` receives, matched to its parameters."""
        parameters = tuple(optimizer.parameters)

        def pre_hook(cell: Any, inputs: tuple) -> None:
            try:
                grads = inputs[0] if len(inputs) == 1 else inputs
                if len(grads) == len(parameters):
                    self._grads = {id(p): (p, g) for p, g in zip(parameters, grads)}
            except Exception:  # the optimizer's update comes first; its gradients are then absent
                self._grads = {}

        return RemovableHandle(optimizer.register_forward_pre_hook(pre_hook).remove)

    def grad(self, parameter: Any) -> mindspore.Tensor | None:
        found = self._grads.pop(id(parameter), None)  # each gradient is read once, at its step's boundary
        return found[1] if found is not None else None

    # -- reading tensors ---------------------------------------------------------------

    def describe(self, tensor: mindspore.Tensor) -> tuple[str, tuple[int, ...]]:
        name = _dtype_name(tensor)
        if name is None:
            raise UnsupportedTensor(tensor.dtype)
        return name, tuple(tensor.shape)

    def device_stats(self, tensor: mindspore.Tensor) -> tuple[float, ...] | mindspore.Tensor:
        if 0 in tensor.shape:
            return _ZERO_ROW
        if _is_cpu(tensor):
            return stats.host_row(_host_values(tensor))
        return _device_row(tensor)

    def host_stats_task(self, tensor: mindspore.Tensor) -> Callable[[], tuple[float, ...]] | None:
        if math.prod(tensor.shape) < _OFFLOAD_MIN or not _is_cpu(tensor) or _dtype_name(tensor) not in (
                "float32", "float64", "float16"):
            return None
        # The view (or its float32 widening) is taken here, on the training thread; the worker runs numpy only.
        # The task holds the tensor, which owns the memory the view reads.
        return functools.partial(_row_of_view, _host_values(tensor), tensor)

    def host_copy_task(self, tensor: mindspore.Tensor, pool: HostBufferPool) -> Callable[[], tuple[Any, Any]] | None:
        if math.prod(tensor.shape) < _OFFLOAD_MIN or not _is_cpu(tensor):
            return None
        view = tensor.asnumpy()
        if view.dtype not in _HOST_FLOATS:
            return None

        return pooled_copy(view, pool, keep=tensor)

    def copy_stats_task(self, copy: np.ndarray) -> Callable[[], tuple[float, ...]] | None:
        if not isinstance(copy, np.ndarray) or copy.dtype not in _HOST_FLOATS or copy.size < _OFFLOAD_MIN:
            return None
        return functools.partial(stats.host_row, copy)

    def is_host(self, tensor: mindspore.Tensor) -> bool:
        return _is_cpu(tensor)

    def stats_to_host(self, handles: list[tuple[float, ...] | mindspore.Tensor]) -> np.ndarray:
        rows = np.zeros((len(handles), _NFIELDS), dtype=np.float64)
        on_device = []
        for i, handle in enumerate(handles):
            if isinstance(handle, mindspore.Tensor):
                on_device.append(i)
            else:
                rows[i] = handle
        if on_device:  # one device-to-host copy for the step's device rows
            rows[on_device] = mindspore.ops.stack([handles[i] for i in on_device]).asnumpy()
        return rows

    def host_copy(self, tensor: mindspore.Tensor, pool: HostBufferPool | None = None) -> tuple[np.ndarray, Any]:
        if _dtype_name(tensor) == "bfloat16":  # numpy has no bfloat16: its bits, as the wire carries them
            values = tensor.astype(mindspore.float32).asnumpy()
            return (values.view(np.uint32) >> 16).astype(np.uint16), None
        view = tensor.asnumpy()  # on the CPU a view of the tensor's memory; elsewhere one device-to-host copy
        if pool is not None and view.nbytes:
            buffer = pool.take(view.nbytes)
            copy = buffer.view(view.dtype).reshape(view.shape)
            np.copyto(copy, view)
            return copy, buffer
        return np.array(view, copy=True), None

    def on_accelerator(self, model: mindspore.nn.Cell) -> bool:
        return any(not _is_cpu(p) for p in model.get_parameters())

    def storage_array(self, copy: np.ndarray) -> np.ndarray:
        return copy

    def add_input_hook(self, module: mindspore.nn.Cell,
                       hook: Callable[[Any, tuple, dict[str, Any]], tuple[tuple, dict[str, Any]] | None],
                       ) -> RemovableHandle:
        try:
            return RemovableHandle(module.register_forward_pre_hook(hook, with_kwargs=True).remove)
        except TypeError:  # a MindSpore whose pre-hooks take no keywords: positional arguments only
            def positional(cell: Any, args: tuple) -> tuple | None:
                replaced = hook(cell, args, {})
                return None if replaced is None else replaced[0]

            return RemovableHandle(module.register_forward_pre_hook(positional).remove)

    def to_numpy(self, tensor: mindspore.Tensor) -> np.ndarray:
        if _dtype_name(tensor) == "bfloat16":
            tensor = tensor.astype(mindspore.float32)
        return np.array(tensor.asnumpy(), copy=True)

    def from_numpy(self, array: np.ndarray, like: mindspore.Tensor) -> mindspore.Tensor:
        return mindspore.Tensor(np.ascontiguousarray(array), dtype=like.dtype)

    def inplace_version(self, tensor: Any) -> int | None:
        return None  # Tensor._version misses optimizer and assign writes (see the module docstring)

    def make_sketcher(self, spec: SketchSpec) -> MindSporeSketcher:
        return MindSporeSketcher(spec)

    def loss_tensor(self, loss: Any) -> Any:
        """The loss, after checking that the model's hooks ran this step (compiled cells run none).

        A step whose model ran no hook at all is the sign of a model compiled with jit after
        attach: its loss record fails with the reason (counted in the run's capture health,
        which the report shows, and warned once) rather than the step passing as captured.
        """
        calls, self._hook_calls = self._hook_calls, 0
        if calls == 0 and self._watching_outputs:
            raise GraphModeError("no module output was seen this step: the model ran compiled (jit or "
                                 "GRAPH_MODE), where MindSpore runs no Python hook; run it in PyNative mode "
                                 "without jit on the model to capture it")
        if loss is None or isinstance(loss, mindspore.Tensor):
            return loss
        return mindspore.Tensor(np.array(float(loss), dtype=np.float64))

    _watching_outputs = False
    """True once an output hook is installed: a step boundary then expects hook calls."""


def _row_of_view(view: np.ndarray, keep: Any) -> tuple[float, ...]:
    """Worker thread: statistics of a host view; ``keep`` holds the tensor that owns its memory."""
    return stats.host_row(view)


def _host_values(tensor: mindspore.Tensor) -> np.ndarray:
    """A float32/float64 host array of the tensor's values: a view of a CPU float tensor, else a widened copy."""
    name = _dtype_name(tensor)
    if name == "bfloat16":
        return tensor.astype(mindspore.float32).asnumpy()  # numpy has no bfloat16
    view = tensor.asnumpy()
    if view.dtype == np.float16:
        return view.astype(np.float32)  # float16 squares overflow
    if view.dtype not in _HOST_FLOATS:
        return view.astype(np.float64)  # integers and bool: exact in float64
    return view


def _collect(value: Any, found: list[mindspore.Tensor]) -> None:
    if isinstance(value, mindspore.Tensor):
        found.append(value)  # any dtype: one twinstep cannot read is counted as a failure, not skipped
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, found)
    elif isinstance(value, dict):
        for key in value:
            _collect(value[key], found)
    elif hasattr(value, "to_tuple"):  # mindnlp / mindformers ModelOutput
        _collect(value.to_tuple(), found)


def _device_row(tensor: mindspore.Tensor) -> mindspore.Tensor:
    """Statistics as a float64 device vector (Ascend, GPU), with no host synchronisation.

    The definitions of the torch and paddle device rows: non-finite elements are
    replaced by the finite mean, and m2 comes from the shifted pass.
    """
    ops = mindspore.ops
    name = _dtype_name(tensor)
    x = tensor.astype(mindspore.float32) if name in ("float16", "bfloat16") else tensor
    if name not in ("float16", "bfloat16", "float32", "float64"):
        x = tensor.astype(mindspore.float64)
    f64 = mindspore.float64
    finite = ops.isfinite(x)
    n_finite = finite.astype(f64).sum()
    nan = ops.isnan(x).astype(f64).sum()
    inf = mindspore.Tensor(float(math.prod(x.shape)), f64) - n_finite - nan
    count = ops.maximum(n_finite, mindspore.Tensor(1.0, f64))
    zero = ops.zeros((), x.dtype)
    shift = ops.select(finite, x, zero.broadcast_to(x.shape)).sum() / count.astype(x.dtype)
    y = ops.select(finite, x, shift.broadcast_to(x.shape))
    lo = y.min().astype(f64)
    hi = y.max().astype(f64)
    d = y - shift
    dsum = d.sum().astype(f64)
    dsum_sq = (d * d).sum().astype(f64)
    m2 = ops.maximum(dsum_sq - dsum * dsum / count, mindspore.Tensor(0.0, f64))
    total = shift.astype(f64) * n_finite + dsum
    sum_sq = m2 + total * total / count
    return ops.stack([total, sum_sq, lo, hi, ops.maximum(-lo, hi), nan, inf, m2])
