"""Multi-rank halting, and trainings that outlive their server."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import serve_process, wait_for


def _ddp_env(rank: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}


@pytest.mark.parametrize("server", [{"halt_on_divergence": True}], indirect=True)
def test_two_rank_ddp_runs_halt_at_the_same_step_on_every_rank(server, jobs, tmp_path):
    started = []
    for run, bug in (("base", None), ("cand", "lr")):
        rendezvous = f"file://{tmp_path / ('rendezvous-' + run)}"  # no port to hand out: a file both ranks open
        for rank in range(2):
            started.append(
                jobs("torch", server=server.address, session="ddp", run=run, baseline=run == "base", bug=bug,
                     steps=400, env=_ddp_env(rank), extra=["--step-delay", "0.02", "--lockstep", "2",
                                                            "--dist-init", rendezvous])
            )
    results = [job.wait() for job in started]
    for r in results:
        assert r.returncode == 0, r.output
        assert r.halted, r.output
    base0, base1, cand0, cand1 = (r.result for r in results)
    # Every rank of a run stops at one step boundary, so no rank hangs in a collective.
    assert base0["halt_step"] == base1["halt_step"]
    assert cand0["halt_step"] == cand1["halt_step"]
    report = server.report("ddp")
    first = report["first_divergence"]
    assert (first["step"], first["phase"]) == (0, "param")
    assert {r["name"]: r["ranks"] for r in report["runs"]} == {"base": 2, "cand": 2}
    assert {r["state"] for r in report["runs"]} == {"halted"}


def test_training_finishes_when_the_server_is_down_from_the_start(jobs, refused_address):
    start = time.monotonic()
    job = jobs("torch", server=refused_address, session="nobody", baseline=True, steps=20)
    result = job.wait(timeout=120)
    assert result.returncode == 0, result.output
    assert result.result["steps_completed"] == 20 and not result.halted
    assert "lost contact" not in result.output  # there was no contact to lose
    assert result.output.count(f"cannot reach the comparison server at {refused_address}") == 1  # one, not a flood
    assert time.monotonic() - start < 60


def test_training_finishes_when_the_server_is_killed_mid_run(jobs, tmp_path):
    server, address = serve_process()
    try:
        job = jobs("torch", server=address, session="killed", baseline=True, steps=60, extra=["--step-delay", "0.05"])
        report = tmp_path / "report.json"

        def server_has_steps() -> bool:
            out = subprocess.run(
                [sys.executable, "-m", "twinstep.cli.main", "report", "killed", "--server", address, "--json"],
                capture_output=True, text=True,
            )
            if out.returncode != 0:
                return False
            report.write_text(out.stdout)
            return '"last_step": ' in out.stdout and '"last_step": -1' not in out.stdout

        wait_for(server_has_steps, timeout=60, interval=0.2)
        server.kill()
        server.wait()
        result = job.wait(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
    assert result.returncode == 0, result.output
    assert result.result["steps_completed"] == 60 and not result.halted
    assert "lost contact with the comparison server" in result.output
