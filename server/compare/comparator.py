"""Compare one step of a candidate run with the same step of the baseline.

Records are joined on (phase, baseline name, call index, slot); statistics
metrics are computed for all joined records at once with numpy, full-tensor
metrics only where both sides sent the tensor (for a fused group: every part
and the fused module, the parts combined as the fused rule says).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from twinstep.wire import codec, phases
from twinstep.server.compare import layout, metrics, sketch
from twinstep.server.compare.join import Pair, RecordLabel, group_name
from twinstep.server.compare.lossy import ELEMENTWISE
from twinstep.server.compare.mapping import FusedRule, NameMapping
from twinstep.server.compare.plan import JoinPlan, PlanCache, build_plan, gather
from twinstep.server.compare.tolerance import METRICS, ToleranceConfig
from twinstep.server.ingest.step import StepData

if TYPE_CHECKING:
    from twinstep.server.detect.noise import NoiseBands


@dataclass
class Row:
    """One compared record; ``metric`` is its worst metric relative to tolerance."""

    phase: str
    name: str
    candidate_name: str
    type: str
    call_index: int
    slot: int
    metric: str
    value: float
    tolerance: float
    divergent: bool
    ndim: int = 0
    """Dimensions of the baseline tensor (1 for biases and norm weights)."""
    scale: float = 1.0
    """Candidate RMS over baseline RMS: a common factor across records points at scaling or clipping."""
    noise: float = -1.0
    """The baseline's own run-to-run value of ``metric`` (reference rerun); -1 when unknown."""
    dtype: str = "float32"
    """The arithmetic the tolerance was taken for (the less precise side's; see effective_dtype)."""


class Rows(Sequence[Row]):
    """The rows of one compared step, held as arrays (the join plan's static part plus the step's verdict).

    A ``Row`` object is made when first read and kept, so a row read twice is the
    same object (``rows[k] is rows[k]``; ``rows.index(row)`` finds it by identity);
    iterating makes them all.  Detectors read the arrays, so a step whose rows
    nobody reads (most of them) makes none.
    """

    __slots__ = ("_all", "_first", "_lock", "_made", "divergent", "metric", "noise", "plan", "scale", "tolerance",
                 "value")

    def __init__(self, plan: JoinPlan, metric: np.ndarray, value: np.ndarray, tolerance: np.ndarray,
                 divergent: np.ndarray, scale: np.ndarray, noise: np.ndarray | None) -> None:
        self.plan = plan
        self.metric = metric
        """Index into METRICS of each row's worst metric (the most exceeded one if any is)."""
        self.value = value
        self.tolerance = tolerance
        """Value and tolerance of that metric."""
        self.divergent = divergent
        self.scale = scale
        self.noise = noise
        """The baseline's own run-to-run value of that metric; None when no noise bands were used (-1 each)."""
        self._made: dict[int, Row] = {}
        self._all: list[Row] | None = None
        self._first: int | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.value)

    @overload
    def __getitem__(self, k: int) -> Row: ...
    @overload
    def __getitem__(self, k: slice) -> list[Row]: ...
    def __getitem__(self, k):
        if isinstance(k, slice):
            return self.materialize()[k]
        if self._all is not None:
            return self._all[k]
        n = len(self)
        k = int(k)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError("row index out of range")
        row = self._made.get(k)
        if row is None:
            with self._lock:
                row = self._made.get(k)
                if row is None:
                    row = self._made[k] = self._make(k)
        return row

    def _make(self, k: int) -> Row:
        phase, name, cand_name, type_, call, slot, ndim, dtype = self.plan.static_rows[k]
        noise = -1.0 if self.noise is None else self.noise[k].item()
        return Row(phase, name, cand_name, type_, call, slot, METRICS[int(self.metric[k])], self.value[k].item(),
                   self.tolerance[k].item(), bool(self.divergent[k]), ndim, self.scale[k].item(), noise, dtype)

    def materialize(self) -> list[Row]:
        """Every row, as a list (made once; rows already read are kept)."""
        rows = self._all
        if rows is not None:
            return rows
        with self._lock:
            if self._all is None:
                n = len(self)
                noise = [-1.0] * n if self.noise is None else self.noise.tolist()
                made = [
                    Row(phase, name, cand_name, type_, call, slot, METRICS[m], value, limit, bad, ndim, factor, band,
                        dtype)
                    for (phase, name, cand_name, type_, call, slot, ndim, dtype), m, value, limit, bad, factor, band
                    in zip(self.plan.static_rows, self.metric.tolist(), self.value.tolist(), self.tolerance.tolist(),
                           self.divergent.tolist(), self.scale.tolist(), noise)
                ]
                for k, row in self._made.items():
                    made[k] = row
                self._all = made
            return self._all

    def __iter__(self) -> Iterator[Row]:
        return iter(self.materialize())

    def __reversed__(self) -> Iterator[Row]:
        return reversed(self.materialize())

    def index(self, row: Any, start: int = 0, stop: int | None = None) -> int:
        if stop is None and start == 0:
            for k, made in self._made.items():  # the rows read one by one (first divergences): few
                if made is row:
                    return k
        return self.materialize().index(row, start, len(self) if stop is None else stop)

    def first_divergent(self) -> int:
        """Index of the first divergent row that is not a module input; -1 if none."""
        if self._first is None:
            mask = self.divergent & self.plan.judged
            k = int(mask.argmax()) if len(mask) else 0
            self._first = k if len(mask) and mask[k] else -1
        return self._first

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Rows):
            other = other.materialize()
        if isinstance(other, list):
            return self.materialize() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.materialize())


