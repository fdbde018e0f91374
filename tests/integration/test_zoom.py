"""Live capture control with real jobs: a zoom asked for a step, and auto_zoom after a divergence."""

from __future__ import annotations

import jsonschema
import pytest

from tests.conftest import wait_for
from twinstep.cli.main import main as cli
from twinstep.server import ServerConfig
from twinstep.server.config import DiagnosisConfig, SessionsConfig
from twinstep.server.report.render import render_text, report_schema


def _ranks_at(server, session: str, runs: tuple[str, ...], ranks: int, step: int) -> bool:
    """Every rank of every run has delivered ``step`` (the report's per-run last step is the furthest rank's)."""
    try:
        report = server.report_proto(session)
    except KeyError:
        return False
    rows = {r.name: r for r in report.runs}
    return all(name in rows and rows[name].ranks == ranks and rows[name].last_step >= step for name in runs) and \
        report.steps_compared >= step


@pytest.mark.parametrize("server", [{"config": ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5))}], indirect=True)
def test_a_zoom_brings_full_tensors_of_its_module_from_the_step_it_names_on_every_rank(server, jobs, tmp_path):
    # The baseline is torch DDP over two ranks (gloo); the candidate, paddle on two ranks as
    # paddle.distributed.launch numbers them (PADDLE_TRAINER_ID), each training on its rank's batches.
    started = []
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    for rank in range(2):
        started.append(jobs("torch", server=server.address, session="zm", run="torch", baseline=True, steps=60,
                            env={"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"},
                            extra=["--step-delay", "0.03", "--lockstep", "2", "--dist-init", rendezvous]))
        started.append(jobs("paddle", server=server.address, session="zm", run="paddle", steps=60,
                            env={"PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": "2"},
                            extra=["--step-delay", "0.03", "--lockstep", "2"]))
    wait_for(lambda: _ranks_at(server, "zm", ("torch", "paddle"), 2, 1), timeout=120)
    furthest = max(r.last_step for r in server.report_proto("zm").runs)
    first = furthest + 25  # ahead of what the server can promise, even on a loaded machine
    assert first + 2 < 60, f"the jobs ran too far ahead ({furthest}) for the test to name a step"
    assert cli(["zoom", "zm", "--module", "layers.0.mlp.fc1", "--steps", "3", "--from-step", str(first),
                "--server", server.address]) == 0
    results = [job.wait() for job in started]
    for result in results:
        assert result.returncode == 0, result.output
        assert result.result["steps_completed"] == 60, result.output
    report = server.report_proto("zm")
    [window] = report.zooms
    assert (window.origin, window.spec.first_step, window.spec.last_step) == ("operator", first, first + 2)
    assert sorted(window.runs) == ["paddle", "torch"]
    tensor_steps = {t.rank: t for t in report.tensor_steps if t.candidate_run == "paddle"}
    # Exactly the named steps, on both ranks, and only the zoomed module's records (its output, its
    # gradient, its parameters' gradients and values): statistics everywhere else.
    assert sorted(tensor_steps) == [0, 1] and len(report.tensor_steps) == 2, report.tensor_steps
    for rank, steps in tensor_steps.items():
        assert (steps.first_step, steps.last_step) == (first, first + 2), (rank, steps)
        assert set(steps.modules) == {"layers.0.mlp.fc1", "layers.0.mlp.fc1.weight", "layers.0.mlp.fc1.bias"}
        # Element-wise metrics were computed (DDP averages the baseline's gradients over its ranks, the paddle
        # ranks train alone: their parameters part after step 0, so the values are large).
        assert 0 < steps.max_rel_l2 < float("inf") and steps.max_cosine > 0
    text = render_text(report)
    assert f"#1 operator: layers.0.mlp.fc1 in tensors, steps {first}-{first + 2}" in text
    assert f"paddle rank 1, steps {first}-{first + 2}: layers.0.mlp.fc1" in text


@pytest.mark.parametrize("server", [{"config": ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5), diagnosis=DiagnosisConfig(auto_zoom=True, auto_zoom_steps=3))}],
                         indirect=True)
def test_auto_zoom_after_a_divergence_brings_the_module_and_its_neighbours_in_full_tensors(server, jobs):
    started = [
        jobs("torch", server=server.address, session="auto", baseline=True, steps=40,
             extra=["--step-delay", "0.03", "--lockstep", "2"]),
        jobs("paddle", server=server.address, session="auto", bug="gelu_tanh", steps=40,
             extra=["--step-delay", "0.03", "--lockstep", "2"]),
    ]
    results = [job.wait() for job in started]
    for result in results:
        assert result.returncode == 0 and not result.halted, result.output
    report = server.report_proto("auto")
    assert report.first_divergence.module == "layers.1.mlp.act"
    # auto_ops (on by default) asks for the activation's operations too: a window of its own.
    [window] = [w for w in report.zooms if w.origin == "auto"]
    assert window.origin == "auto" and window.spec.divergent_step == report.first_divergence.step
    assert set(window.spec.modules) == {"layers.1.mlp", "layers.1.mlp.fc1", "layers.1.mlp.act", "layers.1.mlp.fc2"}
    assert window.spec.last_step - window.spec.first_step == 2
    [steps] = report.tensor_steps
    assert (steps.candidate_run, steps.first_step, steps.last_step) == (
        "paddle", window.spec.first_step, window.spec.last_step)
    assert "layers.1.mlp.act" in steps.modules and "layers.1.mlp.fc1.weight" in steps.modules
    assert all(name.startswith("layers.1.mlp") for name in steps.modules)  # the rest stayed in statistics
    assert steps.max_rel_l2 > 1e-4  # the tanh GELU, seen element by element (tolerance 1e-4)
    jsonschema.validate(server.report("auto"), report_schema())  # the JSON form of both sections
    assert sorted(z["origin"] for z in server.report("auto")["zooms"]) == ["auto", "auto-ops"]
