"""Preflight end to end: unmodified torch and paddle trainings under ``twinstep run``, their set-ups diffed.

The zero-code installer finds each script's optimizer by itself (the one whose step ends
a step) and hands it to attach; the paddle script's learning rate is 1.1x the torch one's
(--bug lr).  The difference is in the report (JSON and text), told as a "preflight" alert,
and shown by ``twinstep watch``, before any training arithmetic is compared.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Iterator

import grpc
import pytest

from tests.conftest import ROOT, wait_for
from tests.integration.rawclient import RawStream, hello
from tests.integration.test_zero_code import clean_env, script, twinstep_run
from twinstep.server import ServerConfig, serve
from twinstep.server.config import JournalConfig, SessionsConfig
from twinstep.server.report.render import render_text
from twinstep.runtime.setup import setup_value
from twinstep.v1 import twinstep_pb2 as pb

SESSION = "preflight-zero-code"


@pytest.fixture(scope="module")
def server() -> Iterator:
    handle = serve(port=0, config=ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5)))
    address = handle.address
    # Watching from before the runs join, as a user would: the alert is shown as it happens.
    watch = subprocess.Popen([sys.executable, "-m", "twinstep", "watch", SESSION, "--plain", "--server", address],
                             cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    torch_job = twinstep_run(["--session", SESSION, "--run", "torch", "--baseline", "--server", address],
                             script("torch", "--steps", "1"))
    paddle_job = twinstep_run(["--session", SESSION, "--run", "paddle", "--server", address],
                              script("paddle", "--bug", "lr", "--steps", "1"))
    torch_job.wait()
    paddle_job.wait()
    handle.watch_output = watch.communicate(timeout=60)[0]  # it ends once every run has ended
    yield handle
    handle.stop(grace=0.5)


def test_the_learning_rate_difference_is_a_preflight_finding_naming_every_parameter(server):
    report = server.report(SESSION)
    warnings = [f for f in report["preflight"] if f["severity"] == "warning"]
    assert [f["category"] for f in warnings] == ["lr"], report["preflight"]
    finding = warnings[0]
    assert finding["candidate_run"] == "paddle"
    assert float(finding["candidate"]) == pytest.approx(1.1 * float(finding["baseline"]))
    # Every parameter the optimizers update, named as the baseline names them.
    assert len(finding["affects"]) + finding["affects_unlisted"] >= 4, finding
    assert all(name.endswith((".weight", ".bias")) for name in finding["affects"]), finding
    text = render_text(server.report_proto(SESSION))
    assert "WARNING learning rate differs" in text, text


def test_the_finding_is_an_alert_that_watch_shows(server):
    assert "WARNING: run 'paddle': preflight: learning rate differs" in server.watch_output, server.watch_output


def test_the_alert_has_kind_preflight_for_webhooks_and_prometheus(server):
    alerts = [e.alert for e in server.registry.get(SESSION).events.history if e.WhichOneof("body") == "alert"]
    assert [(a.kind, a.run) for a in alerts if a.kind == "preflight"] == [("preflight", "paddle")], alerts


def _setup_stream(address: str, session: str, run: str, lr: float, *, baseline: bool = False) -> RawStream:
    """A hand-driven run that sends its set-up and leaves (what attach does before the first step)."""
    setup = pb.Setup(groups=[pb.ParameterGroup(values=[setup_value("lr", "lr", lr)], parameters=["fc.weight"])])
    stream = RawStream(address).send(hello(session, run, baseline=baseline)).send(pb.ClientMessage(setup=setup))
    assert stream.next().WhichOneof("body") == "welcome"
    stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=-1)))
    stream.close()
    stream.wait_end()
    return stream


def test_the_findings_survive_a_restart_on_the_journal(tmp_path):
    first = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path))))
    try:
        _setup_stream(first.address, "durable", "torch", 1e-3, baseline=True)
        _setup_stream(first.address, "durable", "paddle", 2e-3)
        before = wait_for(lambda: list(first.report_proto("durable").preflight))
    finally:
        first.stop(grace=0.5)
    second = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path))))
    try:
        assert list(second.report_proto("durable").preflight) == before
        assert before[0].category == "lr" and list(before[0].affects) == ["fc.weight"]
    finally:
        second.stop(grace=0.5)


def test_an_oversized_setup_ends_its_own_stream_only(server):
    setup = pb.Setup(modules=[pb.ModuleSetup(name=f"m{i}") for i in range(20_001)])
    stream = RawStream(server.address).send(hello("bad-setup", "paddle")).send(pb.ClientMessage(setup=setup))
    error = stream.error()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 20000" in error.details()
    assert server.report(SESSION)["preflight"]  # the other session is untouched, the server serves


def test_the_sender_process_carries_the_setup_too(tmp_path):
    """sender="process": the set-up travels as a frame to the sender process, which sends it."""
    import torch

    import twinstep

    handle = serve(port=0)
    try:
        for run, eps in (("torch", 1e-5), ("again", 1e-6)):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4, eps=eps))
            monitor = twinstep.attach(model, session="sidecar", run=run, baseline=run == "torch",
                                      server=handle.address, capture="tensors", sender="process",
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
            monitor.close()
        findings = wait_for(lambda: handle.report("sidecar")["preflight"], timeout=30)
        assert [(f["category"], f["affects"]) for f in findings] == [("norm_eps", ["1"])], findings
    finally:
        handle.stop(grace=0.5)


def test_prometheus_counts_the_warnings_and_webhooks_take_the_alert(server):
    from twinstep.server.alert.prometheus import collect_text
    from twinstep.server.alert.webhook_payload import json_payload

    text = collect_text(server.registry).decode()
    assert f'twinstep_run_preflight_warnings{{run="paddle",session="{SESSION}"}} 1.0' in text
    alert = next(e for e in server.registry.get(SESSION).events.history if e.alert.kind == "preflight")
    assert json_payload(alert)["event"] == "preflight"
