"""Named records (Monitor.record): placed in the step where they were recorded, read, judged and described."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit_tests.test_recorder import toy
from twinstep.wire import phases
from twinstep.runtime.capture import CaptureConfig, Recorder, backend_for
from twinstep.runtime.capture.named import NamedRecords
from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.compare.tolerance import ToleranceConfig
from twinstep.server.detect.first_divergence import FirstDivergenceTracker
from twinstep.server.detect.stage import describe, record_kind
from twinstep.server.errors import InputError
from twinstep.server.ingest.decode import decode_step
from twinstep.server.ingest.manifest import Manifest
from twinstep.wire.stats import DEVICE_FIELDS
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.runtime.values import statistics_row, to_host


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_records_sit_where_they_were_recorded_and_every_tensor_keeps_its_row(framework):
    model, _ = toy(framework)
    backend = backend_for(model)
    recorder = Recorder(model, backend, CaptureConfig(capture="tensors", stats_workers=0))
    named = NamedRecords(max_value_bytes=64)
    if framework == "torch":
        import torch
        x = torch.randn(3, 4)
    else:
        import paddle
        x = paddle.randn([3, 4])
    ids = np.arange(6).reshape(2, 3)
    named.add("input_ids", ids, recorder.last_phase())  # before the model's first call
    loss = model(x).square().mean()
    named.add("logit_scale", 2.0, recorder.last_phase())  # after the forward
    loss.backward()
    named.add("lr", 1e-3, recorder.last_phase())  # after the backward
    named.add("lr", 5e-4, recorder.last_phase())  # the same name again: its second call
    named.add("big", np.zeros(100), recorder.last_phase())  # over max_value_bytes: statistics only
    before = recorder.finish_step(0, loss)
    tensors_before = {id(h): h.copy for h in before.tensors}
    batch = named.merge_into(before, backend)

    order = [phases.describe(int(p)) for p in batch.phase]
    assert order[0] == "record"
    first_loss = order.index("loss")
    assert order[first_loss + 1] == "record" and order[first_loss + 2] == "backward"
    last_grad = max(i for i, p in enumerate(order) if p == "grad")
    assert order[last_grad + 1: last_grad + 4] == ["record"] * 3 and order[last_grad + 4] == "param"
    assert batch.record_names == ["input_ids", "logit_scale", "lr", "big"]
    records = [i for i, p in enumerate(order) if p == "record"]
    assert [int(batch.target[i]) for i in records] == [0, 1, 2, 2, 3]
    assert [int(batch.call_index[i]) for i in records] == [0, 0, 0, 1, 0]
    assert batch.dims_of(records[0]) == (2, 3) and batch.dims_of(records[2]) == ()
    assert tuple(batch.device_stats[records[0]]) == statistics_row(to_host(ids))
    assert len(batch.device_stats[0]) == len(DEVICE_FIELDS) and batch.count[records[4]] == 100
    # Every full tensor still points at a row of its own dtype and shape (the module rows moved down).
    sent = {i for host in batch.tensors for i in host.records}
    assert set(records[:4]) <= sent and records[4] not in sent
    for host in batch.tensors:
        for i in host.records:
            shape = tuple(np.shape(batch.storage_array(host.copy)))
            assert batch.dims_of(i) == shape, (order[i], host.dtype)
            if id(host) in tensors_before:
                assert order[i] != "record"
    assert len(batch.phase) == len(batch.target) == len(batch.ndim) == len(batch.count) == len(batch.device_stats)


def _step(names, phase, target, ndim=0, dims=()) -> pb.StepRecords:
    n = len(phase)
    return pb.StepRecords(step=0, phase=phase, target=target, call_index=[0] * n, slot=[0] * n,
                          dtype=[pb.INT64] * n, ndim=[ndim] * n, dims=list(dims) * n, record_names=names,
                          stats=pb.Statistics(count=[1] * n, sum=[0.0] * n, sum_sq=[0.0] * n, min=[0.0] * n,
                                              max=[0.0] * n, abs_max=[0.0] * n, nan_count=[0] * n,
                                              inf_count=[0] * n, m2=[0.0] * n))


def test_the_server_reads_record_names_from_the_step_and_refuses_ones_that_do_not_add_up():
    data = decode_step(_step(["input_ids", "lr"], [pb.RECORD, pb.RECORD], [1, 0]), Manifest())
    assert data.names == ["lr", "input_ids"] and data.types == ["record", "record"]
    with pytest.raises(InputError, match="names record 2, but the step names 2"):
        decode_step(_step(["a", "b"], [pb.RECORD], [2]), Manifest())
    with pytest.raises(InputError, match="lists a name twice"):
        decode_step(_step(["a", "a"], [pb.RECORD], [0]), Manifest())
    with pytest.raises(InputError, match="1 to 256 characters"):
        decode_step(_step([""], [pb.RECORD], [0]), Manifest())


def test_integer_records_are_exact_float_ones_judged_like_a_loss_and_both_configurable_by_name():
    config = ToleranceConfig.from_dict({
        "record": {"rel_l2": 1e-3},
        "overrides": [{"pattern": "lr*", "phase": "record", "rel_l2": 0.0, "max_abs": 0.0},
                      {"pattern": "labels", "phase": "record", "max_abs": 1.0}],
    })
    ids = config.for_record("record", "input_ids", "int64")
    assert ids["max_abs"] == ids["rms"] == ids["mean"] == ids["rel_l2"] == 0.0 and ids["cosine"] == float("inf")
    assert config.for_record("record", "labels", "int64")["max_abs"] == 1.0
    assert config.for_record("record", "grad_norm", "float32")["rel_l2"] == 1e-3
    assert config.for_record("record", "lr", "float64")["rel_l2"] == 0.0
    assert config.for_record("record", "loss", "bfloat16")["rms"] == pytest.approx(5e-3)  # as a bf16 loss
    with pytest.raises(ValueError, match="recor.*is not one of"):
        ToleranceConfig.from_dict({"overrides": [{"pattern": "x", "phase": "recor"}]})


def _row(phase: str, name: str, divergent: bool) -> Row:
    return Row(phase=phase, name=name, candidate_name=name, type="record" if phase == "record" else "Linear",
               call_index=0, slot=0, metric="rms", value=1.0 if divergent else 0.0, tolerance=1e-5,
               divergent=divergent)


def test_a_record_diverging_in_a_step_comes_before_the_parameters_it_updates_on_any_rank():
    layout = [("record", "input_ids"), ("forward", "fc"), ("loss", "loss"), ("backward", "fc"), ("grad", "fc.weight"),
              ("record", "lr"), ("param", "fc.weight")]

    def comparison(rank: int, bad: set[tuple[str, str]]) -> StepComparison:
        return StepComparison(step=3, rank=rank, candidate_run="cand",
                              rows=[_row(p, n, (p, n) in bad) for p, n in layout])

    param, lr = ("param", "fc.weight"), ("record", "lr")
    tracker = FirstDivergenceTracker()
    tracker.add(comparison(0, {param}))  # rank 0: only its parameters show it
    tracker.add(comparison(1, {lr, param}))  # rank 1: the learning rate, recorded after the backward
    found = tracker.declare({"cand": 3})[0]
    assert (found.row.name, found.comparison.rank) == ("lr", 1)
    assert describe(found.row, found.comparison).startswith("learning rate schedule: the named value 'lr' differs "
                                                            "at step 3")
    data = FirstDivergenceTracker()
    data.add(comparison(0, {("forward", "fc")}))
    data.add(comparison(1, {("record", "input_ids"), ("forward", "fc")}))  # recorded before the first module
    assert data.declare({"cand": 3})[0].row.name == "input_ids"


@pytest.mark.parametrize("name, kind", [("lr", "learning rate schedule"), ("learning_rate", "learning rate schedule"),
                                        ("input_ids", "data pipeline"), ("labels", "data pipeline"),
                                        ("attention_mask", "data pipeline"), ("grad_norm", "gradient norm"),
                                        ("train/loss", "loss value"), ("tokens_per_second", "data pipeline"),
                                        ("temperature", None)])
def test_the_stage_says_what_the_name_says_the_value_is(name, kind):
    found = record_kind(name)
    assert (found[0] if found else None) == kind


def test_rows_of_a_batch_in_another_order_are_caught_though_every_statistic_is_equal():
    import torch

    import twinstep
    from twinstep.server import serve

    server = serve(port=0)
    try:
        for run, baseline in (("torch", True), ("port", False)):
            torch.manual_seed(0)
            model = torch.nn.Embedding(10, 4)
            with twinstep.attach(model, session="order", run=run, baseline=baseline, server=server.address) as mon:
                for step in range(3):
                    ids = torch.arange(8).reshape(2, 4)
                    if not baseline and step == 1:
                        ids = ids.flip(0)  # the same tokens, the rows swapped: equal mean, RMS and extrema
                    mon.record("input_ids", ids)
                    model(ids).sum().backward()
                    mon.step()
                    model.zero_grad()
        report = server.report_proto("order")
        first = report.first_divergence
        assert (first.step, first.phase, first.module, first.metric) == (1, "record", "input_ids", "rel_l2")
        found = next(r for r in report.records if r.name == "input_ids")
        assert (found.elements_differing, list(found.first_index), found.baseline_value, found.candidate_value) == (
            8, [0, 0], 0.0, 4.0)
    finally:
        server.stop(grace=0.5)
