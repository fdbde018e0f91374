"""The origin statistic (server/detect/origin.py) on synthetic series, and the tracker's use of it."""

from __future__ import annotations

import numpy as np

from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.detect.first_divergence import FirstDivergenceTracker
from twinstep.server.detect.origin import CLEAR, CLEAR_FORWARD, OriginTracer, forward_floor, param_floor

NORMS = [f"layers.{i}.norm.weight" for i in range(4)]
#: A parameter error that is evidence on its own at step 0.
DECAY = 1.2 * CLEAR * param_floor("1d", "rms", 0)
#: Module name -> type name of the forward rows (the kind of module sets its floor).
TYPES = {"rotary": "RotaryEmbedding", "act": "GELU", "norm": "RMSNorm", "embed": "Embedding", "block": "DecoderLayer",
         "proj": "Linear"}
MATRICES = [f"layers.{i}.proj.weight" for i in range(4)]


def _step(step: int, norm_error, matrix_error: float = 0.0, mean_error: float = 0.0, shrink: float = 1.0,
          forward: list[tuple[str, float, float]] = (), crossing: str | None = None) -> StepComparison:
    """A step with forward rows (name, input error, output error) and parameter rows; values are relative errors."""
    rows, values = [], {m: [] for m in ("rms", "mean", "extrema")}

    def add(phase, name, ndim, rms, mean=0.0, scale=1.0, divergent=False):
        rows.append(Row(phase, name, name, TYPES.get(name, "T"), 0, 0, "rms", rms, 1e-3 if divergent else 5e-5,
                        divergent, ndim, scale))
        values["rms"].append(rms)
        values["mean"].append(mean)
        values["extrema"].append(rms)

    for name, given, out in forward:
        add("input", name, 3, given)
        add("forward", name, 3, out, divergent=name == crossing)
    norm_errors = norm_error if isinstance(norm_error, list) else [norm_error] * len(NORMS)
    for name, error in zip(NORMS, norm_errors):
        add("param", name, 1, error, scale=shrink)
    for name in MATRICES:
        add("param", name, 2, matrix_error, mean_error)
    return StepComparison(step, 0, "cand", rows, values={m: np.array(v) for m, v in values.items()})


def _faithful(step: int) -> list[float]:
    """Rounding noise: a quarter of the floor, in random-looking order."""
    return [0.25 * param_floor("1d", "rms", step) * f for f in (1.0, 0.3, 0.7, 0.5)]


def test_faithful_noise_never_makes_an_origin():
    tracer = OriginTracer()
    for step in range(60):
        found = tracer.observe(_step(step, _faithful(step), 0.3 * param_floor("nd", "rms", step),
                                     0.3 * param_floor("nd", "mean", step),
                                     forward=[("rotary", 0.0, 0.3 * forward_floor("float32", "rotary", "rms", step)),
                                              ("norm", 0.0, 0.3 * forward_floor("float32", "norm", "rms", step)),
                                              ("proj", 1e-9, 0.3 * forward_floor("float32", "linear", "rms", step))]))
        assert found is None, (step, found)


def test_an_update_far_over_the_floor_is_its_own_origin():
    tracer = OriginTracer()
    # Weight decay on norms: 1e-5 relative per step, here with a decay ten times as strong (1e-5 is found too,
    # by its linear growth: the floor at step 0 is wide enough for SGD's first update).
    assert tracer.observe(_step(0, DECAY, shrink=1 - 1e-5)) is not None
    origin = tracer.found["cand"]
    assert (origin.comparison.step, origin.row.phase, origin.row.name) == (0, "param", NORMS[0])
    assert origin.rule == "clear" and origin.one_dimensional and origin.involved == NORMS
    assert origin.shrink is not None and abs(origin.shrink - (1 - 1e-5)) < 1e-9


def test_weight_decay_of_1e_5_per_step_is_traced_back_to_step_0_by_its_growth():
    tracer = OriginTracer()
    found = None
    for step in range(8):
        found = tracer.observe(_step(step, 1e-5 * (step + 1), shrink=(1 - 1e-5) ** (step + 1)))
        if found is not None:
            break
    assert found is not None and found.comparison.step == 0 and found.rule in ("growth", "clear"), found


