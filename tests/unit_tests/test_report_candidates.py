"""server/report: one section per candidate (three-way sessions), in the Report, its JSON and its text."""

from __future__ import annotations

import jsonschema

from tests.unit_tests.test_first_divergence import comparison
from twinstep.server.detect.first_divergence import FirstDivergenceTracker
from twinstep.server.report.builder import build_report
from twinstep.server.report.render import render_text, report_schema, report_to_dict
from twinstep.server.report.snapshot import CandidateSnapshot, SessionSnapshot
from twinstep.v1 import twinstep_pb2 as pb


def _snapshot(candidates: tuple[CandidateSnapshot, ...], first) -> SessionSnapshot:
    runs = [pb.RunStatus(name="torch", baseline=True, framework="torch", ranks=1, last_step=5, state="finished")]
    runs += [pb.RunStatus(name=c.run, framework=c.framework, ranks=1, last_step=5, state="finished") for c in candidates]
    return SessionSnapshot(
        name="three", status="diverged" if first else "aligned", status_reasons=(), halted=False, runs=tuple(runs),
        steps_compared=6, first=first, last_comparison=None, unmatched_baseline=(), unmatched_candidate=(),
        errors=(), proposed_mapping=None, coverage=(), long_run=(), headroom=(), candidates=candidates)


def _three_way():
    """'bad' diverges at step 3 in the backward of 'b'; 'good' stays within tolerance for 6 steps."""
    tracker = FirstDivergenceTracker()
    for step in range(6):
        tracker.add(comparison(step, [("backward", "b")] if step >= 3 else None, run="bad"))
        tracker.add(comparison(step, run="good"))
    tracker.declare({"bad": 5, "good": 5})
    bad = CandidateSnapshot(run="bad", framework="paddle", status="diverged", status_reasons=(), halted=True,
                            steps_compared=4, first=tracker.declared["bad"], last_comparison=tracker.last["bad"],
                            coverage="steps 0-3 compared")
    good = CandidateSnapshot(run="good", framework="mindspore", status="aligned", status_reasons=(), halted=False,
                             steps_compared=6, first=None, last_comparison=tracker.last["good"],
                             coverage="steps 0-5 compared")
    return _snapshot((bad, good), tracker.first())


def test_each_candidate_gets_its_own_verdict_divergence_and_tree():
    report = build_report(_three_way())
    bad, good = report.candidates
    assert (bad.candidate_run, bad.status, bad.halted, bad.steps_compared) == ("bad", "diverged", True, 4)
    d = bad.first_divergence
    assert (d.step, d.phase, d.module, d.candidate_run) == (3, "backward", "b", "bad")
    assert bad.stage and bad.tree_step == 3 and [r.name for r in bad.tree if r.first] == ["b"]
    assert all(r.divergent == (r.name == "b") for r in bad.tree)
    assert (good.candidate_run, good.status, good.framework) == ("good", "aligned", "mindspore")
    assert not good.HasField("first_divergence") and not good.stage
    assert good.tree_step == 5 and good.tree and not any(r.divergent for r in good.tree)  # its last step's forward
    # The session-level fields keep their meaning: the earliest divergence among the candidates.
    assert report.first_divergence.candidate_run == "bad" and report.first_divergence.step == 3


def test_json_has_a_section_per_candidate_and_validates():
    document = report_to_dict(build_report(_three_way()))
    jsonschema.validate(document, report_schema())
    sections = {c["candidate_run"]: c for c in document["candidates"]}
    assert sections["bad"]["status"] == "diverged" and sections["bad"]["first_divergence"]["step"] == 3
    assert sections["bad"]["tree"]["phase"] == "backward" and sections["bad"]["tree"]["step"] == 3
    assert sections["good"]["status"] == "aligned" and sections["good"]["first_divergence"] is None
    assert sections["good"]["tree"]["phase"] == "forward" and sections["good"]["tree"]["step"] == 5
    broken = {**document, "candidates": [{**sections["good"], "status": "fine"}]}
    try:
        jsonschema.validate(broken, report_schema())
    except jsonschema.ValidationError:
        pass
    else:
        raise AssertionError("the schema accepted a candidate status outside its vocabulary")


def test_text_heads_one_section_per_candidate_with_several():
    text = render_text(build_report(_three_way()))
    bad_at = text.index("== candidate 'bad' (paddle) against the baseline: DIVERGED  (halted), 4 step(s) compared")
    good_at = text.index("== candidate 'good' (mindspore) against the baseline: ALIGNED, 6 step(s) compared")
    assert bad_at < good_at
    bad_section, good_section = text[bad_at:good_at], text[good_at:]
    assert "first divergence: step 3, rank 0, backward of 'b' in run 'bad'" in bad_section
    assert "first divergence" not in good_section and "forward records, step 5:" in good_section
    assert text.count("first divergence:") == 1  # the session's earliest is the bad candidate's, told once


def test_text_with_one_candidate_is_unchanged():
    snapshot = _three_way()
    one = _snapshot(snapshot.candidates[:1], snapshot.first)
    text = render_text(build_report(one))
    assert "== candidate" not in text
    assert "first divergence: step 3, rank 0, backward of 'b' in run 'bad'" in text
    assert "backward records, step 3:" in text


def test_dashboard_view_has_a_panel_per_candidate():
    from twinstep.server.view.model import build_view

    view = build_view(build_report(_three_way()), None)
    panels = {p["run"]: p for p in view["candidates"]}
    assert panels["bad"]["divergence"]["first"]["module"] == "b" and panels["bad"]["halted"]
    assert [row["name"] for row in panels["bad"]["divergence"]["tree"] if row["first"]] == ["b"]
    assert panels["good"]["divergence"] is None and panels["good"]["status"] == "aligned"
    assert view["divergence"]["first"]["candidate_run"] == "bad"  # the session's panel, as before
