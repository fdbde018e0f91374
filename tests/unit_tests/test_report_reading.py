"""The text report as a first-time reader meets it: the module tree's columns named, the step of a tree without a
divergence given as a number, long-run criteria under a divergence said to judge only the loss and the gradient
norm, and the noise criterion of a deterministic reference rerun floored at float rounding."""

from __future__ import annotations

import numpy as np

from tests.unit_tests.test_first_divergence import comparison
from twinstep.server.detect import drift
from twinstep.server.detect.drift import LongRunTracker
from twinstep.server.detect.first_divergence import FirstDivergenceTracker
from twinstep.server.ingest.step import StepData
from twinstep.server.report.agreement import check_words
from twinstep.server.report.builder import build_report
from twinstep.server.report.render import render_text, report_to_dict
from twinstep.server.report.snapshot import CandidateSnapshot, SessionSnapshot
from twinstep.v1 import twinstep_pb2 as pb


def _one_candidate(divergent_from: int | None, steps: int = 6, long_run: tuple[pb.LongRun, ...] = ()):
    """A torch baseline and one paddle candidate over ``steps`` steps; from ``divergent_from`` on the backward
    of 'b' diverges (None: aligned)."""
    tracker = FirstDivergenceTracker()
    for step in range(steps):
        bad = [("backward", "b")] if divergent_from is not None and step >= divergent_from else None
        tracker.add(comparison(step, bad, run="paddle"))
    tracker.declare({"paddle": steps - 1})
    first = tracker.declared.get("paddle")
    status = "diverged" if first else "aligned"
    candidate = CandidateSnapshot(run="paddle", framework="paddle", status=status, status_reasons=(), halted=False,
                                  steps_compared=steps, first=first, last_comparison=tracker.last["paddle"],
                                  coverage=f"compared steps 0 to {steps - 1} ({steps} step(s))")
    runs = (pb.RunStatus(name="torch", baseline=True, framework="torch", ranks=1, last_step=steps - 1,
                         state="finished"),
            pb.RunStatus(name="paddle", framework="paddle", ranks=1, last_step=steps - 1, state="finished"))
    return SessionSnapshot(
        name="port", status=status, status_reasons=(), halted=False, runs=runs, steps_compared=steps, first=first,
        last_comparison=tracker.last["paddle"], unmatched_baseline=(), unmatched_candidate=(), errors=(),
        proposed_mapping=None, coverage=(), long_run=long_run, headroom=(), candidates=(candidate,))


def _loss(step: int, loss: float, dtype: str = "float32") -> StepData:
    return StepData(step=step, rank=0, phase=np.array([pb.LOSS]), names=[""], types=["Loss"], call_index=np.zeros(1),
                    slot=np.zeros(1), dtypes=[dtype], shapes=[()], table={"sum": np.array([loss])}, payloads={},
                    nbytes=8)


def _long_run(differences: list[float], reference: list[float] | None = None, loss: float = 4.39,
              dtype: str = "float32") -> pb.LongRun:
    tracker = LongRunTracker(window=1000)
    for s, difference in enumerate(differences):
        tracker.add("paddle", s, 0, _loss(s, loss, dtype), _loss(s, loss + difference, dtype))
        if reference is not None:
            tracker.add("rerun", s, 0, _loss(s, loss, dtype), _loss(s, loss + reference[s], dtype))
    return tracker.summary("paddle", "rerun" if reference is not None else None, 3.0)


# ---------------------------------------------------------------- the module tree: columns named, step given

