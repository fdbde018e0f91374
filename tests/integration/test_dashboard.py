"""The live dashboard in a real headless Chromium, against `twinstep serve --http-port` and two real jobs.

One server process (with an operator token and a session token), one torch baseline and one paddle
candidate carrying the GELU porting bug, one browser: the page asks for a token, shows the heatmap
growing while the jobs stream, names the diverging module, refuses a halt with a session token and
halts both jobs with the operator's.  Then the kept reports (`twinstep report --html/--csv`) of the
same session are checked against the JSON report, and the HTML file is opened with no server.

The browser is Debian's chromium with its chromedriver (the test set-up installs both); without
/usr/bin/chromium the test is skipped, saying so.  The screenshot goes to $TWINSTEP_ARTIFACTS (or the
test's temporary directory) and its path is printed.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import ROOT, Job

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CLI = [sys.executable, "-m", "twinstep"]
OPERATOR = "operator-token-for-the-dashboard-test"
SESSION_TOKEN = "session-token-for-the-dashboard-test"
SESSION = "dash"
MODULE = "layers.1.mlp.act"

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent: install Debian's chromium and chromium-driver")


def _artifacts(tmp: Path) -> Path:
    folder = Path(os.environ.get("TWINSTEP_ARTIFACTS") or tmp)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def server():
    """`twinstep serve --http-port 0` with tokens; (process, gRPC address, dashboard URL)."""
    process = subprocess.Popen(CLI + ["serve", "--port", "0", "--http-port", "0", "--operator-token", OPERATOR,
                                      "--session-token", f"{SESSION}={SESSION_TOKEN}"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = url = None
    lines = []
    for line in process.stdout:
        lines.append(line)
        found = re.search(r"listening on (\S+)", line)
        address = found.group(1) if found else address
        found = re.search(r"^dashboard: (\S+)", line)
        if found:
            url = found.group(1)
            break
    assert address and url, "".join(lines)
    threading.Thread(target=process.stdout.read, daemon=True).start()
    yield process, address, url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1000", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def streaming(server, tmp_path_factory):
    """The baseline and the buggy candidate, streaming slowly enough to be watched (and halted)."""
    _, address, _ = server
    tmp = tmp_path_factory.mktemp("jobs")
    env = {"TWINSTEP_TOKEN": SESSION_TOKEN}
    extra = ["--step-delay", "0.05", "--lockstep", "2", "--quiet"]
    jobs = [Job(tmp, "torch", server=address, session=SESSION, baseline=True, steps=2000, extra=extra, env=env),
            Job(tmp, "paddle", server=address, session=SESSION, bug="gelu_tanh", steps=2000, extra=extra, env=env)]
    yield jobs
    for job in jobs:
        if job.process.poll() is None:
            job.process.kill()
            job.process.wait()


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:  # the element is being replaced by the page's next render
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"within {timeout:.0f} s: {what}")


def _css(driver, selector: str):
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, selector)
    return found[0] if found else None


def _post(url: str, token: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=b"{}", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_the_live_dashboard_follows_the_runs_and_halts_them(server, browser, streaming, tmp_path):
    _, _, url = server
    started = time.monotonic()
    browser.get(url + f"sessions/{SESSION}")
    # The server has tokens: the page asks for one before it reads anything.
    _wait(lambda: _css(browser, "#token-panel").is_displayed(), 15, "the token panel to show")
    _css(browser, "#token-input").send_keys(SESSION_TOKEN)
    _css(browser, "#token-form button").click()

    def columns() -> int:
        canvas = _css(browser, "canvas.heatmap[data-run='paddle']")
        return int(canvas.get_attribute("data-columns")) if canvas is not None else 0

    first = _wait(columns, 60, "the heatmap to appear")
    grown = _wait(lambda: columns() >= first + 3 and columns(), 30, "the heatmap to grow while the jobs stream")
    assert grown > first
    step = int(_wait(lambda: _css(browser, "tr[data-run='paddle'] td.step").text, 5, "the run's step"))
    assert step >= 0

    # The first divergence, named in the panel: the module, its phase and step, the stage in words.
    module = _wait(lambda: _css(browser, "#divergence code.module").text, 30, "the first divergence")
    assert module == MODULE
    assert _css(browser, "#divergence .phase").text == "forward" and _css(browser, "#divergence .step").text == "0"
    assert _css(browser, "#stage").text.startswith("forward")
    assert _css(browser, f"#divergence tr.first[data-module='{MODULE}']") is not None
    # The set-up difference behind it, found when the runs attached (preflight): the activation variant.
    finding = _wait(lambda: _css(browser, "#preflight tr[data-severity='warning']"), 10, "the preflight panel")
    assert MODULE in finding.find_element("css selector", "td.affects").text and "tanh" in finding.text
    # Heatmap rows are folded by the module tree, opened along the path to the divergence.
    labels = [e.get_attribute("data-path") for e in browser.find_elements("css selector", ".heatmap-label")]
    assert MODULE in labels and "layers.0.attn.q_proj" not in labels

    # A session's token may read but not halt; no token at all is refused too.
    _css(browser, "#halt-button").click()
    refused = _wait(lambda: "Refused" in _css(browser, "#halt-message").text and _css(browser, "#halt-message").text,
                    10, "the halt to be refused")
    assert "403" in refused and "operator token" in refused
    assert _post(url + f"api/sessions/{SESSION}/halt", None) == 401
    assert all(job.process.poll() is None for job in streaming)

    # The operator's token halts both jobs.
    _css(browser, "#token-status a").click()
    _wait(lambda: _css(browser, "#token-panel").is_displayed(), 5, "the token panel again")
    _css(browser, "#token-input").send_keys(OPERATOR)
    _css(browser, "#token-form button").click()
    _wait(lambda: _css(browser, "#halt-button").is_enabled(), 10, "the halt button")
    _css(browser, "#halt-reason").send_keys("halted by the dashboard test")
    _css(browser, "#halt-button").click()
    sent = _wait(lambda: "Halt sent" in _css(browser, "#halt-message").text and _css(browser, "#halt-message").text,
                 15, "the halt to be sent")
    assert "torch" in sent and "paddle" in sent
    results = [job.wait(60) for job in streaming]
    assert all(r.returncode == 0 and r.halted for r in results), [r.output[-2000:] for r in results]
    assert all(r.result["halt_reason"] == "halted by the dashboard test" for r in results)
    _wait(lambda: "halted" in _css(browser, "#status").text, 10, "the page to show the halt")

    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1400, min(max(height, 1000), 4000))
    time.sleep(0.3)
    shot = _artifacts(tmp_path) / "dashboard.png"
    browser.save_screenshot(str(shot))
    print(f"dashboard screenshot: {shot} (the browser part took {time.monotonic() - started:.1f} s)")
    assert shot.stat().st_size > 10_000


def test_kept_reports_hold_what_the_dashboard_showed(server, browser, streaming, tmp_path):
    """`twinstep report --html/--csv` of the halted session, against its JSON report."""
    _, address, _ = server
    for job in streaming:
        job.wait(60)
    auth = ["--server", address, "--token", SESSION_TOKEN]
    html, tables = tmp_path / "kept" / "dash.html", tmp_path / "tables"
    html.parent.mkdir()
    out = subprocess.run(CLI + ["report", SESSION, *auth, "--html", str(html), "--csv", str(tables)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"wrote {html}" in out.stdout
    report = json.loads(subprocess.run(CLI + ["report", SESSION, *auth, "--json"], capture_output=True, text=True,
                                       timeout=60, check=True).stdout)
    first = report["first_divergence"]
    assert first["module"] == MODULE and report["halted"]

    page = html.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I), "an asset from the network"
    assert not re.search(r"""url\(\s*["']?\s*(https?:)?//|@import""", page, re.I)
    view = json.loads(re.search(r'<script type="application/json" id="twinstep-view">(.*?)</script>', page,
                                re.S).group(1))
    assert view["session"] == SESSION and not view["live"]
    assert view["divergence"]["first"] == first
    assert view["report"]["steps_compared"] == report["steps_compared"]
    (heat,) = view["heatmap"]["candidates"]
    assert heat["run"] == "paddle" and heat["columns"][0][0] == 0
    (coverage,) = report["coverage"]
    assert heat["columns"][-1][1] == coverage["compared"][-1][1]  # up to the last step compared

    rows = list(csv.DictReader((tables / "errors.csv").open()))
    at_first = {r["module"]: r for r in rows
                if r["phase"] == first["phase"] and int(r["step"]) <= first["step"] <= int(r["last_step"])}
    culprit = at_first[MODULE]
    assert culprit["divergent"] == "1" and culprit["metric"] == first["metric"]
    assert math.isclose(float(culprit["value"]), first["value"], rel_tol=1e-6)
    assert math.isclose(float(culprit["tolerance"]), first["tolerance"], rel_tol=1e-6)
    for tree_row in report["tree"]["rows"]:  # the report's tree at that step, module by module
        line = at_first[tree_row["name"]] if tree_row["name"] else None
        if line is None:
            continue  # the whole model's output: its row is the phase's own
        assert line["divergent"] == ("1" if tree_row["divergent"] else "0"), tree_row
        assert math.isclose(float(line["value"]), tree_row["value"], rel_tol=1e-6, abs_tol=1e-30), tree_row
    assert all(r["divergent"] == ("1" if float(r["value"]) > float(r["tolerance"]) else "0") for r in rows)
    curves = list(csv.DictReader((tables / "curves.csv").open()))
    assert {r["run"] for r in curves} == {"paddle"}
    assert int(curves[0]["step"]) == 0 and abs(float(curves[0]["loss"]) - float(curves[0]["baseline_loss"])) < 1e-3

    # The file opens with no server: its own data, its own script.
    copy = Path(tempfile.mkdtemp()) / "moved.html"
    shutil.copy(html, copy)
    browser.get(copy.as_uri())
    assert _wait(lambda: _css(browser, "#divergence code.module").text, 10, "the kept page to render") == MODULE
    assert _css(browser, "canvas.heatmap[data-run='paddle']") is not None
    fetched = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert not [name for name in fetched if name.startswith(("http:", "https:"))], fetched


def test_several_candidates_get_a_divergence_part_each(browser, tmp_path):
    """Three-way sessions: the first-divergence panel has one part per candidate, each with its own verdict."""
    from tests.unit_tests.test_report_candidates import _three_way
    from twinstep.v1 import twinstep_pb2 as pb
    from twinstep.server.report.builder import build_report
    from twinstep.server.view.model import build_view
    from twinstep.server.view.page import render_frozen

    affects = [f"layers.{i}.ln.weight" for i in range(6)]
    findings = (
        pb.PreflightFinding(candidate_run="bad", category="weight_decay", key="optimizer.group0.weight_decay",
                            baseline="0.0", candidate="0.01", affects=affects, affects_unlisted=2, severity="warning",
                            message="weight decay 0.0 (baseline) vs 0.01 (bad) on layers.0.ln.weight, ... (8)"),
        pb.PreflightFinding(candidate_run="good", category="versions", key="framework", baseline="torch 2.13.0",
                            candidate="mindspore 2.10.0", severity="info", message="frameworks differ"))
    page = tmp_path / "three.html"
    page.write_text(render_frozen(build_view(build_report(replace(_three_way(), preflight=findings)), None)))
    browser.get(page.as_uri())
    bad = _wait(lambda: _css(browser, '#divergence .candidate-divergence[data-run="bad"]'), 20, "the part of 'bad'")
    good = _css(browser, '#divergence .candidate-divergence[data-run="good"]')
    assert "candidate bad (paddle): DIVERGED, halted, 4 step(s) compared" in bad.text
    assert "step 3" in bad.text and "backward" in bad.text and "DIVERGED ◀ first" in bad.text
    assert "candidate good (mindspore): ALIGNED" in good.text
    assert "None: every compared step is within tolerance." in good.text
    # Set-up differences: warnings first, each with its candidate (several here), and the affected beyond four counted.
    rows = browser.find_elements("css selector", "#preflight tbody tr")
    assert [(r.get_attribute("data-run"), r.get_attribute("data-severity")) for r in rows] == [
        ("bad", "warning"), ("good", "info")]
    assert rows[0].find_element("css selector", "td.affects").text == \
        "layers.0.ln.weight, layers.1.ln.weight, layers.2.ln.weight, layers.3.ln.weight and 4 more"
    assert "1 can change the numbers, 1 for context" in _css(browser, "#preflight").text
