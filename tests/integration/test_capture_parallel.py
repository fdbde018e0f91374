"""Capture of parallel layouts: each rank's place in the mesh, and how each record relates to its logical tensor.

Real torch processes over gloo on the CPU (tests/integration/jobs/parallel_capture_run.py: two ranks of
torch's tensor-parallel API, or of DistributedDataParallel); single-process checks in here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import twinstep
from twinstep.runtime import settings
from twinstep.runtime.capture import CaptureConfig, Recorder, backend_for, placement
from tests.conftest import run_status, wait_for

_HERE = Path(__file__).parent / "jobs"
B = 4  # each rank's batch (parallel_capture_run.BATCH)
W, H = 16, 64  # the models' width and the tensor-parallel layers' (parallel_capture_run.WIDTH, HIDDEN)
h = H // 2  # each rank's share


def run_ranks(case: str, tmp: Path, server: str = "", env: dict[str, str] | None = None, world: int = 2) -> list[dict]:
    out = subprocess.run([sys.executable, str(_HERE / "parallel_capture_run.py"), case, str(tmp), server],
                         capture_output=True, text=True, timeout=240, cwd=tmp,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert out.returncode == 0, out.stderr[-6000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def by_label(found: dict, step: int = 0) -> dict[tuple[str, str, int], dict]:
    return {(r["phase"], r["name"], r["slot"]): r for r in found["steps"][step] if r["call"] == 0}


def block(global_shape, offset, split_by="tensor", scale=0.0) -> dict:
    return {"kind": "block", "global_shape": list(global_shape), "offset": list(offset), "scale": scale,
            "split_by": split_by}


@pytest.fixture(scope="module")
def tp(tmp_path_factory) -> tuple[list[dict], object]:
    from twinstep.server import ServerConfig, serve
    from twinstep.server.config import SessionsConfig

    handle = serve(port=0, config=ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5)))
    try:
        ranks = run_ranks("tp", tmp_path_factory.mktemp("tp"), handle.address)
        yield ranks, run_status(handle, "parallel-tp", "candidate")
    finally:
        handle.stop(grace=0.5)


def test_dtensors_are_captured_as_their_local_shards(tmp_path):
    """Parameters, gradients and inputs of tensor-parallel modules are DTensors: read through their local shard."""
    detection_off = {settings.BY_NAME["layout_detect"].env: "false"}
    for rank, found in enumerate(run_ranks("local", tmp_path, env=detection_off)):
        assert found["failures"] == [], found["failures"]
        assert found["layout"] is None  # detection off: no place, no placements
        records = by_label(found)
        assert all(r["placement"] is None for step in found["steps"] for r in step)
        # Shapes on the wire are local shapes.
        assert records[("param", "q.weight", 0)]["shape"] == [h, W]
        assert records[("grad", "q.weight", 0)]["shape"] == [h, W]
        assert records[("param", "o.weight", 0)]["shape"] == [W, h]
        assert records[("param", "o.bias", 0)]["shape"] == [W]
        assert records[("input", "o", 0)]["shape"] == [B, h]
        assert records[("input", "q", 0)]["shape"] == [B, W]
        assert records[("forward", "q", 0)]["shape"] == [B, h]
        assert records[("forward", "o", 0)]["shape"] == [B, W]
        assert records[("forward", "", 0)]["shape"] == [B, W]
        assert ("loss", "", 0) in records
        phases = {label[0] for label in records}
        assert phases == {"input", "forward", "backward", "loss", "grad", "param"}


def test_tensor_parallel_placements_on_both_ranks(tp):
    ranks, _ = tp
    for rank, found in enumerate(ranks):
        assert found["failures"] == [], found["failures"]
        assert found["layout"] == {"data_rank": 0, "data_size": 1, "tensor_rank": rank, "tensor_size": 2,
                                   "pipeline_rank": 0, "pipeline_size": 1, "context_rank": 0, "context_size": 1,
                                   "expert_rank": 0, "expert_size": 1, "source": "torch-tp"}
        for step in (0, 1):
            r = by_label(found, step)
            cols = block([B, H], [0, h * rank])
            for name in ("q", "k", "v"):
                # Column parallel: each rank holds 3 of the 6 output features (torch's hook made them local).
                assert r[("forward", name, 0)]["placement"] == cols, (rank, name)
                assert r[("backward", name, 0)]["placement"] == cols, (rank, name)
                assert r[("input", name, 0)]["placement"] is None  # replicated input
                assert r[("param", f"{name}.weight", 0)]["placement"] == block([H, W], [h * rank, 0])
                assert r[("grad", f"{name}.weight", 0)]["placement"] == block([H, W], [h * rank, 0])
                assert r[("param", f"{name}.bias", 0)]["placement"] == block([H], [h * rank])
                assert r[("grad", f"{name}.bias", 0)]["placement"] == block([H], [h * rank])
            # The activation between them inherits its input's block; so does its own input record.
            assert r[("input", "act", 0)]["placement"] == cols
            assert r[("forward", "act", 0)]["placement"] == cols
            assert r[("backward", "act", 0)]["placement"] == cols
            # Row parallel: its input is split along the last dimension; its output is reduced (whole).
            assert r[("input", "o", 0)]["placement"] == cols
            assert r[("forward", "o", 0)]["placement"] is None
            assert r[("backward", "o", 0)]["placement"] is None
            assert r[("param", "o.weight", 0)]["placement"] == block([W, H], [0, h * rank])
            assert r[("grad", "o.weight", 0)]["placement"] == block([W, H], [0, h * rank])
            assert r[("param", "o.bias", 0)]["placement"] is None  # replicated
            assert r[("grad", "o.bias", 0)]["placement"] is None
            assert r[("forward", "", 0)]["placement"] is None
            assert r[("loss", "", 0)]["placement"] is None  # tensor parallel alone: every rank has the whole loss


def test_shards_sketches_add_up_to_the_whole_tensors(tp):
    """Sketches of blocks are keyed by the element's index in the logical tensor: the ranks' add up to the whole's."""
    ranks, _ = tp
    for name in ("q", "o"):
        shards = [by_label(found, 1)[("param", f"{name}.weight", 0)]["sketch"] for found in ranks]
        assert all(shards), name
        whole = ranks[0]["whole_sketches"][name]
        assert ranks[1]["whole_sketches"][name] == pytest.approx(whole)
        assert [a + b for a, b in zip(*shards)] == pytest.approx(whole, rel=1e-5, abs=1e-5), name


