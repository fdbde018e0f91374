"""Live capture control: windows on the training side, the recorder under a zoom, names and steps on the server."""

from __future__ import annotations

import logging

import pytest

from tests.unit_tests.test_recorder import FRAMEWORKS, names, toy
from twinstep.runtime.capture import CaptureConfig, Recorder, backend_for
from twinstep.runtime.capture.control import CaptureControl, StepZoom
from twinstep.server.control import names as module_names
from twinstep.server.control.steps import MIN_LEAD_STEPS, earliest_step
from twinstep.v1 import twinstep_pb2 as pb


def spec(id=1, modules=("fc1",), capture="tensors", first=5, last=7, every=1, sketch=False, bundle=""):
    return pb.ZoomSpec(id=id, modules=modules, capture=capture, first_step=first, last_step=last, every=every,
                       sketch=sketch, bundle_module=bundle, divergent_step=-1)


# -- the training side's windows -------------------------------------------------------------------


def test_a_window_applies_at_its_steps_on_its_cadence_and_then_stops():
    control = CaptureControl("r", 0, lambda: 0)
    control.add(spec(first=5, last=9, every=2))
    assert [s for s in range(12) if control.captures(s)] == [5, 7, 9]
    assert control.plan(4) is None and control.plan(6) is None
    zoom = control.plan(7)
    assert zoom.tensors("fc1") and not zoom.tensors("fc2") and not zoom.sketch("fc1")
    assert control.plan(10) is None and not control.captures(9)  # over: forgotten


def test_a_window_told_twice_is_applied_once_and_one_over_is_ignored(caplog):
    step = {"now": 0}
    control = CaptureControl("r", 0, lambda: step["now"])
    with caplog.at_level(logging.INFO, logger="twinstep"):
        control.add(spec(id=1))
        control.add(spec(id=1))  # again after a reconnect
        step["now"] = 20
        control.add(spec(id=2, first=5, last=7))  # a run that joined late is told every window
    assert len([r for r in caplog.records if "zoom #" in r.getMessage()]) == 1
    assert control.plan(20) is None


def test_a_late_window_applies_from_the_next_step_and_says_so(caplog):
    control = CaptureControl("r", 3, lambda: 6)
    with caplog.at_level(logging.WARNING, logger="twinstep"):
        control.add(spec(first=5, last=8))
    assert "arrived at step 6: applied from step 7 on this rank" in caplog.text
    assert control.plan(7).tensors("fc1")


def test_a_window_is_told_in_words_as_an_informational_line(caplog):
    """What the training's log says of each window: what is captured, at which steps, and who asked."""
    control = CaptureControl("r", 0, lambda: 10)
    after = 'asked by the server after the divergence at step 3'
    windows = [
        (pb.ZoomSpec(id=1, modules=[""], capture="tensors", first_step=12, last_step=12, divergent_step=3),
         f"full tensors of the whole model at step 12, {after}"),
        (pb.ZoomSpec(id=2, capture="tensors", first_step=12, last_step=12, ops_module="layers.1.mlp.act",
                     divergent_step=3),
         f"the operations of 'layers.1.mlp.act' in its first call at step 12, {after}"),
        (pb.ZoomSpec(id=3, modules=["layers.1.mlp.act"], capture="tensors", first_step=12, last_step=12,
                     bundle_module="layers.1.mlp.act", divergent_step=3),
         f"full tensors of layers.1.mlp.act and a reproducer bundle of 'layers.1.mlp.act' at step 12, {after}"),
        (pb.ZoomSpec(id=4, modules=["layers.*.attn", "embed"], capture="stats", sketch=True, every=2, first_step=12,
                     last_step=20, divergent_step=-1, reason="asked by an operator"),
         "sketches of layers.*.attn, embed at every 2nd step of steps 12-20, asked by an operator"),
        (pb.ZoomSpec(id=5, modules=["fc1"], capture="lossy", first_step=12, last_step=13, divergent_step=-1,
                     reason="checking fc1"),
         "full tensors of fc1 at steps 12-13, asked by an operator: checking fc1"),
    ]
    with caplog.at_level(logging.INFO, logger="twinstep"):
        for window, _ in windows:
            control.add(window)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", f"twinstep: run 'r' rank 0: zoom #{window.id} from the server: {words}") for window, words in windows]


