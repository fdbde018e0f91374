"""Merging a run's ranks per logical tensor: exact statistics, summed sketches, replicas that must agree."""

from __future__ import annotations

import numpy as np
import pytest

from twinstep.server.ingest.step import StepData
from twinstep.server.layouts.merge import StepMerger
from twinstep.server.layouts.placement import BLOCK, MEAN, PARTIAL, RecordPlacement
from twinstep.wire import phases, stats
from twinstep.wire.sketch import SketchSpec, sketch_array

SPEC = SketchSpec()


def _step(rank: int, records: list[tuple[int, str, np.ndarray, RecordPlacement | None]], step: int = 0,
          sketch: bool = True) -> StepData:
    """A StepData of real arrays: statistics as a backend computes them, sketches keyed by the logical index."""
    table = stats.empty_table(len(records))
    sketches, rows = [], {}
    placements = {}
    for i, (phase, name, array, placement) in enumerate(records):
        row = stats.host_row(np.ascontiguousarray(array, dtype=np.float64))
        table["count"][i] = array.size
        for field, value in zip(stats.DEVICE_FIELDS, row):
            table[field][i] = value
        if placement is not None:
            placements[i] = placement
        if sketch and array.size > 1:
            block = (placement.global_shape, placement.offset) if placement is not None and placement.kind == BLOCK \
                else None
            rows[i] = len(sketches)
            sketches.append(sketch_array(array, SPEC, block=block))
    return StepData(
        step=step, rank=rank, phase=np.asarray([r[0] for r in records]), names=[r[1] for r in records],
        types=["Linear"] * len(records), call_index=np.zeros(len(records), dtype=np.int64),
        slot=np.zeros(len(records), dtype=np.int64), dtypes=["float64"] * len(records),
        shapes=[tuple(r[2].shape) for r in records], table=table, payloads={}, nbytes=0,
        sketch_rows=rows, sketches=np.stack(sketches).astype(np.float32) if sketches else None,
        sketch_spec=(SPEC.buckets, SPEC.seed), placements=placements,
    )


def _block(glob, offset, scale=1.0, by="data"):
    return RecordPlacement(BLOCK, tuple(glob), tuple(offset), scale, by)


def _close(merged: StepData, k: int, whole: np.ndarray) -> None:
    expect = stats.host_row(np.ascontiguousarray(whole, dtype=np.float64))
    for field, value in zip(stats.DEVICE_FIELDS, expect):
        assert merged.table[field][k] == pytest.approx(value, rel=1e-10, abs=1e-12), field
    assert merged.table["count"][k] == whole.size


def test_blocks_along_two_dims_merge_to_the_whole_tensors_statistics():
    rng = np.random.default_rng(0)
    whole = rng.normal(3.0, 2.0, size=(8, 6))
    parts = {}
    for rank, (r0, c0) in enumerate([(0, 0), (0, 3), (4, 0), (4, 3)]):
        parts[rank] = _step(rank, [(phases.FORWARD, "fc", whole[r0:r0 + 4, c0:c0 + 3],
                                    _block((8, 6), (r0, c0), by="tensor+data"))], sketch=False)
    merged = StepMerger("cand").merge(parts, 4)
    assert merged.data.names == ["fc"] and merged.data.shapes == [(8, 6)]
    _close(merged.data, 0, whole)
    assert "shards of ranks 0-3" in merged.provenance[("forward", "fc")]
    assert "dim 0, 1" in merged.provenance[("forward", "fc")]


def test_data_parallel_output_gradients_are_scaled_and_their_sketches_add():
    rng = np.random.default_rng(1)
    whole = rng.normal(size=(6, 40))  # the whole batch's output gradient
    parts = {r: _step(r, [(phases.BACKWARD, "fc", 2.0 * whole[3 * r:3 * r + 3], _block((6, 40), (3 * r, 0), 0.5))])
             for r in range(2)}  # each replica's is 2x (mean over half the batch)
    merged = StepMerger("cand").merge(parts, 2).data
    _close(merged, 0, whole)
    np.testing.assert_allclose(merged.sketches[merged.sketch_rows[0]], sketch_array(whole, SPEC), rtol=1e-5, atol=1e-5)


def test_replicas_are_compared_once_and_a_loss_is_the_mean_of_the_replicas():
    w = np.arange(12.0).reshape(3, 4)
    parts = {r: _step(r, [(phases.PARAM, "fc.weight", w, None),
                          (phases.LOSS, "loss", np.array(1.0 + r), RecordPlacement(MEAN, (), (), 1.0, "data"))])
             for r in range(3)}
    merged = StepMerger("cand").merge(parts, 3)
    assert merged.data.names == ["fc.weight", "loss"]
    _close(merged.data, 0, w)
    assert merged.data.table["sum"][1] == pytest.approx(2.0)
    assert merged.replicas == []
    assert merged.provenance[("param", "fc.weight")] == "replicas on ranks 0-2, one compared"


