"""server/detect/first_divergence.py: the earliest divergence, declared once no earlier one can appear."""

from __future__ import annotations

from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.detect.first_divergence import FirstDivergenceTracker

PHASES = ("forward", "loss", "backward", "grad", "param")


def row(phase: str, name: str, divergent: bool) -> Row:
    return Row(
        phase=phase, name=name, candidate_name=name, type="Linear", call_index=0, slot=0,
        metric="rms", value=1.0 if divergent else 0.0, tolerance=1e-4, divergent=divergent,
    )


def comparison(step: int, divergent: list[tuple[str, str]] | None = None, rank: int = 0, run: str = "cand",
               rows: list[tuple[str, str]] | None = None) -> StepComparison:
    """Rows in baseline order (all phases); the listed (phase, name) ones divergent."""
    layout = rows or [("forward", "a"), ("forward", "b"), ("loss", "loss"), ("backward", "b"), ("backward", "a"),
                      ("grad", "b.weight"), ("grad", "a.weight"), ("param", "a.weight"), ("param", "b.weight")]
    bad = set(divergent or [])
    return StepComparison(step=step, rank=rank, candidate_run=run, rows=[row(p, n, (p, n) in bad) for p, n in layout])


def test_no_divergence_nothing_declared():
    t = FirstDivergenceTracker()
    for s in range(3):
        t.add(comparison(s))
    assert t.declare({"cand": 10}) == []
    assert t.first() is None


def test_earliest_step_wins_even_if_seen_later():
    t = FirstDivergenceTracker()
    t.add(comparison(5, [("forward", "a")]))
    t.add(comparison(7, [("forward", "a")]))
    t.add(comparison(3, [("param", "b.weight")]))  # later arrival, earlier step, later phase
    t.add(comparison(4, [("forward", "a")]))
    declared = t.declare({"cand": 10})
    assert len(declared) == 1
    found = declared[0]
    assert found.comparison.step == 3
    assert (found.row.phase, found.row.name) == ("param", "b.weight")
    assert t.first() is found


def test_phase_order_within_a_step():
    # The same step seen on different ranks, each diverging first in another phase:
    # forward < loss < backward < grad < param whatever the arrival order.
    for expected_index, expected in enumerate(PHASES):
        t = FirstDivergenceTracker()
        names = {"forward": "b", "loss": "loss", "backward": "a", "grad": "a.weight", "param": "b.weight"}
        for rank, phase in reversed(list(enumerate(PHASES))):
            if PHASES.index(phase) >= expected_index:
                t.add(comparison(2, [(phase, names[phase])], rank=rank))
        (found,) = t.declare({"cand": 2})
        assert found.row.phase == expected, (expected, found.row.phase)


def test_within_phase_baseline_record_order_then_rank():
    t = FirstDivergenceTracker()
    t.add(comparison(1, [("backward", "a")], rank=0))  # position 4
    t.add(comparison(1, [("backward", "b")], rank=1))  # position 3
    (found,) = t.declare({"cand": 1})
    assert found.row.name == "b" and found.comparison.rank == 1
    t = FirstDivergenceTracker()
    t.add(comparison(1, [("backward", "b")], rank=2))
    t.add(comparison(1, [("backward", "b")], rank=1))
    (found,) = t.declare({"cand": 1})
    assert found.comparison.rank == 1


def test_first_divergent_row_of_a_comparison_is_used():
    t = FirstDivergenceTracker()
    t.add(comparison(0, [("grad", "a.weight"), ("forward", "b"), ("param", "a.weight")]))
    (found,) = t.declare({"cand": 0})
    assert (found.row.phase, found.row.name) == ("forward", "b")
    assert found.key[0] == 0


def test_declare_only_once_frontier_reaches_step():
    t = FirstDivergenceTracker()
    t.add(comparison(4, [("forward", "a")]))
    assert t.declare({}) == []
    assert t.declare({"cand": 3}) == []
    assert t.declare({"other": 100}) == []
    assert t.first() is None
    # An earlier divergence can still arrive while the frontier is behind: it wins.
    t.add(comparison(2, [("loss", "loss")]))
    assert t.declare({"cand": 1.0}) == []
    (found,) = t.declare({"cand": 2})
    assert found.comparison.step == 2
    assert t.declare({"cand": 50}) == []  # each run declared once
    assert t.first() is found


def test_declared_divergence_is_final():
    t = FirstDivergenceTracker()
    t.add(comparison(4, [("forward", "a")]))
    (found,) = t.declare({"cand": 4})
    t.add(comparison(1, [("forward", "a")]))  # cannot happen with a correct frontier; ignored
    assert t.declare({"cand": 10}) == []
    assert t.first() is found and t.first().comparison.step == 4


def test_runs_are_independent():
    t = FirstDivergenceTracker()
    t.add(comparison(6, [("forward", "a")], run="c1"))
    t.add(comparison(2, [("grad", "a.weight")], run="c2"))
    declared = t.declare({"c1": 6, "c2": 1})
    assert [d.comparison.candidate_run for d in declared] == ["c1"]
    declared = t.declare({"c1": 6, "c2": 2})
    assert [d.comparison.candidate_run for d in declared] == ["c2"]
    # the session's first: the earliest of all declared
    assert t.first().comparison.candidate_run == "c2"


def test_steps_compared_counts_steps_seen_on_every_rank():
    t = FirstDivergenceTracker()
    for s in range(3):
        t.add(comparison(s, rank=0))
    t.add(comparison(0, rank=1))
    t.add(comparison(1, rank=1))
    t.add(comparison(1, rank=1))  # same rank twice counts once
    assert t.steps_compared(world_size=1) == 3
    assert t.steps_compared(world_size=2) == 2
    t.add(comparison(0, rank=0, run="other"))
    assert t.steps_compared(world_size=1) == 3
    assert FirstDivergenceTracker().steps_compared(world_size=1) == 0


def test_phase_beats_position_and_rank():
    t = FirstDivergenceTracker()
    # rank 0 records only parameters (position 0 is a grad); rank 1's forward divergence is far down its list
    t.add(comparison(3, [("grad", "w")], rank=0, rows=[("grad", "w"), ("param", "w")]))
    forward_rows = [("forward", f"m{i}") for i in range(6)]
    t.add(comparison(3, [("forward", "m5")], rank=1, rows=forward_rows))
    (found,) = t.declare({"cand": 3})
    assert (found.row.phase, found.row.name, found.comparison.rank) == ("forward", "m5", 1)
    t = FirstDivergenceTracker()
    t.add(comparison(3, [("param", "w")], rank=0, rows=[("param", "w")]))
    t.add(comparison(3, [("backward", "m")], rank=1, rows=[("forward", "x"), ("backward", "x"), ("backward", "m")]))
    (found,) = t.declare({"cand": 3})
    assert found.row.phase == "backward"
