"""The comparison sharded over Ray actors gives the embedded server's report, through a killed shard and a slow one.

Real processes throughout: a torch baseline of two ranks (DDP over gloo) and a paddle candidate of two ranks
(numbered as paddle.distributed.launch numbers them), the paddle port's rank 1 carrying a planted bug (tanh GELU
in layers.1.mlp.act), each rank its own process; one `twinstep serve --shards 2` process (a local Ray instance,
one actor per shard, each shard its own process) shared by the module's tests; and the embedded single-process
server (twinstep.server.serve) for the reference report.

Ranks go to shards by rank (rank % 2): rank 0 of both runs meets on shard 0, rank 1 on shard 1, so the planted bug
is seen by shard 1 alone, while shard 0 sees the candidate's parameter gradients part from the DDP-averaged
baseline's later in the same step: the coordinator must pick the global first divergence across shards.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import grpc
import pytest

pytest.importorskip("ray")  # the sharded server runs on Ray: only the leg that installs the `ray` extra has it

from tests.conftest import JOB_TIMEOUT, ROOT, Job, JobResult, wait_for  # noqa: E402
from twinstep.server import ServerConfig, serve  # noqa: E402
from twinstep.server.config import DiagnosisConfig  # noqa: E402
from twinstep.server.report.render import report_to_dict  # noqa: E402
from twinstep.v1 import twinstep_pb2 as pb  # noqa: E402
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc  # noqa: E402

SHARDS = 2
RANKS = 2
STEPS = 10
DELAY = 0.15  # seconds a step: the jobs are still training when a shard is killed or stopped
RUNS = ("torch", "paddle")
# Reports are compared field for field between separate executions of the jobs, so their statistics must be
# bit-reproducible: numpy's passes (the compiled kernels take over whenever their background load ends and sum
# in another order), one thread per job (threaded CPU kernels round differently from run to run).
DETERMINISTIC = {"TWINSTEP_JIT": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CPU_NUM": "1"}
# Both servers run with their defaults but one: auto_ops, which after a divergence asks every run for one module's
# operations at a step ahead of the furthest rank at that moment; which step, and whether the jobs still reach it,
# depends on timing, not on what was compared (docs/operations.md). Off on both, so both reports are timing-free.
NO_AUTO_OPS = ServerConfig(diagnosis=DiagnosisConfig(auto_ops=False))
SHARD_LINE = re.compile(r"twinstep shard (\d+): pid (\d+) at (\S+)")
RAY_DID_NOT_START = re.compile(r"The current node timed out during startup|Timed out waiting for file .*gcs_server_port")


class Training(Job):
    """One rank's training process; its output read as it comes, so a test can wait for a step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.text = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.text += line

    def last_trained(self) -> int:
        """The last step this rank finished training (-1: none yet)."""
        return max((int(m) for m in re.findall(r"\] step (\d+) loss", self.text)), default=-1)

    def wait(self, timeout: float = JOB_TIMEOUT) -> JobResult:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"job {self.run} did not finish in {timeout}s:\n{self.text}")
        self._reader.join(timeout=10)
        result = json.loads(self.result_file.read_text()) if self.result_file.exists() else {}
        return JobResult(self.process.returncode, self.text, result)


def start_pair(tmp: Path, address: str, session: str, *, steps: int = STEPS, delay: float = DELAY,
               extra: tuple[str, ...] = ()) -> list[Training]:
    """The torch baseline's two DDP ranks and the paddle candidate's two ranks, the bug on paddle's rank 1 only."""
    rendezvous = f"file://{tmp / f'rendezvous-{session}'}"  # no port to hand out: a file both torch ranks open
    common = ["--step-delay", str(delay), *extra]
    started = []
    for rank in range(RANKS):
        started.append(Training(tmp, "torch", server=address, session=session, run="torch", baseline=True,
                                steps=steps, extra=[*common, "--dist-init", rendezvous],
                                env={**DETERMINISTIC, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                     "WORLD_SIZE": str(RANKS)}))
        started.append(Training(tmp, "paddle", server=address, session=session, run="paddle", steps=steps,
                                bug="gelu_tanh" if rank == 1 else None, extra=common,
                                env={**DETERMINISTIC, "PADDLE_TRAINER_ID": str(rank),
                                     "PADDLE_TRAINERS_NUM": str(RANKS)}))
    return started


def finish(trainings: list[Training], steps: int = STEPS) -> list[JobResult]:
    """Every training ran to its last step and exited 0: fail-open, whatever happened to the server."""
    results = [t.wait() for t in trainings]
    for result in results:
        assert result.returncode == 0, result.output
        assert result.result["steps_completed"] == steps and not result.halted, result.output
    return results


