"""The state of one session and the rules that change it: inputs in, actions out.

A core holds who joined (runs.membership), the compare pipeline
(pipeline.py: alignment, comparison, detection), the divergence policy
(policy.py), the verdict (verdict.py), the zoom windows and the halt state.
Each input (a hello, a manifest, a step, a health report, a set-up, a close,
a leave, a reconnect grace running out, a halt) is one method call that
returns the actions it causes (actions.py), in order.  It takes no lock,
starts no thread, reads no clock (a Moment comes with each input that needs
one) and sends nothing: the coordinator (coordinator.py) does all that, and
a journal's replay carries out the same actions differently.

Input errors are raised (twinstep.server.errors.InputError) before anything
changes, as far as the input can be checked up front.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

import grpc

from twinstep._version import PROTOCOL_VERSION
from twinstep.server.align.coverage import CoverageLedger
from twinstep.server.compare.lossy import lossy_bounds
from twinstep.server.compare.mapping_resolver import MappingResolver
from twinstep.server.config import ServerConfig
from twinstep.server.connection import Connection
from twinstep.server.control.zoom import Window, ZoomWindows, not_asked_alert, told_alert, zoom_command
from twinstep.server.detect.coverage import describe_failure
from twinstep.server.detect.coverage import failure_kinds as _failure_kinds
from twinstep.server.detect.first_divergence import Candidate
from twinstep.server.errors import InputError, invalid
from twinstep.server.ingest.decode import decode_step
from twinstep.server.journal.entries import Kind, leave_header
from twinstep.server.ops import OperationsInspector
from twinstep.server.preflight import PreflightTracker, check_setup
from twinstep.server.runs.credits import credit_updates
from twinstep.server.runs.halt import HaltState, halt_command
from twinstep.server.runs.membership import MAX_TEXT, MAX_WARNINGS, Membership, RankState, RunState, check_hello
from twinstep.server.session import verdict
from twinstep.server.session.actions import (Action, Actions, ArmGiveUp, Commit, CommitStep, EndStream, HaltRuns,
                                             HaltTarget, Log, Moment, Publish, PublishProgress, Send, SessionEnded,
                                             SetCredit)
from twinstep.server.session.pipeline import MAX_LISTED, ComparePipeline
from twinstep.server.session.policy import DivergencePolicy
from twinstep.server.shards.ownership import WHOLE, RankShare
from twinstep.v1 import twinstep_pb2 as pb

if TYPE_CHECKING:
    from twinstep.server.control.zoom import PerRun

_MAX_FAILURE_ENTRIES = 1024


class SessionCore:
    """One comparison of a baseline with its candidates, as state and rules (see the module docstring)."""

    def __init__(self, name: str, config: ServerConfig, now: Moment, share: RankShare = WHOLE) -> None:
        self.name = name
        self.config = config
        self.share = share
        """The ranks this server compares: all, or one shard's (twinstep.server.shards)."""
        self.members = Membership(name, config.limits.max_runs_per_session)
        self.halts = HaltState()
        self.mappings = MappingResolver(config.mapping, config.comparison.auto_mapping)
        self.coverage = CoverageLedger()
        self.pipeline = ComparePipeline(name, config, self.members, self.coverage, self.mappings,
                                        self._error, self._refresh_preflight, share)
        self.policy = DivergencePolicy()
        self.preflight = PreflightTracker()
        """The runs' training set-ups and the differences found between them (twinstep.server.preflight)."""
        self.operations = OperationsInspector(config.tolerances)
        """Operations inside a module: captures kept until both sides are in, and the findings (twinstep.server.ops)."""
        self.zooms = ZoomWindows()
        """Live capture changes told to the runs (twinstep.server.control)."""
        self.errors: list[str] = []
        self.archived = False
        """Left the registry (its runs had ended): a stream that still holds it must join the name afresh."""
        self.ended_at = 0.0
        """Wall-clock time when every run had ended (0 while one streams)."""
        self.last_active = now.monotonic
        """When a stream last delivered or ended (for the memory budget's eviction order)."""
        self._stream_ids = itertools.count(1)
        self._left: dict[int, Connection] = {}  # lost streams within their reconnect grace, by stream id
        self._verdict_told = False
        self._journal_failure_told = False
        self._lossy: dict[str, pb.LossyBound] | None = None

    # -- who is in it ------------------------------------------------------------------------------

    @property
    def runs(self) -> dict[str, RunState]:
        return self.members.runs

    @property
    def baseline(self) -> str | None:
        return self.members.baseline

    @property
    def candidates(self) -> list[str]:
        return self.members.candidates

    @property
    def references(self) -> list[str]:
        return self.members.references

    @property
    def halted(self) -> bool:
        return self.halts.halted

    # -- membership ----------------------------------------------------------------------------------

    def join(self, conn: Connection, hello: pb.Hello, now: Moment) -> list[Action]:
        """Admit a stream: its Welcome is the first action for it (then its zoom windows, a halt or its credit)."""
        precision = check_hello(hello)
        if self.archived:
            raise InputError(grpc.StatusCode.UNAVAILABLE, f"session {self.name!r} was just archived; reconnect "
                             "to start it afresh")
        out = Actions()
        _, replaced = self.members.join(conn, hello, precision, now.monotonic)
        if replaced is not None:
            out.add(EndStream(replaced))
        for stream_id, left in list(self._left.items()):  # it came back: its grace timer has nothing to do
            if (left.run, left.rank) == (hello.run, hello.rank):
                del self._left[stream_id]
        if not conn.stream_id:
            conn.stream_id = next(self._stream_ids)
        else:  # replayed: later streams are numbered after it
            self._stream_ids = itertools.count(max(conn.stream_id + 1, next(self._stream_ids)))
        self.ended_at = 0.0
        out.add(Commit(Kind.HELLO, conn.stream_id, hello))
        self._verdict_told = False  # a run (re)joined: the verdict is told again when all have ended
        self.coverage.declare(hello.run, hello.rank, hello)
        self.pipeline.aligner(hello.rank).reopen(hello.run)
        self.pipeline.rank_rejoined(hello.run, hello.rank)
        self.pipeline.decide_layout(out)
        welcome = pb.Welcome(protocol_version=PROTOCOL_VERSION,
                             last_step_received=self.pipeline.delivered(hello.run, hello.rank),
                             max_step_tensor_bytes=self.config.window.bytes)
        if hello.capture == "lossy":
            for phase, bound in self._lossy_bounds().items():
                welcome.lossy[phase].CopyFrom(bound)
        out.add(Send(conn, pb.ServerMessage(welcome=welcome)))
        for spec in self.zooms.told_to(hello.run):  # zoom windows of its run that are not over yet
            out.add(Send(conn, zoom_command(spec)))
        reason = self.halts.reason_for(hello.run)  # the session's halt, or its run's alone
        out.add(Log(logging.INFO, f"session {self.name}: run {hello.run!r} rank {hello.rank} joined "
                                  f"({hello.framework} {hello.framework_version})"))
        for warning in hello.warnings[:MAX_WARNINGS]:
            out.alert("warning", f"run {hello.run!r} rank {hello.rank}: {warning[:MAX_TEXT]}")
        out.add(PublishProgress(force=True))
        if reason is not None:
            out.add(Send(conn, halt_command(-1, reason)))
        else:
            self._credits(hello.rank, out)
        return out.items

    def leave(self, conn: Connection, now: Moment, silent_for: float | None = None,
              grace: float | None = None) -> list[Action]:
        """The stream of ``conn`` ended, cleanly (after Close) or not.

        A stream that broke leaves its rank ``lost`` at once, but for ``grace`` seconds (reconnect_grace)
        the rank may come back: until then nothing it could still match is released.
        ``silent_for``: the silence measured when it happened (a replay from the journal).
        """
        run = self.members.leave(conn, now.monotonic)
        if run is None:
            return []
        out = Actions()
        state = run.ranks[conn.rank]
        lost = state.state == "lost"
        if lost and silent_for is not None and silent_for >= 0:
            state.silent_for = silent_for
        out.add(Commit(Kind.LEAVE, conn.stream_id, leave_header(state.silent_for)))
        grace = self.config.sessions.reconnect_grace if grace is None else grace
        waits = lost and grace > 0
        if waits:
            state.awaiting_return = True
            self._left[conn.stream_id] = conn
            self.last_active = now.monotonic
        else:
            declared, ended = self._rank_ended(run, conn.rank, now, out)
        if lost:
            comeback = f"; it may reconnect within {grace:g} s" if grace > 0 else ""
            out.alert("warning", f"run {run.name!r} rank {conn.rank} is lost after step {state.last_step}: its stream "
                      f"ended without a goodbye, {state.silent_for:.1f} s after its last message (the process died "
                      f"or the network failed){comeback}; the other runs go on", kind="lost_run", run=run.name,
                      rank=conn.rank)
        if waits:
            out.add(ArmGiveUp(conn, grace))
            self._credits(conn.rank, out)
            out.add(PublishProgress(force=True))
        else:
            self._after_rank_ended(conn.rank, declared, ended, out)
        return out.items

    def give_up(self, conn: Connection, now: Moment) -> list[Action]:
        """The reconnect grace of lost stream ``conn`` ran out: release what its run could still have matched."""
        if self._left.pop(conn.stream_id, None) is None:
            return []
        run = self.runs.get(conn.run or "")
        state = run.ranks.get(conn.rank) if run else None
        if run is None or state is None or not state.awaiting_return or state.connection is not None:
            return []  # it came back
        out = Actions()
        state.awaiting_return = False
        out.add(Commit(Kind.GIVE_UP, conn.stream_id, b""))
        declared, ended = self._rank_ended(run, conn.rank, now, out)
        self._after_rank_ended(conn.rank, declared, ended, out)
        return out.items

    def absent(self, conn: Connection, grace: float, now: Moment) -> list[Action]:
        """After a restart: ``conn`` was open before it and did not come back within ``grace`` s: it is lost."""
        run = self.runs.get(conn.run or "")
        state = run.ranks.get(conn.rank) if run else None
        if state is None or state.connection is not conn:
            return []  # it came back (a newer stream replaced this one)
        out = Actions()
        out.alert("warning", f"run {conn.run!r} rank {conn.rank} did not reconnect within {grace:g} s of the "
                  "server's restart")
        return out.items + self.leave(conn, now, grace=0)

    def close_stream(self, conn: Connection, message: pb.Close) -> list[Action]:
        self.members.close(conn, message)
        return [Commit(Kind.CLOSE, conn.stream_id, message)]

    def _rank_ended(self, run: RunState, rank: int, now: Moment,
                    out: Actions) -> tuple[list[Candidate], tuple[str, str] | None]:
        """A rank's stream ended for good: release, compare what is ready, declare."""
        self.pipeline.rank_ended(run.name, rank, out)
        declared = self.pipeline.declare()
        ended = self._ended_verdict()
        self.last_active = now.monotonic
        if self.members.all_ended() and not self.ended_at:
            self.ended_at = now.wall
        return declared, ended

    def _after_rank_ended(self, rank: int, declared: list[Candidate], ended: tuple[str, str] | None,
                          out: Actions) -> None:
        self.policy.announce(self, declared, out)
        if ended is not None:
            out.alert(*ended)
        if self.ended_at:
            out.add(SessionEnded())
        self._credits(rank, out)
        out.add(PublishProgress(force=True))

    def _ended_verdict(self) -> tuple[str, str] | None:
        """Once, when the last run ends without a divergence: the verdict and its reasons."""
        if self._verdict_told or not self.members.all_ended():
            return None
        words = verdict.ended_words(self)
        if words is not None:
            self._verdict_told = True
        return words

    # -- ingest ----------------------------------------------------------------------------------------

    def add_manifest(self, conn: Connection, message: pb.Manifest) -> list[Action]:
        self.members.rank_of(conn).manifest.add(message)
        return [Commit(Kind.MANIFEST, conn.stream_id, message)]

    def add_health(self, conn: Connection, health: pb.CaptureHealth) -> list[Action]:
        """The client's latest word on what it could not capture; watchers hear of each new kind once."""
        if len(health.failures) > _MAX_FAILURE_ENTRIES:
            raise invalid(f"capture health lists {len(health.failures)} failures; at most {_MAX_FAILURE_ENTRIES}")
        rank_state = self.members.rank_of(conn)
        before = _failure_kinds(rank_state.health)
        rank_state.health = health
        rank_state.merge_dropped(health.dropped)
        self.coverage.client_missing(conn.run or "", conn.rank, health)
        reported = max((m.last_step for m in health.missing), default=-1)
        rank_state.accounted_step = max(rank_state.accounted_step, reported)
        news = [kind for kind in _failure_kinds(health) if kind not in before]
        out = Actions([Commit(Kind.HEALTH, conn.stream_id, health)])
        for kind in news[:MAX_WARNINGS]:
            out.alert("warning", f"run {conn.run!r} rank {conn.rank}: capture is failing: "
                      f"{describe_failure(health, kind)}", kind="capture_failure", run=conn.run or "", rank=conn.rank)
        self._credits(conn.rank, out)  # steps said missing move this run along, as delivered ones do
        out.add(PublishProgress(force=True))
        return out.items

    def add_setup(self, conn: Connection, setup: pb.Setup) -> list[Action]:
        """A run's training set-up (docs/preflight.md): diffed against the baseline's, new differences alerted."""
        check_setup(setup)
        if setup.rank != conn.rank:
            raise invalid(f"setup says rank {setup.rank}, but this stream joined as rank {conn.rank}")
        self.members.rank_of(conn)
        out = Actions([Commit(Kind.SETUP, conn.stream_id, setup)])
        # A run's set-up is its lowest rank's: a shard without rank 0 holds none (the session's report takes
        # rank 0's shard's findings), rather than diff another rank's and name findings the session has not.
        if not self.share.whole and setup.rank != 0:
            return out.items
        if self.preflight.add(conn.run or "", setup):
            self._refresh_preflight(out)
        return out.items

    def _refresh_preflight(self, out: Actions) -> None:
        """Diff every candidate's set-up again; alert the warnings not told yet."""
        news = self.preflight.refresh(self.baseline, self.candidates, self.mappings.for_names)
        for finding in news[:MAX_WARNINGS]:
            out.alert("warning", f"run {finding.candidate_run!r}: preflight: {finding.message}", kind="preflight",
                      run=finding.candidate_run)
        if len(news) > MAX_WARNINGS:
            out.alert("warning", f"preflight: {len(news) - MAX_WARNINGS} more set-up differences: see the report",
                      kind="preflight")

    def add_step(self, conn: Connection, message: pb.StepRecords, now: Moment) -> list[Action]:
        """One step's records: journaled, aligned, compared when its counterparts are in, divergences declared."""
        if message.rank != conn.rank:
            raise invalid(f"step {message.step} says rank {message.rank}, but this stream joined as rank {conn.rank}")
        if message.step < 0:
            raise invalid(f"negative step {message.step}")
        rank_state = self.members.rank_of(conn)
        if message.step <= self.pipeline.delivered(conn.run or "", conn.rank):
            # Sent again after a reconnect: this server holds it (or compared it) already.
            conn.pieces.discard()
            rank_state.steps_resent += 1
            rank_state.last_heard = now.monotonic
            return []
        pieces = tuple(conn.pieces.received())
        data = decode_step(message, rank_state.manifest, conn.pieces)
        out = Actions()
        ops_found = self._operations_of(conn, message, out) if message.HasField("ops") else []
        out.add(CommitStep(conn.stream_id, message, pieces))
        self._delivered(conn, rank_state, data.step, message, now)
        self.zooms.delivered(conn.run or "", data.step, bool(data.payloads),
                             message.ops.zoom_id if message.HasField("ops") else 0)
        rank_state.records_received += len(message.phase)
        if message.HasField("cost"):
            rank_state.add_cost(message.cost)
        self.pipeline.add(conn.run or "", conn.rank, data, out)
        self.policy.announce(self, self.pipeline.declare(), out)
        for finding in ops_found:
            out.alert("warning" if finding.status == "found" else "info", f"operations: {finding.message}",
                      kind="operations", run=finding.candidate_run, rank=finding.rank)
        self._credits(conn.rank, out)
        out.add(PublishProgress())
        return out.items

    def _operations_of(self, conn: Connection, message: pb.StepRecords, out: Actions) -> list[pb.OperationFinding]:
        """A step's operation capture (twinstep.server.ops); a malformed one is the session's error, the step goes on."""
        try:
            return self.operations.add(message.ops, conn.run or "", conn.rank, message.step, self.baseline,
                                       list(self.candidates))
        except InputError as bad:
            self._error(f"run {conn.run!r} rank {conn.rank}: its capture of operations was refused ({bad.message}); "
                        "the step's records are compared as usual", out)
            return []

    def _delivered(self, conn: Connection, rank_state: RankState, step: int, message: pb.StepRecords,
                   now: Moment) -> None:
        rank_state.last_heard = self.last_active = now.monotonic
        rank_state.merge_dropped(message.dropped)
        if rank_state.last_step >= 0 and step > rank_state.last_step:
            rank_state.stride = step - rank_state.last_step
        rank_state.last_step = max(rank_state.last_step, step)
        rank_state.accounted_step = max(rank_state.accounted_step, step)
        if rank_state.first_step < 0 or step < rank_state.first_step:
            rank_state.first_step = step
        self.coverage.delivered(conn.run or "", conn.rank, step, list(message.incomplete))

    # -- halts, zooms, errors ---------------------------------------------------------------------------

    def halt(self, reason: str, at_step: int | None = None) -> list[Action]:
        """Halt every run (once): ranks of one run stop at one step; ``at_step``: every rank stops there."""
        out = Actions()
        self.halt_into(reason, at_step, out)
        return out.items

    def halt_into(self, reason: str, at_step: int | None, out: Actions) -> None:
        if not self.halts.start(reason):
            return
        out.add(Commit(Kind.HALT, 0, reason.encode()))
        out.add(HaltRuns(tuple(HaltTarget(run.name, run.world_size,
                                          tuple(s.connection for s in run.ranks.values() if s.connection is not None))
                               for run in self.runs.values()), reason, at_step))

    def tell_zoom(self, spec: pb.ZoomSpec, origin: str, per_run: "PerRun") -> tuple[Window, list[Action]]:
        """Number a zoom window and tell it to every open stream, each run in its own names (``per_run``)."""
        window = self.zooms.open(spec, origin)
        out = Actions()
        for run in self.runs.values():
            told = per_run(self, run.name, spec) if not run.baseline else spec
            window.per_run[run.name] = told
            message = zoom_command(told)
            conns = [s.connection for s in run.ranks.values() if s.connection is not None]
            if conns:
                window.runs.append(run.name)
            out.items.extend(Send(conn, message) for conn in conns)
        out.add(Publish(told_alert(spec, origin, window.runs), keep=True))
        return window, out.items

    def archive(self) -> list[Action]:
        """The session leaves the registry (its time to live is over): no run can join it any more, so a verdict
        that waited for a baseline or a candidate is final now, and told."""
        waited = verdict.waiting_for(self) is not None
        self.archived = True
        if not waited:
            return []
        out = Actions()
        out.alert(*verdict.final_words(self))
        return out.items

    def skip_zoom(self, spec: pb.ZoomSpec, origin: str, why: str) -> tuple[Window, list[Action]]:
        """Keep a zoom the session decided on and did not ask of any run, with why; watchers are told."""
        window = self.zooms.not_asked(spec, origin, why)
        return window, [Publish(not_asked_alert(window), keep=True)]

    def note_error(self, message: str, kind: str) -> list[Action]:
        """An error found beside the streams (a damaged recording): listed once in the report, told to watchers."""
        if message not in self.errors:
            self.errors.append(message)
        return [Publish(pb.Event(alert=pb.AlertNotice(level="error", message=message, kind=kind)), keep=True)]

    def journal_failed(self, failure: str) -> list[Action]:
        """The journal stopped taking this session: say so once; the session goes on in memory."""
        if self._journal_failure_told:
            return []
        self._journal_failure_told = True
        self.errors.append(f"the journal stopped taking this session ({failure}): it goes on in memory and will not "
                           "survive a server restart")
        return [Publish(pb.Event(alert=pb.AlertNotice(level="error", message=self.errors[-1])), keep=True)]

    def _error(self, message: str, out: Actions) -> None:
        if len(self.errors) < MAX_LISTED:
            self.errors.append(message)
        out.alert("error", message)

    def _credits(self, rank: int, out: Actions) -> None:
        """Tell every stream of this rank how far it may run ahead."""
        for conn, max_step, acked in credit_updates(self.runs.values(), rank, self.config.window.steps,
                                                    self.config.window.inflight_steps):
            out.add(SetCredit(conn, max_step, acked))

    def _lossy_bounds(self) -> dict[str, pb.LossyBound]:
        if self._lossy is None:
            self._lossy = lossy_bounds(self.config.tolerances)
        return self._lossy

    # -- what it holds ----------------------------------------------------------------------------------

    def coverage_of(self, candidate: str) -> pb.Coverage:
        return self.pipeline.coverage_of(candidate)

    def module_names(self, run: str) -> list[str]:
        """Every module name the run's ranks declared, in the order first produced."""
        state = self.runs.get(run)
        if state is None:
            return []
        seen: dict[str, None] = {}
        for rank in sorted(state.ranks):
            for name in state.ranks[rank].manifest.module_order:
                seen.setdefault(name, None)
        return list(seen)

    def open_streams(self) -> list[tuple[Connection, str]]:
        """Every stream still streaming, with its run's name (one that said goodbye will capture nothing more)."""
        return [(s.connection, run.name) for run in self.runs.values() for s in run.ranks.values()
                if s.connection is not None and s.state == "streaming"]

    def waiting_streams(self) -> list[Connection]:
        """Lost streams still within their reconnect grace."""
        return list(self._left.values())
