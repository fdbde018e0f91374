"""Runs of different layouts over real streams: merged per logical tensor, replicas checked, differences named.

Hand-driven streams (tests/integration/rawclient.py) send exactly the records
a tensor-parallel or data-parallel client sends; the jobs of real torch
parallel trainings are in test_parallel_layouts.py.
"""

from __future__ import annotations

import jsonschema
import numpy as np
import pytest

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, hello, manifest, step
from tests.integration.test_capture_health import Watcher
from twinstep.server.report.render import render_text, report_schema
from twinstep.server.view.model import build_view
from twinstep.server.config import config_from_dict
from twinstep.v1 import twinstep_pb2 as pb

RNG = np.random.default_rng(7)
H = RNG.normal(size=(4, 8)).astype(np.float32)        # replicated activation (norm output)
Q = RNG.normal(size=(4, 6)).astype(np.float32)        # column-parallel output, split along dim 1 under TP=2
MODULES = [(0, "norm", "RMSNorm"), (1, "q_proj", "Linear")]


def _open(address, session, run, *, baseline, rank=0, world=1, layout=None):
    message = hello(session, run, baseline=baseline, rank=rank, world_size=world)
    if layout is not None:
        message.hello.layout.CopyFrom(layout)
    stream = RawStream(address).send(message)
    assert stream.next().WhichOneof("body") == "welcome"
    return stream.send(manifest(*MODULES))


def _finish(stream, last):
    stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=last)))
    stream.close()
    stream.wait_end()


def _tp_step(number, rank, q_shard_error=0.0):
    cols = slice(3 * rank, 3 * rank + 3)
    message = step(number, [(0, H), (1, Q[:, cols] + q_shard_error)], rank=rank)
    message.step.placements.append(pb.Placement(record=1, kind=pb.Placement.BLOCK, global_shape=[4, 6],
                                                offset=[0, 3 * rank], split_by="tensor"))
    return message


def _tp_session(server, session, error_on_rank1=0.0):
    base = _open(server.address, session, "tp1", baseline=True)
    place = [pb.MeshPlace(tensor_rank=r, tensor_size=2, data_size=1, pipeline_size=1, source="torch-tp")
             for r in range(2)]
    cands = [_open(server.address, session, "tp2", baseline=False, rank=r, world=2, layout=place[r]) for r in range(2)]
    for s in range(3):
        base.send(step(s, [(0, H), (1, Q)]))
        for r, cand in enumerate(cands):
            cand.send(_tp_step(s, r, error_on_rank1 if (r == 1 and s == 2) else 0.0))
    _finish(base, 2)
    for cand in cands:
        _finish(cand, 2)
    return server.report_proto(session)


def test_tensor_parallel_shards_merge_to_the_baselines_whole_tensor(server):
    report = _tp_session(server, "tp-merge")
    assert report.status == "aligned", report
    assert report.layout_mode == "logical"
    assert "TP=2 x DP=1 x PP=1, 2 ranks, torch-tp" in report.layout_summary
    assert report.steps_compared == 3
    texts = {run.name: run.layout_text for run in report.runs}
    assert texts == {"tp1": "1 rank", "tp2": "TP=2 x DP=1 x PP=1, 2 ranks, torch-tp"}
    assert list(report.layout_differences) == [] and list(report.unmatched_candidate) == []


