"""Framework-neutral recording of one training step, on the training thread.

The recorder installs one output hook per selected module.  Each hook computes
device statistics of the module's outputs (no host sync), optionally takes a
host copy (tensor mode), and registers a gradient hook on each output so the
gradient with respect to it is recorded during backward.  ``finish_step`` adds
the loss, parameter gradients and updated parameters and hands back a
:class:`StepBatch`: everything later work (encoding, compression, sending)
needs, with no further reference to the framework's tensors.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from twinstep.runtime.capture.base import CaptureBackend, RemovableHandle
from twinstep.runtime.capture.buffers import HostBufferPool, HostMemory, HostTensor
from twinstep.runtime.capture.health import CaptureHealth, describe_error
from twinstep.runtime.capture.offload import DEFAULT_TIMEOUT, StatsOffload, StatsTask
from twinstep.runtime.capture.placement import Block, DeclaredSplit, Layout, Placements
from twinstep.wire.codec import DTYPE_TO_WIRE, WIRE_TO_DTYPE
from twinstep.wire.layouts import is_in_out
from twinstep.wire.sketch import SketchSpec
from twinstep.wire.stats import DEVICE_FIELDS
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

#: Dtypes that are sketched (integer and boolean tensors compare exactly by their statistics).
_FLOATS = frozenset({"float32", "float16", "bfloat16", "float64"})

#: (the tensor, its in-place version, record index) of a tensor recorded this step.
_Seen = tuple[Any, Any, int]

#: What a run may capture: statistics, plus full tensors sent losslessly or within the server's error budget.
CAPTURE_MODES = ("stats", "tensors", "lossy")

#: Upper bound on records in one step, so a missing ``step()`` call cannot grow memory without end.
MAX_RECORDS_PER_STEP = 1_000_000


@dataclass(kw_only=True)
class CaptureConfig:
    """What to capture."""

    capture: str = "stats"
    """"stats": statistics only; "tensors": statistics plus full tensors (lossless);
    "lossy": statistics plus full tensors quantised within the error budget the server
    derives from its tolerances (no verdict changes; see twinstep.wire.codec)."""
    include: tuple[str, ...] = ("*",)
    """Glob patterns over module names ("" is the whole model); a module must match one."""
    exclude: tuple[str, ...] = ()
    """Glob patterns over module names to leave out."""
    every: int = 1
    """Capture every N-th step (0, N, 2N, ...)."""
    backward: bool = True
    """Record gradients with respect to module outputs."""
    parameters: bool = True
    """Record parameter gradients and parameters after the update."""
    sketch: bool = False
    """Record a count-sketch of every floating tensor larger than the sketch
    (twinstep.wire.sketch): the server then estimates rel_l2 and cosine of whole tensors,
    which no statistic shows (rows swapped, a sign flipped in one place), at a
    fraction of tensor mode's cost."""
    inputs: bool = True
    """Record each module's first input, so the server can tell a module that creates an
    error from one that inherits it.  Nearly free: an input that another hooked module
    produced reuses that module's statistics.  The input is the call's first positional
    tensor, else its first keyword tensor in the order of the forward signature
    (twinstep.wire.inputs), so that a module one framework calls by
    keyword pairs with the other's positional call."""
    stats_workers: int = 1
    """Threads that compute CPU tensors' statistics (and, in tensor modes, make their host
    copies) off the training thread, while it computes (twinstep.runtime.capture.offload).
    0: on the training thread, in the hook."""
    stats_timeout: float = DEFAULT_TIMEOUT
    """Seconds the step boundary waits for outstanding statistics; past it they are
    counted as not captured and later steps compute inline."""

    def __post_init__(self) -> None:
        if self.capture not in CAPTURE_MODES:
            raise ValueError(f"capture must be one of {', '.join(map(repr, CAPTURE_MODES))}, got {self.capture!r}")
        if isinstance(self.include, str) or isinstance(self.exclude, str):
            raise ValueError("include and exclude take a sequence of glob patterns, not a string")
        self.include = tuple(self.include)
        self.exclude = tuple(self.exclude)
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be a positive integer, got {self.every!r}")
        if not isinstance(self.stats_workers, int) or self.stats_workers < 0:
            raise ValueError(f"stats_workers must be a non-negative integer, got {self.stats_workers!r}")
        if not self.stats_timeout > 0:
            raise ValueError(f"stats_timeout must be positive, got {self.stats_timeout!r}")

    def selects(self, module_name: str) -> bool:
        return any(fnmatch.fnmatchcase(module_name, p) for p in self.include) and not any(
            fnmatch.fnmatchcase(module_name, p) for p in self.exclude
        )


class StepNotCaptured(RuntimeError):
    """Every record of a step failed: nothing of it can be delivered (a whole-step gap)."""


