"""Three-way sessions: one torch baseline, several candidates, each judged on its own (real processes).

Two sessions share one server and run at the same time (seven processes):

- ``one-bad``: a faithful paddle port ("good"), a paddle port with the tanh GELU ("bad"), and a
  torch rerun of the baseline as reference (noise bands).  "bad" is halted alone at its
  divergence; the baseline, the reference and "good" go on to the end.
- ``all-bad``: the tanh GELU port and the learning-rate port (both ahead of the baseline).  The
  first declared halts alone while the other still waits for the baseline; once both have
  diverged the whole session halts, the baseline with them.
"""

from __future__ import annotations

import subprocess
import sys

import jsonschema
import pytest

from tests.conftest import JOB_TIMEOUT, Job, run_status, wait_for
from twinstep.server import ServerConfig, serve
from twinstep.server.config import HaltConfig, SessionsConfig
from twinstep.server.report.render import render_text, report_schema
from twinstep.server.view.model import build_view

CLI = [sys.executable, "-m", "twinstep"]
STEPS = 10
BAD_STEPS = 400  # "bad" trains until its halt reaches it (0.25 s a step: 100 s if it never did)


@pytest.fixture(scope="module")
def three_way(tmp_path_factory):
    server = serve(port=0, config=ServerConfig(halt=HaltConfig(on_divergence=True), sessions=SessionsConfig(reconnect_grace=0.5)))
    tmp = tmp_path_factory.mktemp("three-way")
    watch = subprocess.Popen(CLI + ["watch", "one-bad", "--server", server.address, "--plain"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = server.address
    # Candidates and the reference join first: their steps wait in the server's window until the
    # baseline's arrive, so every step is compared whatever order the processes start in.
    jobs = {
        ("one-bad", "rerun"): Job(tmp, "torch", server=address, session="one-bad", run="rerun", steps=STEPS,
                                  extra=["--reference"]),
        ("one-bad", "bad"): Job(tmp, "paddle", server=address, session="one-bad", run="bad", bug="gelu_tanh",
                                steps=BAD_STEPS, extra=["--step-delay", "0.25"]),
        ("one-bad", "good"): Job(tmp, "paddle", server=address, session="one-bad", run="good", steps=STEPS),
        ("all-bad", "gelu"): Job(tmp, "paddle", server=address, session="all-bad", run="gelu", bug="gelu_tanh",
                                 steps=STEPS),
        ("all-bad", "lr"): Job(tmp, "paddle", server=address, session="all-bad", run="lr", bug="lr", steps=STEPS),
    }
    try:
        wait_for(lambda: all(run_status(server, session, run) for session, run in jobs), timeout=JOB_TIMEOUT)
        jobs[("one-bad", "torch")] = Job(tmp, "torch", server=address, session="one-bad", baseline=True,
                                         steps=STEPS)
        jobs[("all-bad", "torch")] = Job(tmp, "torch", server=address, session="all-bad", baseline=True,
                                         steps=200, extra=["--lockstep", "1"])
        results = {key: job.wait() for key, job in jobs.items()}
        watched, _ = watch.communicate(timeout=60)
        yield server, results, watched
    finally:
        for job in jobs.values():
            if job.process.poll() is None:
                job.process.kill()
                job.process.wait()
        if watch.poll() is None:
            watch.kill()
            watch.wait()
        server.stop(grace=0.5)


def test_each_candidate_has_its_own_verdict_and_first_divergence(three_way):
    server, results, _ = three_way
    assert all(r.returncode == 0 for r in results.values()), {k: r.output[-2000:] for k, r in results.items()}
    report = server.report("one-bad")
    jsonschema.validate(report, report_schema())
    assert report["status"] == "diverged" and report["halted"] is False  # the session went on for "good"
    sections = {c["candidate_run"]: c for c in report["candidates"]}
    assert list(sections) == ["bad", "good"] or list(sections) == ["good", "bad"]

    bad = sections["bad"]
    first = bad["first_divergence"]
    assert (bad["status"], bad["halted"], first["candidate_run"]) == ("diverged", True, "bad")
    assert (first["step"], first["rank"], first["phase"], first["module"]) == (0, 0, "forward", "layers.1.mlp.act")
    assert bad["stage"] and bad["tree"]["step"] == 0
    assert [r["name"] for r in bad["tree"]["rows"] if r["first"]] == ["layers.1.mlp.act"]

    good = sections["good"]
    assert (good["status"], good["halted"], good["first_divergence"]) == ("aligned", False, None), good
    assert good["steps_compared"] == STEPS and good["stage"] is None
    assert good["tree"]["step"] == STEPS - 1 and not any(r["divergent"] for r in good["tree"]["rows"])
    # The reference's noise bands reached the candidate still compared: its tree shows them.
    assert any(r["noise"] is not None for r in good["tree"]["rows"]), good["tree"]["rows"][:3]
    assert [r for r in report["runs"] if r["reference"]][0]["name"] == "rerun"

    # The session's own first divergence keeps its meaning: the earliest among the candidates.
    assert report["first_divergence"]["candidate_run"] == "bad"


def test_only_the_diverged_candidate_halts_while_another_is_within_tolerance(three_way):
    _, results, _ = three_way
    bad = results[("one-bad", "bad")]
    assert bad.halted and bad.result["steps_completed"] < BAD_STEPS, bad.output[-2000:]
    assert "run 'bad': divergence at step 0, forward of 'layers.1.mlp.act'" in bad.result["halt_reason"]
    for run in ("torch", "rerun", "good"):
        result = results[("one-bad", run)]
        assert not result.halted and result.result["steps_completed"] == STEPS, (run, result.output[-2000:])


def test_the_baseline_halts_once_every_candidate_has_diverged(three_way):
    server, results, _ = three_way
    base = results[("all-bad", "torch")]
    assert base.halted and base.result["steps_completed"] < 200, base.output[-2000:]
    assert all(results[("all-bad", run)].result["steps_completed"] == STEPS for run in ("gelu", "lr"))  # ahead
    report = server.report("all-bad")
    assert report["halted"] is True and report["status"] == "diverged"
    sections = {c["candidate_run"]: c for c in report["candidates"]}
    assert {run: s["status"] for run, s in sections.items()} == {"gelu": "diverged", "lr": "diverged"}
    assert all(s["halted"] for s in sections.values())
    assert (sections["gelu"]["first_divergence"]["step"], sections["gelu"]["first_divergence"]["phase"]) == (0, "forward")
    assert (sections["lr"]["first_divergence"]["step"], sections["lr"]["first_divergence"]["phase"]) == (0, "param")


def test_text_report_and_dashboard_have_one_part_per_candidate(three_way):
    server, _, _ = three_way
    proto = server.report_proto("one-bad")
    text = render_text(proto)
    bad = text.index("== candidate 'bad' (paddle) against the baseline: DIVERGED  (halted)")
    good = text.index(f"== candidate 'good' (paddle) against the baseline: ALIGNED, {STEPS} step(s) compared")
    bad_part = text[bad:good] if bad < good else text[bad:]
    assert "first divergence: step 0, rank 0, forward of 'layers.1.mlp.act' in run 'bad'" in bad_part
    view = build_view(proto, None)
    panels = {c["run"]: c for c in view["candidates"]}
    assert panels["bad"]["divergence"]["first"]["module"] == "layers.1.mlp.act"
    assert panels["good"]["divergence"] is None and panels["good"]["status"] == "aligned"


def test_watch_names_the_candidate_and_ends_with_each_verdict(three_way):
    _, _, watched = three_way
    assert "DIVERGENCE run 'bad' step 0 rank 0 forward 'layers.1.mlp.act'" in watched, watched
    assert "HALT run 'bad'" in watched and "HALT run 'torch'" not in watched and "HALT run 'good'" not in watched
    verdicts = [line for line in watched.splitlines() if " VERDICT " in line]
    assert sorted(verdicts) == sorted([
        "[one-bad] VERDICT candidate 'bad' (paddle): DIVERGED at step 0 rank 0, forward of 'layers.1.mlp.act' (halted)",
        f"[one-bad] VERDICT candidate 'good' (paddle): ALIGNED over {STEPS} compared step(s)",
    ]), watched


def test_a_halted_candidate_that_reconnects_is_told_to_halt_again(three_way):
    """The halt of one run is kept: a stream of that run joining later halts at once; others do not."""
    from tests.integration.rawclient import RawStream, hello, manifest

    server, _, _ = three_way
    stream = RawStream(server.address).send(hello("one-bad", "bad", framework="paddle")).send(
        manifest((0, "fc", "Linear")))
    messages = [stream.next() for _ in range(2)]
    stream.close()
    halts = [m for m in messages if m.WhichOneof("body") == "command"]
    assert halts and "layers.1.mlp.act" in halts[0].command.reason, messages


def _mindspore_usable() -> str:
    """Why MindSpore cannot run a demo job here ("" when it can)."""
    import importlib.util

    import numpy

    if importlib.util.find_spec("mindspore") is None:
        return "mindspore is not installed"
    if int(numpy.__version__.split(".")[0]) >= 2:
        return f"MindSpore's wheels need numpy 1.x (numpy {numpy.__version__} here)"
    return ""


@pytest.mark.skipif(bool(_mindspore_usable()), reason=_mindspore_usable() or "usable")
def test_torch_baseline_with_a_paddle_and_a_mindspore_candidate(three_way, jobs):
    server, _, _ = three_way
    paddle = jobs("paddle", server=server.address, session="three-frameworks", run="paddle", bug="gelu_tanh",
                  steps=STEPS)
    mindspore = jobs("mindspore", server=server.address, session="three-frameworks", run="mindspore", steps=STEPS)
    wait_for(lambda: run_status(server, "three-frameworks", "paddle") and
             run_status(server, "three-frameworks", "mindspore"), timeout=JOB_TIMEOUT)
    base = jobs("torch", server=server.address, session="three-frameworks", baseline=True, steps=STEPS)
    results = [job.wait() for job in (paddle, mindspore, base)]
    assert all(r.returncode == 0 for r in results), [r.output[-2000:] for r in results]
    report = server.report("three-frameworks")
    jsonschema.validate(report, report_schema())
    sections = {c["candidate_run"]: c for c in report["candidates"]}
    assert sections["mindspore"]["framework"] == "mindspore"
    assert (sections["mindspore"]["status"], sections["mindspore"]["steps_compared"]) == ("aligned", STEPS)
    first = sections["paddle"]["first_divergence"]
    assert (sections["paddle"]["status"], first["step"], first["phase"], first["module"]) == (
        "diverged", 0, "forward", "layers.1.mlp.act")
    assert not results[2].halted  # the baseline went on for the MindSpore port