@dataclass
class StepComparison:
    step: int
    rank: int
    candidate_run: str
    rows: Sequence[Row]
    """In the baseline's record order: phase, then production order.  A list, or (from compare_step) Rows."""
    unmatched_baseline: list[RecordLabel] = field(default_factory=list)
    unmatched_candidate: list[RecordLabel] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    """metric -> value per row (aligned with ``rows``), for noise bands and culprit analysis."""
    tolerance: dict[str, np.ndarray] = field(default_factory=dict)
    """metric -> tolerance per row (aligned with ``rows``), for headroom."""
    keys: list[tuple[str, str, int, int]] = field(default_factory=list)
    """(phase, baseline name, call index, slot) per row: the record across steps."""
    layout_mismatches: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    """Pairs left out because the runs' layouts differ (server/compare/plan.py)."""
    evidence: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)
    """Each row's error on one scale, and its metric (server/detect/evidence.py); filled when first asked."""

    @property
    def first(self) -> Row | None:
        """The first divergent record; module inputs are evidence, never a divergence of their own."""
        rows = self.rows
        if isinstance(rows, Rows):
            k = rows.first_divergent()
            return rows[k] if k >= 0 else None
        return next((row for row in rows if row.divergent and row.phase != "input"), None)


@dataclass(kw_only=True)
class CompareContext:
    base_framework: str
    cand_framework: str
    candidate_run: str
    tolerances: ToleranceConfig
    mapping: NameMapping
    noise: "NoiseBands | None" = None
    """Noise bands from a reference rerun: tolerances become multiples of them."""
    tf32: bool = False
    """Either run multiplies float32 matrices in TF32: float32 records get tf32 tolerances."""
    plans: PlanCache | None = None
    """Join plans kept by whoever compares (a session holds one for all its steps); None plans every step afresh."""
    shapes_are_layout: bool = False
    """The runs' parallel layouts differ: shapes that cannot match are layout differences, not divergences."""