def test_linear_growth_is_traced_back_to_its_onset():
    """Zero-initialised norm weights (gemma): decay starts at step 1, a few times the floor, growing linearly."""
    tracer = OriginTracer()
    found = None
    for step in range(12):
        error = _faithful(step) if step == 0 else [7.4e-6 * step] * len(NORMS)
        found = tracer.observe(_step(step, error, shrink=(1 - 7e-6) ** step))
        if found is not None:
            break
    assert found is not None
    assert found.rule == "growth" and found.comparison.step == 1 and found.evidence_step >= 4, found
    assert found.ratio < CLEAR  # not clear on its own: the growth is the evidence


def test_an_error_that_stops_growing_is_not_an_origin():
    """Over the floor but saturating (a faithful pair's zero-initialised parameters): not linear growth."""
    tracer = OriginTracer()
    for step in range(20):
        level = 2.5 * param_floor("1d", "rms", 1)
        error = _faithful(step) if step == 0 else [level] * len(NORMS)
        assert tracer.observe(_step(step, error)) is None, step


def test_no_origin_is_claimed_across_an_uncompared_step():
    """Steps 0..2 compared, 3 not: an error already over the floor at step 4 may have begun in the gap."""
    tracer = OriginTracer()
    for step in (0, 1, 2):
        assert tracer.observe(_step(step, _faithful(step))) is None
    assert tracer.observe(_step(4, 1e-3)) is None  # its run of steps reaches back to the gap
    assert tracer.observe(_step(5, 2e-3)) is None


def test_a_module_creating_an_error_far_over_its_kinds_floor_is_an_origin():
    tracer = OriginTracer()
    found = tracer.observe(_step(0, _faithful(0), forward=[("embed", 0.0, 0.0), ("rotary", 0.0, 7.7e-6),
                                                           ("block", 1e-7, 1e-6)]))
    assert found is not None and (found.row.phase, found.row.name) == ("forward", "rotary")
    assert found.row.tolerance == forward_floor("float32", "rotary", found.row.metric, 0)
    assert found.ratio > CLEAR_FORWARD
    assert "rotary's input matches exactly and its output is off by rms 7.7e-06, growth from exactly 0" \
        in found.evidence


def test_an_error_under_tolerance_created_by_a_module_with_parameters_is_an_origin():
    """An RMSNorm epsilon 1e-5 against 1e-6 on a residual stream of order 1: 4.5e-6 relative, under every flat
    tolerance; its input (the embeddings) matches; a later crossing downstream inherits from it."""
    tracer = OriginTracer()
    found = tracer.observe(_step(0, _faithful(0), forward=[("embed", 0.0, 0.0), ("norm", 0.0, 4.5e-6),
                                                           ("proj", 4.5e-6, 2e-5)]))
    assert found is not None and found.row.name == "norm" and found.created[2] == "norm"


def test_a_module_that_only_passes_an_error_on_is_not_an_origin():
    """The same error downstream: the projection's input already carries it (growth under CREATES)."""
    tracer = OriginTracer()
    assert tracer.observe(_step(0, _faithful(0), forward=[("proj", 4.5e-6, 2e-5)])) is None


def test_a_created_error_within_its_kinds_floor_times_clear_is_not_an_origin():
    tracer = OriginTracer()
    below = 0.9 * CLEAR_FORWARD * forward_floor("float32", "norm", "rms", 0)
    assert tracer.observe(_step(0, _faithful(0), forward=[("norm", 0.0, below)])) is None


def test_low_precision_records_have_floors_of_their_own():
    """A bfloat16 record's created error is judged by bfloat16's floor, not float32's."""
    step = _step(0, _faithful(0), forward=[("norm", 0.0, 1e-4)])
    rows = [r if r.phase != "forward" else Row(**{**r.__dict__, "dtype": "bfloat16"}) for r in step.rows]
    low = StepComparison(0, 0, "cand", rows, values=step.values)
    assert forward_floor("bfloat16", "norm", "rms", 0) > 100 * forward_floor("float32", "norm", "rms", 0)
    assert OriginTracer().observe(low) is None
    assert OriginTracer().observe(step) is not None


