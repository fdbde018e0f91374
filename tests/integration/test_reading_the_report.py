"""The report as a new user reads it after `twinstep demo`, and the kept HTML report's long-run and headroom panel.

The demo runs through its command line (a real server, real torch and paddle jobs); the kept page is opened in
Debian's headless chromium (skipped, saying so, without /usr/bin/chromium).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from tests.integration.test_dashboard import _css, _wait, browser  # noqa: F401 (browser: a fixture)

CLI = [sys.executable, "-m", "twinstep"]
CHROMIUM = "/usr/bin/chromium"


def test_the_faithful_demo_names_its_columns_and_its_step_and_says_what_to_do_next():
    out = subprocess.run(CLI + ["demo", "--no-bug"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "forward records, step 19:" in lines, out.stdout
    header = lines[lines.index("forward records, step 19:") + 1]
    assert header.split() == ["module", "type", "metric", "value", "/", "tolerance", "growth", "err", "in", "verdict"]
    assert "seed differs" not in out.stdout
    assert lines[-2:] == [
        'next: your own model and its port: docs/getting-started.md ("Your own two trainings")',
        "  without editing a script: twinstep serve, then twinstep run --server 127.0.0.1:50051 --session S "
        "--run torch --baseline -- python train.py",
    ], lines[-4:]


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent: install Debian's chromium "
                                                          "and chromium-driver")
def test_the_kept_report_shows_the_long_run_criteria_and_the_headroom(tmp_path, browser):  # noqa: F811
    from tests.unit_tests.test_report_reading import _long_run, _one_candidate
    from twinstep.server.report.builder import build_report
    from twinstep.server.view.model import build_view
    from twinstep.server.view.page import render_frozen
    from twinstep.v1 import twinstep_pb2 as pb

    headroom = (pb.Headroom(candidate_run="paddle", phase="forward", metric="rms", value=1e-6, tolerance=5e-5, step=3,
                            module="layers.0", dtype="float32"),
                pb.Headroom(candidate_run="paddle", phase="forward", metric="mean", value=5e-6, tolerance=1e-5,
                            step=4, module="layers.1.act", dtype="float32"),
                pb.Headroom(candidate_run="paddle", phase="grad", metric="extrema", value=3e-6, tolerance=1e-4,
                            step=2, module="layers.0.fc.weight", dtype="float32"))
    snapshot = _one_candidate(3, long_run=(_long_run([1e-7] * 6),))
    report = build_report(replace(snapshot, headroom=headroom))
    page = tmp_path / "kept.html"
    page.write_text(render_frozen(build_view(report, None, live=None, max_columns=None)))
    browser.get(page.as_uri())

    panel = _wait(lambda: _css(browser, "#long-run"), 20, "the long-run panel")
    text = panel.text
    assert "Long run and headroom" in text
    assert "candidate paddle: 6 steps compared, criteria over the last 6" in text
    assert "PASS mean loss error: |Δ| 1e-07, 2.28e-06% over 6 steps (limit 0.01 or 1%)" in text
    assert ("these criteria judge only the loss and the global gradient norm: the divergence above "
            "(step 3, backward of 'b') stands") in text
    # Per phase, the metric that came closest to its tolerance, as the text report prints it.
    rows = [r.text for r in browser.find_elements("css selector", "#long-run table.headroom tbody tr")]
    assert rows == ["forward mean 5.00e-6 1.00e-5 0.500 layers.1.act 4 float32",
                    "grad extrema 3.00e-6 1.00e-4 0.030 layers.0.fc.weight 2 float32"], rows