class ModifiedInPlace(RuntimeError):
    """A tensor changed in place between its capture and the end of its step, while its statistics were read off the training thread."""

    def __init__(self) -> None:
        super().__init__("modified in place after capture, while its statistics were computed off the training "
                         "thread; this record is computed on the training thread from the next step on")


class StatisticsLate(RuntimeError):
    """Statistics not ready within ``stats_timeout`` of the step's end."""


#: (phase, target, call, slot): a record's place in every step, for what the recorder learns across steps.
_Key = tuple[int, int, int, int]


@dataclass
class CaptureCost:
    """What capture read and where, for one step or summed over steps (sent with each step)."""

    bytes_captured: int = 0
    """Bytes of every record's tensor: what a capture reading each record separately would read."""
    bytes_read: int = 0
    """Bytes read from the training's tensors: once per distinct tensor (statistics, copy, sketch)."""
    offloaded: int = 0
    """Statistics passes run off the training thread."""
    inline: int = 0
    """Statistics passes run on the training thread (small tensors, accelerators, first sightings)."""
    boundary_seconds: float = 0.0
    """Training-thread time at the step boundary helping and waiting for the offloaded passes."""
    steps: int = 0

    def add(self, other: "CaptureCost") -> None:
        self.bytes_captured += other.bytes_captured
        self.bytes_read += other.bytes_read
        self.offloaded += other.offloaded
        self.inline += other.inline
        self.boundary_seconds += other.boundary_seconds
        self.steps += other.steps

    def to_proto(self) -> pb.CaptureCost:
        return pb.CaptureCost(bytes_captured=self.bytes_captured, bytes_read=self.bytes_read,
                              stats_offloaded=self.offloaded, stats_inline=self.inline,
                              boundary_us=int(self.boundary_seconds * 1e6), steps=self.steps)


@dataclass
class StepBatch:
    """One (rank, step) of records, detached from the framework."""

    step: int
    phase: np.ndarray
    target: np.ndarray
    call_index: np.ndarray
    slot: np.ndarray
    dtype: np.ndarray
    ndim: np.ndarray
    dims: list[int]
    count: np.ndarray
    device_stats: np.ndarray  # [n, len(DEVICE_FIELDS)] float64, twinstep.wire.stats.DEVICE_FIELDS
    tensors: list[HostTensor] = field(default_factory=list)
    """Full tensors (tensor and lossy modes), one per distinct tensor of the step."""
    storage_array: Callable[[Any], np.ndarray] | None = None
    release: Callable[[HostTensor], None] | None = None
    """Gives a tensor's pooled buffer back once it is encoded."""
    copies_ready: Callable[[], None] | None = None
    """Waits for asynchronous device-to-host copies (None: they are complete)."""
    sketch_records: np.ndarray | None = None
    """Ascending record indices that carry a sketch (None: no sketches)."""
    sketches: np.ndarray | None = None
    """[len(sketch_records), buckets] float32."""
    sketch_spec: tuple[int, int] = (0, 0)
    """(buckets, seed) of the sketches."""
    incomplete: tuple[int, ...] = ()
    """Phases in which some record of this step could not be captured (they are absent)."""
    cost: CaptureCost = field(default_factory=CaptureCost)
    """What capturing this step read (twinstep.runtime.capture.recorder.CaptureCost)."""
    record_names: list[str] = field(default_factory=list)
    """Names of the step's named records (phase RECORD; twinstep.runtime.capture.named): their targets index it."""
    ops: bytes = b""
    """A serialized OpTrace: one module's operations, when a zoom asked (twinstep.runtime.capture.ops)."""
    placements: list[tuple[int, Block]] = field(default_factory=list)
    """(record, placement) of the records of a parallel layout that are not whole, ascending
    (twinstep.runtime.capture.placement); empty for a run with no layout."""

    def dims_of(self, record: int) -> tuple[int, ...]:
        """The shape of one record (dims are stored flat, ndim[i] at a time)."""
        start = int(self.ndim[:record].sum())
        return tuple(self.dims[start : start + int(self.ndim[record])])

    @functools.cached_property
    def nbytes(self) -> int:
        """Approximate memory held, for bounding the send queue (fixed once asked: encoding keeps it about equal)."""
        size = self.device_stats.nbytes + 64 * len(self.phase)
        if self.sketches is not None:
            size += self.sketches.nbytes
        for host in self.tensors:
            size += host.nbytes
        return size + len(self.ops)


