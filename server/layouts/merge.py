"""Merge one run's ranks' records of a step into logical records: exact statistics, summed sketches.

Records of all ranks are grouped by label (phase, name, call, slot).  Within
a group, blocks at equal offsets are replicas (one is kept, and replicas of
a gradient or parameter must agree exactly: a silent-corruption check that
needs no baseline); blocks at distinct offsets must tile the logical tensor.
From per-block count, sums, extrema and m2 the logical statistics are exact
(Chan's formula for m2; never a plain average of means); sketches, keyed by
the element's logical index on the client, add; full tensors are assembled.

The grouping is planned once per combination of the parts' layouts and
placements (what stays the same from step to step) and each step is numpy
over the concatenated statistics: see benchmarks/layout_merge.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from twinstep.server.ingest.layouts import records_key
from twinstep.server.ingest.step import StepData
from twinstep.server.layouts.placement import BLOCK, MEAN, PARTIAL, RecordPlacement, whole
from twinstep.wire import phases

#: Merge plans kept per run (most recently used): a training has a handful of layouts.
MAX_PLANS = 16
#: Relative agreement of two replicas of an activation; gradients and parameters must agree exactly.
ACTIVATION_REPLICA_RTOL = 1e-6
#: Sums of one tensor's replicas may differ by rounding (their order of summation): up to this fraction of
#: count x largest magnitude (4 float32 epsilons per element).  A corrupted element beyond it, or one that
#: moves an extremum by any amount, is found.
SUM_ROUNDING = 4 * 2.0**-23
_COUNTS = ("count", "nan_count", "inf_count")
_SUMS = ("sum", "sum_sq")
_FIELDS = _COUNTS + ("min", "max", "abs_max") + _SUMS


@dataclass(frozen=True)
class Skipped:
    """A label not merged this step, and why (``kind``: partial, incomplete, layout)."""

    phase: str
    name: str
    kind: str
    reason: str


@dataclass
class ReplicaFinding:
    """Replicas of one record that should be identical and are not."""

    phase: str
    name: str
    odd: list[int]
    agreeing: list[int]
    statistic: str
    value: float
    expected: float
    tie: bool


@dataclass
class MergedStep:
    data: StepData
    skipped: list[Skipped] = field(default_factory=list)
    replicas: list[ReplicaFinding] = field(default_factory=list)
    provenance: dict[tuple[str, str], str] = field(default_factory=dict)
    """(phase, name) -> what the logical record was merged from, in words."""


@dataclass(frozen=True)
class AssembledTensor:
    """A logical tensor assembled from its shards' payloads (the comparator reads it as a payload)."""

    array: np.ndarray
    lossy: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def decode(self, dtype: str, shape) -> np.ndarray:
        return self.array.reshape(tuple(shape))


@dataclass
class _Output:
    label: tuple[int, str, int, int]
    type: str
    dtype: str
    shape: tuple[int, ...]
    kind: int
    sources: list[tuple[int, int, RecordPlacement]]  # (part, record, placement) of distinct blocks
    replicas: list[list[tuple[int, int]]]  # per distinct block: every (part, record) holding it, kept one first
    text: str


@dataclass
class _Plan:
    outputs: list[_Output]
    skipped: list[Skipped]
    src: np.ndarray  # flat row (in the concatenated parts) of each BLOCK output's sources, grouped by output
    seg: np.ndarray  # output index of each source
    scale: np.ndarray
    starts: np.ndarray  # first source of each block output in src (reduceat's segments)
    block_outputs: np.ndarray  # output indices of BLOCK kind, ascending
    means: dict[int, tuple[np.ndarray, np.ndarray]]  # MEAN output -> (rows, scales) of its sources
    replica_pairs: np.ndarray  # [k, 3]: kept row, other row, output index
    layout_key: tuple


