"""No first divergence across an uncompared gap without the gap named; coverage said exactly.

Real torch and paddle jobs in their own processes, a real server.  Each test
makes one kind of gap on purpose: capture that fails for the first steps and
then recovers, a send queue that overflows while the server is paused, a run
that captures every 2nd step (a declared gap, not a hole), and a candidate
that joins at step 5.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import jsonschema
import pytest

from tests.conftest import ROOT, serve_process, wait_for
from tests.integration.test_capture_health import FAULTY, Watcher
from twinstep.server.report.render import render_text, report_schema
from twinstep.server.config import config_from_dict

CAPTURE_FAILED = "capture failed: StepNotCaptured: every record failed; the first: AttributeError"


def _pair(jobs, server, session, *, steps, cand_extra=(), base_extra=(), bug=None, module="twinstep.tools.demo.job"):
    base = jobs("torch", server=server.address, session=session, baseline=True, steps=steps, extra=list(base_extra))
    cand = jobs("paddle", server=server.address, session=session, steps=steps, bug=bug, module=module,
                extra=list(cand_extra))
    return base.wait(), cand.wait()


@pytest.mark.parametrize("server", [{"halt_on_divergence": True}], indirect=True)
def test_divergence_after_failed_steps_is_earliest_among_compared_and_names_the_gap(server, jobs):
    watcher = Watcher(server.address, "recovers")
    base, cand = _pair(jobs, server, "recovers", steps=40, bug="gelu_tanh", module=FAULTY,
                       cand_extra=["--fault=stats-until=3", "--lockstep", "1"], base_extra=["--lockstep", "1"])
    assert base.returncode == 0 and cand.returncode == 0, cand.output
    report = server.report_proto("recovers")
    first = report.first_divergence
    # The bug is at step 0, but steps 0 to 2 were never captured on the paddle side.
    assert (first.step, first.phase, first.module) == (3, "forward", "layers.1.mlp.act")
    assert first.after_gap
    (gap,) = first.gaps_before
    assert (gap.run, gap.first_step, gap.last_step, gap.phase) == ("paddle", 0, 2, "")
    assert gap.reason.startswith(CAPTURE_FAILED), gap.reason
    # The halt went ahead (halt_after_gap defaults to on), and says why it is less certain.
    assert cand.halted and "after a gap" in cand.result["halt_reason"] and "steps 0 to 2" in cand.result["halt_reason"]
    text = render_text(report)
    assert "after a gap" in text and "steps 0 to 2 (run 'paddle': capture failed" in text
    document = server.report("recovers")
    jsonschema.validate(document, report_schema())
    assert document["first_divergence"]["after_gap"] is True
    assert document["first_divergence"]["gaps_before"][0]["last_step"] == 2
    wait_for(lambda: any("AFTER A GAP" in line for line in watcher.lines))
    wait_for(lambda: any("comes after steps that were not compared" in line for line in watcher.lines))
    watcher.close()


@pytest.mark.parametrize("server", [{"config": config_from_dict({"halt": {"on_divergence": True, "after_gap": False}})}], indirect=True)
def test_halt_after_gap_off_holds_the_halt_for_the_user(server, jobs):
    watcher = Watcher(server.address, "hold")
    base, cand = _pair(jobs, server, "hold", steps=6, bug="gelu_tanh", module=FAULTY,
                       cand_extra=["--fault=stats-until=2"])
    assert not base.halted and not cand.halted
    assert cand.result["steps_completed"] == 6
    report = server.report_proto("hold")
    assert report.status == "diverged" and report.first_divergence.after_gap and not report.halted
    assert report.first_divergence.step == 2
    wait_for(lambda: any("not halting" in line and "halt_after_gap" in line for line in watcher.lines))
    watcher.close()


def test_faithful_run_with_failed_first_steps_is_incomplete_with_its_coverage(server, jobs):
    _pair(jobs, server, "partial", steps=6, module=FAULTY, cand_extra=["--fault=stats-until=3"])
    report = server.report_proto("partial")
    assert report.status == "incomplete" and not report.HasField("first_divergence")
    (coverage,) = report.coverage
    assert [(r.first, r.last) for r in coverage.compared] == [(3, 5)]
    assert coverage.summary.startswith("compared steps 3 to 5 (3 step(s)); not compared: steps 0 to 2 "
                                       "(run 'paddle': capture failed"), coverage.summary
    assert any(r.startswith("run 'paddle': not compared: steps 0 to 2 (run 'paddle': capture failed")
               for r in report.status_reasons), report.status_reasons
    assert report.long_run[0].coverage == coverage.summary
    jsonschema.validate(server.report("partial"), report_schema())


def test_every_second_step_is_a_declared_gap_not_a_hole(server, jobs):
    _pair(jobs, server, "every", steps=6, cand_extra=["--every", "2"])
    report = server.report_proto("every")
    assert report.status == "aligned" and list(report.status_reasons) == []
    (coverage,) = report.coverage
    assert [(r.first, r.last) for r in coverage.compared] == [(0, 0), (2, 2), (4, 4)]
    assert not coverage.gaps and list(coverage.declared) == ["run 'paddle' captures every 2 steps (every=2)"]
    document = server.report("every")
    jsonschema.validate(document, report_schema())
    assert document["coverage"][0]["compared"] == [[0, 0], [2, 2], [4, 4]]
    _pair(jobs, server, "every-bug", steps=4, bug="gelu_tanh", cand_extra=["--every", "2"])
    first = server.report_proto("every-bug").first_divergence
    assert (first.step, first.module, first.after_gap) == (0, "layers.1.mlp.act", False)


def test_a_candidate_that_joins_at_step_5(server, jobs):
    _pair(jobs, server, "late", steps=8, bug="gelu_tanh", cand_extra=["--start-step", "5"])
    report = server.report_proto("late")
    first = report.first_divergence
    # Five unwatched steps of the buggy activation moved the weights: at step 5 the first module
    # to differ is wherever that shows first, not the activation.  Exactly why the gap must be named.
    assert (first.step, first.phase, first.after_gap) == (5, "forward", True)
    (gap,) = first.gaps_before
    assert (gap.run, gap.first_step, gap.last_step, gap.reason) == ("paddle", 0, 4, "run 'paddle' started at step 5")
    _pair(jobs, server, "late-ok", steps=8, cand_extra=["--start-step", "5"])
    report = server.report_proto("late-ok")
    assert report.status == "incomplete"
    assert report.coverage[0].summary == ("compared steps 5 to 7 (3 step(s)); not compared: steps 0 to 4 "
                                          "(run 'paddle' started at step 5)")
    document = server.report("late-ok")
    jsonschema.validate(document, report_schema())
    assert document["coverage"][0]["gaps"] == [{"run": "paddle", "rank": 0, "first_step": 0, "last_step": 4,
                                                "phase": None, "reason": "run 'paddle' started at step 5"}]


class _Lines:
    """A job's output, read as it comes."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.text = ""
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self.text += line

    def reached(self, step: int) -> bool:
        return f" step {step} loss" in self.text


