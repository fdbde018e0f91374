"""The session core driven directly: inputs in, actions out, with no gRPC, no threads and no clock.

Membership (join, a lost stream's grace, giving up, coming back), alignment of
runs at different speeds, detection of the first divergence, and the
divergence policy (halt, halt_after_gap, a candidate halted alone) with the
verdict's words.  Messages are real protobufs, as a client encodes them.
"""

from __future__ import annotations

import numpy as np

from tests.integration.rawclient import hello, step
from twinstep.server.config import HaltConfig, ServerConfig
from twinstep.server.connection import Connection
from twinstep.server.journal.entries import Entry, Kind
from twinstep.server.journal.replay import replay
from twinstep.server.session import Session, SessionCore
from twinstep.server.session.actions import (Action, Alert, ArmGiveUp, Commit, CommitStep, EndStream, HaltRun,
                                             HaltRuns, HaltWithBundle, Moment, Publish, PublishProgress, Send,
                                             SessionEnded, SetCredit)
from twinstep.v1 import twinstep_pb2 as pb

START = Moment(monotonic=1000.0, wall=1_800_000_000.0)
MANIFEST = pb.Manifest(modules=[pb.ModuleInfo(id=0, name="fc", type="Linear"),
                                pb.ModuleInfo(id=1, name="head", type="Linear")])


def at(seconds: float) -> Moment:
    return Moment(START.monotonic + seconds, START.wall + seconds)


def records(number: int, head_scale: float = 1.0) -> pb.StepRecords:
    """Step ``number``'s forward outputs of fc and head (the same values for every run unless scaled)."""
    rng = np.random.default_rng(number)
    return step(number, [(0, rng.normal(size=(4, 8))), (1, rng.normal(size=(4, 2)) * head_scale)]).step


class Run:
    """One rank of a run, as its stream's inputs to the core."""

    def __init__(self, core: SessionCore, name: str, baseline: bool = False, now: Moment = START) -> None:
        self.core = core
        self.name = name
        self.conn = Connection(f"test:{name}")
        self.hello = hello("s", name, baseline=baseline).hello
        self.joined = core.join(self.conn, self.hello, now)
        core.add_manifest(self.conn, MANIFEST)

    def step(self, number: int, head_scale: float = 1.0, now: Moment = START) -> list[Action]:
        return self.core.add_step(self.conn, records(number, head_scale), now)

    def steps(self, numbers, head_scale: float = 1.0) -> list[Action]:
        return [action for number in numbers for action in self.step(number, head_scale)]

    def finish(self, last_step: int, now: Moment = START) -> list[Action]:
        self.core.close_stream(self.conn, pb.Close(reason="finished", last_step=last_step))
        return self.core.leave(self.conn, now)


def of(actions: list[Action], kind: type) -> list:
    return [action for action in actions if isinstance(action, kind)]


def alerts(actions: list[Action]) -> list[str]:
    return [action.message for action in of(actions, Alert)]


def divergences(actions: list[Action]) -> list[pb.Divergence]:
    return [a.event.divergence for a in of(actions, Publish) if a.event.WhichOneof("body") == "divergence"]


def halting(on_divergence: bool = True, after_gap: bool = True, bundle: bool = False) -> ServerConfig:
    return ServerConfig(halt=HaltConfig(on_divergence=on_divergence, after_gap=after_gap, bundle=bundle))


# -- membership --------------------------------------------------------------------------------


def test_a_join_is_journaled_then_welcomed_before_its_credit():
    core = SessionCore("s", ServerConfig(), START)
    base = Run(core, "torch", baseline=True)
    [commit] = of(base.joined, Commit)
    assert (commit.kind, commit.stream) == (Kind.HELLO, 1) and pb.Hello.FromString(commit.rows()[0][2]) == base.hello
    sends = [i for i, a in enumerate(base.joined) if isinstance(a, Send)]
    credits = [i for i, a in enumerate(base.joined) if isinstance(a, SetCredit)]
    assert base.joined[sends[0]].message.WhichOneof("body") == "welcome" and sends[0] < credits[0]
    assert base.joined[sends[0]].message.welcome.last_step_received == -1
    # Alone, a run may lead by the server's window; it holds nothing yet.
    assert [(a.conn, a.max_step, a.acked_step) for a in of(base.joined, SetCredit)] == [(base.conn, 255, -1)]
    assert of(base.joined, PublishProgress) == [PublishProgress(force=True)]
    paddle = Run(core, "paddle")
    assert paddle.conn.stream_id == 2 and core.candidates == ["paddle"]