def test_an_error_in_one_shard_is_found_at_its_step_and_module_with_what_was_merged(server):
    watcher = Watcher(server.address, "tp-error")
    try:
        report = _tp_session(server, "tp-error", error_on_rank1=0.5)
        first = report.first_divergence
        assert (report.status, first.step, first.phase, first.module) == ("diverged", 2, "forward", "q_proj")
        assert first.rank == 0  # the one logical rank
        assert "tensor-parallel shards of ranks 0, 1 (split along dim 1)" in first.merged_from
        assert "baseline 'tp1': rank 0 alone" in first.merged_from
        # what `twinstep watch` prints live: the runs' layouts, and the divergence of merged ranks
        wait_for(lambda: any("DIVERGENCE" in line for line in watcher.lines))
        wait_for(lambda: any("tp2 (TP=2 x DP=1 x PP=1, 2 ranks, torch-tp)" in line for line in watcher.lines))
        divergence = next(line for line in watcher.lines if "DIVERGENCE" in line)
        assert "step 2 every rank merged forward 'q_proj'" in divergence
        assert "merged per logical tensor: 'tp2': tensor-parallel shards of ranks 0, 1" in divergence
    finally:
        watcher.close()
    text = render_text(report)
    assert "first divergence: step 2, every rank merged, forward of 'q_proj'" in text
    assert "    layout: TP=2 x DP=1 x PP=1, 2 ranks, torch-tp" in text
    assert "lined up: the layouts differ: each run's ranks merged per logical tensor" in text
    progress = {row["run"]: row["layout"] for row in build_view(report, None)["progress"]}
    assert progress == {"tp1": "1 rank", "tp2": "TP=2 x DP=1 x PP=1, 2 ranks, torch-tp"}


def test_a_record_whose_placement_is_unknown_is_a_named_layout_difference_not_a_divergence(server):
    # Ranks of the candidate send q_proj's shards with no placement: they hold different values.
    base = _open(server.address, "tp-unknown", "tp1", baseline=True)
    place = [pb.MeshPlace(tensor_rank=r, tensor_size=2, source="config") for r in range(2)]
    cands = [_open(server.address, "tp-unknown", "tp2", baseline=False, rank=r, world=2, layout=place[r])
             for r in range(2)]
    base.send(step(0, [(0, H), (1, Q)]))
    for r, cand in enumerate(cands):
        cand.send(step(0, [(0, H), (1, Q[:, 3 * r:3 * r + 3])], rank=r))
    _finish(base, 0)
    for cand in cands:
        _finish(cand, 0)
    report = server.report_proto("tp-unknown")
    assert report.status == "aligned" and not report.HasField("first_divergence")
    [difference] = report.layout_differences
    assert (difference.run, difference.phase, difference.name) == ("tp2", "forward", "q_proj")
    assert "placement is not known" in difference.reason


def test_a_layout_that_differs_with_nothing_declared_names_shape_differences(server):
    # 2 ranks against 1 with no layout declared: no shape mismatch is ever a divergence.
    base = _open(server.address, "undeclared", "one", baseline=True)
    cands = [_open(server.address, "undeclared", "two", baseline=False, rank=r, world=2) for r in range(2)]
    base.send(step(0, [(0, H), (1, Q)]))
    for r, cand in enumerate(cands):
        cand.send(step(0, [(0, H), (1, Q[2 * r:2 * r + 2])], rank=r))
    _finish(base, 0)
    for cand in cands:
        _finish(cand, 0)
    report = server.report_proto("undeclared")
    assert not report.HasField("first_divergence"), report.first_divergence
    assert report.layout_mode == "logical"
    [difference] = report.layout_differences
    assert difference.name == "q_proj"
    document = server.report("undeclared")
    jsonschema.validate(document, report_schema())
    assert document["layouts"]["differences"][0]["name"] == "q_proj"
    assert "not compared, because the runs' layouts differ" in render_text(report)


