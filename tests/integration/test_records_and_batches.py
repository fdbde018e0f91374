"""Batch sync and named records, end to end (docs/records-and-batches.md).

Real torch baselines and paddle candidates in their own processes
(tests/integration/jobs/data_pipeline.py), one real server over loopback for
the module.  Three pairs train at once:

- ``synced``: the candidate's loader swaps steps 2 and 3, but it trains on the
  baseline's published batches: aligned, input ids equal at every step;
- ``unsynced``: the same loader bug without batch sync: the first divergence is
  the ``input_ids`` record at step 2 (before any module), said to be the data;
- ``schedule``: the candidate halves its learning rate one step early: the
  first divergence is the ``lr`` record at step 3, the step it starts, ahead of
  the parameters it updates in that same step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import jsonschema
import pytest

from tests.conftest import ROOT
from twinstep.server import ServerConfig, serve
from twinstep.server.config import SessionsConfig
from twinstep.server.report.render import render_text, report_schema, report_to_dict
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

JOB = "tests.integration.jobs.data_pipeline"
STEPS = 6

PAIRS = {
    "synced": (["--publish", "--record", "ids"], ["--order-bug", "2", "--sync", "--record", "ids"]),
    "unsynced": (["--record", "ids"], ["--order-bug", "2", "--record", "ids"]),
    "schedule": (["--record", "lr"], ["--lr-bug", "--record", "lr"]),
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory):
    """Every pair trained to the end: (server, {session: (baseline result, candidate result)})."""
    tmp = tmp_path_factory.mktemp("records")
    handle = serve(port=0, config=ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5)))
    procs = []
    for session, (base_args, cand_args) in PAIRS.items():
        for framework, run, extra in (("torch", "torch", ["--baseline", *base_args]), ("paddle", "paddle", cand_args)):
            result = tmp / f"{session}-{run}.json"
            cmd = [sys.executable, "-m", JOB, "--framework", framework, "--server", handle.address,
                   "--session", session, "--run", run, "--steps", str(STEPS), "--result-file", str(result), *extra]
            procs.append((session, run, result, subprocess.Popen(
                cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})))
    results: dict[str, dict[str, dict]] = {}
    try:
        for session, run, result, proc in procs:
            output, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0, f"{session}/{run}:\n{output}"
            results.setdefault(session, {})[run] = json.loads(Path(result).read_text())
        yield handle, results
    finally:
        for *_, proc in procs:
            if proc.poll() is None:
                proc.kill()
        handle.stop(grace=0.5)


def _report(handle, session: str):
    report = handle.report_proto(session)
    jsonschema.validate(report_to_dict(report), report_schema())
    return report


def _record(report, name: str):
    return next(r for r in report.records if r.name == name)


def test_batch_sync_removes_a_data_order_bug(finished):
    handle, results = finished
    report = _report(handle, "synced")
    assert report.status == "aligned", render_text(report)
    assert report.steps_compared == STEPS
    ids = _record(report, "input_ids")
    assert (ids.first_step, ids.steps_compared, ids.exact, ids.dtype) == (-1, STEPS, True, "int64")
    assert report.batch_sync.published == STEPS and report.batch_sync.delivered == STEPS
    candidate = results["synced"]["paddle"]
    assert candidate["batch_stats"]["fetched"] == STEPS
    assert candidate["dtypes"] == ["paddle.int64", "paddle.int64"]  # the baseline's dtype, in paddle
    assert results["synced"]["torch"]["batch_stats"]["published"] == STEPS
    # The same losses as the baseline's: it trained on the very same batches.
    assert candidate["losses"] == pytest.approx(results["synced"]["torch"]["losses"], rel=1e-5)


def test_without_batch_sync_the_input_ids_record_names_the_first_step_whose_order_differs(finished):
    handle, _ = finished
    report = _report(handle, "unsynced")
    assert report.status == "diverged"
    first = report.first_divergence
    assert (first.step, first.phase, first.module) == (2, "record", "input_ids"), render_text(report)
    assert report.stage.startswith("data pipeline:"), report.stage
    ids = _record(report, "input_ids")
    assert ids.first_step == 2 and ids.exact and ids.elements_differing > 0
    assert ids.baseline_value != ids.candidate_value and len(ids.first_index) == 2
    assert "input_ids" in render_text(report).split("named records, candidate 'paddle'")[1]


def test_a_learning_rate_record_catches_a_schedule_difference_at_the_step_it_starts(finished):
    handle, _ = finished
    report = _report(handle, "schedule")
    first = report.first_divergence
    assert (first.step, first.phase, first.module) == (3, "record", "lr"), render_text(report)
    assert report.stage.startswith("learning rate schedule:"), report.stage
    lr = _record(report, "lr")
    assert (lr.baseline_value, lr.candidate_value) == pytest.approx((1e-3, 5e-4))
    # The parameters updated with that rate differ at that same step: the record came first in it.
    with grpc.insecure_channel(handle.address) as channel:
        history = pb_grpc.TwinstepStub(channel).GetHistory(pb.HistoryRequest(session="schedule"), timeout=10)
    errors = history.candidates[0]
    columns = len(errors.first_step)
    divergent_params = {
        errors.first_step[c] for r, row in enumerate(errors.rows) if row.phase == "param"
        for c in range(columns) if errors.divergent[r * columns + c] and errors.first_step[c] == errors.last_step[c]}
    assert min(divergent_params) == 3, divergent_params