def compare_step(base: StepData, cand: StepData, ctx: CompareContext) -> StepComparison:
    """Compare every joined record of one step: numpy over the step's statistics, a loop only over
    records with full tensors, sketches or fused parts; what does not change between steps is planned once."""
    def build():
        return build_plan(base, cand, mapping=ctx.mapping, tolerances=ctx.tolerances,
                          base_framework=ctx.base_framework, cand_framework=ctx.cand_framework, tf32=ctx.tf32,
                          shapes_are_layout=ctx.shapes_are_layout)

    if ctx.plans is None:
        plan = build()
    else:
        base_layout, cand_layout = base.layout, cand.layout
        rest = (ctx.base_framework, ctx.cand_framework, ctx.tf32, ctx.shapes_are_layout)
        key = (base_layout, cand_layout, *rest)
        # A layout's record part is one object for every step of a stream (ingest/layouts.py): found by identity.
        alias = ((id(base_layout[0]), base_layout[1:], id(cand_layout[0]), cand_layout[1:], *rest),
                 (base_layout[0], cand_layout[0]))
        plan = ctx.plans.get(key, ctx.mapping, ctx.tolerances, build, alias)
    result = StepComparison(
        step=base.step,
        rank=base.rank,
        candidate_run=ctx.candidate_run,
        rows=[],
        unmatched_baseline=list(plan.unmatched_baseline),
        unmatched_candidate=list(plan.unmatched_candidate),
        layout_mismatches=plan.layout_mismatches,
    )
    pairs = plan.pairs
    if not pairs:
        return result

    base_table = gather(base.table, plan.gather_base)
    cand_table = gather(cand.table, plan.gather_cand)
    from_stats, rms_b, rms_c = metrics.from_statistics_and_rms(base_table, cand_table)
    with np.errstate(divide="ignore", invalid="ignore"):
        # RMS are >= 0: the ratio is >= 0, +inf or NaN (0/0), never -inf.
        scale = rms_c / rms_b
        scale[np.isnan(scale)] = 1.0
    # One [metric, pair] matrix; ``values`` holds its rows (views), in METRICS order.
    value_matrix = np.zeros((len(METRICS), len(pairs)))
    values = {m: value_matrix[c] for c, m in enumerate(METRICS)}
    for name, column in from_stats.items():
        values[name][:] = column
    values["shape"][:] = plan.shape_mismatch

    for k in plan.fused_pairs:
        base_group, cand_group = pairs[k]
        # Fused on one side: statistics merge exactly; full tensors need the parts combined.
        try:
            fused = _fused_metrics(base, cand, base_group, cand_group, plan.fused_rules[base_group[0]], ctx)
        except codec.PayloadError as exc:
            group = group_name([base.names[x] for x in base_group])
            result.errors.append(f"step {base.step} rank {base.rank} {group!r}: {exc}")
            continue
        if fused is None:
            values["shape"][k] = 1.0
        for name, value in (fused or {}).items():
            values[name][k] = value

    if base.payloads and cand.payloads:
        for k, i, j, transpose in plan.tensor_pairs:
            if i not in base.payloads or j not in cand.payloads:
                continue
            try:
                a = _decode(base, i)
                b = _decode(cand, j)
            except codec.PayloadError as exc:
                result.errors.append(f"step {base.step} rank {base.rank} {base.names[i]!r}: {exc}")
                continue
            a, b = layout.align(a, b, transpose)
            for name, value in metrics.from_tensors(a, b).items():
                values[name][k] = value

    if base.sketches is not None and cand.sketches is not None:
        if base.sketch_spec != cand.sketch_spec:
            result.errors.append(f"step {base.step} rank {base.rank}: the runs' sketches use other buckets or "
                                 f"seeds ({base.sketch_spec} vs {cand.sketch_spec}); sketches not compared")
        else:
            sketched = [
                (k, i, j) for k, i, j in plan.sketch_pairs
                if i in base.sketch_rows and j in cand.sketch_rows and not (i in base.payloads and j in cand.payloads)
            ]
            if sketched:
                _sketch_metrics(base, cand, sketched, values)

    limits = plan.limits
    bands = None
    if ctx.noise is not None:
        banded, bands = ctx.noise.banded(ctx.noise.rows(plan.keys), limits)
        limits = np.where(plan.bandable, banded, limits)
        # A lossy payload resolves element-wise differences only down to the tolerance its
        # error budget was derived from (server/compare/lossy.py): never tighter than that there.
        lossy = _lossy_pairs(base, cand, pairs)
        if lossy.any():
            elementwise = np.array([m in ELEMENTWISE for m in METRICS])[:, None] & lossy[None, :]
            limits = np.where(elementwise & plan.bandable, np.maximum(limits, plan.limits), limits)
    tolerance = {m: limits[c] for c, m in enumerate(METRICS)}
    result.values = values
    result.tolerance = tolerance
    result.keys = plan.keys

    over = value_matrix > limits
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(limits > 0, value_matrix / limits, np.where(value_matrix > 0, np.inf, 0.0))
    ratio = np.nan_to_num(ratio, nan=0.0, copy=False)
    worst = np.argmax(np.where(over, np.inf, ratio), axis=0)
    # Among exceeded metrics prefer the one exceeded most.
    worst_over = np.argmax(np.where(over, ratio, -1.0), axis=0)
    divergent = over.any(axis=0)
    chosen = np.where(divergent, worst_over, worst)
    columns = np.arange(len(pairs))
    result.rows = Rows(
        plan, chosen, value_matrix[chosen, columns], limits[chosen, columns], divergent, scale,
        bands[chosen, columns] if bands is not None else None,
    )
    return result