def test_records_whose_tolerance_the_user_set_are_left_to_it():
    """A user who loosened a module's (or a phase's) tolerance said what difference is acceptable there."""
    from twinstep.server.compare.tolerance import ToleranceConfig

    rotary = [("embed", 0.0, 0.0), ("rotary", 0.0, 7.7e-6)]
    loosened = ToleranceConfig.from_dict({"overrides": [{"pattern": "rot*", "phase": "forward", "mean": 1e-3}]})
    assert OriginTracer(loosened).observe(_step(0, _faithful(0), forward=rotary)) is None
    decay = ToleranceConfig.from_dict({"param": {"rms": 1e-3}})
    assert OriginTracer(decay).observe(_step(0, DECAY, shrink=1 - 1e-5)) is None
    # An override elsewhere changes nothing here.
    other = ToleranceConfig.from_dict({"overrides": [{"pattern": "lm_head", "mean": 1e-3}]})
    assert OriginTracer(other).observe(_step(0, _faithful(0), forward=rotary)) is not None


def test_a_module_whose_input_carries_the_error_is_not_its_own_origin():
    tracer = OriginTracer()
    assert tracer.observe(_step(0, _faithful(0), forward=[("act", 1e-5, 5e-5)])) is None  # growth x5 < CREATES


def test_the_tracker_declares_the_origin_and_keeps_where_a_tolerance_was_first_crossed():
    tracker = FirstDivergenceTracker()
    tracker.add(_step(0, DECAY, shrink=1 - 1e-5))
    tracker.add(_step(1, 2 * DECAY, forward=[("act", 1e-3, 2e-3)], crossing="act"))
    (found,) = tracker.declare({"cand": 1})
    proto = found.to_proto()
    assert (proto.step, proto.phase, proto.module) == (0, "param", NORMS[0])
    assert proto.HasField("origin") and proto.origin.involved_total == len(NORMS)
    assert (proto.crossed.step, proto.crossed.phase, proto.crossed.module) == (1, "forward", "act")
    assert "only 1-D parameters" in proto.stage and "weight decay" in proto.stage


def test_a_crossing_at_the_origin_step_and_phase_keeps_its_own_words():
    """A learning-rate bug crosses at step 0 in the update: the crossing is the origin, not replaced."""
    tracker = FirstDivergenceTracker()
    comparison = _step(0, 1e-1)
    comparison.rows[0].divergent = True
    tracker.add(comparison)
    (found,) = tracker.declare({"cand": 0})
    assert found.origin is None and not found.to_proto().HasField("origin")


def test_an_origin_found_later_replaces_a_declared_crossing():
    """Declared at the crossing (step 5); the linear growth from step 1 names the earlier origin afterwards."""
    tracker = FirstDivergenceTracker()
    tracker.add(_step(0, _faithful(0)))
    tracker.add(_step(1, [7.4e-6] * len(NORMS)))
    tracker.add(_step(2, [1.48e-5] * len(NORMS), forward=[("act", 1e-3, 2e-3)], crossing="act"))
    (crossing,) = tracker.declare({"cand": 2})
    assert crossing.origin is None and crossing.comparison.step == 2
    for step in (3, 4, 5):
        tracker.add(_step(step, [7.4e-6 * step] * len(NORMS)))
    (origin,) = tracker.declare({"cand": 5})
    assert origin.origin is not None and origin.comparison.step == 1 and origin.crossed is crossing
    assert tracker.first() is origin


def test_watch_and_the_text_report_show_the_origin_and_its_crossing():
    from twinstep.cli.watch import format_event
    from twinstep.server.report.render import report_to_dict
    from twinstep.v1 import twinstep_pb2 as pb

    tracker = FirstDivergenceTracker()
    tracker.add(_step(0, DECAY, shrink=1 - 1e-5))
    tracker.add(_step(1, 2 * DECAY, forward=[("act", 1e-3, 2e-3)], crossing="act"))
    (found,) = tracker.declare({"cand": 1})
    divergence = found.to_proto()
    line = format_event(pb.Event(session="s", divergence=divergence))
    assert "traced back to its origin" in line and "first crossed a tolerance at step 1, forward of 'act'" in line
    first = report_to_dict(pb.Report(session="s", status="diverged", first_divergence=divergence))["first_divergence"]
    assert first["origin"]["involved"] == NORMS and first["crossed"]["step"] == 1