def test_a_lost_stream_waits_out_its_grace_and_its_run_ends_when_the_timer_fires():
    core = SessionCore("s", ServerConfig(), START)
    base, cand = Run(core, "torch", baseline=True), Run(core, "paddle")
    base.steps(range(3))
    cand.steps(range(2))
    base.finish(2)
    left = core.leave(cand.conn, at(5))  # no Close: the stream broke
    [lost] = alerts(left)
    assert lost == ("run 'paddle' rank 0 is lost after step 1: its stream ended without a goodbye, 5.0 s after its "
                    "last message (the process died or the network failed); it may reconnect within 30 s; the other "
                    "runs go on")
    assert of(left, ArmGiveUp) == [ArmGiveUp(cand.conn, 30.0)] and not of(left, SessionEnded)
    assert not core.members.all_ended() and core.ended_at == 0.0
    gave_up = core.give_up(cand.conn, at(35))
    assert of(gave_up, Commit)[0].kind is Kind.GIVE_UP
    assert core.members.all_ended() and core.runs["paddle"].state == "lost"
    assert of(gave_up, SessionEnded) and core.ended_at == at(35).wall
    assert any(message.startswith("every run has ended: INCOMPLETE") for message in alerts(gave_up))
    assert core.give_up(cand.conn, at(36)) == []  # once


def test_a_stream_that_comes_back_within_its_grace_cancels_the_give_up():
    core = SessionCore("s", ServerConfig(), START)
    base, cand = Run(core, "torch", baseline=True), Run(core, "paddle")
    base.steps(range(4))
    cand.steps(range(3))
    core.leave(cand.conn, at(1))
    back = Run(core, "paddle", now=at(2))
    [welcome] = [a.message.welcome for a in of(back.joined, Send) if a.message.WhichOneof("body") == "welcome"]
    assert welcome.last_step_received == 2  # it resends from step 3
    assert back.conn.stream_id == 3 and core.runs["paddle"].state == "streaming"
    assert core.give_up(cand.conn, at(31)) == []
    assert core.runs["paddle"].state == "streaming" and not core.runs["paddle"].ranks[0].awaiting_return


def test_a_replaced_stream_is_ended_and_a_resent_step_is_counted_not_taken_again():
    core = SessionCore("s", ServerConfig(), START)
    base, cand = Run(core, "torch", baseline=True), Run(core, "paddle")
    base.steps(range(2))
    cand.steps(range(2))
    again = Run(core, "paddle")
    assert [a.conn for a in of(again.joined, EndStream)] == [cand.conn]
    assert again.step(1) == []  # held already: no journal entry, no comparison
    assert core.runs["paddle"].ranks[0].steps_resent == 1 and core.pipeline.steps_compared() == 2


# -- alignment -------------------------------------------------------------------------------------


def test_runs_at_different_speeds_are_compared_step_by_step_as_the_slower_catches_up():
    core = SessionCore("s", ServerConfig(), START)
    base, cand = Run(core, "torch", baseline=True), Run(core, "paddle")
    actions = base.steps(range(5))
    assert core.pipeline.steps_compared() == 0 and [c.kind for c in of(actions, Commit)] == []
    assert len(of(actions, CommitStep)) == 5
    assert core.pipeline.aligners[0].pending_steps("torch") == 5
    compared = []
    for number in range(3):
        cand.step(number)
        compared.append(core.pipeline.steps_compared())
    assert compared == [1, 2, 3]
    assert core.pipeline.aligners[0].pending_steps("torch") == 2  # steps 3 and 4 wait for their counterparts
    assert core.pipeline.last_comparison.step == 2 and core.pipeline.last_comparison.candidate_run == "paddle"
    # Each may run the window past the other, and at most 16 steps past the last it sent (max in flight).
    credits = {a.conn.peer: (a.max_step, a.acked_step) for a in cand.step(3) if isinstance(a, SetCredit)}
    assert credits == {"test:torch": (4 + 16, 4), "test:paddle": (3 + 16, 3)}


