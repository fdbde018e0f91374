"""Alerts into the tools people use: Prometheus metrics, webhooks and the live `twinstep watch`.

One embedded server (halt on divergence, five webhook receivers) and real jobs in their own
processes, shared by every test here: a torch baseline and a paddle port that diverges (the
tanh GELU) and whose capture fails on one module, halted at their first divergence; and a
torch run killed mid-run (a lost run).  The receivers are a real local HTTP server; the
metrics are scraped over real HTTP from the server's own HTTP port (``http_port``, as `twinstep serve
--http-port`); `twinstep watch` runs under a real pseudo-terminal.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, Job, wait_for
from twinstep.server import ServerConfig, serve
from twinstep.server.config import AlertsConfig, HaltConfig, SessionsConfig
from twinstep.server.alert.prometheus import collect_text
from twinstep.server.alert.webhook_config import WebhookConfig

SESSION, LOST = "alerts", "alerts-lost"
FAULTY = "tests.integration.jobs.faulty_capture"
CLI = [sys.executable, "-m", "twinstep"]
TOKEN_ENV = "TWINSTEP_TEST_WEBHOOK_TOKEN"
ANSI = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07|[()][A-Z0-9]|[=>78])")


class Receiver:
    """A local HTTP server standing in for a webhook receiver; what it does depends on the path."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.release = threading.Event()  # /hang answers once set
        self.hanging = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver.lock:
                    receiver.requests.append({"path": self.path, "time": time.time(), "headers": dict(self.headers),
                                              "body": json.loads(body)})
                    tries = sum(1 for r in receiver.requests if r["path"] == self.path)
                status = 200
                if self.path == "/flaky" and tries <= 2:
                    status = 503
                elif self.path == "/auth" and self.headers.get("Authorization") != "Bearer s3cret":
                    status = 401
                elif self.path == "/hang":
                    with receiver.lock:
                        receiver.hanging += 1
                    receiver.release.wait(120)
                    with receiver.lock:
                        receiver.hanging -= 1
                try:
                    self.send_response(status)
                    self.end_headers()
                except OSError:
                    pass

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def bodies(self, path: str) -> list[dict]:
        with self.lock:
            return [r["body"] for r in self.requests if r["path"] == path]

    def count(self, path: str) -> int:
        return len(self.bodies(path))

    def close(self) -> None:
        self.release.set()
        self.http.shutdown()
        self.http.server_close()