def get_report(address: str, session: str) -> dict | None:
    """The session's report over gRPC, as the JSON `twinstep report --json` prints (None: not there yet)."""
    try:
        with grpc.insecure_channel(address) as channel:
            report = pb_grpc.TwinstepStub(channel).GetReport(pb.ReportRequest(session=session), timeout=10)
    except grpc.RpcError:
        return None
    return report_to_dict(report)


def ended(report: dict | None) -> bool:
    """Both runs have every rank and none is streaming any more."""
    if report is None:
        return False
    runs = {r["name"]: r for r in report["runs"]}
    return set(runs) == set(RUNS) and all(r["ranks"] == RANKS and r["state"] != "streaming" for r in runs.values())


def final_report(address: str, session: str) -> dict:
    return wait_for(lambda: (r := get_report(address, session)) is not None and ended(r) and r, timeout=60,
                    interval=0.2)


def streaming(address: str, session: str, step: int) -> dict | None:
    """The report once every rank of both runs is streaming and some rank has delivered ``step``."""
    report = get_report(address, session)
    if report is None:
        return None
    runs = {r["name"]: r for r in report["runs"]}
    if set(runs) != set(RUNS) or any(r["ranks"] != RANKS or r["last_step"] < step for r in runs.values()):
        return None
    return report


# What must be the same on the sharded server as on the embedded one. Expected to differ, and left out:
#   session                      the name: the sharded server's sessions of this module are named per test
#   runs[].environment, warnings what each process reported of its libraries at attach: the same machine, but not
#                                what is compared
#   runs[].steps_resent          how many steps clients sent again after a reconnect, which depends on when a fault
#                                struck (exactly once is checked on records_received, which stays)
#   runs[].capture_cost.boundary_seconds  wall time the training thread waited at step boundaries
#   runs[].capture_health        capture's own health, counted per process as the clients saw it
# Everything else, the merged report included (coverage, layouts, tree, stage, records), is compared whole.
SERVER_ONLY = ("environment", "warnings", "steps_resent", "capture_health", "health")


def comparable(report: dict) -> dict:
    data = json.loads(json.dumps(report))  # a deep copy
    data.pop("session", None)
    for run in data.get("runs", []):
        for key in SERVER_ONLY:
            run.pop(key, None)
        if run.get("capture_cost"):
            run["capture_cost"].pop("boundary_seconds", None)
    return data


def assert_same_report(report: dict, expected: dict) -> None:
    """Field by field first (the verdict, the first divergence, counts and coverage), then whole."""
    assert (report["status"], report["status_reasons"]) == (expected["status"], expected["status_reasons"])
    where = ("step", "phase", "module", "candidate_module", "rank", "candidate_run", "metric", "value", "tolerance")
    first, reference = report["first_divergence"], expected["first_divergence"]
    assert {k: first[k] for k in where} == {k: reference[k] for k in where}
    assert report["steps_compared"] == expected["steps_compared"]
    counts = ("name", "ranks", "first_step", "last_step", "state", "dropped", "dropped_by_reason", "records_received")
    assert [{k: r[k] for k in counts} for r in report["runs"]] == [{k: r[k] for k in counts} for r in expected["runs"]]
    assert report["coverage"] == expected["coverage"]
    differ = differences(comparable(report), comparable(expected))
    assert not differ, "the sharded report != the embedded one:\n" + "\n".join(differ)