# -- detection ---------------------------------------------------------------------------------------


def test_a_divergent_step_declares_the_first_divergence_at_its_step_phase_and_module():
    core = SessionCore("s", ServerConfig(), START)
    base, cand = Run(core, "torch", baseline=True), Run(core, "paddle")
    base.steps(range(4))
    assert divergences(cand.steps(range(2))) == []
    [found] = divergences(cand.step(2, head_scale=3.0))
    assert (found.candidate_run, found.step, found.rank, found.phase, found.module) == ("paddle", 2, 0, "forward",
                                                                                            "head")
    assert found.value > found.tolerance
    announced = [a for a in of(cand.step(3, head_scale=3.0), Publish) if a.event.HasField("divergence")]
    assert announced == []  # declared once
    assert core.pipeline.tracker.first().comparison.step == 2


def test_a_difference_within_tolerance_declares_nothing_and_the_runs_end_aligned():
    core = SessionCore("s", ServerConfig(), START)
    base, cand = Run(core, "torch", baseline=True), Run(core, "paddle")
    base.steps(range(3))
    actions = cand.steps(range(3), head_scale=1 + 1e-7)
    assert divergences(actions) == [] and core.pipeline.tracker.first() is None
    base.finish(2)
    ended = cand.finish(2, now=at(9))
    assert alerts(ended) == ["every run has ended: aligned over 3 compared step(s)"]
    assert of(ended, Alert)[0].level == "info" and of(ended, SessionEnded) and core.ended_at == at(9).wall


# -- policy ------------------------------------------------------------------------------------------


def test_halt_on_divergence_halts_every_run_and_tells_a_late_joiner_to_halt():
    core = SessionCore("s", halting(), START)
    base, cand = Run(core, "torch", baseline=True), Run(core, "paddle")
    base.steps(range(3))
    cand.steps(range(2))
    actions = cand.step(2, head_scale=3.0)
    [halt] = of(actions, HaltRuns)
    assert [(t.run, t.streams) for t in halt.targets] == [("torch", (base.conn,)), ("paddle", (cand.conn,))]
    assert halt.reason.startswith("divergence at step 2, forward of 'head' (") and halt.at_step is None
    assert halt.told == ["torch", "paddle"]
    assert [c.kind for c in of(actions, Commit)] == [Kind.HALT]
    assert core.halted and core.halt("again") == []  # a halt happens once
    late = Run(core, "mindspore")
    halts = [a.message.command for a in of(late.joined, Send) if a.message.WhichOneof("body") == "command"]
    assert [(c.kind, c.at_step, c.reason) for c in halts] == [(pb.Command.HALT, -1, halt.reason)]
    assert not of(late.joined, SetCredit)


def test_with_halt_after_gap_off_a_divergence_after_a_gap_is_told_not_halted():
    core = SessionCore("s", halting(after_gap=False), START)
    base, cand = Run(core, "torch", baseline=True), Run(core, "paddle")
    base.steps(range(4))
    cand.step(0)
    actions = cand.step(3, head_scale=3.0)  # steps 1 and 2 never came
    [found] = divergences(actions)
    assert found.step == 3 and found.after_gap
    assert not of(actions, HaltRuns) and not core.halted
    told = alerts(actions)
    assert told[0].startswith("run 'paddle': first divergence at step 3 comes after steps that were not compared")
    assert told[1].startswith("not halting on the divergence at step 3, forward of 'head'")
    assert "halt_after_gap is off, so the decision is yours (twinstep halt s)" in told[1]


