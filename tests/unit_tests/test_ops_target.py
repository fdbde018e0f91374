"""Which module's operations are captured after a forward divergence (server/ops/target.py)."""

from __future__ import annotations

from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.detect.first_divergence import Candidate
from twinstep.server.detect.stage import describe
from twinstep.server.ops.target import ops_target


def row(phase: str, name: str, divergent: bool = False, type: str = "Linear") -> Row:
    return Row(phase=phase, name=name, candidate_name=name.replace("model.", "net."), type=type, call_index=0,
               slot=0, metric="rms", value=1.0 if divergent else 0.0, tolerance=0.5, divergent=divergent, ndim=2)


def target(rows: list[Row], step: int = 0) -> tuple[tuple[str, str] | None, str]:
    comparison = StepComparison(step=step, rank=0, candidate_run="cand", rows=rows)
    found = Candidate((step, 0, 0, 0), comparison.first, comparison)
    return ops_target(found), describe(found.row, comparison)


def test_a_module_that_creates_the_error_has_its_own_operations_captured():
    picked, stage = target([row("input", "model.embed"), row("forward", "model.embed"),
                            row("input", "model.layers.0.act"), row("forward", "model.layers.0.act", True, "GELU")])
    assert stage.startswith("forward:") and picked == ("model.layers.0.act", "net.layers.0.act")


def test_an_input_that_already_differs_points_at_the_parents_forward():
    picked, stage = target([row("input", "model.embed"), row("forward", "model.embed"),
                            row("input", "model.layers.0.act", True), row("forward", "model.layers.0.act", True)])
    assert stage.startswith("forward:") and picked == ("model.layers.0", "net.layers.0")


def test_a_data_divergence_captures_no_operations():
    """The step's first module already has a differing input: the cause is the data, in no module's code."""
    picked, stage = target([row("input", "model.embed", True), row("forward", "model.embed", True, "Embedding"),
                            row("forward", "model.layers.0.act", True)])
    assert stage.startswith("data: step 0 differs from its very first module (model.embed)")
    assert picked is None  # not model.embed's parent, "model", whose forward only passes the data on
    # At a later step with matching weights, a first module that differs is data too, its input captured or not.
    picked, stage = target([row("forward", "model.embed", True), row("forward", "model.layers.0.act", True)], step=3)
    assert stage.startswith("data: step 3") and picked is None


def test_other_phases_and_the_root_capture_nothing():
    assert target([row("forward", "model.embed"), row("grad", "model.embed.weight", True)])[0] is None
    assert target([row("input", ""), row("forward", "", True)])[0] is None
