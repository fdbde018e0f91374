"""Compare one step of a candidate run with the same step of the baseline.

Records are joined on (phase, baseline name, call index, slot); statistics
metrics are computed for all joined records at once with numpy, full-tensor
metrics only where both sides sent the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from twinstep import codec, stats
from twinstep.server.compare import layout, metrics
from twinstep.server.compare.mapping import NameMapping
from twinstep.server.compare.records import PHASE_NAMES, StepData
from twinstep.server.compare.tolerance import METRICS, ToleranceConfig

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


def compare_step(base: StepData, cand: StepData, ctx: CompareContext) -> StepComparison:
    pairs, unmatched_baseline, unmatched_candidate = _join(base, cand, ctx.mapping)
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
    for name in ("shape", "rel_l2", "cosine", "max_abs"):
        values[name] = np.zeros(len(pairs))

    for k, (base_group, cand_group) in enumerate(pairs):
        if len(base_group) > 1 or len(cand_group) > 1:
            # Fused on one side: statistics merge exactly; the parts must hold the same elements.
            if sum(base.table["count"][base_group]) != sum(cand.table["count"][cand_group]):
                values["shape"][k] = 1.0
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

    names = [_group_name([base.names[x] for x in group]) for group, _ in pairs]
    keys = [(PHASE_NAMES[int(base.phase[i])], names[k], int(base.call_index[i]), int(base.slot[i])) for k, i in enumerate(ib.tolist())]
    tolerance = {m: np.empty(len(pairs)) for m in METRICS}
    for k, i in enumerate(ib.tolist()):
        limits = ctx.tolerances.for_record(keys[k][0], base.names[i], base.dtypes[i])
        for m in METRICS:
            limit = limits[m]
            if ctx.noise is not None and m not in ("shape", "nonfinite") and np.isfinite(limit):
                limit = ctx.noise.tolerance(keys[k], m, limit)
            tolerance[m][k] = limit
    result.values = values
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
            )
        )
    return result


Pair = tuple[list[int], list[int]]


def _join(base: StepData, cand: StepData, mapping: NameMapping) -> tuple[list[Pair], list[str], list[str]]:
    """Match records: fused groups first, then names (after mapping); in the baseline's order."""
    def key(data: StepData, i: int, name: str) -> tuple[int, str, int, int]:
        return (int(data.phase[i]), name, int(data.call_index[i]), int(data.slot[i]))

    base_index = {key(base, i, name): i for i, name in enumerate(base.names)}
    pairs: list[Pair] = []
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
                parts = mapping.fused_parts(side, module)
                if not parts:
                    continue
                found = [index.get(key(data, x, part + local)) for part in parts]
                if any(f is None or f in used_parts for f in found):
                    continue
                used_single.add(x)
                used_parts.update(found)  # type: ignore[arg-type]
                group = [f for f in found if f is not None]
                pairs.append((group, [x]) if side == "candidate" else ([x], group))
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
    return pairs, unmatched_baseline, unmatched_candidate


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


def _decode(data: StepData, index: int) -> np.ndarray:
    payload = data.payloads[index]
    return codec.decode(payload.codec, payload.data, payload.raw_nbytes, data.dtypes[index], data.shapes[index])


def _label(phase: int, name: str) -> str:
    return f"{PHASE_NAMES.get(phase, '?')}:{name or '(model)'}"


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