def test_tensor_parallel_ranks_declare_their_place_to_the_server(tp):
    ranks, status = tp
    for rank, found in enumerate(ranks):
        assert found["hello_layout"]["tensor_size"] == 2 and found["hello_layout"]["tensor_rank"] == rank
        assert found["steps_sent"] == 2
    assert status is not None and status.last_step == 1  # the server took both ranks' steps, placements included
    assert (status.layout.tensor_size, status.layout.source) == (2, "torch-tp")  # from the ranks' Hello


def test_data_parallel_placements(tmp_path):
    for rank, found in enumerate(run_ranks("ddp", tmp_path)):
        assert found["failures"] == [], found["failures"]
        layout = found["layout"]
        assert (layout["data_rank"], layout["data_size"], layout["tensor_size"], layout["source"]) == (
            rank, 2, 1, "ddp")
        r = by_label(found)
        rows = block([2 * B, 8], [B * rank, 0], "data")
        assert r[("forward", "fc1", 0)]["placement"] == rows
        assert r[("forward", "act", 0)]["placement"] == rows
        assert r[("input", "act", 0)]["placement"] == rows
        assert r[("input", "fc1", 0)]["placement"] == block([2 * B, W], [B * rank, 0], "data")
        assert r[("forward", "", 0)]["placement"] == block([2 * B, 3], [B * rank, 0], "data")
        # The gradient of a mean loss over half the batch is twice the whole batch's.
        assert r[("backward", "fc1", 0)]["placement"] == block([2 * B, 8], [B * rank, 0], "data", scale=0.5)
        assert r[("loss", "", 0)]["placement"] == {"kind": "mean", "global_shape": [], "offset": [], "scale": 0.0,
                                                  "split_by": "data"}
        # Reduced gradients and updated parameters are replicas: whole.
        assert r[("grad", "fc1.weight", 0)]["placement"] is None
        assert r[("param", "fc1.weight", 0)]["placement"] is None