def test_a_replica_whose_gradient_differs_is_named_with_no_baseline_needed(server):
    params = [pb.ParameterInfo(id=0, name="q_proj.weight", module="q_proj", module_type="Linear", shape=[4, 6],
                               dtype=pb.FLOAT32)]
    streams = []
    for r in range(3):
        message = hello("replicas", "dp3", baseline=False, rank=r, world_size=3)
        message.hello.layout.CopyFrom(pb.MeshPlace(data_rank=r, data_size=3, source="ddp"))
        stream = RawStream(server.address).send(message)
        assert stream.next().WhichOneof("body") == "welcome"
        stream.send(pb.ClientMessage(manifest=pb.Manifest(parameters=params)))
        streams.append(stream)
    base = RawStream(server.address).send(hello("replicas", "dp1", baseline=True))
    assert base.next().WhichOneof("body") == "welcome"
    base.send(pb.ClientMessage(manifest=pb.Manifest(parameters=params)))
    base.send(step(0, [(0, Q)], phase=pb.GRAD))
    for r, stream in enumerate(streams):
        stream.send(step(0, [(0, Q + (1e-6 if r == 1 else 0.0))], rank=r, phase=pb.GRAD))
    _finish(base, 0)
    for stream in streams:
        _finish(stream, 0)
    report = server.report_proto("replicas")
    [mismatch] = report.replica_mismatches
    assert (mismatch.run, mismatch.name, list(mismatch.ranks), list(mismatch.agreeing)) == (
        "dp3", "q_proj.weight", [1], [0, 2])
    assert "differs from ranks 0, 2" in mismatch.text
    document = server.report("replicas")
    jsonschema.validate(document, report_schema())
    [found] = document["layouts"]["replica_mismatches"]
    assert (found["ranks"], found["agreeing"], found["statistic"]) == ([1], [0, 2], "min")
    assert document["runs"][1]["layout"]["data_size"] == 3
    text = render_text(report)
    assert "replicas that should be identical and are not" in text
    assert text.splitlines()[0].endswith("(but replicas disagree within run 'dp3': see below)")


@pytest.mark.parametrize("server", [{"config": config_from_dict({"comparison": {"layouts": "ranks"}})}], indirect=True)
def test_the_layouts_setting_forces_rank_by_rank_and_shapes_that_differ_are_named(server):
    report = _tp_session(server, "forced-ranks")
    assert report.layout_mode == "ranks" and "comparison.layouts: ranks" in report.layout_summary
    # rank 0 of each run compared: the replicated norm matches, the column shard's shape differs
    assert report.status == "aligned" and not report.HasField("first_divergence")
    [difference] = report.layout_differences
    assert difference.name == "q_proj" and "[4, 6] on 'tp1' (1 rank)" in difference.reason
    assert "[4, 3] on 'tp2' (TP=2 x DP=1 x PP=1, 2 ranks, torch-tp)" in difference.reason


def test_full_tensors_of_shards_are_assembled_and_compared_element_by_element(server):
    from tests.integration.rawclient import step_with_pieces

    def tensor_hello(run, baseline, rank=0, world=1, layout=None):
        message = hello("assembled", run, baseline=baseline, rank=rank, world_size=world)
        message.hello.capture = "tensors"
        if layout is not None:
            message.hello.layout.CopyFrom(layout)
        stream = RawStream(server.address).send(message)
        assert stream.next().WhichOneof("body") == "welcome"
        return stream.send(manifest(*MODULES))

    base = tensor_hello("tp1", True)
    cands = [tensor_hello("tp2", False, r, 2, pb.MeshPlace(tensor_rank=r, tensor_size=2, source="torch-tp"))
             for r in range(2)]
    for message in step_with_pieces(0, [(0, H), (1, Q)]):
        base.send(message)
    wrong = Q.copy()
    wrong[2, 4] += 0.05  # one element of rank 1's shard: the statistics barely move, the tensors do
    for r, cand in enumerate(cands):
        messages = step_with_pieces(0, [(0, H), (1, wrong[:, 3 * r:3 * r + 3])])
        messages[-1].step.rank = r
        messages[-1].step.placements.append(pb.Placement(record=1, kind=pb.Placement.BLOCK, global_shape=[4, 6],
                                                         offset=[0, 3 * r], split_by="tensor"))
        for message in messages:
            cand.send(message)
    _finish(base, 0)
    for cand in cands:
        _finish(cand, 0)
    report = server.report_proto("assembled")
    [steps] = report.tensor_steps
    assert (steps.candidate_run, steps.rank, steps.first_step, steps.last_step) == ("tp2", 0, 0, 0)
    assert "q_proj" in steps.modules and "norm" in steps.modules
    # the relative L2 of the assembled tensors: only the whole tensors give it
    assert steps.max_rel_l2 == pytest.approx(0.05 / np.linalg.norm(Q.astype(np.float64)), rel=1e-3)
    assert report.first_divergence.module == "q_proj"