def test_patterns_select_modules_and_sketches_apart():
    zoom = StepZoom([spec(modules=("layers.1.*",)), spec(id=2, modules=("embed",), capture="stats", sketch=True)])
    assert zoom.tensors("layers.1.mlp") and not zoom.tensors("embed") and zoom.sketch("embed")
    assert zoom.wants_tensors and zoom.wants_sketches
    assert not StepZoom([spec(capture="stats")]).wants_tensors


def test_a_bundle_is_due_once_at_its_step_or_the_first_step_after():
    control = CaptureControl("r", 0, lambda: 0)
    control.add(spec(first=5, last=5, bundle="fc1"))
    assert control.bundles_due(4) == []
    assert [s.bundle_module for s in control.bundles_due(6)] == ["fc1"]  # step 5 had begun: the next one
    assert control.bundles_due(7) == []


# -- the recorder under a zoom -------------------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_statistics_run_zoomed_sends_full_tensors_of_the_zoomed_module_only(framework):
    model, train_step = toy(framework)
    recorder = Recorder(model, backend_for(model), CaptureConfig())
    assert recorder.pool is None
    recorder.set_zoom(StepZoom([spec(modules=("fc1",))]))
    batch = recorder.finish_step(0, train_step())
    labels = names(recorder, batch)
    with_tensor = sorted({labels[i] for host in batch.tensors for i in host.records})
    assert with_tensor == sorted([("forward", "fc1", 0), ("backward", "fc1", 0), ("grad", "fc1.weight", 0),
                                  ("grad", "fc1.bias", 0), ("param", "fc1.weight", 0), ("param", "fc1.bias", 0)])
    assert recorder.pool is not None and batch.release is not None
    for host in batch.tensors:
        batch.release(host)
    recorder.set_zoom(None)  # the window is over: statistics again
    batch = recorder.finish_step(1, train_step())
    assert batch.tensors == [] and batch.sketches is None


def wide(framework: str):
    """Linear(32, 32) -> ReLU -> Linear(32, 32) on 16 rows: tensors larger than a sketch (256 buckets)."""
    if framework == "torch":
        import torch

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
        x = torch.randn(16, 32)
    else:
        import paddle

        paddle.seed(0)
        model = paddle.nn.Sequential(paddle.nn.Linear(32, 32), paddle.nn.ReLU(), paddle.nn.Linear(32, 32))
        x = paddle.randn([16, 32])

    def train_step():
        loss = model(x).square().mean()
        loss.backward()
        return loss
    return model, train_step


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_zoom_asks_for_sketches_of_its_modules_only(framework):
    model, train_step = wide(framework)
    recorder = Recorder(model, backend_for(model), CaptureConfig())
    recorder.set_zoom(StepZoom([spec(modules=("0",), capture="stats", sketch=True)]))
    batch = recorder.finish_step(0, train_step())
    labels = names(recorder, batch)
    assert batch.tensors == []
    sketched = sorted({labels[i][:2] for i in batch.sketch_records.tolist()})
    # Module 0's output, its gradient and its weight (the bias has fewer elements than a sketch); not module 2's.
    assert sketched == [("backward", "0"), ("forward", "0"), ("grad", "0.weight"), ("param", "0.weight")]


# -- the server's choices -----------------------------------------------------------------------------


def test_neighbours_are_the_parent_the_siblings_and_the_children():
    tree = ["", "embed", "layers", "layers.0", "layers.0.mlp", "layers.0.mlp.fc1", "layers.0.mlp.act", "layers.0.mlp.act.inner",
            "layers.0.mlp.fc2", "layers.0.attn", "layers.1.mlp.act"]
    assert module_names.neighbourhood("layers.0.mlp.act", tree) == [
        "layers.0.mlp", "layers.0.mlp.fc1", "layers.0.mlp.act", "layers.0.mlp.act.inner", "layers.0.mlp.fc2"]
    assert module_names.neighbourhood("embed", tree) == ["", "embed", "layers"]
    assert module_names.module_of("grad", "layers.0.mlp.fc1.weight") == "layers.0.mlp.fc1"
    assert module_names.module_of("forward", "layers.0.mlp.fc1") == "layers.0.mlp.fc1"