def test_tensor_parallel_within_data_parallel_on_a_named_mesh(tmp_path):
    """A ("dp", "tp") mesh of four ranks: blocks of the tensor-parallel split and of the global batch at once."""
    for rank, found in enumerate(run_ranks("tp_dp", tmp_path, world=4)):
        assert found["failures"] == [], found["failures"]
        tp_rank, dp_rank = rank % 2, rank // 2
        layout = found["layout"]
        assert (layout["tensor_rank"], layout["tensor_size"], layout["data_rank"], layout["data_size"],
                layout["source"]) == (tp_rank, 2, dp_rank, 2, "dtensor")
        r = by_label(found)
        both = block([2 * B, H], [B * dp_rank, h * tp_rank], "tensor+data")
        assert r[("forward", "q", 0)]["placement"] == both
        assert r[("input", "o", 0)]["placement"] == both
        assert r[("backward", "q", 0)]["placement"] == block([2 * B, H], [B * dp_rank, h * tp_rank], "tensor+data",
                                                             scale=0.5)
        assert r[("input", "q", 0)]["placement"] == block([2 * B, W], [B * dp_rank, 0], "data")
        assert r[("forward", "o", 0)]["placement"] == block([2 * B, W], [B * dp_rank, 0], "data")
        assert r[("param", "q.weight", 0)]["placement"] == block([H, W], [h * tp_rank, 0])  # replicas across dp
        assert r[("param", "o.bias", 0)]["placement"] is None
        assert r[("loss", "", 0)]["placement"]["kind"] == "mean"


def test_a_run_with_no_layout_has_no_placements(server):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    backend = backend_for(model)
    assert placement.find_layout(backend, model, rank=0, world_size=1) is None
    recorder = Recorder(model, backend, CaptureConfig(), layout=None)
    loss = model(torch.randn(3, 4)).square().mean()
    loss.backward()
    assert recorder.finish_step(0, loss).placements == []
    recorder.remove()
    with twinstep.attach(model, session="no-layout", run="r", server=server.address) as mon:
        assert mon.layout is None
        loss = model(torch.randn(3, 4)).square().mean()
        loss.backward()
        mon.step(loss=loss)
    status = wait_for(lambda: run_status(server, "no-layout", "r"))
    # The Hello said nothing of a layout: the server reads the run as one whole rank.
    assert (status.layout.source, status.layout.tensor_size, status.layout.data_size) == ("", 1, 1)


def _declared(**values) -> settings.AttachSettings:
    return settings.resolve({"session": "s", "run": "r", "server": "localhost:1", **values}, environ={}).settings


def test_declared_layout_ranks_in_megatrons_order():
    chosen = _declared(tensor_parallel=2, data_parallel=2, rank=3, world_size=4)
    chosen.check()
    found = placement.declared_layout(chosen.layout, rank=3, world_size=4)
    assert placement.layout_dict(found) == {"data_rank": 1, "data_size": 2, "tensor_rank": 1, "tensor_size": 2,
                                            "pipeline_rank": 0, "pipeline_size": 1, "context_rank": 0,
                                            "context_size": 1, "expert_rank": 0, "expert_size": 1,
                                            "source": "config"}
    # The data parallel size follows from the world when left out; given ranks win over derived ones.
    chosen = _declared(tensor_parallel=2, pipeline_parallel=2, tensor_parallel_rank=0, rank=5, world_size=8)
    found = placement.declared_layout(chosen.layout, rank=5, world_size=8)
    assert (found.tensor_rank, found.data_rank, found.data_size, found.pipeline_rank) == (0, 0, 2, 1)
    chosen = _declared(tensor_parallel=2, pipeline_parallel=2, data_parallel_rank=1, pipeline_parallel_rank=0,
                       rank=5, world_size=8)
    found = placement.declared_layout(chosen.layout, rank=5, world_size=8)
    assert (found.tensor_rank, found.data_rank, found.pipeline_rank) == (1, 1, 0)
    assert placement.declared_layout(_declared().layout, rank=0, world_size=1) is None
    with pytest.raises(ValueError, match="tensor_parallel"):
        _declared(tensor_parallel=3, rank=0, world_size=4).check()
    with pytest.raises(ValueError, match="tensor_parallel_split"):
        _declared(tensor_parallel_split={"*.q": "sideways"})


