"""A reproducer bundle from a halted real run, replayed in one process (twinstep reproduce)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT
from twinstep.server import ServerConfig
from twinstep.server.config import HaltConfig, SessionsConfig


@pytest.mark.parametrize("server", [{"config": ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5), halt=HaltConfig(on_divergence=True, bundle=True))}], indirect=True)
def test_a_bundle_from_a_halted_run_reproduces_the_modules_error_in_one_process(server, jobs, tmp_path):
    bundles = tmp_path / "bundles"
    env = {"TWINSTEP_BUNDLE_DIR": str(bundles)}
    started = [
        jobs("torch", server=server.address, session="rep", baseline=True, steps=60, env=env,
             extra=["--step-delay", "0.02", "--lockstep", "2"]),
        jobs("paddle", server=server.address, session="rep", bug="gelu_tanh", steps=60, env=env,
             extra=["--step-delay", "0.02", "--lockstep", "2"]),
    ]
    results = [job.wait() for job in started]
    for result in results:
        assert result.returncode == 0 and result.halted, result.output
    report = server.report_proto("rep")
    live = report.first_divergence
    assert (live.step, live.phase, live.module) == (0, "forward", "layers.1.mlp.act")
    # Both runs halted at the end of the step their bundle holds, the step the report names.
    [window] = report.zooms
    at = window.spec.first_step
    assert window.origin == "halt" and window.spec.bundle_module == "layers.1.mlp.act"
    assert [r.result["halt_step"] for r in results] == [at, at]
    written = [r.result["bundles"] for r in results]
    assert all(len(paths) == 1 for paths in written), written
    base_bundle, cand_bundle = (paths[0] for paths in written)
    with zipfile.ZipFile(cand_bundle) as archive:
        meta = json.loads(archive.read("bundle.json"))
    assert (meta["format"], meta["version"], meta["step"], meta["divergent_step"]) == ("twinstep-bundle", 1, at, 0)
    assert meta["framework"] == "paddle" and meta["module_class"] == "paddle.nn.layer.activation.GELU"
    assert any("step 0 itself" in text for text in meta["missing"])  # it says it holds a later step

    # One bundle given: its counterpart is found beside it; torch and paddle run in one process.
    out = subprocess.run([sys.executable, "-m", "twinstep", "reproduce", cand_bundle, "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr  # 1: the module itself diverges
    result = json.loads(out.stdout)
    assert result["baseline"]["bundle"] == base_bundle and result["baseline"]["framework"] == "torch"
    assert result["module_diverges"] and "the bug is in this module" in result["verdict"]
    by = {c["label"]: c for c in result["comparisons"]}
    same = by["same inputs"]
    assert live.metric in same["exceeded"]
    # The live report's metric, reproduced to the same order of magnitude (a later step, the same bug).
    assert live.value / 10 < same["values"][live.metric] < live.value * 10
    assert same["values"]["rel_l2"] > 1e-4  # the tanh GELU element by element (tolerance 1e-4)
    # Each replay gives back exactly what its training recorded.
    assert by["baseline replay"]["values"]["max_abs"] == 0 and by["candidate replay"]["values"]["max_abs"] == 0