def _lossy_pairs(base: StepData, cand: StepData, pairs: list[Pair]) -> np.ndarray:
    """Pairs with a quantised payload on either side."""
    out = np.zeros(len(pairs), dtype=bool)
    if not (any(t.lossy for t in base.payloads.values()) or any(t.lossy for t in cand.payloads.values())):
        return out
    for k, (base_group, cand_group) in enumerate(pairs):
        out[k] = _any_lossy(base, base_group) or _any_lossy(cand, cand_group)
    return out


def _fused_metrics(
    base: StepData, cand: StepData, base_group: list[int], cand_group: list[int], rule: FusedRule, ctx: CompareContext
) -> dict[str, float] | None:
    """Full-tensor metrics of a fused group ({} without every payload); None if its shapes cannot match.

    The parts are brought into the single side's layout and combined: outputs and
    output gradients along the rule's axis; parameters along the single side's out
    axis (a Linear weight's is 0 in torch's [out, in], -1 in paddle's [in, out]; a
    bias has only axis 0), parts transposed where their layout differs.  Raises
    codec.PayloadError for a payload that does not decode.
    """
    # one: the side holding the fused module (record s); many: the side holding its parts.
    if rule.single_side == "candidate":
        one, s, one_fw = cand, cand_group[0], ctx.cand_framework
        many, parts, many_fw = base, base_group, ctx.base_framework
    else:
        one, s, one_fw = base, base_group[0], ctx.base_framework
        many, parts, many_fw = cand, cand_group, ctx.cand_framework
    if int(one.phase[s]) == phases.INPUT:
        # Each part reads the fused module's whole input, not a piece of it (inputs carry no payload).
        return {} if all(layout.shapes_compatible(one.shapes[s], many.shapes[p], False) for p in parts) else None
    # The parts must hold the same elements as the fused module (merged statistics compare them).
    if sum(many.table["count"][parts]) != one.table["count"][s]:
        return None
    if int(one.phase[s]) in phases.PARAM_PHASES:
        single = (one_fw, one.types[s], one.names[s])
        flips = [layout.needs_transpose(single, (many_fw, many.types[p], many.names[p])) for p in parts]
        axis = -1 if layout.is_in_out(*single) else 0
    else:
        flips = [False] * len(parts)
        axis = rule.axis
    shapes = [tuple(reversed(many.shapes[p])) if flip else many.shapes[p] for p, flip in zip(parts, flips)]
    combined = layout.fused_shape(shapes, axis, rule.groups)
    if combined is None or not layout.shapes_compatible(one.shapes[s], combined, False):
        # Same elements in another axis order, declared so: statistics only, as for 1:1 records.
        permuted = combined is not None and sorted(combined) == sorted(one.shapes[s]) and any(
            ctx.mapping.is_permuted(base.names[i]) for i in base_group
        )
        return {} if permuted else None
    if s not in one.payloads or any(p not in many.payloads for p in parts):
        return {}
    single_tensor = _decode(one, s)
    decoded = [_decode(many, p) for p in parts]
    fused = layout.fuse([part.T if flip else part for part, flip in zip(decoded, flips)], axis, rule.groups)
    # rel_l2 is relative to the baseline, whichever side is fused.
    a, b = (fused, single_tensor) if rule.single_side == "candidate" else (single_tensor, fused)
    return metrics.from_tensors(*layout.align(a, b, False))


def _sketch_metrics(base: StepData, cand: StepData, sketched: list[tuple[int, int, int]],
                    values: dict[str, np.ndarray]) -> None:
    """rel_l2 and cosine gap estimated from both sides' sketches, as lower confidence bounds."""
    k, record_b, record_c = (np.asarray(column, dtype=np.int64) for column in zip(*sketched))
    rb = np.fromiter((base.sketch_rows[i] for i in record_b.tolist()), dtype=np.int64, count=len(record_b))
    rc = np.fromiter((cand.sketch_rows[j] for j in record_c.tolist()), dtype=np.int64, count=len(record_c))
    estimate = sketch.from_sketches(base.sketches[rb], cand.sketches[rc],
                                    base.table["sum_sq"][record_b], cand.table["sum_sq"][record_c])
    values["sketch_rel_l2"][k] = sketch.lower_bound("rel_l2", estimate["rel_l2"], estimate["buckets"])
    values["sketch_cosine"][k] = sketch.lower_bound("cosine", estimate["cosine"], estimate["buckets"])


def _decode(data: StepData, index: int) -> np.ndarray:
    return data.payloads[index].decode(data.dtypes[index], data.shapes[index])


def _any_lossy(data: StepData, group: list[int]) -> bool:
    return any(data.payloads[x].lossy for x in group if x in data.payloads)