def test_a_forward_origin_gives_way_to_the_parameter_update_behind_it():
    """A forward origin at step 1 (a module without parameters of its own here), then the linear growth of the
    norm weights' decay proves the update of step 0 a few steps later: that earlier origin replaces the forward
    one, keeping the crossing."""
    tracker = FirstDivergenceTracker()
    for step in range(8):
        forward = [("embed", 0.0, 0.0), ("norm", 0.0, 1e-5 * step)]
        if step == 5:
            forward.append(("act", 1e-3, 2e-3))
        tracker.add(_step(step, 1e-5 * (step + 1), shrink=(1 - 1e-5) ** (step + 1), forward=forward,
                          crossing="act" if step == 5 else None))
        tracker.declare({"cand": step})
        if step == 1:  # the norm's own error is seen first
            assert (tracker.declared["cand"].row.phase, tracker.declared["cand"].row.name) == ("forward", "norm")
    proto = tracker.declared["cand"].to_proto()
    assert (proto.step, proto.phase) == (0, "param"), proto
    assert (proto.crossed.step, proto.crossed.module) == (5, "act"), proto.crossed


def test_the_floors_tables_are_the_committed_calibration_runs_merged():
    """server/detect/origin.py's tables come from benchmarks/calibration/*.log (held-out runs excepted) through
    benchmarks/merge_calibration.py: a table edited by hand, or a run added without merging, fails here."""
    import pathlib
    import sys

    from twinstep.server.detect import origin

    root = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        from merge_calibration import merge
    finally:
        sys.path.remove(str(root / "benchmarks"))
    logs = sorted(str(p) for p in (root / "benchmarks" / "calibration").glob("*.log")
                  if not p.name.startswith("heldout"))
    merged = {key: tuple(float(f"{v:.1e}") for v in values) for key, values in merge(logs).items()}
    assert merged == {**origin.PARAM_ENVELOPE, **origin.FORWARD_ENVELOPE}


def _own_params(step: int, norm_error: float, forward_error: float) -> StepComparison:
    """A step where the module "layers.0.norm" (whose weight is NORMS[0]) creates ``forward_error``."""
    comparison = _step(step, [norm_error] + _faithful(step)[1:], forward=[("layers.0.norm", 0.0, forward_error)])
    rows = [r if r.name != "layers.0.norm" else Row(**{**r.__dict__, "type": "RMSNorm"}) for r in comparison.rows]
    return StepComparison(step, 0, "cand", rows, values=comparison.values)


def test_a_module_whose_weights_already_differ_does_not_create_its_error():
    """After step 0 a module's error is its own only if its parameters matched after the step before."""
    error = 20 * forward_floor("float32", "norm", "rms", 1)
    differed = OriginTracer()
    differed.observe(_own_params(0, 0.5 * CLEAR * param_floor("1d", "rms", 0), 0.0))  # over the floor, not clear
    assert differed.observe(_own_params(1, 0.5 * CLEAR * param_floor("1d", "rms", 1), error)) is None
    matched = OriginTracer()
    matched.observe(_own_params(0, 0.1 * param_floor("1d", "rms", 0), 0.0))
    found = matched.observe(_own_params(1, 0.1 * param_floor("1d", "rms", 1), error))
    assert found is not None and found.row.name == "layers.0.norm"


def test_no_forward_origin_is_claimed_for_a_module_with_weights_after_a_gap():
    """Steps 0 to 2 not compared: at step 3 the weights may have parted in the gap."""
    error = 20 * forward_floor("float32", "norm", "rms", 3)
    assert OriginTracer().observe(_own_params(3, 0.1 * param_floor("1d", "rms", 3), error)) is None
