"""Shared fixtures: an embedded server on a free loopback port, and real training jobs.

Jobs are separate processes running ``python -m twinstep.demo.job`` (torch or
paddle); they report through a JSON result file.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from twinstep import kernels
from twinstep.server import ServerConfig, serve

JOB_TIMEOUT = 240
ROOT = Path(__file__).resolve().parent.parent  # jobs run from here, so `-m tests....` modules import

_KERNELS = kernels._LOADER  # this process's compiled kernels (twinstep.kernels)


def use_numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host arithmetic takes numpy's passes: twinstep.kernels switched off (TWINSTEP_JIT=0)."""
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    monkeypatch.setattr(kernels, "_LOADER", kernels._Loader())


def use_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host arithmetic takes twinstep.kernels' compiled passes (numba is a dependency: they must load)."""
    assert _KERNELS.wait(120), f"twinstep.kernels did not load: {_KERNELS.state}"
    monkeypatch.setattr(kernels, "_LOADER", _KERNELS)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator:
    """An embedded server; parametrise indirectly with a dict of serve() kwargs."""
    kwargs = dict(getattr(request, "param", {}) or {})  # a copy: parametrised dicts are shared
    handle = serve(port=0, config=kwargs.pop("config", None) or ServerConfig(), **kwargs)
    yield handle
    handle.stop(grace=0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class JobResult:
    returncode: int
    output: str
    result: dict

    @property
    def halted(self) -> bool:
        return bool(self.result.get("halted"))


class Job:
    """One training process of the demo model."""

    def __init__(self, tmp: Path, framework: str, *, server: str, session: str, run: str | None = None,
                 baseline: bool = False, steps: int = 20, bug: str | None = None, capture: str = "stats",
                 extra: list[str] | None = None, env: dict[str, str] | None = None,
                 module: str = "twinstep.demo.job") -> None:
        self.run = run or framework
        rank = (env or {}).get("RANK", "0")
        self.result_file = tmp / f"{session}-{self.run}-{rank}.json"
        cmd = [sys.executable, "-m", module, "--framework", framework, "--run", self.run,
               "--server", server, "--session", session, "--steps", str(steps), "--capture", capture,
               "--result-file", str(self.result_file)]
        if baseline:
            cmd.append("--baseline")
        if bug:
            cmd += ["--bug", bug]
        cmd += extra or []
        self.process = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def wait(self, timeout: float = JOB_TIMEOUT) -> JobResult:
        try:
            output, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate()
            raise AssertionError(f"job {self.run} did not finish in {timeout}s:\n{output}")
        result = json.loads(self.result_file.read_text()) if self.result_file.exists() else {}
        return JobResult(self.process.returncode, output, result)


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator:
    """Factory for training jobs; kills leftovers at teardown."""
    started: list[Job] = []

    def start(framework: str, **kwargs) -> Job:
        job = Job(tmp_path, framework, **kwargs)
        started.append(job)
        return job

    yield start
    for job in started:
        if job.process.poll() is None:
            job.process.kill()
            job.process.wait()


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.05):
    """Poll until predicate() is truthy; return its value or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")