class _StepBuffer:
    """Columns of the step being recorded."""

    __slots__ = (
        "phase", "target", "call", "slot", "dtype", "shapes", "stats", "tensors", "calls", "overflow", "produced",
        "grads", "sketches", "copied", "tasks", "checks", "cost", "placements",
    )

    def __init__(self) -> None:
        self.phase: list[int] = []
        self.target: list[int] = []
        self.call: list[int] = []
        self.slot: list[int] = []
        self.dtype: list[int] = []
        self.shapes: list[tuple[int, ...]] = []
        self.stats: list[Any] = []
        self.tensors: list[HostTensor] = []
        self.copied: dict[int, HostTensor] = {}  # record index -> its host copy
        self.calls: dict[int, int] = {}
        self.overflow = 0
        # identity -> (tensor, in-place version, record index) of the tensors recorded this step: a tensor recorded again (a container returns its last child's output, an
        # input is another module's output, two hooks receive one gradient) reuses its statistics.
        self.produced: dict[int, _Seen] = {}
        self.grads: dict[int, _Seen] = {}
        # record index -> device sketch handle
        self.sketches: dict[int, Any] = {}
        self.tasks: list[StatsTask] = []
        # (key, tensor, in-place version at capture, its task or None): statistics read from a live
        # tensor that later training code could modify; checked at the step boundary.  The tensor is held
        # until then so its version counter can still be read.
        self.checks: list[tuple[_Key, Any, Any, StatsTask | None]] = []
        self.cost = CaptureCost(steps=1)
        # record index -> its placement (twinstep.runtime.capture.placement), for a run with a layout
        self.placements: dict[int, Block] = {}