def test_with_two_candidates_the_first_to_diverge_halts_alone_while_the_other_goes_on():
    core = SessionCore("s", halting(), START)
    base, first, second = Run(core, "torch", baseline=True), Run(core, "paddle"), Run(core, "mindspore")
    base.steps(range(4))
    second.steps(range(2))
    first.step(0)
    actions = first.step(1, head_scale=3.0)
    [alone] = of(actions, HaltRun)
    assert alone.target.run == "paddle" and alone.target.streams == (first.conn,)
    assert alone.reason.startswith("run 'paddle': divergence at step 1, forward of 'head'")
    assert not of(actions, HaltRuns) and not core.halted and list(core.halts.runs_halted) == ["paddle"]
    goes_on = second.step(2)
    assert not of(goes_on, HaltRun) and not of(goes_on, HaltRuns)
    assert core.pipeline.tracker.steps_compared_by("mindspore") == 3
    # The last candidate diverging halts the whole session: nobody needs the baseline any more.
    assert of(second.step(3, head_scale=3.0), HaltRuns) and core.halted


def test_a_bundle_halt_is_asked_once_and_comes_back_as_a_halt():
    core = SessionCore("s", halting(bundle=True), START)
    base, cand = Run(core, "torch", baseline=True), Run(core, "paddle")
    base.steps(range(2))
    [bundle] = of(cand.steps(range(2), head_scale=3.0), HaltWithBundle)
    assert bundle.found.comparison.step == 0 and not core.halted  # halted once every run knows where to stop
    assert [t.run for t in of(core.halt(bundle.reason, at_step=5), HaltRuns)[0].targets] == ["torch", "paddle"]


def test_a_baseline_that_ends_before_any_candidate_waits_for_one_and_says_so_without_a_verdict():
    core = SessionCore("s", ServerConfig(), START)
    base = Run(core, "torch", baseline=True)
    base.steps(range(3))
    ended = base.finish(2, now=at(4))
    assert alerts(ended) == ["waiting for a candidate to join (the 3 steps of baseline 'torch' are kept for it); the "
                             "verdict is told once one has run, and is final if no candidate joins within sessions.ttl "
                             "(3600 s)"]
    assert of(ended, Alert)[0].level == "info" and core.ended_at == at(4).wall
    late = Run(core, "paddle", now=at(5))
    assert core.ended_at == 0.0
    late.steps(range(3))
    assert alerts(late.finish(2)) == ["every run has ended: aligned over 3 compared step(s)"]


# -- replay: the same core, a handler that sends nothing ---------------------------------------------------


class Recorded(Connection):
    """A stand-in stream that remembers what it was sent (a replay's are otherwise closed)."""

    sent: list = []

    def send(self, message: pb.ServerMessage) -> None:
        Recorded.sent.append(message)

    def set_credit(self, max_step: int, acked_step: int) -> None:
        Recorded.sent.append((max_step, acked_step))


def test_a_replay_of_the_journaled_inputs_rebuilds_the_verdict_and_sends_nothing(monkeypatch):
    live = SessionCore("s", halting(), START)
    journaled: list[Action] = []
    base, cand = Run(live, "torch", baseline=True), Run(live, "paddle")
    journaled += base.joined + cand.joined
    journaled += [Commit(Kind.MANIFEST, 1, MANIFEST), Commit(Kind.MANIFEST, 2, MANIFEST)]
    journaled += base.steps(range(3)) + cand.steps(range(2)) + cand.step(2, head_scale=3.0)
    rows = [row for a in journaled if isinstance(a, (Commit, CommitStep)) for row in a.rows()]
    rows.sort(key=lambda row: 0 if row[0] is Kind.HELLO else 1 if row[0] is Kind.MANIFEST else 2)
    entries = [Entry(seq, kind, stream, header, payload) for seq, (kind, stream, header, payload) in
               enumerate(rows, 1)]
    assert [e.kind for e in entries].count(Kind.HALT) == 1

    monkeypatch.setattr("twinstep.server.journal.replay.Connection", Recorded)
    Recorded.sent = []
    restored = Session("s", halting())
    result = replay(restored, entries)
    assert result.failed == 0 and len(result.open_streams) == 2
    assert Recorded.sent == []  # no Welcome, credit, event nor halt: the clients are gone
    snapshot = restored.snapshot()
    assert (snapshot.status, snapshot.halted, snapshot.steps_compared) == ("diverged", True, 3)
    assert snapshot.first.comparison.step == 2
    kept = [e.WhichOneof("body") for e in restored.events.history]
    assert kept == ["divergence"]  # kept for watchers who come later; no halt notice: nothing was told
