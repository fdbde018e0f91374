"""Cost of merging a run's ranks per logical tensor, against comparing the same records rank by rank.

    python benchmarks/layout_merge.py [--records 500] [--ranks 2 4 8] [--repeats 50]

A step of ``--records`` records per rank, as a tensor-parallel (and data-parallel) transformer sends
it: a third column-parallel outputs (blocks along the last dimension), a third replicated
activations, a third parameters and gradients (blocks for sharded weights, replicas for norms),
with count-sketches.  Per rank count, it times, in this one process on one core:

* ``merge``: StepMerger.merge of the ranks' steps into one logical step (plan cached, as in a
  session after its first step), including the replica checks;
* ``compare``: compare_step of the merged step against a whole baseline step (what follows);
* ``ranks``: compare_step of rank 0 alone against a rank of the same layout (today's rank-by-rank
  cost of one rank's step), for the ratio.

It prints records merged per second per core (input records: ranks x records) and the ratio of a
merged step's cost (merge + compare) to rank-by-rank comparison of every rank.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from twinstep.server.compare.comparator import CompareContext, compare_step
from twinstep.server.compare.mapping import NameMapping
from twinstep.server.compare.plan import PlanCache
from twinstep.server.compare.tolerance import ToleranceConfig
from twinstep.server.ingest.step import StepData
from twinstep.server.layouts.merge import StepMerger
from twinstep.server.layouts.placement import BLOCK, RecordPlacement
from twinstep.wire import phases, stats

BUCKETS = 256


def _record_kinds(records: int) -> list[tuple[int, str, str]]:
    """(phase, name, kind) per record: kind is sharded, replicated or param."""
    out = []
    for i in range(records):
        kind = ("sharded", "replicated", "param")[i % 3]
        phase = phases.GRAD if kind == "param" else phases.FORWARD
        out.append((phase, f"layers.{i // 3}.{kind}", kind))
    return out


def _step(step: int, rank: int, ranks: int, kinds, rng: np.random.Generator, whole: bool = False) -> StepData:
    n = len(kinds)
    table = stats.empty_table(n)
    table["count"][:] = 4096 if whole else 4096 // ranks
    values = rng.normal(size=(n, 4))
    table["sum"][:], table["sum_sq"][:] = values[:, 0], np.abs(values[:, 1]) * 4096
    table["min"][:], table["max"][:] = -np.abs(values[:, 2]), np.abs(values[:, 3])
    table["abs_max"][:] = np.maximum(-table["min"], table["max"])
    table["m2"][:] = table["sum_sq"]
    placements = {}
    shapes = []
    for i, (_, _, kind) in enumerate(kinds):
        if kind == "replicated" or whole:
            shapes.append((8, 512))
            continue
        local = 512 // ranks
        shapes.append((8, local))
        placements[i] = RecordPlacement(BLOCK, (8, 512), (0, rank * local), 1.0, "tensor")
        if kind == "replicated":
            table["sum"][i] = 1.0  # replicas agree
    for i, (_, _, kind) in enumerate(kinds):
        if kind == "replicated":
            table["sum"][i], table["sum_sq"][i], table["min"][i], table["max"][i] = 1.0, 2.0, -1.0, 1.0
            table["abs_max"][i], table["m2"][i] = 1.0, 2.0
    return StepData(
        step=step, rank=rank, phase=np.asarray([k[0] for k in kinds]), names=[k[1] for k in kinds],
        types=["Linear"] * n, call_index=np.zeros(n, dtype=np.int64), slot=np.zeros(n, dtype=np.int64),
        dtypes=["float32"] * n, shapes=shapes, table=table, payloads={}, nbytes=0,
        sketch_rows={i: i for i in range(n)}, sketches=rng.normal(size=(n, BUCKETS)).astype(np.float32),
        sketch_spec=(BUCKETS, 1), placements=placements,
    )


def _context(plans: PlanCache) -> CompareContext:
    return CompareContext(base_framework="torch", cand_framework="torch", candidate_run="cand",
                          tolerances=ToleranceConfig(), mapping=NameMapping(), plans=plans)


def _timed(fn, repeats: int) -> float:
    fn()  # the first call builds the plans a session keeps
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=500)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    kinds = _record_kinds(args.records)
    print(f"{args.records} records per rank and step, {BUCKETS}-bucket sketches; one process, one core")
    print(f"{'ranks':>5} {'merge ms':>9} {'compare ms':>11} {'merged rec/s/core':>18} "
          f"{'rank-by-rank ms':>16} {'merged / rank-by-rank':>22}")
    for ranks in args.ranks:
        parts = {r: _step(0, r, ranks, kinds, rng) for r in range(ranks)}
        baseline = _step(0, 0, 1, kinds, rng, whole=True)
        merger = StepMerger("cand")
        merged = merger.merge(parts, ranks)
        assert len(merged.data) == args.records and not merged.skipped, merged.skipped[:3]
        plans = PlanCache()
        merge_s = _timed(lambda: merger.merge(parts, ranks), args.repeats)
        compare_s = _timed(lambda: compare_step(baseline, merged.data, _context(plans)), args.repeats)
        same = _step(0, 0, ranks, kinds, rng)
        rank_s = _timed(lambda: compare_step(same, parts[0], _context(plans)), args.repeats) * ranks
        rate = ranks * args.records / merge_s
        print(f"{ranks:>5} {merge_s * 1e3:>9.2f} {compare_s * 1e3:>11.2f} {rate:>18,.0f} {rank_s * 1e3:>16.2f} "
              f"{(merge_s + compare_s) / rank_s:>22.2f}")
    print("RESULT merged records/s/core at the largest rank count:", f"{rate:,.0f}")


if __name__ == "__main__":
    main()
