"""Capture of Megatron-core's tensor parallelism: the rank's place from Megatron's parallel state, and the blocks of
its column- and row-parallel linear layers.

Optional: Megatron-core is not a dependency of twinstep, and these tests are skipped where ``megatron.core`` is
not importable.  Two real torch processes over gloo on the CPU (tests/integration/jobs/megatron_capture_run.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_status

try:
    _MEGATRON = importlib.util.find_spec("megatron.core") is not None
except ModuleNotFoundError:  # no "megatron" package at all
    _MEGATRON = False

pytestmark = pytest.mark.skipif(not _MEGATRON, reason="Megatron-core is not installed (megatron.core is not "
                                                      "importable): its tensor-parallel layers cannot be run")

_HERE = Path(__file__).parent / "jobs"
B = 4  # the batch (megatron_capture_run.BATCH)
W, H = 16, 64  # the model's width and the tensor-parallel layers' (megatron_capture_run.WIDTH, HIDDEN)
h = H // 2  # each rank's share


def block(global_shape, offset, split_by="tensor") -> dict:
    return {"kind": "block", "global_shape": list(global_shape), "offset": list(offset), "scale": 0.0,
            "split_by": split_by}


def by_label(found: dict, step: int = 0) -> dict[tuple[str, str, int], dict]:
    return {(r["phase"], r["name"], r["slot"]): r for r in found["steps"][step] if r["call"] == 0}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], object]:
    from twinstep.server import ServerConfig, serve
    from twinstep.server.config import SessionsConfig

    tmp = tmp_path_factory.mktemp("megatron")
    handle = serve(port=0, config=ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5)))
    try:
        out = subprocess.run([sys.executable, str(_HERE / "megatron_capture_run.py"), str(tmp), handle.address],
                             capture_output=True, text=True, timeout=300, cwd=tmp,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-6000:]
        found = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
        yield found, run_status(handle, "megatron-tp", "candidate")
    finally:
        handle.stop(grace=0.5)


def test_megatron_parallel_state_gives_the_ranks_place(ranks):
    found, status = ranks
    for rank, one in enumerate(found):
        assert one["failures"] == [], one["failures"]
        expected = {"data_rank": 0, "data_size": 1, "tensor_rank": rank, "tensor_size": 2, "pipeline_rank": 0,
                    "pipeline_size": 1, "context_rank": 0, "context_size": 1, "expert_rank": 0, "expert_size": 1,
                    "source": "megatron"}
        assert one["layout"] == expected
        assert one["hello_layout"] == expected  # what attach sent in its Hello
        assert one["steps_sent"] == 2
    assert status is not None and status.last_step == 1
    assert (status.layout.tensor_size, status.layout.source) == (2, "megatron")


def test_megatron_column_and_row_parallel_layers_are_placed(ranks):
    found, _ = ranks
    for rank, one in enumerate(found):
        for step in (0, 1):
            r = by_label(one, step)
            cols = block([B, H], [0, h * rank])
            # Column parallel (gather_output=False): its output is this rank's block of the output features.
            assert r[("forward", "up", 0)]["shape"] == [B, h]
            assert r[("forward", "up", 0)]["placement"] == cols, (rank, step)
            assert r[("backward", "up", 0)]["placement"] == cols, (rank, step)
            assert r[("input", "up", 0)]["placement"] is None  # the same input on every rank
            # Its weight and bias are split by output features (Megatron's partition_dim 0), as are their gradients.
            for phase in ("param", "grad"):
                assert r[(phase, "up.weight", 0)]["shape"] == [h, W]
                assert r[(phase, "up.weight", 0)]["placement"] == block([H, W], [h * rank, 0]), (phase, rank)
                assert r[(phase, "up.bias", 0)]["placement"] == block([H], [h * rank]), (phase, rank)
            # The activation between them passes the block on.
            assert r[("input", "act", 0)]["placement"] == cols
            assert r[("forward", "act", 0)]["placement"] == cols
            # Row parallel (input_is_parallel=True): its input is a block along the last dimension, its output
            # is reduced over the ranks (whole).
            assert r[("input", "down", 0)]["shape"] == [B, h]
            assert r[("input", "down", 0)]["placement"] == cols
            assert r[("forward", "down", 0)]["shape"] == [B, W]
            assert r[("forward", "down", 0)]["placement"] is None
            assert r[("backward", "down", 0)]["placement"] is None
            for phase in ("param", "grad"):
                assert r[(phase, "down.weight", 0)]["placement"] == block([W, H], [0, h * rank]), (phase, rank)
                assert r[(phase, "down.bias", 0)]["placement"] is None  # replicated
            assert r[("forward", "", 0)]["placement"] is None
            assert r[("loss", "", 0)]["placement"] is None
            # A strided layer's rank holds interleaved chunks, not one block: sent whole (the server names what
            # it cannot merge), never merged as a block.
            assert r[("forward", "fused", 0)]["shape"] == [B, h]
            assert r[("forward", "fused", 0)]["placement"] is None
            assert r[("param", "fused.weight", 0)]["shape"] == [h, W]
            assert r[("param", "fused.weight", 0)]["placement"] is None
            assert r[("param", "fused.bias", 0)]["placement"] is None


def test_megatron_shards_sketches_add_up_to_the_whole_weights(ranks):
    found, _ = ranks
    for name in ("up", "down"):
        shards = [by_label(one, 1)[("param", f"{name}.weight", 0)]["sketch"] for one in found]
        assert all(shards), name
        whole = found[0]["whole_sketches"][name]
        assert found[1]["whole_sketches"][name] == pytest.approx(whole)
        assert [a + b for a, b in zip(*shards)] == pytest.approx(whole, rel=1e-5, abs=1e-5), name
