"""server/detect/headroom.py: the closest approach to tolerance, per candidate, phase and metric."""

from __future__ import annotations

import numpy as np

from tests.unit_tests.test_comparator import Rec, ctx, decoded, model_records
from twinstep.server.compare.comparator import compare_step
from twinstep.server.detect.headroom import HeadroomTracker


def test_worst_value_of_each_phase_and_metric_with_where_and_when():
    tracker = HeadroomTracker()
    base = model_records()
    for step, size in ((0, 1e-7), (1, 3e-6), (2, 1e-6)):
        cand = model_records(perturb={"forward:layers.1": size, "grad:layers.0.weight": size / 10})
        tracker.add(compare_step(decoded(base, step=step), decoded(cand, step=step), ctx()))
    rows = {(h.phase, h.metric): h for h in tracker.to_proto("cand")}
    worst = rows[("forward", "mean")]
    assert (worst.step, worst.module, worst.dtype) == (1, "layers.1", "float32")
    assert worst.value > 1e-6 and worst.tolerance == 1e-5
    assert rows[("grad", "mean")].module == "layers.0.weight"
    # Phases that matched exactly have nothing to report; other runs are kept apart.
    assert not [h for h in rows.values() if h.phase == "param"]
    assert tracker.to_proto("another run") == []


def test_module_inputs_and_non_finite_values_are_left_out():
    tracker = HeadroomTracker()
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    base = decoded([Rec("input", "fc", x), Rec("forward", "fc", x)])
    cand = decoded([Rec("input", "fc", x * 2), Rec("forward", "fc", x + np.float32(1e-3))])
    tracker.add(compare_step(base, cand, ctx()))
    phases = {h.phase for h in tracker.to_proto("cand")}
    assert phases == {"forward"}


def test_text_report_names_each_phases_worst_metric_against_its_tolerance():
    from twinstep.server.report.render import render_text
    from twinstep.v1 import twinstep_pb2 as pb

    report = pb.Report(session="s", status="aligned")
    report.headroom.extend([
        pb.Headroom(candidate_run="paddle", phase="forward", metric="rms", value=1e-6, tolerance=5e-5, step=3,
                    module="layers.0", dtype="float32"),
        pb.Headroom(candidate_run="paddle", phase="forward", metric="mean", value=5e-6, tolerance=1e-5, step=7,
                    module="layers.1.act", dtype="float32"),
    ])
    text = render_text(report)
    assert "worst value against its tolerance per phase, candidate 'paddle'" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("forward"))
    assert "mean" in line and "0.500 of it" in line and "layers.1.act, step 7" in line
