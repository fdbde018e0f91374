"""Where a rank sits in its training's parallel layout, and how each of its records relates to the logical tensor.

Framework-neutral: the backends read what only a framework can tell (a DTensor's placements, a
tensor-parallel layer's split, the framework's process groups); the rules that turn it into a
:class:`Block` per record live here.  The wire contract is ``MeshPlace`` (a :class:`Layout`, sent
in the Hello) and ``Placement`` (a :class:`Block`, sent per record in ``StepRecords.placements``):
a record without one is whole.

Where a layout comes from (:func:`find_layout`): the attach settings when they declare sizes
(``source`` "config"), else the backend's detection (torch: DTensor meshes, the tensor-parallel
API, DistributedDataParallel, Megatron-core; paddle: fleet's hybrid groups, DataParallel), else
none.  A run with no layout (one process, or detection off) builds no :class:`Placements` at all:
the recorder's hot path then pays one ``is None`` test per record.

Per record (:class:`Placements`, one per recorder):

- a distributed tensor (a DTensor parameter, gradient or output) is placed by its own placements;
- a module whose layer the backend or the config describes (a column-parallel Linear: its outputs
  hold a block of the last dimension; a row-parallel one: its input does) places its outputs, the
  gradients with respect to them, and its input;
- a module with no parameters (an activation, dropout) whose input holds a known block of this
  step and whose output has the input's shape passes the block on;
- with data parallelism, forward, input and backward records whose first dimension is this step's
  batch (the first dimension of the model's first input) are also a block of the global batch;
  output gradients are scaled by 1/data_size (a mean loss over a share of the batch), the loss is
  a MEAN over the replicas, and parameters and their gradients stay whole (replicas).

Most of it depends on the module and the shape only, and is cached; the per-step map of blocks by
tensor identity is cleared at every step boundary and bounded.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

from twinstep.runtime.settings import parse_tensor_parallel_split
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

BLOCK = pb.Placement.BLOCK
PARTIAL = pb.Placement.PARTIAL
MEAN = pb.Placement.MEAN

#: Entries of the per-step map of blocks by tensor identity (activations passing a block on).
MAX_TRACKED_PER_STEP = 65536


@dataclass(frozen=True)
class Layout:
    """One rank's place in its training's device mesh (``MeshPlace``); a size of 1 means no such parallelism."""

    data_rank: int = 0
    data_size: int = 1
    tensor_rank: int = 0
    tensor_size: int = 1
    pipeline_rank: int = 0
    pipeline_size: int = 1
    context_rank: int = 0
    context_size: int = 1
    expert_rank: int = 0
    expert_size: int = 1
    source: str = ""
    """How it was found: "dtensor", "torch-tp", "ddp" (a data-parallel wrapper around the model), "megatron",
    "paddle-fleet", "config", or "world" (inferred from a process group larger than the model's parallel part,
    with no wrapper seen: its ranks may not synchronise their gradients, so the server does not check replicas)."""

    @property
    def parallel(self) -> bool:
        """Some parallelism spans more than one rank."""
        return any(n > 1 for n in (self.data_size, self.tensor_size, self.pipeline_size, self.context_size,
                                   self.expert_size))

    def to_proto(self) -> pb.MeshPlace:
        return pb.MeshPlace(**dataclasses.asdict(self))

    def text(self) -> str:
        """"TP=2 x DP=4 x PP=1 (torch-tp)", for log lines."""
        parts = [f"TP={self.tensor_size}", f"DP={self.data_size}", f"PP={self.pipeline_size}"]
        parts += [f"{k}={n}" for k, n in (("CP", self.context_size), ("EP", self.expert_size)) if n > 1]
        return " x ".join(parts) + (f" ({self.source})" if self.source else "")


def layout_dict(layout: Layout | pb.MeshPlace) -> dict[str, Any]:
    """Every field by name (a MeshPlace's sizes of 0 read as 1)."""
    if isinstance(layout, Layout):
        return dataclasses.asdict(layout)
    out: dict[str, Any] = {f.name: getattr(layout, f.name) for f in dataclasses.fields(Layout)}
    for name in out:
        if name.endswith("_size"):
            out[name] = out[name] or 1
    return out


@dataclass(frozen=True)
class Block:
    """How one record relates to its logical tensor (``Placement``)."""

    kind: int
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    scale: float = 0.0
    """The logical values are scale times the record's (0: 1)."""
    split_by: str = ""
    """"tensor", "data", "tensor+data", ...: for the report."""

    def __hash__(self) -> int:  # cache keys on the hot path: hashed once
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash((self.kind, self.global_shape, self.offset, self.scale, self.split_by))
            object.__setattr__(self, "_hash", value)
            return value

    def to_proto(self, record: int) -> pb.Placement:
        return pb.Placement(record=record, kind=self.kind, global_shape=self.global_shape, offset=self.offset,
                            scale=self.scale, split_by=self.split_by)

    @property
    def sketch_block(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(global shape, offsets) that key a BLOCK's sketch by the element's index in the logical tensor."""
        return (self.global_shape, self.offset) if self.kind == BLOCK else None


#: What a backend answers for a distributed tensor whose placements say it holds the whole logical tensor.
REPLICATED = Block(BLOCK, (), (), split_by="replicated")


@dataclass(frozen=True)
class Split:
    """A module's tensor holds the block ``[offset, offset + local)`` of ``size`` along ``dim`` (negative: from the
    end).  ``size`` 0: not known up front; the block is then ``tensor_rank * local`` of ``tensor_size * local``."""

    dim: int
    size: int = 0
    offset: int = 0
    by: str = "tensor"


@dataclass(frozen=True)
class ModuleRule:
    """What one module's records hold: its outputs' split, its input's split, and whether it passes its input's
    block on to an output of the same shape (a module with no parameters)."""

    output: Split | None = None
    input: Split | None = None
    inherit: bool = False


@dataclass(frozen=True)
class DeclaredSplit:
    """A glob over module names (outputs, input) or parameter names (the parameter), from the attach settings."""

    pattern: str
    output: int | None
    input: int | None


def parse_splits(mapping: Mapping[str, str] | None) -> tuple[DeclaredSplit, ...]:
    """The setting ``tensor_parallel_split`` as rules (ValueError for a value it cannot read)."""
    return tuple(DeclaredSplit(pattern, output, input_)
                 for pattern, (output, input_) in parse_tensor_parallel_split(mapping or {}).items())


# -- where a layout comes from ---------------------------------------------------------------------


def declared_layout(chosen: Any, rank: int, world_size: int) -> Layout | None:
    """The layout the attach settings declare (``chosen``: their ``layout`` group), or None when they declare no size.

    Ranks not given are derived from the global rank in Megatron's order: tensor fastest, then
    data, then pipeline.  The data-parallel size not given is what the world leaves.
    """
    tp, dp, pp = chosen.tensor_parallel or 0, chosen.data_parallel or 0, chosen.pipeline_parallel or 0
    if not (tp or dp or pp):
        return None
    tp, pp = tp or 1, pp or 1
    dp = dp or max(world_size // (tp * pp), 1)
    tensor_rank = chosen.tensor_parallel_rank
    data_rank = chosen.data_parallel_rank
    pipeline_rank = chosen.pipeline_parallel_rank
    return Layout(data_rank=(rank // tp) % dp if data_rank is None else data_rank, data_size=dp,
                  tensor_rank=rank % tp if tensor_rank is None else tensor_rank, tensor_size=tp,
                  pipeline_rank=(rank // (tp * dp)) % pp if pipeline_rank is None else pipeline_rank,
                  pipeline_size=pp, source="config")


def find_layout(backend: Any, model: Any, *, detect: bool = True, rank: int = 0, world_size: int = 1,
                settings: Any = None) -> Layout | None:
    """This rank's layout: declared in ``settings`` (the attach settings' ``layout`` group), else found by the
    backend (unless ``detect`` or the settings' ``layout_detect`` is off), else None (every record whole)."""
    if settings is not None:
        declared = declared_layout(settings, rank, world_size)
        if declared is not None:
            return declared
        detect = detect and settings.layout_detect
    if not detect:
        return None
    try:
        found = backend.detect_layout(model)
    except Exception as error:  # never break attach over a layout; say so, and compare rank by rank
        logger.warning("twinstep: could not tell this rank's parallel layout (%s: %s); its records are sent as "
                       "whole tensors (declare the layout in the settings: tensor_parallel, data_parallel, ...)",
                       type(error).__name__, error)
        return None
    return found if found is not None and found.parallel else None


# -- placements of one recorder's records ------------------------------------------------------------


def _along(split: Split, shape: tuple[int, ...], layout: Layout) -> Block | None:
    """The block a tensor of ``shape`` holds by ``split``; None when ``shape`` cannot hold it (no such dimension,
    or a block that does not fit)."""
    if not shape or not -len(shape) <= split.dim < len(shape):
        return None
    dim = split.dim % len(shape)
    local = shape[dim]
    size, offset = (split.size, split.offset) if split.size else (local * layout.tensor_size,
                                                                   local * layout.tensor_rank)
    if offset < 0 or offset + local > size or (size == local and offset == 0):
        return None
    glob = shape[:dim] + (size,) + shape[dim + 1:]
    where = (0,) * dim + (offset,) + (0,) * (len(shape) - dim - 1)
    return Block(BLOCK, glob, where, split_by=split.by)


class Placements:
    """Each record's :class:`Block` for one recorder of a run with a layout (training thread only)."""

    def __init__(self, layout: Layout, backend: Any, splits: tuple[DeclaredSplit, ...] = ()) -> None:
        self.layout = layout
        self.backend = backend
        self.splits = splits
        self.data = layout.data_size > 1
        """Data parallel: records of the batch are blocks of the global batch (needs :attr:`batch`)."""
        self.batch: int | None = None
        """This step's batch: dim 0 of the model's first input (set by the recorder's pre-hook on the model)."""
        self._plain = backend.plain_types if backend.has_shards else None
        self._rules: dict[int, ModuleRule] = {}
        # (module, slot or -1 for the input, shape, batch) -> (the rule's block, with the batch's split, whether
        # the module passes its input's block on instead): all a plain tensor's placement needs, once per shape
        self._calls: dict[tuple, tuple[Block | None, Block | None, bool]] = {}
        self._with_batch: dict[tuple, Block | None] = {}  # (block, shape, backward) -> with the data split
        self._parameters: dict[tuple, Block | None] = {}  # (phase, parameter, shape) -> block
        self._interned: dict[Block, Block] = {}
        self._step: dict[Any, tuple[Any, Block]] = {}  # identity -> (tensor, its tensor-parallel block) this step
        self._data_scale = 1.0 / layout.data_size if self.data else 0.0

    def new_step(self) -> None:
        self._step.clear()

    # -- rules, cached per module ---------------------------------------------------------------

    def rule(self, module_id: int, name: str, module: Any) -> ModuleRule:
        rule = self._rules.get(module_id)
        if rule is None:
            rule = self._rules[module_id] = self._make_rule(name, module)
        return rule

    def _make_rule(self, name: str, module: Any) -> ModuleRule:
        found = self.backend.module_split(module, self.layout)
        output, input_ = found if found is not None else (None, None)
        for declared in self.splits:
            if fnmatch.fnmatchcase(name, declared.pattern):
                if declared.output is not None:
                    output = Split(declared.output)
                if declared.input is not None:
                    input_ = Split(declared.input)
        inherit = output is None and input_ is None and not self.backend.has_parameters(module)
        return ModuleRule(output, input_, inherit)

    def _distributed(self, tensor: Any) -> Block | None:
        """A distributed tensor's own placement (REPLICATED: whole), or None for a plain tensor."""
        plain = self._plain
        if plain is None or type(tensor) in plain:
            return None
        return self.backend.tensor_placement(tensor)

    # -- per record (hot) -------------------------------------------------------------------------

    def module_input(self, module_id: int, name: str, module: Any, tensor: Any, local: Any,
                     ) -> tuple[Block | None, Block | None, tuple[int, ...]]:
        """(its tensor-parallel block, its placement, its local shape) of a module call's first input."""
        shape = tuple(local.shape)
        own = self._distributed(tensor)
        if own is not None:
            block = None if own is REPLICATED else own
            return block, self._data_block(block, shape, False), shape
        step = self._step
        if step:
            known = step.get(self.backend.identity(local))  # held until the step ends: no reused identity
            if known is not None:
                return known[1], self._data_block(known[1], shape, False), shape
        block, placed, _ = self._call(module_id, name, module, -1, shape)
        return block, placed, shape

    def module_output(self, module_id: int, name: str, module: Any, slot: int, tensor: Any, local: Any,
                      given: tuple[Block | None, tuple[int, ...]] | None) -> tuple[Block | None, Block | None]:
        """(its tensor-parallel block, its placement) of one output; ``given``: the call's input's block and shape."""
        shape = tuple(local.shape)
        own = self._distributed(tensor)
        if own is not None:
            block = None if own is REPLICATED else own
            placed = self._data_block(block, shape, False)
        else:
            block, placed, inherits = self._call(module_id, name, module, slot, shape)
            if inherits and given is not None and given[0] is not None and given[0].kind == BLOCK and given[1] == shape:
                block = given[0]
                placed = self._data_block(block, shape, False)
        if block is not None and block.kind == BLOCK and len(self._step) < MAX_TRACKED_PER_STEP:
            self._step[self.backend.identity(local)] = (local, block)
        return block, placed

    def output_gradient(self, block: Block | None, grad: Any, local: Any) -> Block | None:
        """The placement of the gradient with respect to an output whose tensor-parallel block is ``block``."""
        own = self._distributed(grad)
        if own is not None:
            block = None if own is REPLICATED else own
        return self._data_block(block, tuple(local.shape), True)

    def parameter(self, phase: int, pid: int, name: str, tensor: Any, local: Any, param: Any = None) -> Block | None:
        """A parameter's (or its gradient's) placement: its own, or the one its layer or the config declares.

        ``param``: the parameter of a gradient, which carries the framework's marks of its split (Megatron's
        ``partition_dim``, paddle's ``split_axis``); a gradient tensor has none of its own."""
        own = self._distributed(tensor)
        if own is not None:
            return None if own is REPLICATED else own
        shape = tuple(local.shape)
        key = (phase, pid, shape)
        if key in self._parameters:
            return self._parameters[key]
        split = self.backend.parameter_split(tensor if param is None else param, self.layout)
        for declared in self.splits:
            if declared.output is not None and fnmatch.fnmatchcase(name, declared.pattern):
                split = Split(declared.output)
        block = self._intern(_along(split, shape, self.layout)) if split is not None else None
        self._parameters[key] = block
        return block

    def loss(self, local: Any) -> Block | None:
        """Data parallel: each replica's loss is one term of the mean over them."""
        if not self.data:
            return None
        shape = tuple(local.shape)
        if math.prod(shape) != 1:
            return None
        return Block(MEAN, shape, (0,) * len(shape), split_by="data")

    # -- helpers ----------------------------------------------------------------------------------

    def _call(self, module_id: int, name: str, module: Any, slot: int, shape: tuple[int, ...],
              ) -> tuple[Block | None, Block | None, bool]:
        """A plain tensor's (tensor-parallel block, placement, passes its input's block on) by its module's rule:
        computed once per (module, slot, shape, batch)."""
        key = (module_id, slot, shape, self.batch)
        found = self._calls.get(key)
        if found is None:
            rule = self.rule(module_id, name, module)
            split = rule.input if slot < 0 else rule.output
            block = self._intern(_along(split, shape, self.layout)) if split is not None else None
            found = (block, self._data_block(block, shape, False), rule.inherit and slot >= 0 and block is None)
            if len(self._calls) < MAX_TRACKED_PER_STEP:
                self._calls[key] = found
        return found

    def _intern(self, block: Block | None) -> Block | None:
        """One object per distinct block: the caches keyed by blocks then compare them by identity."""
        if block is None:
            return None
        if len(self._interned) >= MAX_TRACKED_PER_STEP:
            return block
        return self._interned.setdefault(block, block)

    def _data_block(self, block: Block | None, shape: tuple[int, ...], backward: bool) -> Block | None:
        """``block`` with the data-parallel split of the batch's dimension (and a gradient's scale) added."""
        if not self.data or not shape or shape[0] != self.batch:
            return block
        key = (block, shape, backward)
        try:
            return self._with_batch[key]
        except KeyError:
            pass
        layout = self.layout
        scale = self._data_scale if backward else 0.0
        local = shape[0]
        if block is None:
            out: Block | None = Block(BLOCK, (local * layout.data_size,) + shape[1:],
                                      (local * layout.data_rank,) + (0,) * (len(shape) - 1), scale, "data")
        elif block.kind != BLOCK or "data" in block.split_by.split("+"):
            out = dataclasses.replace(block, scale=scale) if scale and "data" in block.split_by else block
        elif block.global_shape[0] != local:  # already split along the batch's dimension (a sequence split)
            out = block
        else:
            out = Block(BLOCK, (local * layout.data_size,) + block.global_shape[1:],
                        (local * layout.data_rank,) + block.offset[1:], scale, f"{block.split_by}+data")
        out = self._intern(out)
        if len(self._with_batch) < MAX_TRACKED_PER_STEP:
            self._with_batch[key] = out
        return out


def wrapped_by(model: Any, wrapper_names: tuple[str, ...]) -> bool:
    """Whether an object of one of ``wrapper_names`` (a data-parallel wrapper's class) wraps ``model``.

    A training often attaches twinstep to the inner model of its DistributedDataParallel or
    paddle.DataParallel: the wrapper holds it as ``module`` (torch) or ``_layers`` (paddle).  One pass
    over the garbage collector's objects, once, at attach.
    """
    import gc

    for candidate in gc.get_objects():
        if type(candidate).__name__ in wrapper_names:
            held = candidate.__dict__.get("_modules", {}).get("module") if hasattr(candidate, "__dict__") else None
            if held is model or getattr(candidate, "_layers", None) is model:
                return True
    return False
