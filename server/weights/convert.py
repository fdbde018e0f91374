"""Which baseline parameters make each candidate parameter, and how: the plan of a weight sync.

Matching follows the comparator's join (twinstep.server.compare.join), so that
the parameters loaded are the ones later compared: fused rules first (a fused
candidate parameter is built from the baseline's parts; a candidate part is
cut out of a fused baseline parameter), then names after the session's
mapping (exact, prefix, regex, msprobe layer_mapping), on canonical names
(MindSpore's ``gamma``/``beta``/``embedding_table`` are torch's
``weight``/``bias``/``weight``: twinstep.wire.layouts, as in the join).  Automatic matching
is not used: it aligns the statistics of a compared step, and there is none
before the first step.  Layouts come from the framework and the owning
module's type (twinstep.wire.layouts), never from shapes, so square weights are
transposed too.

Everything is checked before anything is converted: a shape no rule explains
is a problem, and a plan with problems is refused whole, so a candidate never
loads half a model.  Conversion only moves storage elements (bfloat16 as its
bit pattern): values arrive bit for bit, in the baseline's dtype; the
candidate casts where its own dtype differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from twinstep.wire.codec import DTYPE_TO_WIRE, WIRE_TO_DTYPE, storage_dtype
from twinstep.wire.layouts import canonical_parameter_name
from twinstep.server.compare import layout
from twinstep.server.compare.mapping import NameMapping
from twinstep.v1 import twinstep_pb2 as pb

_FLOATS = frozenset({"float32", "float16", "bfloat16", "float64"})
#: Problems listed in one error message; the rest are counted.
MAX_PROBLEMS_SHOWN = 20


@dataclass(frozen=True)
class Param:
    """One parameter as a run declared it (ParameterInfo)."""

    id: int
    name: str
    module: str
    module_type: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def from_proto(cls, info: pb.ParameterInfo) -> "Param":
        return cls(info.id, info.name, info.module, info.module_type, tuple(info.shape), WIRE_TO_DTYPE[info.dtype])

    @property
    def local(self) -> str:
        """The name within its owning module (``weight``, ``bias``), which follows it through fused rules."""
        return self.name[len(self.module) + 1:] if self.module and self.name.startswith(self.module + ".") else self.name

    @property
    def canonical(self) -> str:
        """The name with torch's local name (a MindSpore LayerNorm's ``gamma`` is ``weight``): what is matched."""
        return canonical_parameter_name(self.module_type, self.name)

    @property
    def canonical_local(self) -> str:
        return canonical_parameter_name(self.module_type, self.local)


@dataclass(frozen=True)
class Load:
    """How one candidate parameter is made: copied, fused from parts, or cut out of a fused parameter."""

    target: Param
    sources: tuple[Param, ...]
    transposed: tuple[bool, ...]
    """Per source: its layout is the transpose of the target's (or, for a fused group, of the fused side's)."""
    axis: int = 0
    """Fused or split: the axis of the fused side's layout along which the parts are joined."""
    groups: int = 1
    part: int = -1
    """Split: the target's index among the parts; -1 otherwise."""
    part_sizes: tuple[int, ...] = ()
    """Split: every part's size along ``axis``, in the fused side's layout."""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.target.shape, dtype=np.int64)) * storage_dtype(self.sources[0].dtype).itemsize

    def convert(self, arrays: Mapping[int, np.ndarray]) -> np.ndarray:
        """The target's values in its own layout and shape, in the sources' storage dtype (C order)."""
        if self.part >= 0:
            fused = arrays[self.sources[0].id].reshape(self.sources[0].shape)
            value = layout.unfuse(fused, self.axis, self.groups, list(self.part_sizes))[self.part]
            return np.ascontiguousarray(value.T if self.transposed[0] else value)
        parts = [arrays[s.id].reshape(s.shape) for s in self.sources]
        parts = [p.T if flip else p for p, flip in zip(parts, self.transposed)]
        value = parts[0] if len(parts) == 1 else layout.fuse(parts, self.axis, self.groups)
        return np.ascontiguousarray(value)

    def to_proto(self) -> pb.LoadedWeight:
        return pb.LoadedWeight(parameter=self.target.id, name=self.target.name,
                               sources=[s.name for s in self.sources], transposed=list(self.transposed),
                               groups=self.groups, part=self.part, dtype=DTYPE_TO_WIRE[self.sources[0].dtype],
                               candidate_dtype=DTYPE_TO_WIRE[self.target.dtype])


