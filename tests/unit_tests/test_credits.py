"""Credit: how far a stream may run ahead of the other runs, and of what the server has taken."""

from __future__ import annotations

from twinstep.server.connection import Connection
from twinstep.server.runs.credits import credit_updates
from twinstep.server.runs.membership import RankState, RunState


def run(name: str, last_step: int, *, stride: int = 1, max_lead: int = 0) -> RunState:
    state = RunState(name=name, baseline=name == "base", framework="torch", framework_version="t", world_size=1,
                     capture="stats", max_lead=max_lead)
    state.ranks[0] = RankState(connection=Connection(name), last_step=last_step, accounted_step=last_step,
                               stride=stride)
    return state


def credits(*runs: RunState, window: int = 256, inflight: int | None = 16) -> dict[str, tuple[int, int]]:
    return {conn.peer: (max_step, acked) for conn, max_step, acked in credit_updates(runs, 0, window, inflight)}


def test_a_stream_may_send_at_most_max_inflight_steps_past_what_the_server_took():
    # The candidate is far behind: the window alone would let the baseline send up to step 10 + 256.
    assert credits(run("base", 100), run("cand", 10)) == {"base": (116, 100), "cand": (26, 10)}
    assert credits(run("base", 100), run("cand", 10), inflight=None) == {"base": (266, 100), "cand": (356, 10)}


def test_the_bound_is_in_the_run_s_own_step_numbers():
    # Captured every 10 steps: 16 messages in flight reach 160 steps further.
    assert credits(run("base", 100, stride=10), run("cand", 100, stride=10))["base"] == (260, 100)


def test_a_stream_that_sent_nothing_yet_is_bounded_by_the_window_only():
    # Its first step number is unknown (a run resumed from a checkpoint starts far from 0).
    assert credits(run("base", -1), run("cand", -1))["base"] == (255, -1)


def test_lockstep_stays_the_tighter_bound():
    assert credits(run("base", 100, max_lead=2), run("cand", 99))["base"] == (101, 100)
