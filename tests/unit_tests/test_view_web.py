"""The dashboard's HTTP side over real HTTP(S) on loopback: tokens, origins, hosts, caching, /metrics, stop."""

from __future__ import annotations

import http.client
import json
import ssl
import time
import urllib.error
import urllib.request
from email.message import Message

import pytest

from twinstep.server import ServerConfig, serve
from twinstep.server.config import SessionsConfig
from twinstep.server.security import ServerSecurity, self_signed

OPERATOR = "operator-secret-1"
OWN = "session-secret-a"
OTHER = "session-secret-b"


def request(url: str, method: str = "GET", token: str | None = None, headers: dict | None = None,
            body: bytes | None = None, context: ssl.SSLContext | None = None) -> tuple[int, Message, bytes]:
    headers = dict(headers or {})
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


@pytest.fixture(scope="module")
def guarded():
    """A server with an operator token and two sessions' tokens; session 'a' exists."""
    security = ServerSecurity(operator_token=OPERATOR, session_tokens=[("a", OWN), ("b", OTHER)])
    handle = serve(port=0, http_port=0, security=security, config=ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5)))
    handle.registry.get_or_create("a")
    yield handle
    handle.stop(grace=0.5)


def test_pages_load_without_a_token_but_data_needs_one(guarded):
    url = guarded.http_url
    status, headers, page = request(url + "sessions/a")
    assert status == 200 and b'data-page="dashboard"' in page
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert json.loads(request(url + "api/info")[2]) | {"version": ""} == {
        "version": "", "auth_required": True, "halt_enabled": True, "halt_message": ""}
    status, _, body = request(url + "api/sessions/a/view")
    assert status == 401 and "needs a token" in json.loads(body)["error"]
    assert request(url + "api/sessions/a/view", token="wrong")[0] == 401
    status, _, body = request(url + "api/sessions/a/view", token=OTHER)
    assert status == 403 and "for session 'b'" in json.loads(body)["error"]
    status, headers, body = request(url + "api/sessions/a/view", token=OWN)
    assert status == 200 and json.loads(body)["session"] == "a"
    assert request(url + "api/sessions/a/view", token=OPERATOR)[0] == 200
    # A session's token lists its own session only; the operator's lists every one.
    assert [s["name"] for s in json.loads(request(url + "api/sessions", token=OWN)[2])["sessions"]] == ["a"]
    assert request(url + "api/sessions", token=OTHER)[0] == 200
    assert request(url + "api/sessions/nope/view", token=OPERATOR)[0] == 404


def test_an_unchanged_view_answers_not_modified(guarded):
    url = guarded.http_url + "api/sessions/a/view"
    status, headers, _ = request(url, token=OWN)
    assert status == 200
    status, _, body = request(url, token=OWN, headers={"If-None-Match": headers["ETag"]})
    assert status == 304 and body == b""


def test_halting_needs_the_operator_and_the_page_s_own_origin(guarded):
    url = guarded.http_url + "api/sessions/a/halt"
    origin = guarded.http_url.rstrip("/")
    body = json.dumps({"reason": "checked by a test"}).encode()
    assert request(url, "POST", body=body)[0] == 401
    status, _, answer = request(url, "POST", token=OWN, body=body)
    assert status == 403 and "needs the operator token" in json.loads(answer)["error"]
    status, _, answer = request(url, "POST", token=OPERATOR, body=body, headers={"Origin": "http://evil.example"})
    assert status == 403 and "cross-origin" in json.loads(answer)["error"]
    assert request(url, "POST", token=OPERATOR, body=body, headers={"Sec-Fetch-Site": "cross-site"})[0] == 403
    assert request(guarded.http_url + "api/sessions/a/view", "POST", token=OPERATOR, body=body)[0] == 405
    status, _, answer = request(url, "POST", token=OPERATOR, body=body, headers={"Origin": origin})
    assert status == 200 and json.loads(answer) == {"runs": [], "reason": "checked by a test"}
    assert guarded.registry.get("a").halted


def test_a_loopback_dashboard_answers_only_to_loopback_host_names(guarded):
    """A page elsewhere that rebinds its own name to 127.0.0.1 still sends its own Host: refused."""

    def with_host(path: str, host: str) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", guarded.http_port, timeout=10)
        try:
            connection.request("GET", path, headers={"Host": host, "Authorization": f"Bearer {OPERATOR}"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    status, body = with_host("/api/sessions/a/view", f"evil.example:{guarded.http_port}")
    assert status == 421 and "localhost" in json.loads(body)["error"]
    assert with_host("/api/sessions/a/view", f"localhost:{guarded.http_port}")[0] == 200
    assert with_host("/api/sessions/a/view", f"[::1]:{guarded.http_port}")[0] == 200
    assert with_host("/metrics", "evil.example")[0] == 421


def test_metrics_are_the_operator_s_when_the_server_has_tokens(guarded):
    url = guarded.http_url + "metrics"
    assert request(url)[0] == 401
    assert request(url, token=OWN)[0] == 403
    status, headers, body = request(url, token=OPERATOR)
    assert status == 200 and headers["Content-Type"].startswith("text/plain") and b"twinstep_" in body


def test_an_open_server_s_page_cannot_halt_and_says_how_to_allow_it():
    handle = serve(port=0, http_port=0)
    try:
        info = json.loads(request(handle.http_url + "api/info")[2])
        assert not info["auth_required"] and not info["halt_enabled"]
        assert "--operator-token" in info["halt_message"]
        handle.registry.get_or_create("open")
        status, _, body = request(handle.http_url + "api/sessions/open/halt", "POST", body=b"{}")
        assert status == 403 and "--operator-token" in json.loads(body)["error"]
        assert not handle.registry.get("open").halted
        view = json.loads(request(handle.http_url + "api/sessions/open/view")[2])
        assert view["halt"] == {"enabled": False, "message": info["halt_message"], "outcome": None}
    finally:
        started = time.monotonic()
        handle.stop(grace=0.5)
        assert time.monotonic() - started < 3.0
    with pytest.raises(OSError):
        urllib.request.urlopen(handle.http_url + "api/info", timeout=2)


def test_the_loopback_rule_applies_to_the_dashboard_s_host():
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0"):
        serve(port=0, http_port=0, http_host="0.0.0.0")


def test_https_with_the_server_s_certificate(tmp_path):
    cert, key = self_signed(tmp_path / "tls")
    handle = serve(port=0, http_port=0, security=ServerSecurity(tls_cert=str(cert), tls_key=str(key)))
    try:
        assert handle.http_url.startswith("https://")
        context = ssl.create_default_context(cafile=str(cert))
        status, _, body = request(handle.http_url + "api/info", context=context)
        assert status == 200 and json.loads(body)["auth_required"] is False
        with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP is not spoken there
            urllib.request.urlopen(handle.http_url.replace("https", "http") + "api/info", timeout=5)
    finally:
        handle.stop(grace=0.5)
