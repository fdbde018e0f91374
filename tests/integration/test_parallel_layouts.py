"""Runs of different parallel layouts compared live: real torch processes over gloo on the CPU, a real server.

The job (tests/integration/jobs/parallel_llama.py) trains a small Llama-like model at a
tensor-parallel (torch's parallelize_module on a CPU device mesh) or data-parallel
(DistributedDataParallel) layout; every layout computes the same training, so a TP=2 or DP=2 run
is compared with a one-process baseline per logical tensor, and a bug of the parallel port is
found where it starts.  Multi-process runs start under torch.distributed.run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import JOB_TIMEOUT, ROOT, wait_for
from twinstep.server import ServerConfig, serve
from twinstep.server.config import SessionsConfig
from twinstep.server.report.render import render_text

JOB = ROOT / "tests" / "integration" / "jobs" / "parallel_llama.py"
CORRUPTED = "model.layers.1.mlp.down_proj.weight"  # the gradient --bug corrupt_replica changes (the job's CORRUPTED)
SETTLE_TIMEOUT = 60


@pytest.fixture(scope="module")
def server() -> Iterator:
    handle = serve(port=0, config=ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5)))
    yield handle
    handle.stop(grace=0.5)


class Training:
    """One run of the job: one process, or torch.distributed.run with one process per rank."""

    def __init__(self, results: Path, address: str, session: str, run: str, *, tp: int = 1, dp: int = 1,
                 steps: int, baseline: bool = False, bug: str | None = None, extra: tuple[str, ...] = ()) -> None:
        self.run, self.ranks, self.results = run, tp * dp, results
        job = [str(JOB), "--tp", str(tp), "--dp", str(dp), "--steps", str(steps), "--quiet",
               "--session", session, "--run-name", run, "--server", address, "--result-dir", str(results), *extra]
        if baseline:
            job.append("--baseline")
        if bug:
            job += ["--bug", bug]
        # --standalone: the launcher's rendezvous takes a free port itself (no port handed out and raced for).
        launcher = [] if self.ranks == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                               str(self.ranks)]
        drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TWINSTEP_") and k not in drop}
        self.process = subprocess.Popen([sys.executable, *launcher, *job], cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        env={**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})

    def wait(self) -> list[dict]:
        """Every rank's summary, once the run ended well."""
        try:
            output, _ = self.process.communicate(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate()
            raise AssertionError(f"run {self.run} did not finish in {JOB_TIMEOUT} s:\n{output}")
        assert self.process.returncode == 0, f"run {self.run} exited {self.process.returncode}:\n{output}"
        summaries = [json.loads((self.results / f"{self.run}-rank{rank}.json").read_text())
                     for rank in range(self.ranks)]
        assert all(not s["halted"] for s in summaries), output
        return summaries


@pytest.fixture
def train(server, tmp_path) -> Iterator:
    """Starts runs of the job against the module's server; kills what is left at teardown."""
    started: list[Training] = []

    def start(session: str, run: str, **options) -> Training:
        training = Training(tmp_path, server.address, session, run, **options)
        started.append(training)
        return training

    yield start
    for training in started:
        if training.process.poll() is None:
            training.process.kill()
            training.process.wait()


def describe(report) -> str:
    """The report as a user reads it, and the fields of parallel layouts, for an assertion's message."""
    layouts = [f"  run {r.name!r}: layout_text={r.layout_text!r} layout={{{_fields(r.layout)}}}" for r in report.runs]
    return "\n".join([
        render_text(report),
        f"layout_mode={report.layout_mode!r} layout_summary={report.layout_summary!r}", *layouts,
        f"first_divergence={{{_fields(report.first_divergence)}}}" if report.HasField("first_divergence") else "",
        *(f"layout difference: {{{_fields(d)}}}" for d in report.layout_differences),
        *(f"replica mismatch: {{{_fields(m)}}}" for m in report.replica_mismatches),
    ])


def _fields(message) -> str:
    return ", ".join(f"{field.name}={value!r}" for field, value in message.ListFields()
                     if field.name not in ("path", "origin", "crossed", "gaps_before", "explained_by"))


def settled(server, session: str, runs: int):
    """The session's report once every one of its ``runs`` has ended and the server has compared what it held."""

    def ended():
        try:
            report = server.report_proto(session)
        except KeyError:
            return None
        done = len(report.runs) == runs and all(r.state in ("finished", "halted") for r in report.runs)
        return report if done and report.status != "running" else None

    try:
        return wait_for(ended, timeout=SETTLE_TIMEOUT, interval=0.1)
    except AssertionError:
        raise AssertionError(f"session {session!r} did not settle in {SETTLE_TIMEOUT} s:\n"
                             f"{describe(server.report_proto(session))}") from None


def assert_captured_everything(report) -> None:
    """No rank of any run failed to capture a record (DTensor parameters, gradients and inputs included)."""
    failures = [(r.name, h.rank, f.name, f.error) for r in report.runs for h in r.health for f in h.capture.failures]
    assert not failures, f"{failures}\n{describe(report)}"
    assert all(h.capture.failed_steps == 0 for r in report.runs for h in r.health), describe(report)


def assert_aligned(report, steps: int) -> None:
    """Aligned over ``steps`` steps, nothing declared wrong and nothing left out because of the layouts."""
    text = describe(report)
    assert report.status == "aligned", text
    assert report.steps_compared == steps, text
    assert not report.HasField("first_divergence"), text
    assert not any(c.HasField("first_divergence") for c in report.candidates), text
    assert not report.layout_differences, text
    assert not report.replica_mismatches, text
    assert not report.unmatched_baseline and not report.unmatched_candidate, text
    assert_captured_everything(report)


def runs_of(report) -> dict:
    return {r.name: r for r in report.runs}


def first_divergence(report) -> tuple[int, str, str]:
    assert report.status == "diverged" and report.HasField("first_divergence"), describe(report)
    first = report.first_divergence
    return first.step, first.phase, first.module


# -- tensor parallelism: TP=2 against one process -----------------------------------------------------------


def test_tensor_parallel_port_stays_aligned_with_its_one_process_baseline(server, train):
    steps = 20
    runs = [train("tp-faithful", "tp1", steps=steps, baseline=True),
            train("tp-faithful", "tp2", tp=2, steps=steps)]
    for run in runs:
        run.wait()
    report = settled(server, "tp-faithful", 2)
    assert_aligned(report, steps)
    # Two layouts, so each run's ranks are merged per logical tensor before they are compared.
    assert report.layout_mode == "logical" and report.layout_summary, describe(report)
    baseline, candidate = runs_of(report)["tp1"], runs_of(report)["tp2"]
    assert candidate.ranks == 2 and candidate.layout.tensor_size == 2, describe(report)
    assert candidate.layout.source in ("torch-tp", "dtensor"), describe(report)
    assert "TP=2" in candidate.layout_text, describe(report)
    assert baseline.ranks == 1 and baseline.layout.tensor_size <= 1 and baseline.layout_text, describe(report)
    assert "TP=2" not in baseline.layout_text, describe(report)


def test_a_wrong_head_split_on_one_shard_is_found_where_attention_uses_it(server, train):
    runs = [train("tp-heads", "tp1", steps=3, baseline=True),
            train("tp-heads", "tp2", tp=2, steps=3, bug="tp_heads_order")]
    for run in runs:
        run.wait()
    report = settled(server, "tp-heads", 2)
    assert report.layout_mode == "logical", describe(report)
    # Rank 1 reverses its q heads inside self_attn's own forward, after q_proj ran: q, k and v projections
    # match, and the first module whose output differs is o_proj.  Its input (the attention's result, split by
    # heads across the shards, merged here) already differs while every hooked module before it matches, so
    # the culprit is the parent's own code: model.layers.0.self_attn, not o_proj.
    assert first_divergence(report) == (0, "forward", "model.layers.0.self_attn.o_proj"), describe(report)
    assert "in model.layers.0.self_attn (Attention)" in report.culprit, describe(report)
    assert "creates the error" not in report.culprit, describe(report)
    assert "'tp2'" in report.first_divergence.merged_from, describe(report)  # reduced: one replica per rank
    assert_captured_everything(report)


def test_a_row_parallel_bias_added_on_every_shard_is_found_at_that_projection(server, train):
    runs = [train("tp-bias", "tp1", steps=3, baseline=True, extra=("--o-bias",)),
            train("tp-bias", "tp2", tp=2, steps=3, bug="rowwise_bias", extra=("--o-bias",))]
    for run in runs:
        run.wait()
    report = settled(server, "tp-bias", 2)
    assert report.layout_mode == "logical", describe(report)
    # o_proj's input (the attention's result, split by heads, merged) matches; its reduced output carries one
    # bias too many: o_proj itself creates the error.
    assert first_divergence(report) == (0, "forward", "model.layers.0.self_attn.o_proj"), describe(report)
    assert "origin: model.layers.0.self_attn.o_proj (Linear) creates the error" in report.culprit, describe(report)
    assert_captured_everything(report)


def test_the_same_tensor_parallel_layout_on_both_sides_is_compared_rank_by_rank(server, train):
    steps = 5
    runs = [train("tp-same", "base", tp=2, steps=steps, baseline=True),
            train("tp-same", "cand", tp=2, steps=steps)]
    for run in runs:
        run.wait()
    report = settled(server, "tp-same", 2)
    # Every parameter, gradient and input of a tensor-parallel module is a DTensor (or a shard of one): captured.
    assert_aligned(report, steps)
    assert report.layout_mode == "ranks", describe(report)
    assert {r.name: r.layout.tensor_size for r in report.runs} == {"base": 2, "cand": 2}, describe(report)


# -- data parallelism: DP=2 against one process, the same global batch ------------------------------------


def test_data_parallel_port_stays_aligned_with_its_one_process_baseline(server, train):
    steps = 10
    runs = [train("dp-faithful", "dp1", steps=steps, baseline=True),
            train("dp-faithful", "dp2", dp=2, steps=steps)]
    for run in runs:
        run.wait()
    report = settled(server, "dp-faithful", 2)
    assert_aligned(report, steps)
    assert report.layout_mode == "logical", describe(report)
    candidate = runs_of(report)["dp2"]
    assert candidate.layout.data_size == 2 and candidate.layout.source == "ddp", describe(report)
    assert "DP=2" in candidate.layout_text, describe(report)


def test_gradients_averaged_over_the_wrong_group_size_are_found_at_the_gradients(server, train):
    runs = [train("dp-group", "dp1", steps=3, baseline=True),
            train("dp-group", "dp2", dp=2, steps=3, bug="dp_group_size")]
    for run in runs:
        run.wait()
    report = settled(server, "dp-group", 2)
    assert report.layout_mode == "logical", describe(report)
    # Activations, the loss and the activations' gradients match once the replicas' batches are merged; the
    # parameters' gradients, averaged over twice the group, are half the baseline's: every one of them, the first
    # compared being lm_head's (the first that backward produces).
    assert first_divergence(report) == (0, "grad", "lm_head.weight"), describe(report)
    assert "x0.5" in report.stage, describe(report)
    assert "'dp2'" in report.first_divergence.merged_from, describe(report)  # the replicas' gradient, merged
    assert not report.replica_mismatches, describe(report)  # wrong on every replica alike: not a replica's fault


def test_a_corrupted_replica_is_named_on_its_run_alone(server, train):
    # Three replicas, no candidate: the replicas of one run must agree after their gradients' reduction.
    run = train("dp-corrupt", "dp3", dp=3, steps=3, baseline=True, bug="corrupt_replica", extra=("--batch", "6"))
    run.wait()
    report = settled(server, "dp-corrupt", 1)  # every step the run sent has been through the server
    assert report.replica_mismatches, describe(report)
    assert not report.HasField("first_divergence"), describe(report)  # a finding of one run, not a divergence
    first = min(report.replica_mismatches, key=lambda m: (m.step, m.phase != "grad"))
    assert (first.run, first.step, first.phase, first.name) == ("dp3", 0, "grad", CORRUPTED), describe(report)
    assert list(first.ranks) == [2] and sorted(first.agreeing) == [0, 1], describe(report)
    assert first.text and "2" in first.text, describe(report)
    # Every odd replica named is the corrupted one (its parameters drift from the others' after the update).
    assert {rank for m in report.replica_mismatches for rank in m.ranks} == {2}, describe(report)
