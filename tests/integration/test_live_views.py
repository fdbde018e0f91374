"""The live views agree: how far behind a run is (the dashboard, `twinstep watch`'s live view and its plain
lines), a run with no step yet, and a halt that reached no run, against an embedded server with the dashboard.

The runs are raw gRPC streams, so which run is how far behind is exact; the dashboard is read in Debian's
headless chromium (skipped, saying so, without /usr/bin/chromium), as tests/integration/test_dashboard.py does.
"""

from __future__ import annotations

import io
import json
import os
import queue
import threading
import urllib.request

import grpc
import numpy as np
import pytest

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, hello, manifest, step
from tests.integration.test_dashboard import CHROMEDRIVER, CHROMIUM, _css, _wait
from twinstep.cli.watch import LiveView, format_event
from twinstep.server import ServerConfig, serve
from twinstep.server.config import SessionsConfig
from twinstep.server.security import ServerSecurity
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

OPERATOR = "operator-token-for-the-live-views-test"
METADATA = (("authorization", f"Bearer {OPERATOR}"),)
SESSION = "views"
VALUES = np.linspace(-1, 1, 16)

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent: install Debian's chromium and chromium-driver")


class _Stream(RawStream):
    """A raw stream that carries the operator's token."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self._requests = queue.Queue()
        self.call = pb_grpc.TwinstepStub(self.channel).Stream(iter(self._requests.get, None), metadata=METADATA)
        self.responses = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def close(self) -> None:
        self._requests.put(None)


class _Watch:
    """`twinstep watch` of the session in a thread: its plain lines, and its live view fed the same events."""

    def __init__(self, address: str) -> None:
        self.lines: list[str] = []
        self.live = LiveView(SESSION, address)
        self._channel = grpc.insecure_channel(address)
        events = pb_grpc.TwinstepStub(self._channel).Watch(pb.WatchRequest(session=SESSION), metadata=METADATA)
        threading.Thread(target=self._read, args=(events,), daemon=True).start()

    def _read(self, events) -> None:
        try:
            for event in events:
                self.live.add(event)
                self.lines.append(format_event(event))
        except grpc.RpcError:
            pass

    def live_text(self) -> str:
        from rich.console import Console

        console = Console(file=io.StringIO(), width=160, record=True)
        console.print(self.live.render())
        return console.export_text()

    def close(self) -> None:
        self._channel.close()


@pytest.fixture
def server():
    handle = serve(port=0, http_port=0, security=ServerSecurity(operator_token=OPERATOR),
                   config=ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5)))
    yield handle
    handle.stop(grace=0.5)


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--window-size=1400,1000",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    yield driver
    driver.quit()


def _run(address: str, run: str, steps: range, *, baseline: bool = False) -> _Stream:
    stream = _Stream(address).send(hello(SESSION, run, baseline=baseline)).send(manifest((0, "fc", "Linear")))
    assert stream.next().WhichOneof("body") == "welcome"
    for number in steps:
        stream.send(step(number, [(0, VALUES)]))
    return stream


def _finish(stream: _Stream, last: int) -> None:
    stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=last)))
    stream.close()
    stream.wait_end()


def _view(server) -> dict:
    request = urllib.request.Request(server.http_url + f"api/sessions/{SESSION}/view",
                                     headers={"Authorization": f"Bearer {OPERATOR}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _last_step(server, run: str) -> int:
    try:
        return next((r.last_step for r in server.report_proto(SESSION).runs if r.name == run), -1)
    except KeyError:
        return -1


def test_every_view_says_how_far_behind_a_run_is_the_same_way_and_a_halt_that_reached_no_run(server, browser):
    watch = _Watch(server.address)
    torch = _run(server.address, "torch", range(10), baseline=True)
    wait_for(lambda: _last_step(server, "torch") == 9)
    paddle = _run(server.address, "paddle", range(0))
    # Before a run's first step, the plain lines say so in words (not "step -1").
    joined = wait_for(lambda: [line for line in watch.lines if "paddle" in line])
    assert joined[-1] == f"[{SESSION}] torch* step 9 streaming | paddle no step yet, streaming | compared 0", joined
    for number in range(2):
        paddle.send(step(number, [(0, VALUES)]))
    wait_for(lambda: _last_step(server, "paddle") == 1)
    _finish(paddle, 1)
    _finish(torch, 9)
    wait_for(lambda: server.report_proto(SESSION).status == "incomplete")

    # One definition everywhere: the steps a run is behind the furthest run, never negative, on the row of the
    # run that lags (paddle, 8 behind torch), whichever run is the baseline.
    progress = {p["run"]: p for p in _view(server)["progress"]}
    assert {run: p["steps_behind"] for run, p in progress.items()} == {"torch": 0, "paddle": 8}
    assert "lag_steps" not in progress["paddle"]
    wait_for(lambda: {r.name: r.last_step for r in watch.live.progress.runs} == {"torch": 9, "paddle": 1})
    table = [line.replace("│", " ") for line in watch.live_text().splitlines()]  # inside the panel's border
    rows: dict[str, list[str]] = {}
    for line in table:  # the runs panel comes first (the stages panel has rows of candidates too)
        if line.split()[:1] in (["torch"], ["paddle"]):
            rows.setdefault(line.split()[0], line.split())
    header = next(line for line in table if line.split()[:2] == ["run", "role"])
    assert "steps behind" in header and " lag " not in f" {header} ", header
    assert (rows["torch"][3], rows["torch"][5]) == ("9", "0"), rows  # its step, then (after steps/s) steps behind
    assert (rows["paddle"][3], rows["paddle"][5]) == ("1", "8"), rows

    browser.get(server.http_url + f"sessions/{SESSION}")
    _wait(lambda: _css(browser, "#token-panel").is_displayed(), 15, "the token panel to show")
    _css(browser, "#token-input").send_keys(OPERATOR)
    _css(browser, "#token-form button").click()
    _wait(lambda: _css(browser, "tr[data-run='paddle']"), 20, "the runs panel")
    headings = [th.text for th in browser.find_elements("css selector", "#runs th")]
    assert "steps behind" in headings and "lag (steps)" not in headings, headings
    column = headings.index("steps behind")

    def behind(run: str) -> str:
        return browser.find_elements("css selector", f"tr[data-run='{run}'] td")[column].text

    assert (behind("torch"), behind("paddle")) == ("0", "8")

    # Halting a session whose runs have all ended reaches no run: the page says so, not "halted".
    _wait(lambda: _css(browser, "#halt-button").is_enabled(), 10, "the halt button")
    _css(browser, "#halt-button").click()
    outcome = "The halt reached no run: every run had ended before it."
    _wait(lambda: _css(browser, "#halt-message").text == outcome, 15, f"the halt's outcome: {outcome!r}")
    badge = _wait(lambda: "halt" in _css(browser, "#status").text and _css(browser, "#status").text, 10,
                  "the status to show the halt")
    assert badge == "incomplete · halt reached no run", badge
    assert _view(server)["halt"]["outcome"] == outcome
    watch.close()