def test_a_corrupted_gradient_replica_is_named_by_the_majority():
    g = np.linspace(-1, 1, 12).reshape(3, 4)
    parts = {r: _step(r, [(phases.GRAD, "fc.weight", g + (1e-7 if r == 2 else 0.0), None)]) for r in range(3)}
    merged = StepMerger("cand").merge(parts, 3)
    assert len(merged.replicas) == 1
    found = merged.replicas[0]
    assert (found.odd, found.agreeing, found.tie) == ([2], [0, 1], False)
    assert found.statistic == "min" and found.value == pytest.approx(-1 + 1e-7) and found.expected == -1
    # the agreeing replica is the one compared
    _close(merged.data, 0, g)


def test_replicas_summed_in_another_order_agree_and_one_corrupted_element_does_not():
    rng = np.random.default_rng(3)
    g = rng.normal(0, 0.01, size=(128, 64))
    parts = {r: _step(r, [(phases.GRAD, "lm_head.weight", g, None)], sketch=False) for r in range(3)}
    # rank 1 summed its elements in another order (a compiled kernel beside numpy): the last bits of its sums move
    parts[1].table["sum"][0] += 1e-9
    parts[1].table["sum_sq"][0] *= 1 + 1e-12
    assert StepMerger("cand").merge(parts, 3).replicas == []
    corrupted = g.copy()
    corrupted[5, 7] += 1e-3  # inside the extrema: only the sums show it
    parts[2] = _step(2, [(phases.GRAD, "lm_head.weight", corrupted, None)], sketch=False)
    [found] = StepMerger("cand").merge(parts, 3).replicas
    assert (found.odd, found.agreeing, found.statistic) == ([2], [0, 1], "sum")
    assert found.value - found.expected == pytest.approx(1e-3, rel=1e-6)


def test_two_replicas_that_disagree_say_no_majority_decides():
    g = np.ones((2, 2))
    parts = {r: _step(r, [(phases.GRAD, "b", g * (1 + r), None)]) for r in range(2)}
    found = StepMerger("cand").merge(parts, 2).replicas[0]
    assert found.tie and found.odd == [1] and found.agreeing == [0]


def test_a_partial_sum_is_not_merged_and_activations_that_differ_are_a_layout_difference():
    x = np.ones((2, 4))
    parts = {r: _step(r, [(phases.FORWARD, "proj", x * (r + 1), RecordPlacement(PARTIAL, (2, 4), (0, 0), 1.0, "tensor")),
                          (phases.FORWARD, "act", x * (r + 1), None),
                          (phases.FORWARD, "norm", x, None)]) for r in range(2)}
    merged = StepMerger("cand").merge(parts, 2)
    assert merged.data.names == ["norm"]
    kinds = {s.name: s.kind for s in merged.skipped}
    assert kinds == {"proj": "partial", "act": "layout"}
    assert "placement is not known" in next(s.reason for s in merged.skipped if s.name == "act")


def test_missing_shards_leave_a_record_unmerged_and_blocks_that_do_not_tile_are_named():
    whole = np.arange(8.0).reshape(2, 4)
    only = {0: _step(0, [(phases.FORWARD, "fc", whole[:, :2], _block((2, 4), (0, 0)))])}
    merged = StepMerger("cand").merge(only, 2)
    assert merged.data.names == [] and merged.skipped[0].kind == "incomplete"
    gap = {r: _step(r, [(phases.FORWARD, "fc", whole[:, :1], _block((2, 4), (0, 2 * r)))]) for r in range(2)}
    merged = StepMerger("cand").merge(gap, 2)
    assert merged.skipped[0].kind == "layout" and "cover 4 of the 8 elements" in merged.skipped[0].reason


def test_a_merge_plan_is_reused_while_the_layout_stays():
    merger = StepMerger("cand")
    x = np.ones((2, 2))
    first = merger.merge({r: _step(r, [(phases.FORWARD, "a", x, _block((4, 2), (2 * r, 0)))], step=0) for r in range(2)}, 2)
    second = merger.merge({r: _step(r, [(phases.FORWARD, "a", x, _block((4, 2), (2 * r, 0)))], step=1) for r in range(2)}, 2)
    assert first.data.layout is second.data.layout