def test_queue_that_overflows_while_the_server_is_paused(tmp_path):
    server, address = serve_process()
    try:
        server.send_signal(signal.SIGSTOP)  # alive, connected, answering nothing
        common = ["--server", address, "--session", "paused", "--steps", "20", "--max-queue-steps", "3",
                  "--step-delay", "0.2"]
        jobs = [subprocess.Popen([sys.executable, "-m", "twinstep.tools.demo.job", "--framework", framework, *common, *extra],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for framework, extra in (("torch", ["--baseline"]), ("paddle", ["--bug", "gelu_tanh"]))]
        outputs = [_Lines(job) for job in jobs]
        wait_for(lambda: all(out.reached(8) for out in outputs), timeout=120)
        server.send_signal(signal.SIGCONT)
        for job in jobs:
            assert job.wait(timeout=120) == 0
        report = json.loads(subprocess.run([sys.executable, "-m", "twinstep", "report", "paused", "--server", address,
                                            "--json"], capture_output=True, text=True, check=True, cwd=ROOT).stdout)
    finally:
        server.send_signal(signal.SIGCONT)
        server.terminate()
        server.wait(timeout=30)
    jsonschema.validate(report, report_schema())
    runs = {r["name"]: r for r in report["runs"]}
    assert runs["torch"]["dropped_by_reason"].get("queue_full", 0) >= 3, runs
    assert runs["paddle"]["dropped_by_reason"].get("queue_full", 0) >= 3, runs
    first = report["first_divergence"]
    # Where it shows depends on how many buggy steps went unseen: only the gap is certain.
    assert first["after_gap"] is True and first["step"] > 0, first
    gaps = first["gaps_before"]
    assert gaps and gaps[0]["first_step"] == 0, gaps
    assert all("send queue was full" in g["reason"] for g in gaps), gaps
    # Every step before the divergence is either compared or in a named gap.
    named = {s for g in gaps for s in range(g["first_step"], g["last_step"] + 1)}
    assert named == set(range(first["step"])), (named, first["step"])
    assert report["status"] == "diverged" and report["coverage"][0]["gaps"], report["coverage"]
