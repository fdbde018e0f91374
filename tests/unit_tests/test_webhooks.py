"""Webhook senders against a real local HTTP server: config errors, payloads, a queue that never blocks, bounded stop.

The whole path with a live server and real jobs is tests/integration/test_alerts.py.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import ssl
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from twinstep.server.alert.webhook_config import WebhookConfig, webhooks_from_list
from twinstep.server.alert.webhook_payload import event_kind, json_payload, slack_payload
from twinstep.server.alert.webhooks import WebhookDispatcher
from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.config import config_from_dict
from twinstep.server.detect.stage_errors import StageErrors
from twinstep.v1 import twinstep_pb2 as pb


@pytest.fixture
def receiver():
    """/hang never answers (until the test ends), /slow once ``opened`` is set, /gone answers 404, else 200."""
    seen: list[tuple[str, bytes]] = []
    release, opened = threading.Event(), threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            if self.path == "/hang":
                release.wait(60)
            elif self.path == "/slow":
                opened.wait(60)
            try:
                self.send_response(404 if self.path == "/gone" else 200)
                self.end_headers()
            except OSError:
                pass

        def log_message(self, *args) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{http.server_address[1]}", seen, opened
    release.set()
    opened.set()
    http.shutdown()
    http.server_close()


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _divergence(session: str = "s") -> pb.Event:
    return pb.Event(time=1.7e9, session=session, divergence=pb.Divergence(
        step=3, rank=0, phase="forward", module="layers.1.mlp.act", metric="mean", value=2e-4, tolerance=1e-5,
        candidate_run="paddle", stage="forward: the activation"))


def test_config_errors_name_the_entry_and_option(monkeypatch):
    with pytest.raises(ValueError, match=r"webhooks\[1\]: webhook format must be one of json, slack"):
        config_from_dict({"alerts": {"webhooks": ["http://a/x", {"url": "http://b", "format": "teams"}]}})
    with pytest.raises(ValueError, match=r"webhooks\[0\]: unknown options \['uri'\]"):
        config_from_dict({"alerts": {"webhooks": [{"uri": "http://a"}]}})
    with pytest.raises(ValueError, match=r"unknown: \['diverged'\]"):
        webhooks_from_list([{"url": "http://a", "events": ["diverged"]}])
    with pytest.raises(ValueError, match=r"names \$\{NOT_SET_HERE\}, which is not set"):
        webhooks_from_list([{"url": "http://a", "headers": {"Authorization": "Bearer ${NOT_SET_HERE}"}}])
    monkeypatch.setenv("HOOK_TOKEN", "t0k")
    (hook,) = webhooks_from_list([{"url": "https://hooks.example/services/SECRET", "format": "slack",
                                   "events": ["halt"], "headers": {"Authorization": "Bearer ${HOOK_TOKEN}"}}])
    assert hook.headers == {"Authorization": "Bearer t0k"} and hook.events == ("halt",)
    assert "SECRET" not in repr(hook) and "t0k" not in repr(hook)


def test_payloads_say_what_happened():
    event = _divergence()
    assert event_kind(event) == "divergence"
    assert event_kind(pb.Event(alert=pb.AlertNotice(level="warning", message="x"))) is None
    assert event_kind(pb.Event(alert=pb.AlertNotice(kind="lost_run", message="x"))) == "lost_run"
    body = json_payload(event, "host:1")
    assert body["schema"] == "twinstep.webhook/v1" and body["event"] == "divergence" and body["server"] == "host:1"
    assert body["divergence"]["module"] == "layers.1.mlp.act" and body["time_iso"].startswith("2023-11-14T")
    assert body["summary"] == ("session 's': first divergence of run 'paddle' at step 3 rank 0, forward of "
                               "'layers.1.mlp.act': mean 0.0002 > 1e-05")
    json.dumps(body, allow_nan=False)  # valid JSON: no inf or nan numbers
    infinite = _divergence()
    infinite.divergence.value = float("inf")
    assert json_payload(infinite)["divergence"]["value"] == "inf"
    slack = slack_payload(event)
    assert slack["text"].startswith(":rotating_light: twinstep: session 's'") and "&gt;" in slack["text"]
    assert [b["type"] for b in slack["blocks"]] == ["header", "section", "section"]


def test_offer_never_blocks_and_a_full_queue_drops_the_oldest(receiver):
    url, seen, opened = receiver
    dispatcher = WebhookDispatcher([WebhookConfig(url=url + "/slow", queue_size=4)])
    (slow,) = dispatcher.receivers
    started = time.perf_counter()
    for i in range(2000):
        dispatcher.offer(_divergence(f"s{i}"))
    offered = time.perf_counter() - started
    assert offered < 0.5, offered  # about 10 us each, while the receiver has not answered once
    _wait(lambda: seen)
    counts = slow.counts()
    # One in flight (taken at some point while offering), up to 4 waiting, the rest dropped and counted.
    assert counts["queued"] in (3, 4) and counts["dropped"]["queue_full"] + counts["queued"] + 1 == 2000, counts
    opened.set()
    _wait(lambda: slow.counts()["sent"] == counts["queued"] + 1)
    sessions = [json.loads(body)["session"] for _, body in seen]
    assert sessions[-3:] == ["s1997", "s1998", "s1999"]  # the newest were kept, the oldest dropped
    assert dispatcher.stop(timeout=1.0)


def test_stop_is_bounded_with_a_request_in_flight(receiver):
    url, seen, _ = receiver
    dispatcher = WebhookDispatcher([WebhookConfig(url=url + "/hang", timeout=60)])
    (hang,) = dispatcher.receivers
    for i in range(3):
        dispatcher.offer(_divergence(f"s{i}"))
    _wait(lambda: seen)
    started = time.monotonic()
    assert dispatcher.stop(timeout=0.5)  # the request in flight is aborted after the 0.5 s
    assert time.monotonic() - started < 1.5
    counts = hang.counts()
    assert counts["sent"] == 0 and counts["failed"] == 1 and counts["dropped"] == {"shutdown": 2}, counts
    dispatcher.offer(_divergence())  # after the stop: counted, not queued
    assert hang.counts()["dropped"] == {"shutdown": 3} and hang.counts()["queued"] == 0


def test_a_client_error_is_not_retried_and_other_events_are_not_sent(receiver):
    url, seen, _ = receiver
    dispatcher = WebhookDispatcher([WebhookConfig(url=url + "/gone", events=("halt",)),
                                    WebhookConfig(url=url + "/ok?key=1", format="slack")])
    gone, ok = dispatcher.receivers
    dispatcher.offer(pb.Event(session="s", halt=pb.HaltNotice(run="torch", reason="operator", at_step=-1)))
    dispatcher.offer(_divergence())  # /gone does not want divergences
    dispatcher.offer(pb.Event(session="s", progress=pb.Progress()))  # nobody wants progress
    _wait(lambda: gone.counts()["failed"] + ok.counts()["sent"] == 3)
    assert gone.counts() == {"sent": 0, "failed": 1, "retries": 0, "queued": 0, "dropped": {}}
    assert ok.counts()["sent"] == 2
    assert sorted(path for path, _ in seen) == ["/gone", "/ok?key=1", "/ok?key=1"]
    assert dispatcher.stop(timeout=1.0)


def _comparison(step: int, rank: int, rows: list[tuple[str, str, float, float]]) -> StepComparison:
    return StepComparison(step=step, rank=rank, candidate_run="paddle", rows=[
        Row(phase, name, name, "Linear", 0, 0, "mean", value, tolerance, value > tolerance)
        for phase, name, value, tolerance in rows])


def test_stage_errors_keep_the_latest_step_and_the_worst_rank():
    stages = StageErrors()
    stages.add(_comparison(1, 0, [("forward", "a", 0.5, 1.0), ("forward", "b", 3.0, 1.0), ("input", "c", 9.0, 1.0),
                                  ("loss", "", 0.0, 0.0)]))
    stages.add(_comparison(1, 1, [("forward", "a", 4.0, 1.0), ("grad", "w", 1.0, 0.0)]))
    stages.add(_comparison(0, 0, [("forward", "a", 99.0, 1.0)]))  # older: ignored
    rows = {s.phase: s for s in stages.to_proto()}
    assert list(rows) == ["forward", "loss", "grad"]  # step order; module inputs left out
    assert (rows["forward"].ratio, rows["forward"].module, rows["forward"].rank) == (4.0, "a", 1)
    assert rows["loss"].ratio == 0.0 and rows["grad"].ratio == float("inf")
    stages.add(_comparison(2, 0, [("forward", "a", 0.1, 1.0)]))
    assert [(s.step, s.phase, s.ratio) for s in stages.to_proto()] == [(2, "forward", pytest.approx(0.1))]


# -- the proxy variables ----------------------------------------------------------------------------

#: A name no resolver knows (RFC 2606): only the test proxy can reach a receiver called so.
VIA_PROXY = "receiver.test"


@pytest.fixture
def proxy():
    """A forwarding HTTP proxy on loopback: absolute-form requests and CONNECT tunnels, each recorded as
    (method, target, body).  It resolves receiver.test to 127.0.0.1, so what reaches a receiver by that
    name went through it."""
    passed: list[tuple[str, str, bytes]] = []

    def upstream(host: str) -> str:
        return "127.0.0.1" if host == VIA_PROXY else host

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            passed.append(("POST", self.path, body))
            target = urllib.parse.urlsplit(self.path)
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in ("host", "connection", "proxy-connection", "content-length")}
            conn = http.client.HTTPConnection(upstream(target.hostname), target.port, timeout=10)
            conn.request("POST", target.path + (f"?{target.query}" if target.query else ""), body=body,
                         headers={**headers, "Host": target.netloc})
            answer = conn.getresponse()
            data = answer.read()
            conn.close()
            self.send_response(answer.status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_CONNECT(self) -> None:
            passed.append(("CONNECT", self.path, b""))
            host, _, port = self.path.rpartition(":")
            far = socket.create_connection((upstream(host), int(port)), timeout=10)
            self.send_response(200, "Connection established")
            self.end_headers()
            near = self.connection
            try:
                while True:
                    readable, _, _ = select.select([near, far], [], [], 10)
                    if not readable:
                        return
                    for sock in readable:
                        data = sock.recv(1 << 16)
                        if not data:
                            return
                        (far if sock is near else near).sendall(data)
            finally:
                far.close()
                self.close_connection = True

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", passed
    server.shutdown()
    server.server_close()


def _proxy_env(monkeypatch, **variables: str) -> None:
    """Exactly these proxy variables (urllib prefers the lower-case spelling: both are cleared first)."""
    for name in ("http_proxy", "https_proxy", "no_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_webhooks_go_through_the_http_proxy_of_the_environment(receiver, proxy, monkeypatch):
    url, seen, _ = receiver
    proxy_url, passed = proxy
    _proxy_env(monkeypatch, HTTP_PROXY=proxy_url)
    port = urllib.parse.urlsplit(url).port
    dispatcher = WebhookDispatcher([WebhookConfig(url=f"http://{VIA_PROXY}:{port}/hook?key=1")], server="host:1")
    dispatcher.offer(_divergence())
    (receiver_,) = dispatcher.receivers
    _wait(lambda: receiver_.counts()["sent"] == 1)
    body = json.dumps(json_payload(_divergence(), "host:1")).encode()
    assert passed == [("POST", f"http://{VIA_PROXY}:{port}/hook?key=1", body)]  # the body, as sent directly
    assert seen == [("/hook?key=1", body)]
    assert dispatcher.stop(timeout=1.0)


def test_no_proxy_sends_a_webhook_directly(receiver, proxy, monkeypatch):
    url, seen, _ = receiver
    proxy_url, passed = proxy
    _proxy_env(monkeypatch, HTTP_PROXY=proxy_url, NO_PROXY="localhost,127.0.0.1")
    dispatcher = WebhookDispatcher([WebhookConfig(url=url + "/direct")])
    dispatcher.offer(_divergence())
    (receiver_,) = dispatcher.receivers
    _wait(lambda: receiver_.counts()["sent"] == 1)
    assert [path for path, _ in seen] == ["/direct"] and passed == []
    assert dispatcher.stop(timeout=1.0)


def test_an_https_webhook_goes_through_the_https_proxy_in_a_tunnel(proxy, monkeypatch, tmp_path):
    pytest.importorskip("cryptography")  # the tls extra: the receiver's certificate
    from twinstep.server.security import self_signed

    cert, key = self_signed(tmp_path, hosts=[VIA_PROXY])
    seen: list[tuple[str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    https = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    https.socket = context.wrap_socket(https.socket, server_side=True)
    https.daemon_threads = True
    threading.Thread(target=https.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        proxy_url, passed = proxy
        _proxy_env(monkeypatch, HTTPS_PROXY=proxy_url, SSL_CERT_FILE=str(cert))  # the receiver's certificate trusted
        port = https.server_address[1]
        dispatcher = WebhookDispatcher([WebhookConfig(url=f"https://{VIA_PROXY}:{port}/secure", format="slack")])
        dispatcher.offer(_divergence())
        (receiver_,) = dispatcher.receivers
        _wait(lambda: receiver_.counts()["sent"] + receiver_.counts()["failed"] == 1)
        assert receiver_.counts()["sent"] == 1, receiver_.counts()
        assert passed == [("CONNECT", f"{VIA_PROXY}:{port}", b"")]  # a tunnel: the proxy never saw the body
        assert seen == [("/secure", json.dumps(slack_payload(_divergence())).encode())]
        assert dispatcher.stop(timeout=1.0)
    finally:
        https.shutdown()
        https.server_close()
