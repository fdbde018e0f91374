"""The contract a framework backend fulfils so the recorder can stay framework-neutral.

A backend touches framework objects only; it never imports grpc and never
sends anything.  Methods marked *hot* run on the training thread for every
captured tensor: they must be cheap, must not synchronise the device, and must
not keep references to the tensors they are given beyond what they return.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator

import numpy as np

from twinstep.runtime.capture.buffers import HostBufferPool
from twinstep.wire.inputs import call_inputs, keyword_order

Tensor = Any
Module = Any


class UnsupportedTensor(TypeError):
    """A tensor twinstep cannot capture (complex, float8, quantised, ...): counted and reported, never raised into training."""

    def __init__(self, dtype: object) -> None:
        super().__init__(f"{dtype} tensors are not captured (twinstep reads float32/16/64, bfloat16, integers and bool)")


class RemovableHandle:
    """Detaches one hook when removed; removing twice is harmless."""

    def __init__(self, remove: Callable[[], None]) -> None:
        self._remove: Callable[[], None] | None = remove

    def remove(self) -> None:
        remove, self._remove = self._remove, None
        if remove is not None:
            remove()


# -- a call's inputs -------------------------------------------------------------
#
# The recorder records a module call's first tensor input (CaptureConfig.inputs) by the rule
# of twinstep.wire.inputs: the first tensor among the positional arguments, else the first
# tensor among the keyword arguments taken in the order of the module's forward signature
# (then any keyword its signature does not name, in call order).  Each backend's hooks read a
# call through one :class:`CallInputs` per hooked module: the positional arguments alone on
# the hot path, keyword values appended only for a call whose first positional argument is
# not a tensor.


def forward_parameter_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    """The names ``forward`` (a bound ``forward`` or ``construct``) accepts by keyword, in signature order.

    () when unknown.  ``inspect.signature`` follows ``__wrapped__``, so a forward wrapped
    with ``functools.wraps`` (accelerate's hooks) still gives the original order.
    """
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or an object without a readable signature
        return ()
    return tuple(p.name for p in parameters
                 if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


class CallInputs:
    """One module's calls read by the rule above, for a framework whose tensors are ``tensor_type``.

    Make one per hooked module: it reads the module's forward signature (the method named
    ``forward``: "construct" for MindSpore) once, on the first call that needs it.
    """

    __slots__ = ("_forward", "_order", "_tensor_type")

    def __init__(self, tensor_type: type | tuple[type, ...], forward: str = "forward") -> None:
        self._tensor_type = tensor_type
        self._forward = forward
        self._order: tuple[str, ...] | None = None

    def order(self, module: Module) -> tuple[str, ...]:
        """``module``'s forward keyword names in signature order (:func:`forward_parameter_names`)."""
        if self._order is None:
            self._order = forward_parameter_names(getattr(module, self._forward))
        return self._order

    def __call__(self, module: Module, args: tuple, kwargs: dict[str, Any] | None) -> tuple:
        """The call's ``inputs`` for the recorder (hot): ``args``, with the keyword values appended
        (:func:`call_inputs`) when the first positional argument is not a tensor."""
        if kwargs and not (args and isinstance(args[0], self._tensor_type)):
            return call_inputs(args, kwargs, self.order(module))
        return args

    def first(self, module: Module, args: tuple, kwargs: dict[str, Any] | None) -> int | str | None:
        """Where the call's first input is passed: its position in ``args``, its keyword, or None (no
        tensor passed directly; one inside a list or a dict is not looked for)."""
        tensor_type = self._tensor_type
        for position, value in enumerate(args):
            if isinstance(value, tensor_type):
                return position
        if kwargs:
            for name in keyword_order(kwargs, self.order(module)):
                if isinstance(kwargs[name], tensor_type):
                    return name
        return None