def test_replicas_of_a_run_compared_rank_by_rank_are_checked_too(server):
    # Both runs DP=2: compared rank by rank, yet replica 1 of the candidate is checked against replica 0.
    params = [pb.ParameterInfo(id=0, name="w", module="", module_type="Linear", shape=[4, 6], dtype=pb.FLOAT32)]
    streams = {}
    for run, baseline in (("a", True), ("b", False)):
        for r in range(2):
            message = hello("same-dp", run, baseline=baseline, rank=r, world_size=2)
            message.hello.layout.CopyFrom(pb.MeshPlace(data_rank=r, data_size=2, source="ddp"))
            stream = RawStream(server.address).send(message)
            assert stream.next().WhichOneof("body") == "welcome"
            stream.send(pb.ClientMessage(manifest=pb.Manifest(parameters=params)))
            streams[run, r] = stream
    for (run, r), stream in streams.items():
        wrong = run == "b" and r == 1
        stream.send(step(0, [(0, Q * (1.5 if wrong else 1.0))], rank=r, phase=pb.GRAD))
    for stream in streams.values():
        _finish(stream, 0)
    report = server.report_proto("same-dp")
    assert report.layout_mode == "ranks"
    [mismatch] = report.replica_mismatches
    assert (mismatch.run, list(mismatch.ranks), list(mismatch.agreeing)) == ("b", [1], [0])
    assert "no majority says which is right" in mismatch.text
    # rank by rank, the baseline says which replica is wrong: rank 1 diverges
    assert (report.first_divergence.rank, report.first_divergence.phase) == (1, "grad")


def test_data_parallel_four_against_two_merges_the_global_batch_on_both_sides(server):
    # The same global batch of 8 rows: DP=4 ranks hold 2 rows each, DP=2 ranks 4 rows each; output gradients of a
    # mean loss are data_size times the whole batch's on each replica; the loss is the replicas' mean.
    rng = np.random.default_rng(11)
    acts, grads = rng.normal(size=(8, 5)).astype(np.float32), rng.normal(size=(8, 5)).astype(np.float32)
    losses = rng.normal(size=8).astype(np.float32)  # per-row losses: each replica's loss is its rows' mean

    def send_run(session, run, baseline, size, bad_row=None):
        rows = 8 // size
        streams = []
        for r in range(size):
            message = hello(session, run, baseline=baseline, rank=r, world_size=size)
            message.hello.layout.CopyFrom(pb.MeshPlace(data_rank=r, data_size=size, source="ddp"))
            stream = RawStream(server.address).send(message)
            assert stream.next().WhichOneof("body") == "welcome"
            stream.send(manifest(*MODULES))
            part = slice(r * rows, (r + 1) * rows)
            act = acts[part].copy()
            if bad_row is not None and part.start <= bad_row < part.stop:
                act[bad_row - part.start] += 1.0
            forward = step(0, [(0, act)], rank=r)
            backward = step(0, [(0, grads[part] * size)], rank=r, phase=pb.BACKWARD)
            loss = step(0, [(0, np.float32(losses[part].mean()))], rank=r, phase=pb.LOSS)
            records = forward.step
            for extra in (backward.step, loss.step):
                for field in ("phase", "target", "call_index", "slot", "dtype", "ndim", "dims"):
                    getattr(records, field).extend(getattr(extra, field))
                for name in ("count", "sum", "sum_sq", "min", "max", "abs_max", "nan_count", "inf_count", "m2"):
                    getattr(records.stats, name).extend(getattr(extra.stats, name))
            for i, scale in ((0, 0.0), (1, 1.0 / size)):
                records.placements.append(pb.Placement(record=i, kind=pb.Placement.BLOCK, global_shape=[8, 5],
                                                       offset=[r * rows, 0], scale=scale, split_by="data"))
            records.placements.append(pb.Placement(record=2, kind=pb.Placement.MEAN, split_by="data"))
            stream.send(forward)
            streams.append(stream)
        return streams

    for session, bad in (("dp4-dp2", None), ("dp4-dp2-bad", 5)):
        streams = send_run(session, "dp2", True, 2) + send_run(session, "dp4", False, 4, bad)
        for stream in streams:
            _finish(stream, 0)
    report = server.report_proto("dp4-dp2")
    assert report.layout_mode == "logical" and report.status == "aligned", render_text(report)
    assert report.steps_compared == 1
    assert not report.layout_differences and not report.unmatched_candidate and not report.unmatched_baseline
    assert [row.name for row in report.tree] == ["norm"]  # the forward of the last step compared
    # one row of one DP=4 replica off (row 5: rank 2's second row): found, on the merged global batch
    bad = server.report_proto("dp4-dp2-bad")
    first = bad.first_divergence
    assert (first.step, first.phase, first.module) == (0, "forward", "norm"), render_text(bad)
    assert "'dp4': data-parallel shards of ranks 0-3 (split along dim 0)" in first.merged_from
    assert "baseline 'dp2': data-parallel shards of ranks 0, 1 (split along dim 0)" in first.merged_from