def test_a_candidate_gets_its_own_names_for_the_baselines_patterns():
    to_baseline = {"model.h.0.mlp.fc_in": "layers.0.mlp.fc1", "model.h.0.ln": "layers.0.ln1"}.get
    out = module_names.for_candidate(["layers.0.mlp.*"], ["model.h.0.mlp.fc_in", "model.h.0.ln"],
                                     lambda name: to_baseline(name, name))
    assert out == ["layers.0.mlp.*", "model.h.0.mlp.fc_in"]
    assert module_names.matches("a[1].b", [module_names.escape("a[1].b")])


def test_the_step_chosen_is_ahead_of_the_furthest_rank_by_what_the_fastest_does_in_transit():
    # Two ranks: one at step 10 not moving, one at 40 doing 100 steps/s.
    reach = earliest_step({1: 10, 2: 30}, {1: 10, 2: 40}, elapsed=0.1, round_trip=0.01, asked=2)
    assert reach.furthest == 40 and reach.answered == 2
    assert reach.earliest >= 40 + MIN_LEAD_STEPS + 100 * (4 * 0.01 + 0.25)
    idle = earliest_step({1: 3}, {1: 3}, elapsed=0.2, round_trip=0.001, asked=1)
    assert idle.earliest == 3 + MIN_LEAD_STEPS


# -- the Zoom RPC: who may ask, and what is refused ----------------------------------------------------


def test_the_zoom_rpc_refuses_what_it_cannot_do_and_says_why():
    import grpc
    import torch

    import twinstep
    from tests.conftest import wait_for
    from twinstep.server import serve
    from twinstep.server.security import ServerSecurity
    from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

    handle = serve(port=0, security=ServerSecurity(operator_token="op-token", session_tokens=[("z", "z-token")]))
    channel = grpc.insecure_channel(handle.address)
    stub = pb_grpc.TwinstepStub(channel)

    def zoom(token: str, **fields) -> grpc.RpcError | pb.ZoomResponse:
        try:
            return stub.Zoom(pb.ZoomRequest(**fields), timeout=20, metadata=[("authorization", f"Bearer {token}")])
        except grpc.RpcError as error:
            return error

    mon = None
    try:
        assert zoom("op-token", session="nope", modules=["x"]).code() == grpc.StatusCode.NOT_FOUND
        mon = twinstep.attach(torch.nn.Linear(2, 2), session="z", run="r", server=handle.address, token="z-token")
        wait_for(lambda: "z" in handle.registry.names(), timeout=30)
        denied = zoom("z-token", session="z", modules=["x"])
        assert denied.code() == grpc.StatusCode.PERMISSION_DENIED and "operator" in denied.details()
        bad = zoom("op-token", session="z", modules=["*"], bundle=True)
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "exact" in bad.details()
        assert zoom("op-token", session="z").code() == grpc.StatusCode.INVALID_ARGUMENT
        close = zoom("op-token", session="z", modules=[""], from_step=1)
        assert close.code() == grpc.StatusCode.FAILED_PRECONDITION and "earliest" in close.details()
        told = zoom("op-token", session="z", modules=[""], steps=2)
        assert (told.last_step - told.first_step, list(told.runs)) == (1, ["r"])
        mon.close()
        wait_for(lambda: handle.report_proto("z").runs[0].state == "finished", timeout=30)
        gone = zoom("op-token", session="z", modules=[""])
        assert gone.code() == grpc.StatusCode.FAILED_PRECONDITION and "streaming" in gone.details()
    finally:
        if mon is not None:
            mon.close()
        channel.close()
        handle.stop(grace=0.5)