class StepMerger:
    """Merges the steps of one run; keeps its merge plans (bounded)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()

    def merge(self, parts: dict[int, StepData], world_size: int) -> MergedStep:
        """The logical step of ``parts`` (rank -> its step); ranks absent leave their records unmerged."""
        ranks = sorted(parts)
        datas = [parts[r] for r in ranks]
        key = (tuple(ranks), world_size, tuple(d.layout for d in datas),
               tuple(_placement_key(d) for d in datas))
        plan = self._plans.get(key)
        if plan is None:
            plan = _make_plan(ranks, datas, world_size)
            self._plans[key] = plan
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return _apply(plan, ranks, datas)


def _placement_key(data: StepData) -> tuple:
    return tuple(sorted(data.placements.items())) if data.placements else ()


def _label(data: StepData, i: int) -> tuple[int, str, int, int]:
    return (int(data.phase[i]), data.names[i], int(data.call_index[i]), int(data.slot[i]))


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _make_plan(ranks: list[int], datas: list[StepData], world_size: int) -> _Plan:
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for p, data in enumerate(datas):
        for i in range(len(data)):
            groups.setdefault(_label(data, i), []).append((p, i))
    complete = len(ranks) >= world_size
    outputs: list[_Output] = []
    skipped: list[Skipped] = []
    for label, members in groups.items():
        phase, name = phases.name(label[0]), label[1]
        placed = [(p, i, datas[p].placements.get(i) or whole(datas[p].shapes[i])) for p, i in members]
        kinds = {pl.kind for _, _, pl in placed}
        holders = _ranks_text([ranks[p] for p, _, _ in placed])
        p0, i0, first = placed[0]
        if PARTIAL in kinds:
            skipped.append(Skipped(phase, name, "partial", f"a partial sum on {holders}, awaiting its reduction: "
                                   "not merged; the record after the reduction is compared"))
            continue
        if MEAN in kinds:
            if kinds != {MEAN}:
                skipped.append(Skipped(phase, name, "layout", f"placed as a mean on some of {holders} and not on "
                                       "others"))
                continue
            outputs.append(_Output(label, datas[p0].types[i0], datas[p0].dtypes[i0], datas[p0].shapes[i0], MEAN,
                                   [(p, i, pl) for p, i, pl in placed], [], f"the mean over {holders}"))
            continue
        shapes = {pl.global_shape for _, _, pl in placed}
        if len(shapes) > 1:
            skipped.append(Skipped(phase, name, "layout", f"{holders} place it in logical tensors of different "
                                   f"shapes ({', '.join(str(list(s)) for s in sorted(shapes))})"))
            continue
        glob = first.global_shape
        blocks: dict[tuple, list[tuple[int, int, RecordPlacement]]] = {}
        for p, i, pl in placed:
            blocks.setdefault(pl.offset, []).append((p, i, pl))
        sources = [found[0] for found in blocks.values()]
        covered = sum(math.prod(datas[p].shapes[i]) for p, i, _ in sources)
        total = math.prod(glob)
        if covered != total or _overlap([(pl.offset, datas[p].shapes[i]) for p, i, pl in sources]):
            if complete:
                skipped.append(Skipped(phase, name, "layout", f"the blocks of {holders} cover {covered} of the "
                                       f"{total} elements of its logical tensor {list(glob)}"))
            else:
                skipped.append(Skipped(phase, name, "incomplete", f"shards of ranks that did not send this step "
                                       "are missing"))
            continue
        split_by = sorted({pl.split_by for _, _, pl in placed if pl.split_by})
        if len(sources) > 1:
            dims = [d for d in range(len(glob)) if len({pl.offset[d] for _, _, pl in sources}) > 1]
            by = f"{'/'.join(split_by)}-parallel " if split_by else ""
            text = f"{by}shards of {holders} (split along dim {', '.join(map(str, dims))})"
        elif len(placed) > 1:
            text = f"replicas on {holders}, one compared"
        else:
            text = f"{holders} alone"
        outputs.append(_Output(label, datas[p0].types[i0], datas[p0].dtypes[i0], glob, BLOCK, sources,
                               [[(p, i) for p, i, _ in found] for found in blocks.values()], text))
    # Pipeline stages hold different layers: rank order is stage order; keep each part's record order.
    base = np.cumsum([0] + [len(d) for d in datas])
    src, seg, scale, starts, replica_pairs = [], [], [], [], []
    block_outputs: list[int] = []
    means: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for k, out in enumerate(outputs):
        if out.kind == MEAN:
            means[k] = (np.asarray([base[p] + i for p, i, _ in out.sources], dtype=np.int64),
                        np.asarray([pl.scale for _, _, pl in out.sources], dtype=np.float64))
            continue
        block_outputs.append(k)
        starts.append(len(src))
        for p, i, pl in out.sources:
            src.append(base[p] + i)
            seg.append(k)
            scale.append(pl.scale)
        for holders in out.replicas:
            kept = base[holders[0][0]] + holders[0][1]
            replica_pairs.extend((kept, base[p] + i, k) for p, i in holders[1:])
    names = [o.label[1] for o in outputs]
    types = [o.type for o in outputs]
    phase_column = np.asarray([o.label[0] for o in outputs], dtype=np.int64)
    records = records_key(names, types, phase_column, [o.dtype for o in outputs], [o.shape for o in outputs])
    calls = np.asarray([o.label[2] for o in outputs], dtype=np.int64)
    slots = np.asarray([o.label[3] for o in outputs], dtype=np.int64)
    return _Plan(
        outputs=outputs, skipped=skipped,
        src=np.asarray(src, dtype=np.int64), seg=np.asarray(seg, dtype=np.int64),
        scale=np.asarray(scale, dtype=np.float64), starts=np.asarray(starts, dtype=np.int64),
        block_outputs=np.asarray(block_outputs, dtype=np.int64), means=means,
        replica_pairs=np.asarray(replica_pairs, dtype=np.int64).reshape(-1, 3),
        layout_key=(records, calls.tobytes(), slots.tobytes()),
    )


def _overlap(blocks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two of the blocks (offset, shape) share an element (few blocks: pairwise)."""
    for a in range(len(blocks)):
        for b in range(a + 1, len(blocks)):
            (oa, sa), (ob, sb) = blocks[a], blocks[b]
            if all(x < y + m and y < x + n for x, n, y, m in zip(oa, sa, ob, sb)):
                return True
    return False