def test_ranks_that_may_train_on_their_own_are_not_replicas_and_declared_data_parallelism_lines_up_rank_by_rank(server):
    # "world": a process group with no data-parallel wrapper seen; the other run declares nothing.  Both have two
    # ranks holding the whole model: compared rank by rank, and their differing gradients raise no alarm.
    params = [pb.ParameterInfo(id=0, name="w", module="", module_type="Linear", shape=[4, 6], dtype=pb.FLOAT32)]
    streams = []
    for run, baseline, source in (("torch", True, "ddp"), ("paddle", False, "world")):
        for r in range(2):
            message = hello("own-ranks", run, baseline=baseline, rank=r, world_size=2)
            if source == "world":
                message.hello.layout.CopyFrom(pb.MeshPlace(data_rank=r, data_size=2, source=source))
            stream = RawStream(server.address).send(message)
            assert stream.next().WhichOneof("body") == "welcome"
            stream.send(pb.ClientMessage(manifest=pb.Manifest(parameters=params)))
            stream.send(step(0, [(0, Q * (1 + r))], rank=r, phase=pb.GRAD))
            streams.append(stream)
    for stream in streams:
        _finish(stream, 0)
    report = server.report_proto("own-ranks")
    assert report.layout_mode == "ranks" and report.status == "aligned", render_text(report)
    assert list(report.replica_mismatches) == []
    texts = {run.name: run.layout_text for run in report.runs}
    assert texts["paddle"] == ("TP=1 x DP=2 x PP=1, 2 ranks, inferred from the process group, no data-parallel "
                               "wrapper seen")


def test_a_partial_sum_is_left_out_and_the_report_says_so(server):
    # Each candidate rank sends o_proj's product before its all-reduce (PARTIAL) and the reduced norm after it.
    base = _open(server.address, "partial", "tp1", baseline=True)
    place = [pb.MeshPlace(tensor_rank=r, tensor_size=2, source="torch-tp") for r in range(2)]
    cands = [_open(server.address, "partial", "tp2", baseline=False, rank=r, world=2, layout=place[r]) for r in range(2)]
    base.send(step(0, [(0, H), (1, Q)]))
    for r, cand in enumerate(cands):
        message = step(0, [(0, H), (1, Q * 0.5 + r)], rank=r)  # the halves' values are nothing like Q
        message.step.placements.append(pb.Placement(record=1, kind=pb.Placement.PARTIAL, split_by="tensor"))
        cand.send(message)
    _finish(base, 0)
    for cand in cands:
        _finish(cand, 0)
    report = server.report_proto("partial")
    assert report.status == "aligned" and not report.HasField("first_divergence"), render_text(report)
    assert ("partial sums awaiting their reduction were not compared (the records after the reduction were): "
            "run 'tp2': q_proj") in report.layout_summary
    assert "q_proj" in " ".join(report.unmatched_baseline)  # the baseline's whole q_proj had no counterpart
    assert "run 'tp2': q_proj" in render_text(report)