def differences(a, b, path: str = "") -> list[str]:
    """Where two JSON documents differ, one line per leaf: a readable failure for a whole-report comparison."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [line for key in sorted(set(a) | set(b), key=str)
                for line in (differences(a[key], b[key], f"{path}/{key}") if key in a and key in b
                             else [f"{path}/{key}: only in {'the sharded' if key in a else 'the embedded'} report"])]
    if isinstance(a, list) and isinstance(b, list):
        lines = [f"{path}: {len(a)} items != {len(b)}"] if len(a) != len(b) else []
        return lines + [line for i, (x, y) in enumerate(zip(a, b)) for line in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r:.300} != {b!r:.300}"]


class ShardedServer:
    """`twinstep serve --shards 2` in a process of its own; its log kept, for its address and its shards' pids."""

    def __init__(self, *args: str) -> None:
        self.command = [sys.executable, "-m", "twinstep", "serve", "--port", "0", "--shards", str(SHARDS), *args]
        self.retried = ""
        self._start()

    def _start(self) -> None:
        self.process = subprocess.Popen(self.command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(self.process, self.lines), daemon=True).start()

    @staticmethod
    def _read(process: subprocess.Popen, lines: list[str]) -> None:
        for line in process.stdout:
            lines.append(line)

    def _listening(self) -> str | None:
        if self.process.poll() is not None:
            log = "".join(self.lines)
            # A local Ray instance sometimes fails to start on a loaded machine (its GCS, raylet or dashboard
            # process misses Ray's own start-up deadline) before any of twinstep runs: tried once more.
            if not self.retried and RAY_DID_NOT_START.search(log):
                self.retried = log
                self._start()
                return None
            raise AssertionError(f"twinstep serve --shards exited with {self.process.returncode}:\n{log}")
        found = next((m for line in list(self.lines) if (m := re.search(r"listening on (\S+)", line))), None)
        return found.group(1) if found else None

    @property
    def address(self) -> str:
        """The one address clients attach to (the front); waits for the listening line (Ray starts slowly)."""
        return wait_for(self._listening, timeout=180, interval=0.1)

    def shard_pid(self, index: int) -> int | None:
        """The process of shard ``index`` as the front last logged it (a restarted shard logs its new pid)."""
        pids = [int(m.group(2)) for line in list(self.lines)
                if (m := SHARD_LINE.search(line)) and int(m.group(1)) == index]
        return pids[-1] if pids else None

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Iterator[ShardedServer]:
    """One sharded server for the module (Ray starts once); its shards journal, so a killed one restores."""
    journal = tmp_path_factory.mktemp("sharded-journal")
    server = ShardedServer("--journal", str(journal), "--no-auto-ops", "--ray-cpus", "2")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def embedded(sharded, tmp_path_factory) -> dict:
    """The reference: the same jobs' report on the embedded single-process server.

    Asks for ``sharded`` first only so Ray starts while these jobs train.
    """
    handle = serve(port=0, config=NO_AUTO_OPS)
    tmp = tmp_path_factory.mktemp("embedded")
    try:
        started = start_pair(tmp, handle.address, "pair")
        try:
            finish(started)
        finally:
            for training in started:
                if training.process.poll() is None:
                    training.process.kill()
        return final_report(handle.address, "pair")
    finally:
        handle.stop(grace=0.5)


@pytest.fixture
def trainings() -> Iterator[list[Training]]:
    """A test's training processes, killed at teardown if a failed test left them running."""
    started: list[Training] = []
    yield started
    for training in started:
        if training.process.poll() is None:
            training.process.kill()
            training.process.wait()


def test_the_embedded_reference_finds_the_planted_bug_on_rank_1(embedded):
    first = embedded["first_divergence"]
    assert (first["step"], first["phase"], first["module"], first["rank"]) == (0, "forward", "layers.1.mlp.act", 1)
    assert embedded["status"] == "diverged" and embedded["steps_compared"] == STEPS
    for run in embedded["runs"]:
        assert (run["ranks"], run["last_step"], run["dropped"], run["state"]) == (RANKS, STEPS - 1, 0, "finished")


def test_the_sharded_server_gives_the_embedded_servers_report(sharded, embedded, tmp_path, trainings):
    trainings += start_pair(tmp_path, sharded.address, "pair")
    results = finish(trainings)
    report = final_report(sharded.address, "pair")
    assert_same_report(report, embedded)
    for index in range(SHARDS):  # both shards took part: each one's process was logged by the front
        assert sharded.shard_pid(index), sharded.log()
    for result in results:
        assert result.result["dropped"] == {}, result.output


def test_a_shard_killed_mid_run_is_restarted_and_the_report_is_unchanged(sharded, embedded, tmp_path, trainings):
    # A second a step: the kill lands early in the run even when a report through the front is slow to come.
    trainings += start_pair(tmp_path, sharded.address, "killed", delay=1.0)
    before = wait_for(lambda: streaming(sharded.address, "killed", 2), timeout=120, interval=0.1)
    old = sharded.shard_pid(1)
    assert old, sharded.log()
    os.kill(old, signal.SIGKILL)  # rank 1 of both runs loses its shard, and Ray restarts it from its journal
    wait_for(lambda: sharded.shard_pid(1) not in (None, old), timeout=120, interval=0.1)
    results = finish(trainings)
    assert max(r["last_step"] for r in before["runs"]) < STEPS - 2, "the shard was killed too late to test a restart"
    report = final_report(sharded.address, "killed")
    # Nothing acknowledged is lost, nothing counted twice: the fault-free report, records included.
    assert_same_report(report, embedded)
    for run in report["runs"]:
        assert run["dropped"] == 0 and run["last_step"] == STEPS - 1, run
    for result in results:
        assert result.result["dropped"] == {}, result.output