class Terminal:
    """A command under a real pseudo-terminal (120x50): everything it draws, read as it comes."""

    def __init__(self, args: list[str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
        self.process = subprocess.Popen(args, cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                                        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "120",
                                             "LINES": "50"})
        os.close(slave)
        self._master = master
        self._chunks: list[bytes] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:  # EIO: the other end closed
                break
            if not data:
                break
            self._chunks.append(data)
        os.close(self._master)

    @property
    def raw(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw)

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        self._thread.join(5)
        return code


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The server, the receivers, the watchers and the jobs, run to the end of the diverging pair."""
    tmp: Path = tmp_path_factory.mktemp("alerts")
    receiver = Receiver()
    refused = socket.socket()  # bound, never listening: connections are refused
    refused.bind(("127.0.0.1", 0))
    os.environ[TOKEN_ENV] = "s3cret"
    try:
        webhooks = [
            WebhookConfig(url=receiver.url + "/json"),
            WebhookConfig(url=receiver.url + "/slack", format="slack"),
            WebhookConfig(url=receiver.url + "/flaky", events=("divergence",)),
            WebhookConfig(url=receiver.url + "/auth", events=("halt",),
                          headers={"Authorization": f"Bearer ${{{TOKEN_ENV}}}"}),
            WebhookConfig(url=receiver.url + "/hang", timeout=60, queue_size=2),
            WebhookConfig(url=f"http://127.0.0.1:{refused.getsockname()[1]}/down", max_attempts=2),
        ]
    finally:
        del os.environ[TOKEN_ENV]
    # http_port: the dashboard's listener, which serves /metrics (as `twinstep serve --http-port`).
    handle = serve(port=0, config=ServerConfig(halt=HaltConfig(on_divergence=True), sessions=SessionsConfig(reconnect_grace=0.5), alerts=AlertsConfig(webhooks=webhooks)),
                   http_port=0)
    metrics_url = handle.http_url + "metrics"

    live = Terminal(CLI + ["watch", SESSION, "--server", handle.address])
    plain = subprocess.Popen(CLI + ["watch", SESSION, "--server", handle.address], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    # Lockstep: neither run gets ahead of the other, so both are there when the divergence halts them.
    base = Job(tmp, "torch", server=handle.address, session=SESSION, baseline=True, steps=200,
               extra=["--lockstep", "1"])
    cand = Job(tmp, "paddle", server=handle.address, session=SESSION, steps=200, bug="gelu_tanh", module=FAULTY,
               extra=["--fault=spectrum", "--lockstep", "1"])
    lost = Job(tmp, "torch", server=handle.address, session=LOST, baseline=True, steps=10_000,
               extra=["--step-delay", "0.05"])
    results = {"torch": base.wait(), "paddle": cand.wait()}
    wait_for(lambda: (handle.registry.get(LOST) is not None
                      and handle.report_proto(LOST).runs and handle.report_proto(LOST).runs[0].last_step >= 1),
             timeout=120)
    lost.process.send_signal(signal.SIGKILL)
    lost.process.wait(30)
    world = {"handle": handle, "receiver": receiver, "metrics_url": metrics_url, "live": live, "plain": plain,
             "results": results}
    yield world
    for job in (base, cand, lost):
        if job.process.poll() is None:
            job.process.kill()
    for process in (live.process, plain):
        if process.poll() is None:
            process.kill()
    if not world.get("stopped"):
        handle.stop(grace=0.5)
    receiver.close()
    refused.close()


def _scrape(url: str) -> tuple[dict, str]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"].startswith("text/plain")
        text = answer.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}, text


def _value(families, name: str, **labels) -> float:
    family = families[name]
    found = [s.value for s in family.samples if s.name in (name, name + "_total")
             and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, family.samples)
    return found[0]


def test_the_pair_diverged_and_the_halt_did_not_wait_for_the_webhooks(world):
    results = world["results"]
    assert results["torch"].returncode == 0 and results["paddle"].returncode == 0, results["paddle"].output
    assert results["torch"].halted and results["paddle"].halted
    report = world["handle"].report_proto(SESSION)
    assert report.status == "diverged" and report.halted
    assert report.first_divergence.module == "layers.1.mlp.act" and report.first_divergence.step == 0
    # The webhook payloads carry the server's publish times: the halt followed the divergence at once,
    # while one receiver hung (60 s timeout) and another refused connections.
    (divergence,) = [b for b in world["receiver"].bodies("/json") if b["event"] == "divergence"]
    halts = [b for b in world["receiver"].bodies("/json") if b["event"] == "halt"]
    assert halts and all(0 <= h["time"] - divergence["time"] < 0.5 for h in halts), (divergence, halts)


def test_metrics_over_http_match_the_report(world):
    handle = world["handle"]
    wait_for(lambda: handle.report_proto(LOST).runs[0].state == "lost", timeout=30)
    families, text = _scrape(world["metrics_url"])
    report = handle.report_proto(SESSION)
    s = {"session": SESSION}

    # Conventions: the prefix, counters exposed as _total, only bounded labels (no module or step).
    allowed = {"session", "run", "reason", "state", "status", "role", "framework", "receiver", "outcome"}
    for family in families.values():
        assert family.name.startswith("twinstep_"), family.name
        for sample in family.samples:
            assert set(sample.labels) <= allowed, sample
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created")), sample
    assert "layers.1" not in text

    assert _value(families, "twinstep_sessions") == 2
    assert _value(families, "twinstep_session_status", **s, status="diverged") == 1
    assert _value(families, "twinstep_session_status", **s, status="running") == 0
    assert _value(families, "twinstep_session_halts", **s) == 1
    assert _value(families, "twinstep_session_steps_compared", **s) == report.steps_compared > 0
    assert _value(families, "twinstep_run_divergences", **s, run="paddle") == 1
    assert not [x for x in families["twinstep_run_divergences"].samples if x.labels["run"] == "torch"]  # baseline
    leader = max(run.last_step for run in report.runs)
    for run in report.runs:
        r = {**s, "run": run.name}
        assert _value(families, "twinstep_run_last_step", **r) == run.last_step
        assert _value(families, "twinstep_run_lag_steps", **r) == leader - run.last_step
        assert _value(families, "twinstep_run_records_received", **r) == run.records_received > 0
        # Every step from the first to the last came (one rank): received = last - first + 1.
        assert _value(families, "twinstep_run_steps_received", **r) == run.last_step - run.first_step + 1
        assert _value(families, "twinstep_run_state", **r, state=run.state) == 1
        assert run.state == "halted"
        dropped = {x.labels["reason"]: x.value for x in families["twinstep_run_dropped_steps"].samples
                   if x.labels["session"] == SESSION and x.labels["run"] == run.name}
        assert dropped == {reason: float(n) for reason, n in run.dropped_by_reason.items()}
        assert sum(dropped.values()) == run.dropped
        failed = sum(f.count for h in run.health for f in h.capture.failures)
        assert _value(families, "twinstep_run_capture_failed_records", **r) == failed
        assert _value(families, "twinstep_run_capture_read_bytes", **r) == run.capture_cost.bytes_read
    assert _value(families, "twinstep_run_capture_failed_records", **s, run="paddle") > 0  # the spectrum layer
    assert _value(families, "twinstep_run_capture_failed_records", **s, run="torch") == 0
    assert _value(families, "twinstep_run_info", **s, run="torch", role="baseline", framework="torch") == 1
    assert _value(families, "twinstep_run_state", session=LOST, run="torch", state="lost") == 1
    assert _value(families, "twinstep_server_held_bytes") >= 0
    # The webhook senders are counted too; the flaky receiver's event went through on its third try.
    flaky = world["receiver"].url.split("//")[1]
    assert any(x.labels.get("receiver", "").endswith(flaky) for x in families["twinstep_webhook_deliveries"].samples)


def test_webhooks_post_divergence_halt_lost_run_and_capture_failure_as_json(world):
    receiver = world["receiver"]
    report = world["handle"].report_proto(SESSION)
    wait_for(lambda: any(b["event"] == "lost_run" for b in receiver.bodies("/json")), timeout=30)
    bodies = receiver.bodies("/json")
    by_event: dict[str, list[dict]] = {}
    for body in bodies:
        assert body["schema"] == "twinstep.webhook/v1" and body["version"] == 1
        assert body["server"] == world["handle"].address and body["summary"]
        by_event.setdefault(body["event"], []).append(body)
    # The candidate's tanh GELU is also a set-up difference, posted before its first step (preflight).
    assert set(by_event) == {"divergence", "halt", "lost_run", "capture_failure", "preflight"}, bodies
    (preflight,) = by_event["preflight"]
    assert preflight["alert"]["run"] == "paddle" and "layers.1.mlp.act" in preflight["alert"]["message"], preflight

    (divergence,) = by_event["divergence"]
    d, first = divergence["divergence"], report.first_divergence
    assert divergence["session"] == SESSION
    assert (d["candidate_run"], d["step"], d["rank"], d["phase"], d["module"], d["metric"]) == (
        first.candidate_run, first.step, first.rank, first.phase, first.module, first.metric)
    assert d["value"] == pytest.approx(first.value) and d["stage"] == first.stage
    assert sorted(h["halt"]["run"] for h in by_event["halt"]) == ["paddle", "torch"]
    assert all("divergence at step 0" in h["halt"]["reason"] for h in by_event["halt"])
    (failure,) = by_event["capture_failure"]
    assert failure["alert"]["run"] == "paddle" and "'spectrum'" in failure["alert"]["message"]
    (lost,) = by_event["lost_run"]
    assert lost["session"] == LOST and lost["alert"]["run"] == "torch" and "is lost" in lost["alert"]["message"]
    # Filters and headers: /auth wants halts only, with the token read from the environment.
    auth = [r for r in receiver.requests if r["path"] == "/auth"]
    assert sorted(r["body"]["event"] for r in auth) == ["halt", "halt"]
    assert all(r["headers"]["Authorization"] == "Bearer s3cret" for r in auth)
    assert all(r["headers"]["Content-Type"] == "application/json" for r in auth)


def test_slack_bodies_have_text_and_blocks(world):
    receiver = world["receiver"]
    wait_for(lambda: receiver.count("/slack") == receiver.count("/json"), timeout=30)
    bodies = receiver.bodies("/slack")
    assert all(set(b) == {"text", "blocks"} for b in bodies), bodies
    (divergence,) = [b for b in bodies if "first divergence" in b["text"]]
    assert "layers.1.mlp.act" in divergence["text"] and "&gt;" in divergence["text"]  # Slack's escape of >
    assert divergence["blocks"][0]["text"]["text"] == "twinstep: Divergence"
    assert any(f["text"].startswith("*Where*\nforward of `layers.1.mlp.act`") for f in divergence["blocks"][2]["fields"])
    assert f"twinstep report {SESSION} --server" in divergence["blocks"][-1]["elements"][0]["text"]


def test_a_receiver_failing_twice_gets_the_event_on_the_third_try(world):
    receiver = world["receiver"]
    wait_for(lambda: receiver.count("/flaky") == 3, timeout=30)
    bodies = receiver.bodies("/flaky")
    assert all(b["event"] == "divergence" for b in bodies) and bodies[0] == bodies[2]
    flaky = next(r for r in world["handle"].webhooks.receivers if r.config.url.endswith("/flaky"))
    assert flaky.counts() == {"sent": 1, "failed": 0, "retries": 2, "queued": 0, "dropped": {}}
    times = [r["time"] for r in receiver.requests if r["path"] == "/flaky"]
    assert times[1] - times[0] >= 0.25 and times[2] - times[1] >= 0.5  # backoff: half to all of 0.5 s, then 1 s


def test_an_unreachable_receiver_is_retried_then_given_up_and_counted(world):
    down = next(r for r in world["handle"].webhooks.receivers if r.config.url.endswith("/down"))
    # Every event the /json receiver (also all events) got: the divergence, two halts, a lost run, a capture
    # failure and a preflight finding.
    events = len(world["receiver"].bodies("/json"))
    assert events >= 6
    wait_for(lambda: down.counts()["failed"] >= events and down.counts()["queued"] == 0, timeout=60)
    counts = down.counts()
    assert counts["sent"] == 0 and counts["retries"] == counts["failed"]  # max_attempts=2
    text = collect_text(world["handle"].registry, world["handle"].webhooks).decode()
    assert f'twinstep_webhook_deliveries_total{{outcome="failed",receiver="{down.name}"}} {counts["failed"]}.0' in text


def test_watch_on_a_terminal_is_a_live_view(world):
    live = world["live"]
    assert live.wait(60) == 0, live.text
    text = live.text
    if os.environ.get("TWINSTEP_TEST_SAVE_WATCH"):
        Path(os.environ["TWINSTEP_TEST_SAVE_WATCH"]).write_text(live.raw)
    assert "\x1b[" in live.raw  # drawn, not printed line by line
    assert "twinstep watch alerts" in text and "DIVERGED" in text
    for expected in ("steps/s", "steps behind", "dropped", "capture failures", "baseline", "candidate",
                     "latest error / tolerance per stage", "DIVERGENCE", "forward of 'layers.1.mlp.act'",
                     "halts and alerts", "HALT: run 'paddle'", "capture is failing"):
        assert expected in text, (expected, text[-4000:])
    assert "[alerts] DIVERGENCE run" not in text  # not the line format
    # The stage table: the candidate's step 0, forward beyond tolerance (the divergence), loss within it.
    rows = [line.strip("│ \r").split() for line in text.splitlines()]
    stage_rows = [r for r in rows if len(r) > 7 and r[0] == "paddle" and r[1] == "0"]
    assert stage_rows, text[-4000:]
    forward, loss = float(stage_rows[-1][2]), float(stage_rows[-1][3])
    assert forward > 1 > loss, stage_rows[-1]


def test_watch_falls_back_to_lines_when_not_a_terminal(world):
    out, _ = world["plain"].communicate(timeout=60)
    assert world["plain"].returncode == 0
    assert "\x1b[" not in out
    assert "[alerts] DIVERGENCE run 'paddle' step 0 rank 0 forward 'layers.1.mlp.act'" in out
    assert "[alerts] HALT run 'paddle'" in out and "torch* step" in out
    # --plain on a terminal: the same lines, no live view.
    forced = Terminal(CLI + ["watch", SESSION, "--server", world["handle"].address, "--plain"])
    assert forced.wait(60) == 0
    assert forced.text.startswith(f"[{SESSION}] torch* step") and "╭" not in forced.text, forced.text


def test_a_hanging_receiver_does_not_hold_the_stop(world):
    handle, receiver = world["handle"], world["receiver"]
    hang = next(r for r in handle.webhooks.receivers if r.config.url.endswith("/hang"))
    assert receiver.hanging == 1  # one request in flight since the first event, never answered
    counts = hang.counts()
    assert counts["sent"] == 0 and counts["queued"] == 2 and counts["dropped"]["queue_full"] >= 1, counts
    started = time.monotonic()
    handle.stop(grace=1.0)
    world["stopped"] = True
    took = time.monotonic() - started
    assert took < 4.0, took  # the webhooks get the 1 s grace, then the request in flight is aborted
    assert not any(t.name.startswith("twinstep-webhook-") for t in threading.enumerate())
    assert hang.counts()["dropped"]["shutdown"] >= 2