def _concat(datas: list[StepData], name: str) -> np.ndarray:
    return np.concatenate([d.table[name] for d in datas]) if len(datas) > 1 else datas[0].table[name]


def _apply(plan: _Plan, ranks: list[int], datas: list[StepData]) -> MergedStep:
    n = len(plan.outputs)
    table = {name: _concat(datas, name) for name in ("count", "sum", "sum_sq", "min", "max", "abs_max",
                                                     "nan_count", "inf_count", "m2")}
    replicas, dropped = _check_replicas(plan, ranks, datas, table)
    out = {name: np.zeros(n, dtype=np.int64 if name in ("count", "nan_count", "inf_count") else np.float64)
           for name in table}
    if plan.src.size:
        _merge_blocks(plan, table, out)
    for k, (rows, scales) in plan.means.items():
        _merge_mean(k, rows, scales, table, out)
    keep = np.ones(n, dtype=bool)
    skipped = list(plan.skipped)
    for k in dropped:
        keep[k] = False
        o = plan.outputs[k]
        skipped.append(Skipped(phases.name(o.label[0]), o.label[1], "layout",
                               f"{o.text.replace(', one compared', '')} hold different values, though placed alike: "
                               "its placement is not known (declare it in the layout settings)"))
    first = datas[0]
    data = StepData(
        step=first.step, rank=0, phase=np.asarray([o.label[0] for o in plan.outputs], dtype=np.int64),
        names=[o.label[1] for o in plan.outputs], types=[o.type for o in plan.outputs],
        call_index=np.asarray([o.label[2] for o in plan.outputs], dtype=np.int64),
        slot=np.asarray([o.label[3] for o in plan.outputs], dtype=np.int64),
        dtypes=[o.dtype for o in plan.outputs], shapes=[o.shape for o in plan.outputs],
        table=out, payloads=_assemble(plan, datas), nbytes=sum(d.nbytes for d in datas),
        layout_key=plan.layout_key,
    )
    _merge_sketches(plan, datas, data)
    if not keep.all():
        data = select(data, keep)
    provenance = {(phases.name(o.label[0]), o.label[1]): o.text for o in plan.outputs}
    return MergedStep(data, skipped, replicas, provenance)


def _merge_blocks(plan: _Plan, table: dict[str, np.ndarray], out: dict[str, np.ndarray]) -> None:
    src, seg, s = plan.src, plan.seg, plan.scale
    n = len(plan.outputs)
    block = plan.block_outputs
    count = table["count"][src]
    bad = table["nan_count"][src] + table["inf_count"][src]
    finite = count - bad
    total = table["sum"][src] * s
    out["count"][:] += np.bincount(seg, weights=count, minlength=n).astype(np.int64)
    out["nan_count"][:] += np.bincount(seg, weights=table["nan_count"][src], minlength=n).astype(np.int64)
    out["inf_count"][:] += np.bincount(seg, weights=table["inf_count"][src], minlength=n).astype(np.int64)
    out["sum"][:] += np.bincount(seg, weights=total, minlength=n)
    out["sum_sq"][:] += np.bincount(seg, weights=table["sum_sq"][src] * s * s, minlength=n)
    lo = np.where(s >= 0, table["min"][src] * s, table["max"][src] * s)
    hi = np.where(s >= 0, table["max"][src] * s, table["min"][src] * s)
    empty = finite <= 0  # a shard with no finite element has no extrema (its 0s are placeholders)
    lo = np.where(empty, np.inf, lo)
    hi = np.where(empty, -np.inf, hi)
    starts = plan.starts
    for name, values, ufunc in (("min", lo, np.minimum), ("max", hi, np.maximum),
                                ("abs_max", np.where(empty, 0.0, table["abs_max"][src] * np.abs(s)), np.maximum)):
        reduced = ufunc.reduceat(values, starts)
        out[name][block] = np.where(np.isfinite(reduced), reduced, 0.0)
    # Chan: m2 = sum of the blocks' m2 plus each block's count times its mean's squared distance to the whole's.
    n_finite = np.bincount(seg, weights=finite, minlength=n)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_all = np.where(n_finite > 0, out["sum"] / np.maximum(n_finite, 1), 0.0)
        mean_block = np.where(finite > 0, total / np.maximum(finite, 1), 0.0)
    spread = finite * (mean_block - mean_all[seg]) ** 2
    out["m2"][:] += np.bincount(seg, weights=table["m2"][src] * s * s + spread, minlength=n)