def test_a_slow_shard_drops_nothing_silently(sharded, embedded, tmp_path, trainings):
    # 30 steps, a send queue of 2: a shard that answers nothing for many steps makes its ranks' clients drop.
    steps, queue = 30, 2
    trainings += start_pair(tmp_path, sharded.address, "slow", steps=steps, extra=("--max-queue-steps", str(queue)))
    wait_for(lambda: streaming(sharded.address, "slow", 1), timeout=120, interval=0.1)
    pid = sharded.shard_pid(1)
    assert pid, sharded.log()
    slowed = [t for t in trainings if t.result_file.name.endswith("-1.json")]  # rank 1 of each run: shard 1's
    os.kill(pid, signal.SIGSTOP)  # alive, connected, answering nothing: a real slow shard
    try:
        stopped_at = {t.run: t.last_trained() for t in slowed}
        # Fail-open: its ranks train on while it answers nothing, further than the server lets a stream send
        # ahead (16 steps in flight by default) plus the client's queue.
        wait_for(lambda: all(t.last_trained() >= min(stopped_at[t.run] + 16 + queue + 2, steps - 1) for t in slowed),
                 timeout=120, interval=0.1)
    finally:
        os.kill(pid, signal.SIGCONT)
    results = finish(trainings, steps)
    report = final_report(sharded.address, "slow")
    check_accounting(report, embedded, trainings, results, steps)
    # The stopped shard's ranks dropped; the other shard's were not held back by it.
    assert any(r.result["dropped"] for t, r in zip(trainings, results) if t in slowed), [r.result for r in results]


def steps_in(gaps: list[dict]) -> set[int]:
    return {s for g in gaps for s in range(g["first_step"], g["last_step"] + 1)}


def check_accounting(report: dict, embedded: dict, trainings: list[Training], results: list[JobResult],
                     steps: int) -> None:
    """Every step each rank trained is compared, or named in the coverage as dropped with its reason, in the
    counts the clients themselves kept: nothing silently missing."""
    per_step = {r["name"]: r["records_received"] // (RANKS * STEPS) for r in embedded["runs"]}  # records a step
    coverage = report["coverage"]
    assert len(coverage) == 1 and coverage[0]["gaps_unlisted"] == 0, coverage
    gaps = coverage[0]["gaps"]
    assert all("send queue was full" in g["reason"] for g in gaps), gaps
    runs = {r["name"]: r for r in report["runs"]}
    client: dict[str, dict[str, int]] = {run: {} for run in RUNS}
    for training, result in zip(trainings, results):
        rank, dropped = result.result["rank"], result.result["dropped"]
        for reason, count in dropped.items():
            client[training.run][reason] = client[training.run].get(reason, 0) + count
        # What this rank's client dropped is named, step by step, in the coverage.
        named = steps_in([g for g in gaps if (g["run"], g["rank"]) == (training.run, rank)])
        assert len(named) == sum(dropped.values()), (training.run, rank, gaps, dropped)
    for name, run in runs.items():
        # Every step trained reached the server whole, or its client counted it dropped.
        received, partial = divmod(run["records_received"], per_step[name])
        assert partial == 0, (name, run["records_received"], per_step[name])
        assert received + sum(client[name].values()) == RANKS * steps, (name, received, client[name])
        # The report's counts are the clients' own, plus the steps the server received but could not compare
        # because the other run's same step never came ("unmatched"), each named as that run's gap.
        by_reason = dict(run["dropped_by_reason"])
        unmatched = by_reason.pop("unmatched", 0)
        assert by_reason == client[name], (name, run, client)
        expected = sum(len(steps_in([g for g in gaps if g["run"] != name and g["rank"] == rank])
                           - steps_in([g for g in gaps if g["run"] == name and g["rank"] == rank]))
                       for rank in range(RANKS))
        # (A candidate counts each such step; a baseline's step is kept for any candidate, so counted at most.)
        assert unmatched == expected if not run["baseline"] else unmatched <= expected, (name, unmatched, gaps)
    # Rank 0's compared steps (the schema's "compared", as the embedded server gives it) and the steps its gaps
    # name are every step; none is both.
    compared = {s for first, last in coverage[0]["compared"] for s in range(first, last + 1)}
    missed = steps_in([g for g in gaps if g["rank"] == 0])
    assert not compared & missed and compared | missed == set(range(steps)), (coverage[0]["compared"], gaps)