@dataclass
class WeightPlan:
    loads: list[Load] = field(default_factory=list)
    no_counterpart: list[str] = field(default_factory=list)
    """Candidate parameters nothing maps to: they keep the candidate's own values."""
    unused: list[str] = field(default_factory=list)
    """Baseline parameters no candidate parameter takes."""
    problems: list[str] = field(default_factory=list)
    """Why the plan cannot be carried out; empty when it can."""

    @property
    def nbytes(self) -> int:
        return sum(load.nbytes for load in self.loads)

    def describe_problems(self) -> str:
        shown = "; ".join(self.problems[:MAX_PROBLEMS_SHOWN])
        more = len(self.problems) - MAX_PROBLEMS_SHOWN
        return shown + (f"; and {more} more" if more > 0 else "")

    def to_proto(self, baseline_run: str, baseline_framework: str) -> pb.WeightSync:
        return pb.WeightSync(baseline_run=baseline_run, baseline_framework=baseline_framework,
                             loaded=[load.to_proto() for load in self.loads], no_counterpart=self.no_counterpart,
                             unused=self.unused, bytes=self.nbytes)


def build_plan(base_framework: str, base: Sequence[Param], cand_framework: str, cand: Sequence[Param],
               mapping: NameMapping) -> WeightPlan:
    """Match every candidate parameter to baseline parameters and check that their shapes make it up."""
    plan = WeightPlan()
    base_by_name = {p.canonical: p for p in base}
    cand_by_name = {p.canonical: p for p in cand}
    loads: dict[int, Load] = {}  # by the candidate parameter's id
    claimed: set[int] = set()  # candidate parameters a fused rule spoke for (loaded, or a problem)

    def shape_problem(message: str, target: Param) -> None:
        plan.problems.append(message)
        claimed.add(target.id)

    for c in cand:  # a fused candidate parameter, made of the baseline's parts
        matched = mapping.fused_match("candidate", c.module)
        if matched is None:
            continue
        rule, modules = matched
        names = [_join(module, c.canonical_local) for module in modules]
        found = [base_by_name.get(name) for name in names]
        if not any(found):
            continue  # e.g. a fused bias where the baseline's parts have none: named matching decides
        claimed.add(c.id)
        if not all(found):
            absent = [n for n, f in zip(names, found) if f is None]
            plan.problems.append(f"{c.name}: its fused rule makes it of {', '.join(names)}, and the baseline "
                                 f"has no {', '.join(absent)}")
            continue
        parts: list[Param] = [p for p in found if p is not None]
        single = (cand_framework, c.module_type, c.name)
        flips = tuple(layout.needs_transpose(single, (base_framework, p.module_type, p.name)) for p in parts)
        axis = _out_axis(single, c.shape)
        shapes = [tuple(reversed(p.shape)) if flip else p.shape for p, flip in zip(parts, flips)]
        combined = layout.fused_shape(shapes, axis, rule.groups) if c.shape else None
        if combined != c.shape:
            shape_problem(f"{c.name} {list(c.shape)}: the baseline's parts {_shapes(parts, flips)} do not make it up "
                          f"(joined along axis {axis} in {rule.groups} interleaved group(s))", c)
            continue
        problem = _dtype_problem(c, parts)
        if problem:
            shape_problem(problem, c)
            continue
        loads[c.id] = Load(c, tuple(parts), flips, axis=axis, groups=rule.groups)

    for b in base:  # a fused baseline parameter, cut into the candidate's parts
        matched = mapping.fused_match("baseline", b.module)
        if matched is None:
            continue
        rule, modules = matched
        names = [_join(module, b.canonical_local) for module in modules]
        found = [cand_by_name.get(name) for name in names]
        if not any(found):
            continue
        present = [p for p in found if p is not None]
        claimed.update(p.id for p in present)
        if len(present) != len(found):
            absent = [n for n, f in zip(names, found) if f is None]
            plan.problems.append(f"{', '.join(p.name for p in present)}: cut out of the baseline's fused {b.name} "
                                 f"by a fused rule that needs every part, and the candidate has no {', '.join(absent)}")
            continue
        single = (base_framework, b.module_type, b.name)
        flips = tuple(layout.needs_transpose(single, (cand_framework, p.module_type, p.name)) for p in present)
        axis = _out_axis(single, b.shape)
        shapes = [tuple(reversed(p.shape)) if flip else p.shape for p, flip in zip(present, flips)]
        combined = layout.fused_shape(shapes, axis, rule.groups) if b.shape else None
        if combined != b.shape:
            plan.problems.append(f"{b.name} {list(b.shape)}: does not split into the candidate's parts "
                                 f"{_shapes(present, flips)} (along axis {axis} in {rule.groups} interleaved group(s))")
            continue
        sizes = tuple(shape[axis % len(shape)] for shape in shapes)
        for k, (p, flip) in enumerate(zip(present, flips)):
            problem = _dtype_problem(p, [b])
            if problem:
                plan.problems.append(problem)
                continue
            loads[p.id] = Load(p, (b,), (flip,), axis=axis, groups=rule.groups, part=k, part_sizes=sizes)

    for c in cand:  # every other parameter: by name, after the mapping
        if c.id in claimed or c.id in loads:
            continue
        b = base_by_name.get(canonical_parameter_name(c.module_type, mapping.to_baseline(c.name)))
        if b is None:
            plan.no_counterpart.append(c.name)
            continue
        flip = layout.needs_transpose((base_framework, b.module_type, b.name), (cand_framework, c.module_type, c.name))
        expected = tuple(reversed(b.shape)) if flip else b.shape
        if expected != c.shape:
            how = f" (transposed: {list(expected)}, {cand_framework} stores it the other way)" if flip else ""
            plan.problems.append(f"{c.name} {list(c.shape)}: the baseline's {b.name} is {list(b.shape)}{how}")
            continue
        problem = _dtype_problem(c, [b])
        if problem:
            plan.problems.append(problem)
            continue
        loads[c.id] = Load(c, (b,), (flip,))

    plan.loads = [loads[c.id] for c in cand if c.id in loads]
    taken = {s.name for load in plan.loads for s in load.sources}
    plan.unused = [b.name for b in base if b.name not in taken]
    if not plan.loads and not plan.problems and cand:
        plan.problems.append(
            f"no candidate parameter has a counterpart among the baseline's {len(base)} (candidate names such as "
            f"{', '.join(c.name for c in cand[:3])}; baseline names such as {', '.join(b.name for b in base[:3])}): "
            "give the server a mapping (docs/mapping.md), or run once without init_from_baseline and pin the "
            "automatic one with `twinstep mapping SESSION --write mapping.yaml`")
    return plan


def _join(module: str, local: str) -> str:
    return f"{module}.{local}" if module else local


def _out_axis(single: tuple[str, str, str], shape: tuple[int, ...]) -> int:
    """Where a fused parameter joins its parts: its out axis (-1 for a paddle Linear's [in, out], else 0)."""
    return -1 if layout.is_in_out(*single) and len(shape) > 1 else 0


def _shapes(params: Sequence[Param], flips: Sequence[bool]) -> str:
    return ", ".join(f"{p.name} {list(p.shape)}" + (" transposed" if flip else "") for p, flip in zip(params, flips))


def _dtype_problem(target: Param, sources: Sequence[Param]) -> str:
    """Why the sources' values cannot become the target's dtype ('' when they can)."""
    kinds = {s.dtype for s in sources}
    if len(kinds) > 1:
        return f"{target.name}: its baseline parts have different dtypes ({', '.join(sorted(kinds))})"
    (dtype,) = kinds
    if dtype != target.dtype and not (dtype in _FLOATS and target.dtype in _FLOATS):
        return f"{target.name}: a {target.dtype} parameter cannot take the baseline's {dtype} values"
    return ""
