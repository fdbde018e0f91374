"""The twinstep command line against a real server process and real jobs."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time

import jsonschema
import pytest

from tests.conftest import serve_process

CLI = [sys.executable, "-m", "twinstep"]


def test_serve_report_and_watch(jobs, tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text("halt_on_divergence: false\ntolerances:\n  forward: {mean: 1.0e-5}\n")
    server, address = serve_process("--config", str(config))
    try:
        watch = subprocess.Popen(CLI + ["watch", "cli", "--server", address], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        base = jobs("torch", server=address, session="cli", baseline=True, steps=4)
        cand = jobs("paddle", server=address, session="cli", bug="gelu_tanh", steps=4)
        assert base.wait().returncode == 0 and cand.wait().returncode == 0
        watched, _ = watch.communicate(timeout=60)
        assert watch.returncode == 0
        assert "DIVERGENCE run 'paddle' step 0 rank 0 forward 'layers.1.mlp.act'" in watched
        assert "torch* step 3 finished" in watched

        out = subprocess.run(CLI + ["report", "cli", "--server", address, "--json"], capture_output=True, text=True, check=True)
        report = json.loads(out.stdout)
        # The keys of schema 0 are all still there, with their meaning; the whole document follows the schema.
        assert {"session", "status", "halted", "runs", "steps_compared", "first_divergence"} <= set(report)
        assert {"name", "baseline", "framework", "ranks", "last_step", "state", "dropped"} <= set(report["runs"][0])
        assert {"step", "rank", "phase", "module", "candidate_module", "metric", "value", "tolerance"} <= set(
            report["first_divergence"])
        schema = json.loads(subprocess.run(CLI + ["report", "--schema"], capture_output=True, text=True,
                                           check=True).stdout)
        jsonschema.validate(report, schema)
        assert report["stage"] and report["culprit"] and report["tree"]["rows"] and report["headroom"]
        assert report["status"] == "diverged" and report["halted"] is False and report["steps_compared"] == 4

        text = subprocess.run(CLI + ["report", "cli", "--server", address], capture_output=True, text=True, check=True).stdout
        marked = [line for line in text.splitlines() if "<== first divergence" in line]
        assert len(marked) == 1 and marked[0].split()[0] == "act"
        # Per run, what capture read: the same sums as the JSON, per step.
        capture_lines = [line.strip() for line in text.splitlines() if line.strip().startswith("capture: read ")]
        assert len(capture_lines) == 2, text
        cost = report["runs"][0]["capture_cost"]
        assert f"read {cost['bytes_read'] / cost['steps'] / 1e6:.1f} MB of " \
               f"{cost['bytes_captured'] / cost['steps'] / 1e6:.1f} MB captured per step" in capture_lines[0]
        assert "stage: forward" in text

        missing = subprocess.run(CLI + ["report", "nope", "--server", address], capture_output=True, text=True)
        assert missing.returncode == 2 and "NOT_FOUND" in missing.stderr
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert server.returncode == 0


def test_serve_rejects_a_bad_config(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("tolerances:\n  forwrd: {rms: 1}\n")
    out = subprocess.run(CLI + ["serve", "--port", "0", "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "tolerances.forwrd: unknown phase" in out.stderr


def test_demo_finds_the_bug_and_halts_both_jobs():
    out = subprocess.run(CLI + ["demo"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "first divergence: step 0, rank 0, forward of 'layers.1.mlp.act'" in out.stdout
    assert "[torch] halted at step" in out.stdout and "[paddle] halted at step" in out.stdout
    # Quiet: the halt is told once, and no log line interleaves with the demo's own lines.
    live = out.stdout.split("\nsession 'demo':")[0]
    assert live.count("HALT") == 1 and live.count("divergence at step 0") == 1, live
    assert not re.search(r"\b(INFO|WARNING)\b", live + out.stderr), live + out.stderr
    # The bug is a set-up difference too: told before the first step is compared (preflight).
    assert "[demo] PREFLIGHT run 'paddle': activation differs: baseline gelu, candidate 'paddle' gelu_tanh" in live, live


def test_demo_without_bug_stays_aligned():
    out = subprocess.run(CLI + ["demo", "--no-bug"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "session 'demo': ALIGNED" in out.stdout
    assert "steps compared: 20" in out.stdout


@pytest.mark.skipif(importlib.util.find_spec("mindspore") is not None, reason="MindSpore is installed here")
def test_demo_with_a_mindspore_candidate_refuses_up_front_where_mindspore_is_missing():
    started = time.monotonic()
    out = subprocess.run(CLI + ["demo", "--candidate", "paddle,mindspore"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert ("twinstep demo: MindSpore is not installed: pip install 'twinstep[mindspore]' (it brings the numpy<2 "
            "MindSpore 2.x needs)") in out.stderr, out.stderr
    assert "server on" not in out.stdout and "Traceback" not in out.stderr  # refused before anything started
    assert time.monotonic() - started < 60
