"""twinstep's trainer callbacks under real Trainers: transformers (torch, the baseline) vs paddleformers (paddle).

Two processes (tests/ports/trainer_job.py), each a library's own Trainer training the
test bed's tiny Llama from the same weights on the same micro-batches, 5 optimizer
steps of 2 accumulated micro-batches, AdamW; a real server over loopback.  Each job
trains twice: session "faithful" (same learning rate) and session "lr" (the paddle
job's TrainingArguments say 1.1e-3 instead of 1e-3).  The server halts on divergence.

What the two Trainers define differently by construction is left out on purpose
(docs/trainers.md): transformers scales each micro-batch's loss before backward and
paddleformers the accumulated gradients after it, so gradients with respect to
module outputs differ by the accumulation factor (``backward=False``); transformers'
model output holds the loss over the step's token count, paddleformers' over the
micro-batch's (the root module is excluded: ``exclude=[""]``; the loss phase, which
the callbacks record as the trainers report it, is compared); transformers 5.3 with
accelerate 1.15 steps on half the mean loss's gradient at 2 micro-batches, which the
paddle job reproduces (``--grad-scale 0.5``).

Skipped only when a Trainer cannot be imported in this environment (the job says why).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from tests.ports.corpus import ROOT
from tests.ports.trainer_job import CANNOT_IMPORT
from twinstep.server import serve

STEPS = 5
ACCUMULATION = 2
#: Both jobs' callback options: twinstep.attach's, passed through unchanged.
OPTIONS = {"backward": False, "exclude": [""], "lockstep": 2, "lockstep_timeout": 60}
JOB_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Both jobs run to their end against one server: (server handle, torch result, paddle result)."""
    tmp = tmp_path_factory.mktemp("trainers")
    handle = serve(port=0, halt_on_divergence=True)
    common = ["--server", handle.address, "--weights", str(tmp / "weights.npz"), "--steps", str(STEPS),
              "--accumulation", str(ACCUMULATION), "--options", json.dumps(OPTIONS)]
    jobs = {
        "torch": [*common, "--session", "faithful=1e-3", "--session", "lr=1e-3"],
        "paddle": [*common, "--session", "faithful=1e-3", "--session", "lr=1.1e-3",
                   "--grad-scale", str(1.0 / ACCUMULATION)],
    }
    procs = {}
    for framework, arguments in jobs.items():
        command = [sys.executable, "-m", "tests.ports.trainer_job", "--framework", framework, *arguments,
                   "--result-file", str(tmp / f"{framework}.json")]
        with open(tmp / f"{framework}.log", "w") as log:  # a file, not a pipe: a chatty trainer never blocks on it
            procs[framework] = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait(procs)
        outputs = {f: (tmp / f"{f}.log").read_text(errors="replace") for f in procs}
        for framework, proc in procs.items():
            if proc.returncode == CANNOT_IMPORT:
                pytest.skip(outputs[framework].strip().splitlines()[-1])
        for framework, proc in procs.items():
            assert proc.returncode == 0, f"{framework} job failed ({proc.returncode}):\n{outputs[framework][-4000:]}"
        results = {f: json.loads((tmp / f"{f}.json").read_text()) for f in procs}
        yield handle, results["torch"], results["paddle"]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        handle.stop(grace=0.5)


def _wait(procs: dict[str, subprocess.Popen]) -> None:
    """Until both jobs end; a job that cannot import its Trainer ends the other (it would wait for it)."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        if any(p.returncode == CANNOT_IMPORT for p in procs.values()):
            break
        time.sleep(0.2)
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def test_faithful_trainers_stay_aligned_over_accumulated_steps(trained):
    handle, torch_result, paddle_result = trained
    report = handle.report_proto("faithful")
    assert report.status == "aligned", f"{report.first_divergence} {list(report.status_reasons)}"
    assert report.steps_compared == STEPS
    assert torch_result["faithful"]["global_step"] == paddle_result["faithful"]["global_step"] == STEPS
    # Each phase the callbacks record was compared, the loss included (one record per optimizer step).
    compared = {h.phase for h in report.headroom}
    assert {"forward", "loss", "grad", "param"} <= compared, compared
    # Two micro-batches per step: every module was called twice per step, on both sides.
    last = handle.last_comparison("faithful")
    calls = {row.call_index for row in last.rows if row.phase == "forward" and row.name == "model.layers.0.mlp"}
    assert calls == {0, 1}


def test_callbacks_record_the_loss_each_trainer_reports(trained):
    """The step's loss under accumulation: transformers sums its token-normalised micro-batch losses,
    paddleformers averages its micro-batch means; each callback must record what its trainer logs."""
    _, torch_result, paddle_result = trained
    for framework, result in (("torch", torch_result), ("paddle", paddle_result)):
        recorded, logged = result["faithful"]["recorded_losses"], result["faithful"]["logged_losses"]
        assert len(recorded) == len(logged) == STEPS, (framework, recorded, logged)
        for step, (mine, theirs) in enumerate(zip(recorded, logged)):
            assert math.isclose(mine, theirs, rel_tol=1e-6), (framework, step, mine, theirs)
    # And the two trainers' losses agree (the server compared them at 1e-5 too).
    for a, b in zip(torch_result["faithful"]["recorded_losses"], paddle_result["faithful"]["recorded_losses"]):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)


def test_a_learning_rate_bug_is_found_in_the_first_update_and_stops_both_trainers(trained):
    handle, torch_result, paddle_result = trained
    report = handle.report_proto("lr")
    first = report.first_divergence
    assert (first.step, first.phase) == (0, "param"), first
    assert report.stage.startswith("optimizer:") and "learning rate" in report.stage, report.stage
    assert report.halted
    assert {r.name: r.state for r in report.runs} == {"torch": "halted", "paddle": "halted"}
    # The callbacks turned the server's halt into the trainers' own stop: both ended early, cleanly.
    for result in (torch_result, paddle_result):
        assert result["lr"]["halted"] is True
        assert result["lr"]["global_step"] < STEPS