class CaptureBackend(ABC):
    """Framework adapter used by :class:`twinstep.runtime.capture.recorder.Recorder`."""

    #: Short framework name sent to the server ("torch", "paddle").
    framework: str = ""
    #: The framework's tensor class (parameters included), and the name of a module's forward method.
    tensor_type: type | tuple[type, ...] = ()
    forward_name: str = "forward"

    def call_reader(self) -> CallInputs:
        """A reader of one module's calls by the input rule (:class:`CallInputs`): make one per hooked module."""
        return CallInputs(self.tensor_type, self.forward_name)

    @abstractmethod
    def framework_version(self) -> str: ...

    @abstractmethod
    def named_modules(self, model: Module) -> Iterator[tuple[str, Module]]:
        """All modules including the root (named "")."""

    @abstractmethod
    def named_parameters(self, model: Module) -> Iterator[tuple[str, Tensor, str, str]]:
        """(name, parameter, owner module name, owner module type) per trainable parameter."""

    @abstractmethod
    def add_output_hook(self, module: Module, hook: Callable[[Module, Any, Any], None]) -> RemovableHandle:
        """Call ``hook(module, inputs, output)`` after every forward call of ``module``.

        ``inputs`` is the call's positional arguments, with the values of its keyword
        arguments appended (:func:`call_inputs`) when the first positional argument is not a
        tensor, so that a module called by keyword still has its input recorded (hot: the
        keyword path costs only calls without a positional tensor).
        """

    @abstractmethod
    def output_tensors(self, output: Any) -> list[Tensor]:
        """The floating/integer tensors in a module output, in a stable order (hot)."""

    @abstractmethod
    def add_grad_hook(self, tensor: Tensor, hook: Callable[[Tensor], None]) -> bool:
        """Call ``hook(grad)`` when the gradient of ``tensor`` is computed (hot).

        Returns False when the tensor takes no part in autograd.
        """

    @abstractmethod
    def grad(self, parameter: Tensor) -> Tensor | None: ...

    @abstractmethod
    def describe(self, tensor: Tensor) -> tuple[str, tuple[int, ...]]:
        """(neutral dtype name, shape) (hot)."""

    @abstractmethod
    def device_stats(self, tensor: Tensor) -> Any:
        """A handle to the :data:`twinstep.wire.stats.DEVICE_FIELDS` of ``tensor`` (hot).

        On an accelerator a device vector (no host sync); on the CPU it may be the
        host values themselves.
        """

    def host_stats_task(self, tensor: Tensor) -> Callable[[], tuple[float, ...]] | None:
        """A function computing ``tensor``'s statistics row that any thread may run, or None (hot).

        It must read the tensor's memory only through a host view (no framework
        call: frameworks' eager modes are not all thread-safe) and must keep
        that memory alive.  None for accelerator tensors (their statistics stay
        on the device), tensors too small to be worth a hand-off, and anything
        the backend would rather compute in the hook.
        """
        return None

    def host_copy_task(self, tensor: Tensor, pool: HostBufferPool) -> Callable[[], tuple[Any, Any]] | None:
        """A function making :meth:`host_copy`'s (copy, buffer) on any thread, or None (hot).

        Offered only where :meth:`copy_stats_task` serves the copy it makes
        (host floating tensors above the hand-off size).
        """
        return None

    def copy_stats_task(self, copy: Any) -> Callable[[], tuple[float, ...]] | None:
        """As :meth:`host_stats_task`, for a host copy that :meth:`host_copy` returned."""
        return None

    def identity(self, tensor: Tensor) -> Any:
        """A key equal for two handles of the same tensor while both live (hot): reads are shared by it."""
        return id(tensor)

    def is_host(self, tensor: Tensor) -> bool:
        """True when ``tensor`` lives in host memory (a CPU tensor)."""
        return False

    @abstractmethod
    def stats_to_host(self, handles: list[Any]) -> np.ndarray:
        """Stack statistics into one float64 array [n, len(DEVICE_FIELDS)], one copy per device."""

    @abstractmethod
    def host_copy(self, tensor: Tensor, pool: HostBufferPool | None = None) -> tuple[Any, Any]:
        """A private host copy of ``tensor`` for tensor mode (hot: one copy, no conversion).

        Returns (copy, buffer): with a pool the copy lives in ``buffer``, taken
        from it (give it back once the copy is encoded); without, buffer is None.
        A copy from an accelerator may still be in flight until
        :meth:`host_copies_fence` says otherwise.
        """

    def allocate_host(self, nbytes: int) -> Any:
        """A new host buffer of ``nbytes`` bytes for the pool (page-locked where that makes copies async)."""
        return np.empty(nbytes, dtype=np.uint8)

    def on_accelerator(self, model: Module) -> bool:
        """True when the model's parameters live on an accelerator (host copies of its tensors cross a bus)."""
        return False

    def wrap_host(self, array: np.ndarray) -> Any:
        """A pool buffer over memory allocated elsewhere (a ``uint8`` array, e.g. shared with the sender process)."""
        return array

    def host_copies_fence(self) -> Callable[[], None] | None:
        """A wait for every host copy started so far (None: copies are already complete).

        Called on the training thread at the end of a step; the returned
        callable runs on the sender thread before it reads the copies.
        """
        return None

    @abstractmethod
    def storage_array(self, copy: Any) -> np.ndarray:
        """The wire storage array of a host copy; runs on a background thread."""

    @abstractmethod
    def add_input_hook(self, module: Module,
                       hook: Callable[[Module, tuple, dict[str, Any]], tuple[tuple, dict[str, Any]] | None],
                       ) -> RemovableHandle:
        """Call ``hook(module, args, kwargs)`` before every forward call; a returned ``(args, kwargs)``
        replaces the call's arguments.  ``kwargs`` is {} where the framework passes no keywords to
        pre-hooks (the hook then sees, and may replace, the positional arguments only)."""

    @abstractmethod
    def to_numpy(self, tensor: Tensor) -> np.ndarray:
        """A host copy as numpy (bfloat16 widened to float32)."""

    @abstractmethod
    def from_numpy(self, array: np.ndarray, like: Tensor) -> Tensor:
        """A tensor of ``like``'s dtype and device holding ``array``."""

    @abstractmethod
    def inplace_version(self, tensor: Tensor) -> int | None:
        """The tensor's in-place modification counter (hot): a tensor seen again with the same
        counter holds the same numbers, so its statistics are reused.  None: not tracked
        (never reused)."""

    @abstractmethod
    def make_sketcher(self, spec: Any) -> Any:
        """A device sketcher (twinstep.runtime.capture.<framework>.sketch) for :class:`twinstep.wire.sketch.SketchSpec` ``spec``."""

    def watch_optimizer(self, optimizer: Any) -> RemovableHandle | None:
        """Follow the optimizer where a framework keeps gradients off the parameters (MindSpore).

        None: :meth:`grad` reads the parameter itself (torch, paddle).
        """
        return None

    def float32_matmul_precision(self) -> str:
        """"tf32" when float32 matrix products run on TF32 tensor cores, else "fp32"."""
        return "fp32"

    def loss_tensor(self, loss: Any) -> Tensor | None:
        """The tensor of a loss passed to ``step()``; plain floats are wrapped."""
        return loss

    # -- parallel layouts (twinstep.runtime.capture.placement) ----------------------------------------
    #
    # A framework whose distributed tensors wrap a local shard (torch's DTensor) says so with
    # ``has_shards``; the recorder then reads every tensor whose type is not in ``plain_types``
    # through :meth:`local_shard`: statistics, copies, sketches and shapes are the shard's.

    #: Tensors of a type outside ``plain_types`` may be distributed (read through :meth:`local_shard`).
    has_shards: bool = False
    #: The framework's own tensor and parameter types: their own local shard (a set lookup on the hot path).
    plain_types: frozenset[type] = frozenset()

    def local_shard(self, tensor: Tensor) -> Tensor:
        """The part of ``tensor`` this rank holds, as a plain tensor (hot; only for types outside ``plain_types``)."""
        return tensor

    def tensor_placement(self, tensor: Tensor) -> Any:
        """A distributed tensor's own placement (a :class:`~twinstep.runtime.capture.placement.Block`, or
        ``placement.REPLICATED`` when it holds the whole logical tensor); None for a tensor that is not
        distributed.  Only asked for types outside ``plain_types``."""
        return None

    def module_split(self, module: Module, layout: Any) -> tuple[Any, Any] | None:
        """(its outputs' split, its input's split), each a :class:`~twinstep.runtime.capture.placement.Split`
        or None, of a tensor-parallel layer the framework describes (a column- or row-parallel linear
        layer); None for any other module.  Asked once per module."""
        return None

    def parameter_split(self, parameter: Tensor, layout: Any) -> Any:
        """The :class:`~twinstep.runtime.capture.placement.Split` of a parameter the framework marks as one
        rank's part of a tensor-parallel layer's (Megatron's ``partition_dim``, paddle's ``split_axis``),
        or None.  Asked once per parameter."""
        return None

    def has_parameters(self, module: Module) -> bool:
        """``module`` or a module inside it holds a parameter (one without passes its input's block on)."""
        return next(iter(self.named_parameters(module)), None) is not None

    def detect_layout(self, model: Module) -> Any:
        """This rank's :class:`~twinstep.runtime.capture.placement.Layout` as the framework's process groups,
        device meshes and wrappers tell it, or None (one process, or nothing found).  Called once, at attach."""
        return None