def _tree_block(text: str, title: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(title)
    end = next((k for k in range(start + 1, len(lines)) if not lines[k].startswith("  ")), len(lines))
    return lines[start + 1:end]


def test_a_tree_without_a_divergence_names_the_step_it_shows():
    report = build_report(_one_candidate(None, steps=6))
    text = render_text(report)
    assert "forward records, step 5:" in text.splitlines(), text
    assert "last compared" not in text
    assert report_to_dict(report)["tree"]["step"] == 5


def test_the_tree_has_a_header_line_naming_each_column_and_a_legend():
    text = render_text(build_report(_one_candidate(3)))
    block = _tree_block(text, "backward records, step 3:")
    header, rows, legend = block[0], block[1:-1], block[-1]
    assert header.split() == ["module", "type", "metric", "value", "/", "tolerance", "growth", "err", "in", "verdict"]
    assert legend == ("  growth: output error over input error; err: the record's error on one scale; "
                      "in: its module input's")
    first = next(r for r in rows if "<== first divergence" in r)
    # Each heading starts where its column does on the rows.
    assert header.index("type") == first.index("Linear")
    assert header.index("metric") == first.index("rms ")
    assert header.index("value") <= first.index("1.00e+00") < header.index("/")
    assert header.index("verdict") == first.index("DIVERGED")
    ok = next(r for r in rows if r.rstrip().endswith("  ok"))
    assert header.index("verdict") == ok.rstrip().rindex("ok")


def test_the_noise_column_is_headed_where_a_reference_run_gave_bands():
    report = build_report(_one_candidate(3))
    for k, row in enumerate(report.tree):
        row.noise = 1e-6 * (k + 1)
    block = _tree_block(render_text(report), "backward records, step 3:")
    assert block[0].split()[6] == "noise"
    assert block[0].index("noise") == block[1].index("noise")
    assert block[0].index("verdict") == block[1].rstrip().rindex("DIVERGED" if "DIVERGED" in block[1] else "ok")


# ---------------------------------------------------------------- long-run criteria under a divergence

def test_long_run_criteria_under_a_divergence_say_what_they_judge():
    summary = _long_run([1e-7] * 6)
    text = render_text(build_report(_one_candidate(3, long_run=(summary,))))
    lines = text.splitlines()
    at = lines.index("long run, candidate 'paddle': 6 steps compared, criteria over the last 6:")
    block = lines[at:at + 8]
    assert any(line.startswith("  PASS mean loss error") for line in block), block
    assert ("  these criteria judge only the loss and the global gradient norm: the divergence above "
            "(step 3, backward of 'b') stands") in block, block


def test_long_run_criteria_of_an_aligned_candidate_need_no_such_line():
    text = render_text(build_report(_one_candidate(None, long_run=(_long_run([1e-7] * 6),))))
    assert "these criteria judge only" not in text


# ---------------------------------------------------------------- the loss error's sign at rounding-sized errors

def test_no_sign_is_claimed_for_errors_of_1e_7_on_a_realistic_loss():
    """A faithful float32 port's loss errors of 1e-7, all of one sign: 2e-8 relative, no sentence on their sign."""
    summary = _long_run([1e-7] * 30)
    assert drift.loss_error_share(summary.loss_mean_abs, summary.loss_mean_rel) < drift.BIAS_PREMISE
    text = "\n".join(summary.verdicts)
    assert "biased" not in text and "oscillates" not in text, text


# ---------------------------------------------------------------- the noise criterion's floor

def _noise(summary: pb.LongRun) -> str:
    (line,) = [v for v in summary.verdicts if "own noise" in v]
    return line


def _floor(loss: float, eps: float = 2.0 ** -23) -> float:
    return 4 * eps * loss  # 4 roundings of the mean loss


def test_a_deterministic_reference_gives_a_band_floored_at_float_rounding():
    summary = _long_run([1.03e-7] * 20, reference=[0.0] * 20)
    assert _noise(summary) == (f"PASS within the baseline's own noise: mean loss |Δ| 1.03e-07 vs 3 x reference 0, "
                               f"floored at float32 rounding {_floor(4.39):.3g} (4 x 1.19e-07 x mean loss 4.39)")
    document = report_to_dict(build_report(_one_candidate(None, long_run=(summary,))))
    assert [c.holds for c in check_words(document) if c.kind == "long-run criterion"] == [True, True, True]


def test_an_error_over_the_floor_still_fails_and_a_bfloat16_loss_floors_at_its_own_rounding():
    summary = _long_run([1e-4] * 20, reference=[0.0] * 20)
    assert _noise(summary).startswith("FAIL within the baseline's own noise: mean loss |Δ| 0.0001 vs 3 x reference 0, "
                                      f"floored at float32 rounding {_floor(4.39):.3g}")
    bf16 = _long_run([1e-2] * 20, reference=[0.0] * 20, dtype="bfloat16")
    assert _noise(bf16) == (f"PASS within the baseline's own noise: mean loss |Δ| 0.01 vs 3 x reference 0, "
                            f"floored at bfloat16 rounding {_floor(4.39, 2.0 ** -7):.3g} "
                            "(4 x 0.00781 x mean loss 4.39)")


def test_a_band_over_the_floor_is_not_floored_and_the_checker_reads_the_floor():
    summary = _long_run([0.004] * 20, reference=[0.001] * 20)
    assert _noise(summary) == "FAIL within the baseline's own noise: mean loss |Δ| 0.004 vs 3 x reference 0.001"
    floored = _long_run([1.03e-7] * 20, reference=[0.0] * 20)
    document = report_to_dict(build_report(_one_candidate(None, long_run=(floored,))))
    verdicts = document["long_run"][0]["verdicts"]
    verdicts[-1] = verdicts[-1].replace("PASS", "FAIL")  # FAIL printed beside an error within the floor
    assert [c.holds for c in check_words(document) if c.kind == "long-run criterion"][-1] is False