class Recorder:
    """Hooks one model and records each step; all methods run on the training thread."""

    def __init__(self, model: Any, backend: CaptureBackend, config: CaptureConfig, host_pool_bytes: int = 1 << 30,
                 host_memory: HostMemory | None = None, layout: Layout | None = None,
                 splits: tuple[DeclaredSplit, ...] = ()) -> None:
        self.backend = backend
        self.config = config
        # Distributed tensors (torch's DTensor) are read through their local shard: None, every tensor is its own.
        self._plain: frozenset[type] | None = backend.plain_types if backend.has_shards else None
        self.layout = layout
        """This rank's place in its parallel layout (None: whole; then no placement is ever computed)."""
        self._placer = Placements(layout, backend, tuple(splits)) if layout is not None else None
        self._handles: list[RemovableHandle] = []
        self._module_ids: dict[str, int] = {}
        self._module_names: list[str] = []
        self._new_modules: list[pb.ModuleInfo] = []
        self._buffer = _StepBuffer()
        self._active = True
        self._step = 0
        self.health = CaptureHealth()
        self._step_error: BaseException | None = None  # the first failure of the step being recorded
        self._step_incomplete: set[int] = set()  # phases of this step with a record that failed
        """What could not be captured (the monitor sends it to the server)."""
        self.parameters: list[tuple[int, str, Any]] = []
        self.parameter_infos: list[pb.ParameterInfo] = []
        self._sketcher = backend.make_sketcher(SketchSpec()) if config.sketch else None
        self._host_pool_bytes = host_pool_bytes
        self._zoom: Any = None  # twinstep.runtime.capture.control.StepZoom of the step being recorded (None: as attached)
        self._pool = (
            HostBufferPool(
                (lambda n: backend.wrap_host(host_memory.allocate(n))) if host_memory else backend.allocate_host,
                max_free_bytes=host_pool_bytes, on_discard=host_memory.discard if host_memory else None,
            ) if config.capture != "stats" else None
        )
        self._offload = StatsOffload(config.stats_workers, config.stats_timeout) if config.stats_workers else None
        # Records seen unmodified from capture to their step's end (their statistics may be read off the
        # training thread), and records some training code modified in place (always read in the hook).
        self._settled: set[_Key] = set()
        self._volatile: set[_Key] = set()
        self.cost = CaptureCost()
        """Summed over the captured steps."""
        # Parameters stored as the transpose of the canonical layout: sketched by the canonical index.
        self._transposed: set[int] = set()
        # Hooks are attached only while a step is captured: a step that is not captured runs the model untouched.
        self._hooked = [(module, self._output_hook(name, type(module).__name__))
                        for name, module in backend.named_modules(model) if config.selects(name)]
        # Data parallel: records of the batch are blocks of the global batch; the model's first input says its size.
        self._batch_hook = ((model, self._batch_size_hook(model))
                            if self._placer is not None and self._placer.data else None)
        self._removed = False
        self._attach_hooks()
        if config.parameters:
            for name, param, owner, owner_type in backend.named_parameters(model):
                if not config.selects(owner):
                    continue
                pid = len(self.parameters)
                if is_in_out(backend.framework, owner_type, name):
                    self._transposed.add(pid)
                dtype, shape = backend.describe(self._local(param))
                self.parameters.append((pid, name, param))
                self.parameter_infos.append(
                    pb.ParameterInfo(
                        id=pid, name=name, module=owner, module_type=owner_type, shape=shape, dtype=DTYPE_TO_WIRE[dtype]
                    )
                )

    # -- hooks (hot path) ---------------------------------------------------

    def _output_hook(self, name: str, module_type: str) -> Callable[[Any, Any, Any], None]:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            if not self._active:
                return
            try:
                self._record_output(name, module_type, module, inputs, output)
            except Exception as error:  # never break the training step
                self._hook_failed(pb.FORWARD, name, error)

        return hook

    def _local(self, tensor: Any) -> Any:
        """The tensor this rank holds of ``tensor`` (a DTensor's local shard; most tensors are their own)."""
        plain = self._plain
        if plain is None or type(tensor) in plain:
            return tensor
        return self.backend.local_shard(tensor)

    def _batch_size_hook(self, model: Any) -> Callable[..., None]:
        reader = self.backend.call_reader()
        placer = self._placer

        def hook(module: Any, args: tuple, kwargs: dict[str, Any] | None = None) -> None:
            if not self._active or placer is None:
                return None
            try:
                first = self.backend.output_tensors(reader(module, args, kwargs))[:1]
                shape = tuple(self._local(first[0]).shape) if first else ()
                placer.batch = shape[0] if shape else None
            except Exception:  # the batch stays unknown: this step's records are not split by data
                placer.batch = None
            return None

        return hook

    def _record_output(self, name: str, module_type: str, module: Any, inputs: Any, output: Any) -> None:
        module_id = self._module_ids.get(name)
        if module_id is None:
            module_id = len(self._module_ids)
            self._module_ids[name] = module_id
            self._module_names.append(name)
            self._new_modules.append(pb.ModuleInfo(id=module_id, name=name, type=module_type))
        buffer = self._buffer
        call = buffer.calls.get(module_id, 0)
        buffer.calls[module_id] = call + 1
        placer = self._placer
        given = None  # (tensor-parallel block, local shape) of the call's input, for a run with a layout
        if self.config.inputs or placer is not None:
            first_input = self.backend.output_tensors(inputs)[:1]
            if first_input:
                try:
                    tensor, block = first_input[0], None
                    if placer is not None:
                        local = self._local(tensor)
                        own, block, shape = placer.module_input(module_id, name, module, tensor, local)
                        given, tensor = (own, shape), local
                    if self.config.inputs:
                        self._add_input(module_id, call, tensor, block)
                except Exception as error:  # evidence only: the outputs are still worth recording
                    self._hook_failed(pb.INPUT, name, error)
        for slot, tensor in enumerate(self.backend.output_tensors(output)):
            own = None
            try:  # one unreadable output (a complex tensor, say) leaves its siblings recorded
                if placer is None:
                    self._add(pb.FORWARD, module_id, call, slot, tensor, buffer.produced)
                else:
                    local = self._local(tensor)
                    own, block = placer.module_output(module_id, name, module, slot, tensor, local, given)
                    self._add(pb.FORWARD, module_id, call, slot, local, buffer.produced, block)
            except Exception as error:
                self._hook_failed(pb.FORWARD, name, error)
                continue
            if self.config.backward:
                self.backend.add_grad_hook(tensor, self._grad_hook(module_id, call, slot, name, own))

    def _add_input(self, module_id: int, call: int, tensor: Any, block: Block | None = None) -> None:
        buffer = self._buffer
        backend = self.backend
        tensor = self._local(tensor)
        source = _recorded(buffer.produced, tensor, backend)
        if source is not None:  # another module's output or input: same numbers, no new pass over the tensor
            index = self._append(pb.INPUT, module_id, call, 0, buffer.dtype[source], buffer.shapes[source],
                                 buffer.stats[source])
            if block is not None and index is not None:
                buffer.placements[index] = block
            return
        dtype, shape = backend.describe(tensor)
        stats = self._statistics((pb.INPUT, module_id, call, 0), tensor, _nbytes_of(dtype, shape))
        index = self._append(pb.INPUT, module_id, call, 0, DTYPE_TO_WIRE[dtype], shape, stats)
        if index is not None:
            buffer.produced[backend.identity(tensor)] = (tensor, backend.inplace_version(tensor), index)
            if block is not None:
                buffer.placements[index] = block

    def _grad_hook(self, module_id: int, call: int, slot: int, name: str,
                   output: Block | None = None) -> Callable[[Any], None]:
        """``output``: the tensor-parallel block of the output whose gradient this is (a run with a layout)."""
        def hook(grad: Any) -> None:
            if not self._active:
                return
            try:
                placer = self._placer
                if placer is None:
                    self._add(pb.BACKWARD, module_id, call, slot, grad, self._buffer.grads)
                else:
                    local = self._local(grad)
                    block = placer.output_gradient(output, grad, local)
                    self._add(pb.BACKWARD, module_id, call, slot, local, self._buffer.grads, block)
            except Exception as error:
                self._hook_failed(pb.BACKWARD, name, error)

        return hook

    def _add(
        self, phase: int, target: int, call: int, slot: int, tensor: Any, seen: dict[int, _Seen] | None = None,
        block: Block | None = None,
    ) -> int | None:
        """Record a tensor; returns its record index (None when the step is full).

        ``seen`` maps the tensors already recorded this step: one found there,
        unchanged since, reuses its statistics instead of a new pass.  ``block``: the
        record's placement in its logical tensor (None: whole).
        """
        buffer = self._buffer
        if len(buffer.phase) >= MAX_RECORDS_PER_STEP:
            buffer.overflow += 1
            return None
        backend = self.backend
        plain = self._plain
        if plain is not None and type(tensor) not in plain:
            tensor = backend.local_shard(tensor)
        source = _recorded(seen, tensor, backend) if seen else None
        host: HostTensor | None = None
        full = self._full_tensor(phase, target)
        if source is not None and full and self.config.capture == "stats" and source not in buffer.copied:
            source = None  # recorded already without its tensor (a zoom asks for it here): read it again
        if source is None:
            dtype, shape = backend.describe(tensor)
            wire = DTYPE_TO_WIRE[dtype]
            nbytes = _nbytes_of(dtype, shape)
            if full:
                stats, host = self._copy((phase, target, call, slot), tensor, dtype, nbytes)
            else:
                stats = self._statistics((phase, target, call, slot), tensor, nbytes)
        else:
            wire, shape, stats = buffer.dtype[source], buffer.shapes[source], buffer.stats[source]
            dtype = WIRE_TO_DTYPE[wire]
        index = self._append(phase, target, call, slot, wire, shape, stats)
        if index is None:
            return None
        if full:
            shared = buffer.copied.get(source) if source is not None else None
            if shared is not None:  # the same tensor again: sent once, for both records
                shared.records.append(index)
            elif host is not None:
                host.records.append(index)
                buffer.tensors.append(host)
                buffer.copied[index] = host
        if seen is not None and source is None:
            seen[backend.identity(tensor)] = (tensor, backend.inplace_version(tensor), index)
        if block is not None:
            buffer.placements[index] = block
        sketcher = self._sketcher
        if sketcher is not None and dtype in _FLOATS and (self.config.sketch or self._zoomed(phase, target)[1]):
            if source is not None and source in buffer.sketches and buffer.placements.get(source) == block:
                buffer.sketches[index] = buffer.sketches[source]
            elif math.prod(shape) > sketcher.spec.buckets:
                transpose = phase in (pb.GRAD, pb.PARAM) and target in self._transposed
                # A block is keyed by the element's index in the logical tensor, so the shards' sketches add up.
                keyed = block.sketch_block if block is not None else None
                buffer.sketches[index] = sketcher.sketch(tensor, transpose=transpose, block=keyed)
                buffer.cost.bytes_read += _nbytes_of(dtype, shape)
        return index

    def _statistics(self, key: _Key, tensor: Any, nbytes: int) -> Any:
        """The statistics of a live tensor: a row, a device handle, or a task of the offload pool.

        Off the training thread only where it is safe to read later: recorded at the
        step boundary (nothing runs between that and the wait), or a record seen in an
        earlier step unmodified until its step's end.  A record seen for the first time
        is read here, and checked at the step's end: modified in place after the hook,
        it stays on the training thread for good.  The check at the boundary also
        guards the offloaded reads: one whose tensor changed is dropped, never sent.
        """
        buffer = self._buffer
        buffer.cost.bytes_read += nbytes
        offload = self._offload
        backend = self.backend
        buffer.cost.inline += 1  # corrected below when handed off
        if offload is None or offload.broken or key in self._volatile:
            return backend.device_stats(tensor)
        at_boundary = key[0] in _BOUNDARY_PHASES
        version = None if at_boundary else backend.inplace_version(tensor)
        if at_boundary or (version is not None and key in self._settled):
            task_fn = backend.host_stats_task(tensor)
            if task_fn is None:  # an accelerator's no-sync path, or too small to be worth a hand-off
                return backend.device_stats(tensor)
            task = offload.submit(task_fn)
            buffer.tasks.append(task)
            buffer.cost.inline -= 1
            buffer.cost.offloaded += 1
            if not at_boundary:
                buffer.checks.append((key, tensor, version, task))
            return task
        if version is not None and backend.is_host(tensor):  # first sight: learn whether it may be read late
            buffer.checks.append((key, tensor, version, None))
        return backend.device_stats(tensor)

    def _copy(self, key: _Key, tensor: Any, dtype: str, nbytes: int) -> tuple[Any, HostTensor]:
        """Tensor modes: the record's private host copy and its statistics, read once from the tensor.

        Where statistics may be read late (see :meth:`_statistics`: the same
        rule and the same check at the step boundary), the copy itself is made
        off the training thread, and the statistics come from the copy there;
        otherwise the copy is made here and only its statistics leave.
        """
        buffer = self._buffer
        buffer.cost.bytes_read += nbytes
        backend = self.backend
        offload = self._offload
        usable = offload is not None and not offload.broken and key not in self._volatile and backend.is_host(tensor)
        version = backend.inplace_version(tensor) if usable else None
        at_boundary = key[0] in _BOUNDARY_PHASES
        if usable and (at_boundary or (version is not None and key in self._settled)):
            copy_fn = backend.host_copy_task(tensor, self._pool)
            if copy_fn is not None:
                host = HostTensor([], dtype, None, None, nbytes)
                task = offload.submit(functools.partial(self._copy_and_reduce, copy_fn, host))
                buffer.tasks.append(task)
                buffer.cost.offloaded += 1
                if not at_boundary:
                    buffer.checks.append((key, tensor, version, task))
                return task, host
        copy, pooled = backend.host_copy(tensor, self._pool)
        if usable and version is not None and not at_boundary:  # learn whether it could be copied late
            buffer.checks.append((key, tensor, version, None))
        return self._statistics_of_copy(tensor, copy, nbytes), HostTensor([], dtype, copy, pooled, _nbytes(copy))

    def _copy_and_reduce(self, copy_fn: Callable[[], tuple[Any, Any]], host: HostTensor) -> Any:
        """Worker thread: copy the tensor into its pooled buffer, then reduce the copy."""
        host.copy, host.buffer = copy_fn()
        reduce = self.backend.copy_stats_task(host.copy)
        if reduce is None:
            raise RuntimeError("no host statistics for this copy")  # host_copy_task promised one
        return reduce()

    def _statistics_of_copy(self, tensor: Any, copy: Any, nbytes: int) -> Any:
        """Statistics of a tensor-mode record, from its private host copy (off the thread when on the host)."""
        buffer = self._buffer
        offload = self._offload
        task_fn = None
        if offload is not None and not offload.broken and self.backend.is_host(tensor):
            task_fn = self.backend.copy_stats_task(copy)
        if task_fn is None:
            buffer.cost.inline += 1
            return self.backend.device_stats(tensor)
        task = offload.submit(task_fn)
        buffer.tasks.append(task)
        buffer.cost.offloaded += 1
        return task

    def _append(self, phase: int, target: int, call: int, slot: int, dtype: int, shape: tuple[int, ...], stats: Any) -> int | None:
        buffer = self._buffer
        if len(buffer.phase) >= MAX_RECORDS_PER_STEP:
            buffer.overflow += 1
            return None
        buffer.stats.append(stats)
        buffer.cost.bytes_captured += _ITEMSIZE.get(WIRE_TO_DTYPE.get(dtype, ""), 4) * math.prod(shape)
        buffer.phase.append(phase)
        buffer.target.append(target)
        buffer.call.append(call)
        buffer.slot.append(slot)
        buffer.dtype.append(dtype)
        buffer.shapes.append(shape)
        return len(buffer.phase) - 1

    def _hook_failed(self, phase: int, name: str, error: BaseException) -> None:
        """Counted in the health ledger (which the server sees) and warned once per kind."""
        self.health.record_failure(phase, name, self._step, error)
        if self._step_error is None:
            self._step_error = error
        self._step_incomplete.add(pb.FORWARD if phase == pb.INPUT else phase)  # inputs are forward evidence

    # -- step boundary ------------------------------------------------------

    def set_zoom(self, zoom: Any) -> None:
        """What the step starting now captures beyond the attach settings (a StepZoom of
        twinstep.runtime.capture.control; None: as attached).  Host buffers and the sketcher are made the
        first time a zoom needs them."""
        self._zoom = zoom
        if zoom is None:
            return
        if zoom.wants_tensors and self._pool is None:
            self._pool = HostBufferPool(self.backend.allocate_host, max_free_bytes=self._host_pool_bytes)
        if zoom.wants_sketches and self._sketcher is None:
            self._sketcher = self.backend.make_sketcher(SketchSpec())

    def _zoomed(self, phase: int, target: int) -> tuple[bool, bool]:
        """(full tensor, sketch) a zoom asks for this record's module (a parameter's: its owner)."""
        zoom = self._zoom
        if zoom is None:
            return False, False
        if phase in (pb.GRAD, pb.PARAM):
            if target >= len(self.parameter_infos):
                return False, False
            module = self.parameter_infos[target].module
        elif phase in (pb.FORWARD, pb.BACKWARD, pb.INPUT) and target < len(self._module_names):
            module = self._module_names[target]
        else:
            return False, False
        return zoom.tensors(module), zoom.sketch(module)

    def _full_tensor(self, phase: int, target: int) -> bool:
        """This record carries its full tensor: as attached, or asked by a zoom."""
        return self.config.capture != "stats" or (self._zoom is not None and self._zoomed(phase, target)[0])

    def set_active(self, active: bool, step: int | None = None) -> None:
        """Capture (or not) the step that starts now; ``step`` names it in failure counts.

        A step that is not captured runs with no hook attached at all (frameworks
        take their fast path for a module without hooks).
        """
        self._active = active
        if step is not None:
            self._step = step
        if active:
            self._attach_hooks()
        else:
            self._detach_hooks()

    def _attach_hooks(self) -> None:
        if self._handles or self._removed:
            return
        if self._batch_hook is not None:
            self._handles.append(self.backend.add_input_hook(*self._batch_hook))
        for module, hook in self._hooked:
            self._handles.append(self.backend.add_output_hook(module, hook))

    def _detach_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def last_phase(self) -> int | None:
        """The phase of the step's latest record so far (None before any): where a value named now belongs."""
        phase = self._buffer.phase
        return phase[-1] if phase else None

    def take_new_modules(self) -> list[pb.ModuleInfo]:
        new, self._new_modules = self._new_modules, []
        return new

    def finish_step(self, step: int, loss: Any) -> StepBatch:
        """Add loss, gradients and parameters; return the step and start a new one."""
        backend = self.backend
        # Each record on its own: one that cannot be read is counted, the rest of the step still goes out.
        placer = self._placer
        if loss is not None:
            try:
                loss_tensor = backend.loss_tensor(loss)
                if loss_tensor is not None:
                    local = self._local(loss_tensor)
                    self._add(pb.LOSS, 0, 0, 0, local, None, placer.loss(local) if placer is not None else None)
            except Exception as error:
                self._hook_failed(pb.LOSS, "", error)
        for pid, name, param in reversed(self.parameters):  # the order backward produces them
            try:
                grad = backend.grad(param)
                if grad is not None:
                    self._add_parameter(pb.GRAD, pid, name, grad, param)
            except Exception as error:
                self._hook_failed(pb.GRAD, name, error)
        for pid, name, param in self.parameters:
            try:
                self._add_parameter(pb.PARAM, pid, name, param)
            except Exception as error:
                self._hook_failed(pb.PARAM, name, error)
        if placer is not None:
            placer.new_step()
        self._settle(step, self._buffer)
        buffer, self._buffer = self._buffer, _StepBuffer()
        error, self._step_error = self._step_error, None
        incomplete, self._step_incomplete = self._step_incomplete, set()
        self.cost.add(buffer.cost)
        if error is not None and not buffer.phase:
            raise StepNotCaptured(f"every record failed; the first: {describe_error(error)}") from error
        if buffer.overflow:
            logger.warning("twinstep: step %d had more than %d records; %d not recorded", step, MAX_RECORDS_PER_STEP, buffer.overflow)
        phase = np.asarray(buffer.phase, dtype=np.int32)
        # Records go out grouped by phase, keeping the order they were produced in.
        order = np.argsort(phase, kind="stable")
        shapes = [buffer.shapes[i] for i in order]
        position = np.empty_like(order)
        position[order] = np.arange(len(order))
        return StepBatch(
            step=step,
            phase=phase[order],
            target=np.asarray(buffer.target, dtype=np.uint32)[order],
            call_index=np.asarray(buffer.call, dtype=np.uint32)[order],
            slot=np.asarray(buffer.slot, dtype=np.uint32)[order],
            dtype=np.asarray(buffer.dtype, dtype=np.int32)[order],
            ndim=np.asarray([len(s) for s in shapes], dtype=np.uint32),
            dims=[d for s in shapes for d in s],
            count=np.asarray([math.prod(s) for s in shapes], dtype=np.int64),
            device_stats=(
                backend.stats_to_host(buffer.stats)[order] if buffer.stats else np.zeros((0, len(DEVICE_FIELDS)))
            ),
            tensors=[_renumbered(host, position) for host in buffer.tensors],
            storage_array=backend.storage_array,
            release=self._release if self._pool is not None else None,
            copies_ready=backend.host_copies_fence() if buffer.tensors else None,
            incomplete=tuple(sorted(incomplete)),
            cost=buffer.cost,
            placements=sorted((int(position[i]), block) for i, block in buffer.placements.items()),
            **self._sketch_columns(buffer, position),
        )

    def _add_parameter(self, phase: int, pid: int, name: str, tensor: Any, param: Any = None) -> None:
        placer = self._placer
        if placer is None:
            self._add(phase, pid, 0, 0, tensor)
            return
        local = self._local(tensor)
        self._add(phase, pid, 0, 0, local, None, placer.parameter(phase, pid, name, tensor, local, param))

    def _settle(self, step: int, buffer: _StepBuffer) -> None:
        """Wait for the step's offloaded statistics, check what changed in place, and drop what cannot be trusted.

        Runs on the training thread at the step boundary, when every in-place
        operation of the step has completed and bumped its tensor's version.
        """
        if buffer.tasks and self._offload is not None:
            buffer.cost.boundary_seconds += self._offload.drain(buffer.tasks)
        bad: dict[int, BaseException] = {}  # id(stats object) -> why its records are dropped
        for key, tensor, version, task in buffer.checks:
            if self.backend.inplace_version(tensor) == version:
                self._settled.add(key)
                continue
            self._settled.discard(key)
            self._volatile.add(key)
            if task is not None:  # read off the thread while training code wrote it: not trustworthy
                bad[id(task)] = ModifiedInPlace()
        buffer.checks = []
        for task in buffer.tasks:
            if task.error is not None:
                bad.setdefault(id(task), task.error)
            elif not task.done:
                bad.setdefault(id(task), StatisticsLate(
                    f"statistics not ready {self.config.stats_timeout:.0f} s after the step ended"))
        buffer.tasks = []
        if bad:
            self._drop_records(step, buffer, bad)
        buffer.stats = [s.result if isinstance(s, StatsTask) else s for s in buffer.stats]

    def _drop_records(self, step: int, buffer: _StepBuffer, bad: dict[int, BaseException]) -> None:
        """Remove the records whose statistics failed, keeping every column and index consistent."""
        keep = [id(s) not in bad for s in buffer.stats]
        for index, kept in enumerate(keep):
            if not kept:
                phase, target = buffer.phase[index], buffer.target[index]
                self._hook_failed(phase, self._target_name(phase, target), bad[id(buffer.stats[index])])
        new_index = np.cumsum(keep) - 1
        for name in ("phase", "target", "call", "slot", "dtype", "shapes", "stats"):
            column = getattr(buffer, name)
            setattr(buffer, name, [v for v, kept in zip(column, keep) if kept])
        tensors = []
        for host in buffer.tensors:
            host.records = [int(new_index[i]) for i in host.records if keep[i]]
            if host.records:
                tensors.append(host)
            else:
                self._release(host)
        buffer.tensors = tensors
        buffer.copied = {}
        buffer.sketches = {int(new_index[i]): h for i, h in buffer.sketches.items() if keep[i]}
        buffer.placements = {int(new_index[i]): b for i, b in buffer.placements.items() if keep[i]}

    def _target_name(self, phase: int, target: int) -> str:
        if phase in (pb.GRAD, pb.PARAM):
            return self.parameters[target][1] if target < len(self.parameters) else str(target)
        if phase == pb.LOSS:
            return ""
        return self._module_names[target] if target < len(self._module_names) else str(target)

    def _sketch_columns(self, buffer: _StepBuffer, position: np.ndarray) -> dict[str, Any]:
        """The step's sketches in one copy per device, rows in the order records go out."""
        if self._sketcher is None or not buffer.sketches:
            return {}
        records = np.fromiter(buffer.sketches, dtype=np.int64, count=len(buffer.sketches))
        rows = self._sketcher.to_host(list(buffer.sketches.values())).astype(np.float32)
        out = position[records]
        order = np.argsort(out)
        spec = self._sketcher.spec
        return {"sketch_records": out[order].astype(np.uint32), "sketches": rows[order],
                "sketch_spec": (spec.buckets, spec.seed)}

    def _release(self, host: HostTensor) -> None:
        """Sender thread: a tensor is encoded; its pooled buffer serves a later step."""
        buffer, host.buffer, host.copy = host.buffer, None, None
        if buffer is not None and self._pool is not None:
            self._pool.give(buffer, host.nbytes)

    @property
    def pool(self) -> HostBufferPool | None:
        """The host buffers of tensor mode (None in statistics mode)."""
        return self._pool

    def discard_step(self) -> None:
        for task in self._buffer.tasks:
            task.cancelled = True
        self._buffer = _StepBuffer()
        if self._placer is not None:
            self._placer.new_step()
        self._step_error = None
        self._step_incomplete = set()

    def remove(self) -> None:
        """Detach every hook; the model is left as it was."""
        self._removed = True
        self._detach_hooks()
        self._active = False
        for task in self._buffer.tasks:
            task.cancelled = True
        if self._offload is not None:
            self._offload.close()


def _renumbered(host: HostTensor, position: np.ndarray) -> HostTensor:
    """The host tensor with its records in the order the step goes out (the first stays the one sent)."""
    host.records = sorted(int(position[i]) for i in host.records)
    return host


#: Phases recorded at the step boundary, where no training code runs until the statistics are in.
_BOUNDARY_PHASES = frozenset({pb.LOSS, pb.GRAD, pb.PARAM})

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "int16": 2, "int32": 4,
             "int64": 8, "uint8": 1, "bool": 1}


def _nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    return _ITEMSIZE.get(dtype, 4) * math.prod(shape)


def _nbytes(copy: Any) -> int:
    size = getattr(copy, "nbytes", None)
    return int(size) if isinstance(size, (int, np.integer)) else int(copy.numel() * copy.element_size())


def _recorded(seen: dict[Any, _Seen], tensor: Any, backend: CaptureBackend) -> int | None:
    """Record index of ``tensor`` if recorded this step and not modified in place since.

    The entry holds the first tensor until the step ends, so its identity (an
    id, or a buffer address) cannot be reused by another tensor meanwhile.
    """
    known = seen.get(backend.identity(tensor))
    if known is not None and known[1] is not None and known[1] == backend.inplace_version(tensor):
        return known[2]
    return None
