"""`twinstep run` on unmodified scripts: real processes, real torch and paddle, a real server over loopback.

The scripts (tests/integration/jobs/plain_torch.py, plain_paddle.py) are plain
loops that never mention twinstep unless given ``--explicit-attach``, which
writes ``twinstep.attach(model)`` / ``mon.step(loss)`` into the same loop: the
twin every zero-code verdict is checked against.  Every job of the file starts
at once (a module fixture) so their imports overlap; each test waits for its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import ROOT, last_step, wait_for
from twinstep.server import ServerConfig, serve
from twinstep.server.config import SessionsConfig

JOBS = ROOT / "tests" / "integration" / "jobs"
TIMEOUT = 240
STEPS = 3
ATTACHED = "attached to TinyLM"


class Process:
    """One command, its output collected by ``wait``."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path = ROOT) -> None:
        self.command = command
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        self.output: str | None = None

    def wait(self) -> str:
        if self.output is None:
            try:
                self.output, _ = self.process.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.output, _ = self.process.communicate()
                raise AssertionError(f"{self.command} did not finish in {TIMEOUT} s:\n{self.output}")
        assert self.process.returncode == 0, f"{self.command} exited {self.process.returncode}:\n{self.output}"
        return self.output


def clean_env(**variables: str) -> dict[str, str]:
    """This environment without any TWINSTEP_* or launcher variable, plus ``variables``."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINSTEP_") and k not in drop}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **variables}


def twinstep_run(options: list[str], command: list[str], env: dict[str, str] | None = None) -> Process:
    return Process([sys.executable, "-m", "twinstep", "run", *options, "--", *command], env or clean_env())


def script(framework: str, *args: str) -> list[str]:
    return [sys.executable, str(JOBS / f"plain_{framework}.py"), "--steps", str(STEPS), *args]


@pytest.fixture(scope="module")
def server() -> Iterator:
    handle = serve(port=0, config=ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5)))
    yield handle
    handle.stop(grace=0.5)


@pytest.fixture(scope="module")
def launched(server, tmp_path_factory) -> Iterator[dict[str, Process]]:
    """Every training of this file, started together."""
    tmp = tmp_path_factory.mktemp("zero-code")
    address = server.address
    config = tmp / "twinstep.yaml"
    config.write_text(f"session: twin\nserver: {address}\nruns:\n  zero-code:\n    stats_workers: 0\n")

    def explicit(framework: str, session: str, run: str, baseline: bool, *args: str) -> Process:
        env = clean_env(TWINSTEP_SESSION=session, TWINSTEP_RUN=run, TWINSTEP_SERVER=address,
                        TWINSTEP_BASELINE="1" if baseline else "0")
        return Process(script(framework, "--explicit-attach", *args), env)

    started = {
        # Same script, same framework: twinstep run (by config file alone) against attach written in (by environment).
        "twin-explicit": explicit("torch", "twin", "explicit", True, "--accumulate", "2"),
        "twin-zero-code": twinstep_run(["--config", str(config), "--run", "zero-code"],
                                       script("torch", "--accumulate", "2")),
        # A porting bug, found by zero-code runs (options; environment alone) and by explicit ones.
        "bug-torch": twinstep_run(["--session", "bug-zero-code", "--run", "torch", "--baseline", "--server", address],
                                  script("torch")),
        "bug-paddle": twinstep_run([], script("paddle", "--bug", "gelu_tanh"),
                                   clean_env(TWINSTEP_SESSION="bug-zero-code", TWINSTEP_RUN="paddle",
                                             TWINSTEP_SERVER=address)),
        "bug-explicit-torch": explicit("torch", "bug-explicit", "torch", True),
        "bug-explicit-paddle": explicit("paddle", "bug-explicit", "paddle", False, "--bug", "gelu_tanh"),
        # Two ranks per run, under the frameworks' own launchers.
        "ranks-torch": twinstep_run(
            ["--session", "ranks", "--run", "torch", "--baseline", "--server", address],
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             *script("torch")[1:]]),
        "ranks-paddle": twinstep_run(
            ["--session", "ranks", "--run", "paddle", "--server", address],
            [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
             str(tmp / "paddle-logs"), *script("paddle")[1:]]),
    }
    started["paddle-logs"] = tmp / "paddle-logs"  # type: ignore[assignment]
    yield started
    for process in started.values():
        if isinstance(process, Process) and process.process.poll() is None:
            process.process.kill()
            process.process.wait()


def comparison_keys(server, session: str) -> set[tuple[str, str, int, int]]:
    """(phase, module or parameter, call, slot) of every record the server compared in the last step."""
    return set(server.last_comparison(session).keys)


def test_zero_code_captures_what_explicit_attach_does_record_for_record(server, launched):
    explicit, zero_code = launched["twin-explicit"].wait(), launched["twin-zero-code"].wait()
    assert ATTACHED not in explicit and zero_code.count(ATTACHED) == 1, zero_code
    report = server.report_proto("twin")
    assert report.status == "aligned" and report.steps_compared == STEPS, report
    assert not report.unmatched_baseline and not report.unmatched_candidate, report
    keys = comparison_keys(server, "twin")
    phases = {phase for phase, *_ in keys}
    assert {"forward", "backward", "grad", "param", "loss"} <= phases, phases
    # Two micro-batches a step: every module called twice in the step, as attach counts calls.
    assert ("forward", "layers.1.mlp.act", 1, 0) in keys and ("backward", "layers.1.mlp.act", 1, 0) in keys
    comparison = server.last_comparison("twin")
    assert comparison.step == STEPS - 1
    # The same script computes the same numbers either way: every record equal (to the rounding of the statistics
    # passes), the loss (the sum of the scaled micro-batch losses) included.
    assert all(float(values.max(initial=0.0)) <= 1e-6 for values in comparison.values.values()), comparison.values


def test_zero_code_finds_the_porting_bug_where_explicit_attach_does(server, launched):
    for name in ("bug-torch", "bug-paddle", "bug-explicit-torch", "bug-explicit-paddle"):
        launched[name].wait()
    zero_code = server.report("bug-zero-code")["first_divergence"]
    explicit = server.report("bug-explicit")["first_divergence"]
    where = ("step", "phase", "module", "rank", "metric")
    assert [zero_code[k] for k in where] == [explicit[k] for k in where], (zero_code, explicit)
    assert (zero_code["step"], zero_code["phase"], zero_code["module"]) == (0, "forward", "layers.1.mlp.act")
    assert comparison_keys(server, "bug-zero-code") == comparison_keys(server, "bug-explicit")
    assert "run 'paddle' (session 'bug-zero-code'" in launched["bug-paddle"].output  # named by the environment alone


def test_two_ranks_per_run_under_torchrun_and_paddle_launch(server, launched):
    torch_output = launched["ranks-torch"].wait()
    launched["ranks-paddle"].wait()
    paddle_output = "".join(p.read_text() for p in sorted(launched["paddle-logs"].glob("workerlog.*")))
    for output, run in ((torch_output, "torch"), (paddle_output, "paddle")):
        for rank in range(2):
            assert output.count(f"run {run!r} (rank {rank} of 2") == 1, output
    assert "inside DistributedDataParallel" in torch_output and "inside DataParallel" in paddle_output
    report = server.report("ranks")
    assert {r["name"]: r["ranks"] for r in report["runs"]} == {"torch": 2, "paddle": 2}, report
    assert report["status"] == "aligned" and report["steps_compared"] == STEPS, report
    assert {r["state"] for r in report["runs"]} == {"finished"}


def test_a_halt_ends_an_unmodified_script_with_one_line(server, launched):
    for name in launched:  # after the other jobs: this one trains until halted
        if isinstance(launched[name], Process):
            launched[name].process.wait(timeout=TIMEOUT)
    job = twinstep_run(["--session", "halt", "--run", "torch", "--baseline", "--server", server.address],
                       [sys.executable, str(JOBS / "plain_torch.py"), "--steps", "100000", "--quiet"])
    wait_for(lambda: last_step(server, "halt", "torch") >= 1, timeout=120)
    assert "torch" in server.halt("halt", "stopped by the test")
    output, _ = job.process.communicate(timeout=60)
    assert job.process.returncode == 1, output
    assert "twinstep: the server halted this run at step" in output and "stopped by the test" in output, output
    assert "Traceback" not in output and "steps/s" not in output, output


def test_run_execs_the_command_chaining_sitecustomize_and_keeping_its_exit_code(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("MARK = 'the site one ran'\n")
    env = clean_env(PYTHONPATH=str(tmp_path))
    probe = ("import os, sys, sitecustomize; print(sitecustomize.MARK); "
             "print('armed', 'twinstep.runtime.autoattach' in sys.modules, os.environ['TWINSTEP_EVERY']); sys.exit(7)")
    ran = subprocess.run([sys.executable, "-m", "twinstep", "run", "--session", "s", "--run", "r", "--server",
                          "127.0.0.1:9", "--every", "3", "--", sys.executable, "-c", probe],
                         env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 7, ran.stderr
    assert ran.stdout.splitlines() == ["the site one ran", "armed True 3"], ran.stdout + ran.stderr


@pytest.mark.parametrize("options, message, code", [
    (["--every", "0"], "--every must be an integer >= 1, got '0'", 2),
    (["--server", ""], "no server given", 2),
    # What attach would refuse inside the training is refused here, before it starts (docs/distributed.md).
    (["--server", "http://127.0.0.1:9"], "twinstep run: server address 'http://127.0.0.1:9' has a URL scheme; "
                                         "twinstep speaks gRPC to host:port ('127.0.0.1:9'?)", 2),
    (["--server", "127.0.0.1"], "twinstep run: server address '127.0.0.1' has no port; expected host:port", 2),
    (["--tls-ca", "/no/such/ca.pem"], "twinstep run: cannot read the TLS CA /no/such/ca.pem: No such file or "
                                      "directory", 2),
    (["--tls-client-cert", "/no/such/client.crt"], "twinstep run: a client certificate needs its key too", 2),
    (["--token", "two words"], "twinstep run: the token must be printable text without spaces", 2),
    (["--insecure", "--tls-ca", "/no/such/ca.pem"], "twinstep run: insecure (plaintext) was asked for together "
                                                     "with TLS files; choose one", 2),
    (["--baseline", "--init-from-baseline"], "twinstep run: init_from_baseline is for candidates and references", 2),
    (["--sync-batches", "--baseline"], "twinstep run: sync_batches is a candidate's", 2),
    ([], "no-such-program-for-twinstep' was not found", 127),
])
def test_run_refuses_before_starting_the_training(tmp_path, options, message, code):
    marker = tmp_path / "ran"
    command = ["no-such-program-for-twinstep"] if code == 127 else [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    ran = subprocess.run([sys.executable, "-m", "twinstep", "run", "--session", "s", "--run", "r",
                          "--server", "127.0.0.1:9", *options, "--", *command],
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert ran.returncode == code and message in ran.stderr, ran.stderr
    assert not marker.exists()
