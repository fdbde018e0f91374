"""Shared fixtures: an embedded server on a free loopback port, and real training jobs.

Jobs are separate processes running ``python -m twinstep.tools.demo.job`` (torch or
paddle); they report through a JSON result file.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from twinstep.runtime import kernels
from twinstep.server import ServerConfig, serve
from twinstep.server.config import SessionsConfig

JOB_TIMEOUT = 240
ROOT = Path(__file__).resolve().parent.parent  # jobs run from here, so `-m tests....` modules import

_KERNELS = kernels._LOADER  # this process's compiled kernels (twinstep.runtime.kernels)


def use_numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host arithmetic takes numpy's passes: twinstep.runtime.kernels switched off (TWINSTEP_JIT=0)."""
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    monkeypatch.setattr(kernels, "_LOADER", kernels._Loader())


def use_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host arithmetic takes twinstep.runtime.kernels' compiled passes (numba is a dependency: they must load)."""
    assert _KERNELS.wait(120), f"twinstep.runtime.kernels did not load: {_KERNELS.state}"
    monkeypatch.setattr(kernels, "_LOADER", _KERNELS)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator:
    """An embedded server; parametrise indirectly with a dict of serve() kwargs."""
    kwargs = dict(getattr(request, "param", {}) or {})  # a copy: parametrised dicts are shared
    # A lost run's reconnect grace is 30 s by default; tests that kill a run should not wait that long
    # (test_chaos.py reconnects within the default grace, test_durable_sessions.py across a restart).
    handle = serve(port=0, config=kwargs.pop("config", None) or ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5)), **kwargs)
    yield handle
    handle.stop(grace=0.5)


@pytest.fixture
def refused_address() -> Iterator[str]:
    """An address where a connection is refused: a port this test holds bound, with nothing listening.

    Held for the whole test, so no other process can take it meanwhile (unlike a port
    looked up free and released).
    """
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{held.getsockname()[1]}"


def serve_process(*args: str) -> tuple[subprocess.Popen, str]:
    """`twinstep serve` in a process of its own, on a port it binds itself; returns (process, address).

    Its log keeps being read in the background, so it never blocks on a full pipe.
    """
    process = subprocess.Popen([sys.executable, "-m", "twinstep", "serve", "--port", "0", *args], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        found = re.search(r"listening on (\S+)", line)
        if found:
            threading.Thread(target=process.stdout.read, daemon=True).start()
            return process, found.group(1)
    process.wait(timeout=10)
    raise AssertionError(f"twinstep serve exited with {process.returncode} before listening")


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
                 module: str = "twinstep.tools.demo.job") -> None:
        self.run = run or framework
        # One result file per process: torch's ranks say RANK, paddle's PADDLE_TRAINER_ID (two ranks writing one
        # file leave two JSON documents in it).
        rank = (env or {}).get("RANK", (env or {}).get("PADDLE_TRAINER_ID", "0"))
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


def run_status(server, session: str, run: str):
    """A run's row of the public report (None while the session or the run does not exist)."""
    try:
        report = server.report_proto(session)
    except KeyError:
        return None
    return next((r for r in report.runs if r.name == run), None)


def last_step(server, session: str, run: str) -> int:
    """The last step the server holds of a run (-1: none yet), from the public report."""
    status = run_status(server, session, run)
    return status.last_step if status is not None else -1


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.05):
    """Poll until predicate() is truthy; return its value or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")