def _merge_mean(k: int, rows: np.ndarray, s: np.ndarray, table: dict[str, np.ndarray],
                out: dict[str, np.ndarray]) -> None:
    out["count"][k] = 1
    if table["nan_count"][rows].any() or table["inf_count"][rows].any():
        out["nan_count"][k] = int(table["nan_count"][rows].any())
        out["inf_count"][k] = 1 - out["nan_count"][k]
        return
    value = float(np.mean(table["sum"][rows] * s))
    out["sum"][k], out["sum_sq"][k] = value, value * value
    out["min"][k] = out["max"][k] = value
    out["abs_max"][k] = abs(value)


def _disagree(table: dict[str, np.ndarray], a: np.ndarray, b: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Per pair of rows: the first statistic on which two replicas disagree (index into _FIELDS), or -1.

    Counts and extrema do not depend on the order of summation: a gradient's or parameter's replicas
    must match them exactly (``exact``).  Sums do: two ranks may sum the same values in another order
    (a compiled kernel on one, numpy on another), so they agree within SUM_ROUNDING of the largest sum
    their elements could round to.  Activations (not ``exact``) also agree within a relative 1e-6.
    """
    count = np.maximum(table["count"][a], 1).astype(np.float64)
    top = np.maximum(table["abs_max"][a], table["abs_max"][b])
    first = np.full(len(a), -1, dtype=np.int64)
    for f, name in enumerate(_FIELDS):
        x, y = table[name][a], table[name][b]
        with np.errstate(invalid="ignore"):
            same = (x == y) | (np.isnan(x) & np.isnan(y))
            if name not in _COUNTS:
                close = np.abs(x - y) <= ACTIVATION_REPLICA_RTOL * np.maximum(np.abs(x), np.abs(y))
                if name in _SUMS:
                    bound = SUM_ROUNDING * count * (top if name == "sum" else top * top)
                    same |= np.abs(x - y) <= bound
                same |= ~exact & close
        first = np.where((first < 0) & ~same, f, first)
    return first


def _check_replicas(plan: _Plan, ranks: list[int], datas: list[StepData],
                    table: dict[str, np.ndarray]) -> tuple[list[ReplicaFinding], list[int]]:
    """Findings for gradients and parameters whose replicas differ; outputs of other phases to drop."""
    pairs = plan.replica_pairs
    if not pairs.size:
        return [], []
    kept, other, output = pairs[:, 0], pairs[:, 1], pairs[:, 2]
    exact = np.fromiter((plan.outputs[k].label[0] in phases.PARAM_PHASES for k in output.tolist()), dtype=bool,
                        count=len(pairs))
    differs = _disagree(table, kept, other, exact) >= 0
    if not differs.any():
        return [], []
    findings: list[ReplicaFinding] = []
    dropped: list[int] = []
    starts = np.cumsum([0] + [len(d) for d in datas])
    for k in sorted(set(output[differs].tolist())):
        o = plan.outputs[k]
        if not exact[output == k][0]:
            dropped.append(k)
            continue
        for holders in o.replicas:
            if len(holders) < 2:
                continue
            rows = [starts[p] + i for p, i in holders]
            findings.append(_vote(o, [ranks[p] for p, _ in holders], rows, table))
    return [f for f in findings if f is not None], dropped


def _vote(o: _Output, holder_ranks: list[int], rows: list[int], table: dict[str, np.ndarray]) -> ReplicaFinding | None:
    """The replicas that disagree with the largest group that agrees (the lowest rank's on a tie)."""
    n = len(rows)
    a, b = np.repeat(rows, n), np.tile(rows, n)
    field = _disagree(table, np.asarray(a), np.asarray(b), np.ones(n * n, dtype=bool)).reshape(n, n)
    agree = field < 0
    support = agree.sum(axis=1)
    leader = int(np.argmax(support))  # the first (lowest listed rank) among the most agreed with
    agreeing = [holder_ranks[j] for j in range(n) if agree[leader, j]]
    odd = [holder_ranks[j] for j in range(n) if not agree[leader, j]]
    if not odd:
        return None
    tie = len(odd) >= len(agreeing)
    first_odd = holder_ranks.index(odd[0])
    statistic = _FIELDS[int(field[leader, first_odd])]
    return ReplicaFinding(phases.name(o.label[0]), o.label[1], sorted(odd), sorted(agreeing), statistic,
                          float(table[statistic][rows[first_odd]]), float(table[statistic][rows[leader]]), tie)


def _merge_sketches(plan: _Plan, datas: list[StepData], data: StepData) -> None:
    """Sum the blocks' sketches (scaled) of every block output whose sources all carry one."""
    specs = {d.sketch_spec for d in datas if d.sketches is not None}
    if len(specs) != 1 or any(d.sketches is None for d in datas) or not plan.block_outputs.size:
        return
    spec = specs.pop()
    rows_of = []
    first_row = 0
    for d in datas:  # each part's record -> its row in the stacked sketches (-1: none)
        rows = np.full(len(d), -1, dtype=np.int64)
        if d.sketch_rows:
            records = np.fromiter(d.sketch_rows.keys(), dtype=np.int64, count=len(d.sketch_rows))
            rows[records] = np.fromiter(d.sketch_rows.values(), dtype=np.int64, count=len(d.sketch_rows)) + first_row
        rows_of.append(rows)
        first_row += len(d.sketches)
    row = np.concatenate(rows_of)
    src = plan.src
    missing = np.bincount(plan.seg, weights=row[src] < 0, minlength=len(plan.outputs)) > 0
    stacked = np.concatenate([d.sketches for d in datas]) if len(datas) > 1 else datas[0].sketches
    values = stacked[np.maximum(row[src], 0)].astype(np.float64) * plan.scale[:, None]
    sums = np.add.reduceat(values, plan.starts, axis=0)
    keep = ~missing[plan.block_outputs]
    outputs = plan.block_outputs[keep]
    if outputs.size:
        data.sketch_rows = {int(k): r for r, k in enumerate(outputs.tolist())}
        data.sketches = sums[keep].astype(np.float32)
        data.sketch_spec = spec


def _assemble(plan: _Plan, datas: list[StepData]) -> dict[int, AssembledTensor]:
    if not any(d.payloads for d in datas):
        return {}
    out: dict[int, AssembledTensor] = {}
    for k in plan.block_outputs.tolist():
        o = plan.outputs[k]
        if not all(i in datas[p].payloads for p, i, _ in o.sources):
            continue
        try:
            parts = [(datas[p].payloads[i].decode(datas[p].dtypes[i], datas[p].shapes[i]), pl)
                     for p, i, pl in o.sources]
        except Exception:  # a payload that cannot be decoded is reported by the comparison of its own rank
            continue
        whole_array = np.empty(o.shape, dtype=np.result_type(*[a.dtype for a, _ in parts]))
        for array, pl in parts:
            index = tuple(slice(off, off + n) for off, n in zip(pl.offset, array.shape))
            whole_array[index] = array * pl.scale if pl.scale != 1.0 else array
        out[k] = AssembledTensor(whole_array, any(datas[p].payloads[i].lossy for p, i, _ in o.sources))
    return out


def select(data: StepData, keep: np.ndarray) -> StepData:
    """The step without the records ``keep`` leaves out (replicas that differ where they should not)."""
    index = np.flatnonzero(keep)
    renumber = {int(old): new for new, old in enumerate(index.tolist())}
    sketch_rows = {renumber[i]: r for i, r in data.sketch_rows.items() if i in renumber}
    return StepData(
        step=data.step, rank=data.rank, phase=data.phase[index], names=[data.names[i] for i in index],
        types=[data.types[i] for i in index], call_index=data.call_index[index], slot=data.slot[index],
        dtypes=[data.dtypes[i] for i in index], shapes=[data.shapes[i] for i in index],
        table={k: v[index] for k, v in data.table.items()},
        payloads={renumber[i]: t for i, t in data.payloads.items() if i in renumber}, nbytes=data.nbytes,
        sketch_rows=sketch_rows, sketches=data.sketches, sketch_spec=data.sketch_spec,
        placements={renumber[i]: p for i, p in data.placements.items() if i in renumber},
    )