def test_declared_layout_places_the_declared_modules():
    """A model whose layers twinstep cannot see through: the config names what each rank holds."""

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = torch.nn.Linear(4, 3)  # this rank's 3 of 6 output features
            self.o = torch.nn.Linear(3, 4)  # this rank's 3 of 6 input features

        def forward(self, x):
            return self.o(torch.relu(self.q(x)))

    torch.manual_seed(0)
    model = Attention()
    chosen = _declared(tensor_parallel=2, data_parallel=2, rank=3, world_size=4,
                       tensor_parallel_split={"q": "-1", "q.weight": "0", "q.bias": "0", "o": "input=-1",
                                              "o.weight": "1"})
    backend = backend_for(model)
    layout = placement.find_layout(backend, model, rank=3, world_size=4, settings=chosen.layout)
    assert layout.source == "config" and (layout.tensor_rank, layout.data_rank) == (1, 1)
    recorder = Recorder(model, backend, CaptureConfig(), layout=layout,
                        splits=placement.parse_splits(chosen.layout.tensor_parallel_split))
    loss = model(torch.randn(B, 4)).square().mean()
    loss.backward()
    batch = recorder.finish_step(0, loss)
    modules = {m.id: m.name for m in recorder.take_new_modules()}
    params = {p.id: p.name for p in recorder.parameter_infos}
    from twinstep.v1 import twinstep_pb2 as pb

    placed = {}
    for record, found in batch.placements:
        phase, target = int(batch.phase[record]), int(batch.target[record])
        name = params[target] if phase in (pb.GRAD, pb.PARAM) else "" if phase == pb.LOSS else modules[target]
        placed[(pb.Phase.Name(phase).lower(), name)] = found.to_proto(record)

    def check(label, glob, offset, split_by, scale=0.0):
        got = placed[label]
        got = (list(got.global_shape), list(got.offset), got.split_by, got.scale)
        assert got == (glob, offset, split_by, scale), label

    check(("forward", "q"), [2 * B, 6], [B, 3], "tensor+data")
    check(("backward", "q"), [2 * B, 6], [B, 3], "tensor+data", 0.5)
    check(("input", "o"), [2 * B, 6], [B, 3], "tensor+data")
    check(("forward", "o"), [2 * B, 4], [B, 0], "data")
    check(("input", "q"), [2 * B, 4], [B, 0], "data")
    check(("param", "q.weight"), [6, 4], [3, 0], "tensor")
    check(("grad", "q.bias"), [6], [3], "tensor")
    check(("param", "o.weight"), [4, 6], [0, 3], "tensor")
    assert ("param", "o.bias") not in placed  # replicated
    assert placed[("loss", "")].kind == pb.Placement.MEAN
    recorder.remove()


def run_paddle_ranks(case: str, tmp: Path) -> list[dict]:
    out = subprocess.run([sys.executable, str(_HERE / "parallel_capture_paddle_run.py"), case, str(tmp)],
                         capture_output=True, text=True, timeout=240, cwd=tmp,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_paddle_data_parallel_placements(tmp_path):
    for rank, found in enumerate(run_paddle_ranks("dp", tmp_path)):
        assert found["failures"] == []
        layout = found["layout"]
        assert (layout["data_rank"], layout["data_size"], layout["source"]) == (rank, 2, "ddp")
        placed = {(p["phase"], p["name"]): p for p in found["placements"]}
        assert placed[("forward", "0")]["global_shape"] == [2 * B, 8]
        assert placed[("forward", "0")]["offset"] == [B * rank, 0]
        assert placed[("input", "0")]["global_shape"] == [2 * B, W]
        assert placed[("backward", "2")]["scale"] == 0.5
        assert placed[("loss", "")]["kind"] == 2  # MEAN
        assert not any(p["phase"] in ("grad", "param") for p in found["placements"])  # replicas: whole


def test_paddle_fleet_model_parallel_layout(tmp_path):
    """fleet's hybrid group and its model-parallel layers (their forward has no CPU kernel: not run here)."""
    for rank, found in enumerate(run_paddle_ranks("fleet", tmp_path)):
        assert found["failures"] == []
        layout = found["layout"]
        assert (layout["tensor_rank"], layout["tensor_size"], layout["data_size"], layout["source"]) == (
            rank, 2, 1, "paddle-fleet")
        assert found["splits"] == {"up": [[-1, H, h * rank], None], "down": [None, [-1, H, h * rank]]}
        placed = {(p["phase"], p["name"]): (p["global_shape"], p["offset"]) for p in found["placements"]}
        # paddle stores a Linear weight [in, out]: the column-parallel one is split along its dimension 1.
        assert placed == {("param", "up.weight"): ([W, H], [0, h * rank]), ("param", "up.bias"): ([H], [h * rank]),
                          ("param", "down.weight"): ([H, W], [h * rank, 0])}
