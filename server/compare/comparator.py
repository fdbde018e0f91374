"""Compare one step of a candidate run with the same step of the baseline.

Records are joined on (phase, baseline name, call index, slot); statistics
metrics are computed for all joined records at once with numpy, full-tensor
metrics only where both sides sent the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twinstep import codec
from twinstep.server.compare import layout, metrics
from twinstep.server.compare.mapping import NameMapping
from twinstep.server.compare.records import PHASE_NAMES, StepData
from twinstep.server.compare.tolerance import METRICS, ToleranceConfig
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


@dataclass
class StepComparison:
    step: int
    rank: int
    candidate_run: str
    rows: list[Row]  # in the baseline's record order: phase, then production order
    unmatched_baseline: list[str] = field(default_factory=list)
    unmatched_candidate: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def first(self) -> Row | None:
        return next((row for row in self.rows if row.divergent), None)


@dataclass(kw_only=True)
class CompareContext:
    base_framework: str
    cand_framework: str
    candidate_run: str
    tolerances: ToleranceConfig
    mapping: NameMapping


def compare_step(base: StepData, cand: StepData, ctx: CompareContext) -> StepComparison:
    base_index = {
        (int(p), name, int(c), int(s)): i
        for i, (p, name, c, s) in enumerate(zip(base.phase, base.names, base.call_index, base.slot))
    }
    pairs: list[tuple[int, int]] = []
    matched_base: set[int] = set()
    unmatched_candidate: list[str] = []
    for j, (p, name, c, s) in enumerate(zip(cand.phase, cand.names, cand.call_index, cand.slot)):
        key = (int(p), ctx.mapping.to_baseline(name), int(c), int(s))
        i = base_index.get(key)
        if i is None or i in matched_base:
            unmatched_candidate.append(_label(int(p), name))
            continue
        matched_base.add(i)
        pairs.append((i, j))
    pairs.sort()
    unmatched_baseline = [_label(int(base.phase[i]), base.names[i]) for i in range(len(base)) if i not in matched_base]
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

    ib = np.fromiter((i for i, _ in pairs), dtype=np.int64, count=len(pairs))
    ic = np.fromiter((j for _, j in pairs), dtype=np.int64, count=len(pairs))
    values = metrics.from_statistics(
        {k: v[ib] for k, v in base.table.items()}, {k: v[ic] for k, v in cand.table.items()}
    )
    for name in ("shape", "rel_l2", "cosine", "max_abs"):
        values[name] = np.zeros(len(pairs))

    for k, (i, j) in enumerate(pairs):
        transpose = int(base.phase[i]) in _PARAM_PHASES and layout.needs_transpose(
            (ctx.base_framework, base.types[i], base.names[i]), (ctx.cand_framework, cand.types[j], cand.names[j])
        )
        if not layout.shapes_compatible(base.shapes[i], cand.shapes[j], transpose):
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

    tolerance = {m: np.empty(len(pairs)) for m in METRICS}
    for k, i in enumerate(ib.tolist()):
        limits = ctx.tolerances.for_record(PHASE_NAMES[int(base.phase[i])], base.names[i], base.dtypes[i])
        for m in METRICS:
            tolerance[m][k] = limits[m]
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
    for k, (i, j) in enumerate(pairs):
        m = METRICS[int(worst_over[k] if divergent[k] else worst[k])]
        result.rows.append(
            Row(
                phase=PHASE_NAMES[int(base.phase[i])],
                name=base.names[i],
                candidate_name=cand.names[j],
                type=base.types[i],
                call_index=int(base.call_index[i]),
                slot=int(base.slot[i]),
                metric=m,
                value=float(values[m][k]),
                tolerance=float(tolerance[m][k]),
                divergent=bool(divergent[k]),
            )
        )
    return result


def _decode(data: StepData, index: int) -> np.ndarray:
    payload = data.payloads[index]
    return codec.decode(payload.codec, payload.data, payload.raw_nbytes, data.dtypes[index], data.shapes[index])


def _label(phase: int, name: str) -> str:
    return f"{PHASE_NAMES.get(phase, '?')}:{name or '(model)'}"


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
