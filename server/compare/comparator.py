"""Compare one step of a candidate run with the same step of the baseline.

Records are joined on (phase, baseline name, call index, slot); statistics
metrics are computed for all joined records at once with numpy, full-tensor
metrics only where both sides sent the tensor (for a fused group: every part
and the fused module, the parts combined as the fused rule says).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from twinstep import codec, stats
from twinstep.server.compare import layout, metrics, sketch
from twinstep.server.compare.lossy import ELEMENTWISE
from twinstep.server.compare.mapping import FusedRule, NameMapping
from twinstep.server.compare.records import PHASE_NAMES, StepData
from twinstep.server.compare.tolerance import METRICS, PRECISION_ORDER, ToleranceConfig, effective_dtype

if TYPE_CHECKING:
    from twinstep.server.detect.noise import NoiseBands
from twinstep.v1 import twinstep_pb2 as pb

_PARAM_PHASES = (pb.GRAD, pb.PARAM)


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


@dataclass
class StepComparison:
    step: int
    rank: int
    candidate_run: str
    rows: list[Row]  # in the baseline's record order: phase, then production order
    unmatched_baseline: list[str] = field(default_factory=list)
    unmatched_candidate: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    """metric -> value per row (aligned with ``rows``), for noise bands and culprit analysis."""
    tolerance: dict[str, np.ndarray] = field(default_factory=dict)
    """metric -> tolerance per row (aligned with ``rows``), for headroom."""

    @property
    def first(self) -> Row | None:
        """The first divergent record; module inputs are evidence, never a divergence of their own."""
        return next((row for row in self.rows if row.divergent and row.phase != "input"), None)


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


def compare_step(base: StepData, cand: StepData, ctx: CompareContext) -> StepComparison:
    pairs, fused_rules, unmatched_baseline, unmatched_candidate = _join(base, cand, ctx.mapping)
    result = StepComparison(
        step=base.step,
        rank=base.rank,
        candidate_run=ctx.candidate_run,
        rows=[],
        unmatched_baseline=_dedupe(unmatched_baseline),
        unmatched_candidate=_dedupe(unmatched_candidate),
    )
    if not pairs:
        return result

    ib = np.fromiter((group[0] for group, _ in pairs), dtype=np.int64, count=len(pairs))
    base_table = _gather(base.table, [g for g, _ in pairs])
    cand_table = _gather(cand.table, [g for _, g in pairs])
    values = metrics.from_statistics(base_table, cand_table)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.nan_to_num(stats.rms(cand_table) / stats.rms(base_table), nan=1.0, posinf=np.inf)
    for name in ("shape", "rel_l2", "cosine", "max_abs", "sketch_rel_l2", "sketch_cosine"):
        values[name] = np.zeros(len(pairs))
    sketched: list[tuple[int, int, int]] = []  # (pair, base record, candidate record)
    if base.sketches is not None and cand.sketches is not None and base.sketch_spec != cand.sketch_spec:
        result.errors.append(f"step {base.step} rank {base.rank}: the runs' sketches use other buckets or seeds "
                             f"({base.sketch_spec} vs {cand.sketch_spec}); sketches not compared")
    sketches = base.sketch_spec == cand.sketch_spec and base.sketches is not None and cand.sketches is not None

    for k, (base_group, cand_group) in enumerate(pairs):
        rule = fused_rules.get(base_group[0])
        if rule is not None:
            # Fused on one side: statistics merge exactly; full tensors need the parts combined.
            try:
                fused = _fused_metrics(base, cand, base_group, cand_group, rule, ctx)
            except codec.PayloadError as exc:
                group = _group_name([base.names[x] for x in base_group])
                result.errors.append(f"step {base.step} rank {base.rank} {group!r}: {exc}")
                continue
            if fused is None:
                values["shape"][k] = 1.0
            for name, value in (fused or {}).items():
                values[name][k] = value
            continue
        i, j = base_group[0], cand_group[0]
        transpose = int(base.phase[i]) in _PARAM_PHASES and layout.needs_transpose(
            (ctx.base_framework, base.types[i], base.names[i]), (ctx.cand_framework, cand.types[j], cand.names[j])
        )
        if not layout.shapes_compatible(base.shapes[i], cand.shapes[j], transpose):
            permuted = sorted(base.shapes[i]) == sorted(cand.shapes[j]) and ctx.mapping.is_permuted(base.names[i])
            if not permuted:
                values["shape"][k] = 1.0
            continue
        if sketches and i in base.sketch_rows and j in cand.sketch_rows and not (i in base.payloads and j in cand.payloads):
            # Both keyed by the canonical index (a transposed layout was sketched as its transpose).
            canonical = tuple(reversed(cand.shapes[j])) if transpose else cand.shapes[j]
            if canonical == base.shapes[i]:
                sketched.append((k, i, j))
        if i in base.payloads and j in cand.payloads:
            try:
                a = _decode(base, i)
                b = _decode(cand, j)
            except codec.PayloadError as exc:
                result.errors.append(f"step {base.step} rank {base.rank} {base.names[i]!r}: {exc}")
                continue
            a, b = layout.align(a, b, transpose)
            for name, value in metrics.from_tensors(a, b).items():
                values[name][k] = value

    if sketched:
        _sketch_metrics(base, cand, sketched, values)

    names = [_group_name([base.names[x] for x in group]) for group, _ in pairs]
    keys = [(PHASE_NAMES[int(base.phase[i])], names[k], int(base.call_index[i]), int(base.slot[i])) for k, i in enumerate(ib.tolist())]
    tolerance = {m: np.empty(len(pairs)) for m in METRICS}
    judged_as: list[str] = []
    # The runs' arithmetic: a float32 record computed from bfloat16 products carries their rounding.
    arithmetic = effective_dtype(*set(base.dtypes), *set(cand.dtypes), "tf32" if ctx.tf32 else "float32")
    for k, (base_group, cand_group) in enumerate(pairs):
        i = base_group[0]
        dtype = base.dtypes[i]
        if dtype in PRECISION_ORDER:
            dtype = effective_dtype(dtype, cand.dtypes[cand_group[0]], arithmetic)
        judged_as.append(dtype)
        limits = ctx.tolerances.for_record(keys[k][0], base.names[i], dtype)
        # Only noise bands tighten tolerances, so only then does a lossy payload matter here.
        lossy = ctx.noise is not None and (_any_lossy(base, base_group) or _any_lossy(cand, cand_group))
        for m in METRICS:
            limit = limits[m]
            if ctx.noise is not None and m not in ("shape", "nonfinite") and np.isfinite(limit):
                banded = ctx.noise.tolerance(keys[k], m, limit)
                # A lossy payload resolves element-wise differences only down to the tolerance
                # its error budget was derived from (server/compare/lossy.py).
                limit = max(banded, limit) if lossy and m in ELEMENTWISE else banded
            tolerance[m][k] = limit
    result.values = values
    result.tolerance = tolerance
    over = np.stack([values[m] > tolerance[m] for m in METRICS])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.stack(
            [np.where(tolerance[m] > 0, values[m] / tolerance[m], np.where(values[m] > 0, np.inf, 0.0)) for m in METRICS]
        )
    ratio = np.nan_to_num(ratio, nan=0.0)
    worst = np.argmax(np.where(over, np.inf, ratio), axis=0)
    # Among exceeded metrics prefer the one exceeded most.
    worst_over = np.argmax(np.where(over, ratio, -1.0), axis=0)
    divergent = over.any(axis=0)
    for k, (base_group, cand_group) in enumerate(pairs):
        i = base_group[0]
        m = METRICS[int(worst_over[k] if divergent[k] else worst[k])]
        band = ctx.noise.band(keys[k]) if ctx.noise is not None else None
        result.rows.append(
            Row(
                phase=keys[k][0],
                name=names[k],
                candidate_name=_group_name([cand.names[x] for x in cand_group]),
                type=base.types[i],
                call_index=int(base.call_index[i]),
                slot=int(base.slot[i]),
                metric=m,
                value=float(values[m][k]),
                tolerance=float(tolerance[m][k]),
                divergent=bool(divergent[k]),
                ndim=len(base.shapes[i]),
                scale=float(scale[k]),
                noise=band.get(m, 0.0) if band is not None else -1.0,
                dtype=judged_as[k],
            )
        )
    return result


Pair = tuple[list[int], list[int]]


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
    if int(one.phase[s]) == pb.INPUT:
        # Each part reads the fused module's whole input, not a piece of it (inputs carry no payload).
        return {} if all(layout.shapes_compatible(one.shapes[s], many.shapes[p], False) for p in parts) else None
    # The parts must hold the same elements as the fused module (merged statistics compare them).
    if sum(many.table["count"][parts]) != one.table["count"][s]:
        return None
    if int(one.phase[s]) in _PARAM_PHASES:
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


def _join(
    base: StepData, cand: StepData, mapping: NameMapping
) -> tuple[list[Pair], dict[int, FusedRule], list[str], list[str]]:
    """Match records: fused groups first, then names (after mapping); in the baseline's order.

    Fused pairs' rules are keyed by the pair's first baseline record (each is in one pair only).
    """
    def key(data: StepData, i: int, name: str) -> tuple[int, str, int, int]:
        return (int(data.phase[i]), name, int(data.call_index[i]), int(data.slot[i]))

    base_index = {key(base, i, name): i for i, name in enumerate(base.names)}
    pairs: list[Pair] = []
    fused_rules: dict[int, FusedRule] = {}
    used_base: set[int] = set()
    used_cand: set[int] = set()
    if mapping.fused:
        cand_index = {key(cand, j, name): j for j, name in enumerate(cand.names)}
        for side, data, index, used_single, used_parts in (
            ("candidate", cand, base_index, used_cand, used_base),
            ("baseline", base, cand_index, used_base, used_cand),
        ):
            for x, name in enumerate(data.names):
                module, local = _split(int(data.phase[x]), name)
                matched = mapping.fused_match(side, module)
                if not matched:
                    continue
                rule, parts = matched
                found = [index.get(key(data, x, part + local)) for part in parts]
                if any(f is None or f in used_parts for f in found):
                    continue
                used_single.add(x)
                used_parts.update(found)  # type: ignore[arg-type]
                group = [f for f in found if f is not None]
                pair = (group, [x]) if side == "candidate" else ([x], group)
                pairs.append(pair)
                fused_rules[pair[0][0]] = rule
    unmatched_candidate: list[str] = []
    for j, name in enumerate(cand.names):
        if j in used_cand:
            continue
        i = base_index.get(key(cand, j, mapping.to_baseline(name)))
        if i is None or i in used_base:
            unmatched_candidate.append(_label(int(cand.phase[j]), name))
            continue
        used_base.add(i)
        pairs.append(([i], [j]))
    pairs.sort(key=lambda pair: pair[0][0])
    unmatched_baseline = [_label(int(base.phase[i]), base.names[i]) for i in range(len(base)) if i not in used_base]
    return pairs, fused_rules, unmatched_baseline, unmatched_candidate


def _split(phase: int, name: str) -> tuple[str, str]:
    """(module path, suffix): parameters follow their module through fused rules."""
    if phase in _PARAM_PHASES and "." in name:
        module, local = name.rsplit(".", 1)
        return module, "." + local
    return name, ""


def _gather(table: dict[str, np.ndarray], groups: list[list[int]]) -> dict[str, np.ndarray]:
    """Rows of ``table`` per group, parts of a group merged (exact for concatenations)."""
    if all(len(g) == 1 for g in groups):
        index = np.fromiter((g[0] for g in groups), dtype=np.int64, count=len(groups))
        return {k: v[index] for k, v in table.items()}
    flat = np.fromiter((i for g in groups for i in g), dtype=np.int64)
    starts = np.cumsum([0] + [len(g) for g in groups[:-1]])
    out = {}
    for name, values in table.items():
        reduce = np.minimum if name == "min" else np.maximum if name in ("max", "abs_max") else np.add
        out[name] = reduce.reduceat(values[flat], starts)
    return out


def _group_name(names: list[str]) -> str:
    """"a.b.{q,k,v}.weight" for parts that differ in one path component."""
    if len(names) == 1:
        return names[0]
    split = [n.split(".") for n in names]
    if len({len(s) for s in split}) == 1:
        differing = [i for i in range(len(split[0])) if len({s[i] for s in split}) > 1]
        if len(differing) == 1:
            d = differing[0]
            parts = split[0][:d] + ["{" + ",".join(s[d] for s in split) + "}"] + split[0][d + 1 :]
            return ".".join(parts)
    return "+".join(names)


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


def _label(phase: int, name: str) -> str:
    return f"{PHASE_NAMES.get(phase, '?')}:{name or '(model)'}"


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
