"""One torch baseline, many candidates: the corpus in one session (three-way sessions).

A session may hold several candidates, each compared against the baseline on its own and
reported in its own section (Report.candidates). The bug corpus uses that: one torch
baseline serves a faithful candidate and every buggy candidate at once, so the baseline's
process (transformers' import, the weights file) is paid once per model instead of once
per bug. Each candidate is still its own process with its own --bug.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass

from tests.ports.corpus import ROOT


@dataclass(frozen=True)
class Candidate:
    run: str          # its run name in the session (unique)
    job: str          # the candidate job's module: tests.ports.paddle_job, tests.ports.mindspore_job
    steps: int
    bug: str | None = None
    args: tuple[str, ...] = ()  # more job flags (e.g. --warmup N, which the baseline must share)


def run_session(server: str, session: str, model: str, baseline_steps: int, candidates: list[Candidate],
                timeout: float = 900.0, baseline_args: tuple[str, ...] = ()) -> dict[str, str]:
    """Train the torch baseline and every candidate to the end; returns each run's output (raises if one fails)."""
    with tempfile.TemporaryDirectory() as tmp:
        weights = f"{tmp}/{session}.npz"
        common = ["--model", model, "--server", server, "--session", session, "--weights", weights]
        # The baseline attaches once every candidate has joined: a candidate joining after the baseline's
        # first steps went by would find them released (docs/three-way.md).
        commands = {"torch": [sys.executable, "-m", "tests.ports.torch_job", "--baseline", *common,
                              "--steps", str(baseline_steps), "--wait-for-runs", str(len(candidates)),
                              *baseline_args]}
        for c in candidates:
            commands[c.run] = [sys.executable, "-m", c.job, *common, "--run", c.run, "--steps", str(c.steps)]
            commands[c.run] += (["--bug", c.bug] if c.bug else []) + list(c.args)
        procs = {run: subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for run, cmd in commands.items()}
        outputs = {run: p.communicate(timeout=timeout)[0] for run, p in procs.items()}
        failed = [f"{run} exited {p.returncode}:\n{outputs[run][-3000:]}" for run, p in procs.items() if p.returncode]
        if failed:
            raise RuntimeError("\n".join(failed))
        return outputs
