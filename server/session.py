"""A session: one comparison of a baseline with its candidates, coordinated.

Each message of a training stream takes the data path in order: ingest
(decode the step), align (line it up with the other runs' same step), compare
(under the candidate's mapping), detect (first divergence, gaps, noise,
drift, headroom), then announce (watchers, halts).  The session owns none of
those jobs; it holds the parts that do them and the lock they run under:

- ``members`` (twinstep.server.runs.membership): who joined, their ranks and streams;
- ``halting`` (runs.halt) and ``credits`` (runs.credits): stopping runs, pacing them;
- ``mappings`` (compare.mapping_resolver): which names compare with which;
- ``coverage`` (align.coverage): what each run delivered, declared and missed.

State changes happen under ``lock``; messages to clients and watchers are sent
after it is released.  Reports are built from :meth:`snapshot`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable

import grpc

from twinstep._version import PROTOCOL_VERSION
from twinstep.server.align.coverage import CoverageLedger
from twinstep.server.align.window import RankAligner
from twinstep.server.alert.events import EventBus
from twinstep.server.batches.buffer import BatchBuffer
from twinstep.server.compare.comparator import CompareContext, StepComparison, compare_step
from twinstep.server.compare.join import RecordLabel
from twinstep.server.compare.lossy import lossy_bounds
from twinstep.server.compare.mapping_resolver import MappingResolver
from twinstep.server.compare.plan import PlanCache
from twinstep.server.control import TensorStepLedger, ZoomCoordinator
from twinstep.server.ops import OperationsInspector
from twinstep.server.ops.target import ops_target
from twinstep.server.config import ServerConfig
from twinstep.server.connection import Connection
from twinstep.server.detect.coverage import candidate_verdict, coverage_problems, describe_coverage, describe_failure
from twinstep.server.detect.coverage import failure_kinds as _failure_kinds
from twinstep.server.detect.drift import LongRunTracker
from twinstep.server.detect.first_divergence import Candidate, FirstDivergenceTracker
from twinstep.server.detect.gaps import Side, find_gaps
from twinstep.server.detect.gaps import describe as describe_gaps
from twinstep.server.detect.headroom import HeadroomTracker
from twinstep.server.detect.records import NamedRecordTracker
from twinstep.server.detect.stage_errors import StageErrors
from twinstep.server.detect.noise import NoiseBands
from twinstep.server.errors import InputError, invalid
from twinstep.server.ingest.decode import decode_step
from twinstep.server.journal.entries import Kind, leave_header
from twinstep.server.journal.store import NoJournal, SessionJournal
from twinstep.server.preflight import PreflightTracker, check_setup
from twinstep.server.report.snapshot import CandidateSnapshot, SessionSnapshot
from twinstep.server.runs.credits import credit_updates
from twinstep.server.runs.halt import HaltCoordinator, halt_command
from twinstep.server.view.history import SessionHistory
from twinstep.server.runs.membership import (ENDED, MAX_TEXT, MAX_WARNINGS, Membership, RankState, RunState,
                                              check_hello)
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")

_PROGRESS_INTERVAL = 0.25
_MAX_LISTED = 200
_MAX_FAILURE_ENTRIES = 1024


class Session:
    def __init__(self, name: str, config: ServerConfig, on_ended: Callable[["Session"], object] | None = None) -> None:
        self.name = name
        self.config = config
        self._on_ended = on_ended  # the registry's memory budget and journal summary, once every run has ended
        self.journal: SessionJournal | NoJournal = NoJournal()
        """Where accepted inputs are committed before they are acknowledged (see twinstep.server.journal)."""
        self.replaying = False
        self.archived = False
        """Left the registry (its runs had ended): a stream that still holds it must join the name afresh."""
        """Inputs are being replayed from the journal after a restart: nothing is sent, nothing journaled again."""
        self.created = time.time()
        self.ended_at = 0.0
        """time.time() when every run had ended (0 while one streams)."""
        self._stream_ids = itertools.count(1)
        self._left: dict[int, Connection] = {}  # lost streams within their reconnect grace, by stream id
        self.lock = threading.RLock()
        self.members = Membership(name, config.max_runs_per_session)
        self.events = EventBus(name)
        self.halting = HaltCoordinator(name, config.halt_prepare_timeout, self._announce_halt)
        self.mappings = MappingResolver(config.mapping, config.auto_mapping)
        self.plans = PlanCache()
        self.coverage = CoverageLedger()
        self.aligners: dict[int, RankAligner] = {}
        self.tracker = FirstDivergenceTracker(trace_origins=config.trace_origins, tolerances=config.tolerances)
        self.noise = NoiseBands(config.noise_multiple, config.noise_floor)
        self.long_run = LongRunTracker(config.drift_window)
        self.headroom = HeadroomTracker()
        self.history = SessionHistory(name, config.history_steps, config.history_rows, config.noise_multiple)
        """The dashboard's bounded heatmap and curves (twinstep.server.view); read by copying under the lock."""
        self.stage_errors = StageErrors()
        """The latest compared step's worst error per phase, for live views (Progress.stages)."""
        self.named_records = NamedRecordTracker()
        """Per candidate and name: the values the runs named (Monitor.record), for the report's own section."""
        self.batches = BatchBuffer(config.batch_buffer_bytes)
        """Batches the baseline published for candidates (batch sync; its own lock, not journaled)."""
        self.zooms = ZoomCoordinator(name, config.halt_prepare_timeout)
        self.operations = OperationsInspector(config.tolerances)
        """Operations inside a module: captures kept until both sides are in, and the findings (twinstep.server.ops)."""
        """Live capture control: zoom windows, auto_zoom, reproducer bundles on halt (twinstep.server.control)."""
        self.preflight = PreflightTracker()
        """The runs' training set-ups and the differences found between them (twinstep.server.preflight)."""
        self.tensor_steps = TensorStepLedger()
        """Which compared steps carried full tensors, per candidate rank (what a zoom really brought)."""
        self.errors: list[str] = []
        self.last_comparison: StepComparison | None = None
        self.unmatched_baseline: dict[RecordLabel, None] = {}
        self.unmatched_candidate: dict[RecordLabel, None] = {}
        self._deferred: dict[int, list] = {}
        self._lossy: dict[str, pb.LossyBound] | None = None
        self._last_progress = 0.0
        self._verdict_told = False
        self.last_active = time.monotonic()
        """When a stream last delivered or ended (for the memory budget's eviction order)."""

    # -- views of the parts --------------------------------------------------------

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
        return self.halting.halted

    # -- membership ------------------------------------------------------------------

    def join(self, conn: Connection, hello: pb.Hello) -> None:
        """Admit a stream; its Welcome is the first message it is sent (then a halt, or its credit)."""
        precision = check_hello(hello)
        with self.lock:
            if self.archived:
                raise InputError(grpc.StatusCode.UNAVAILABLE, f"session {self.name!r} was just archived; reconnect "
                                 "to start it afresh")
            self.members.join(conn, hello, precision)
            for stream_id, left in list(self._left.items()):  # it came back: its grace timer has nothing to do
                if (left.run, left.rank) == (hello.run, hello.rank):
                    del self._left[stream_id]
            if not conn.stream_id:
                conn.stream_id = next(self._stream_ids)
            else:  # replayed: later streams are numbered after it
                self._stream_ids = itertools.count(max(conn.stream_id + 1, next(self._stream_ids)))
            self.ended_at = 0.0
            self._journal(Kind.HELLO, conn, hello.SerializeToString())
            self._verdict_told = False  # a run (re)joined: the verdict is told again when all have ended
            self.coverage.declare(hello.run, hello.rank, hello)
            aligner = self._aligner(hello.rank)
            aligner.reopen(hello.run)
            welcome = pb.Welcome(protocol_version=PROTOCOL_VERSION, last_step_received=aligner.delivered(hello.run),
                                 max_step_tensor_bytes=self.config.window_bytes)
            if hello.capture == "lossy":
                for phase, bound in self._lossy_bounds().items():
                    welcome.lossy[phase].CopyFrom(bound)
            # Queued under the lock: no credit (another stream's step may compute one) can overtake it.
            conn.send(pb.ServerMessage(welcome=welcome))
            self.zooms.on_join(conn, hello.run)  # zoom windows of its run that are not over yet
            reason = self.halting.reason_for(hello.run)  # the session's halt, or its run's alone
            halted = reason is not None
        logger.info("session %s: run %r rank %d joined (%s %s)", self.name, hello.run, hello.rank, hello.framework,
                    hello.framework_version)
        for warning in hello.warnings[:MAX_WARNINGS]:
            self._alert("warning", f"run {hello.run!r} rank {hello.rank}: {warning[:MAX_TEXT]}")
        self._publish_progress(force=True)
        if halted:
            conn.send(halt_command(-1, reason))
        else:
            self._update_credits(hello.rank)

    def leave(self, conn: Connection, silent_for: float | None = None, grace: float | None = None) -> None:
        """The stream of ``conn`` ended, cleanly (after Close) or not.

        A stream that broke leaves its rank ``lost`` at once, but for ``grace`` seconds (reconnect_grace)
        the rank may come back: until then nothing it could still match is released.
        ``silent_for``: the silence measured when it happened (a replay from the journal).
        """
        with self.lock:
            if self.journal.closed:
                return  # the server is stopping: no loss, the client comes back to the next server on the journal
            run = self.members.leave(conn)
            if run is None:
                return
            state = run.ranks[conn.rank]
            lost = state.state == "lost"
            if lost and silent_for is not None and silent_for >= 0:
                state.silent_for = silent_for
            self._journal(Kind.LEAVE, conn, leave_header(state.silent_for))
            grace = self.config.reconnect_grace if grace is None else grace
            if lost and grace > 0:
                state.awaiting_return = True
                self._left[conn.stream_id] = conn
                self.last_active = time.monotonic()
            else:
                outcome = self._rank_ended(run, conn.rank)
        if lost:
            comeback = f"; it may reconnect within {grace:g} s" if grace > 0 else ""
            self._alert("warning", f"run {run.name!r} rank {conn.rank} is lost after step {state.last_step}: its stream "
                        f"ended without a goodbye, {state.silent_for:.1f} s after its last message (the process died "
                        f"or the network failed){comeback}; the other runs go on", kind="lost_run", run=run.name,
                        rank=conn.rank)
            if grace > 0:
                if not self.replaying:
                    self._give_up_later(conn, grace)
                self._update_credits(conn.rank)
                self._publish_progress(force=True)
                return
        self._after_rank_ended(conn.rank, *outcome)

    def give_up(self, conn: Connection) -> None:
        """The reconnect grace of lost stream ``conn`` ran out: release what its run could still have matched."""
        with self.lock:
            if self._left.pop(conn.stream_id, None) is None:
                return
            run = self.runs.get(conn.run or "")
            state = run.ranks.get(conn.rank) if run else None
            if state is None or not state.awaiting_return or state.connection is not None:
                return  # it came back
            state.awaiting_return = False
            self._journal(Kind.GIVE_UP, conn, b"")
            outcome = self._rank_ended(run, conn.rank)
        self._after_rank_ended(conn.rank, *outcome)

    def _give_up_later(self, conn: Connection, grace: float) -> None:
        timer = threading.Timer(grace, self._give_up_safely, args=(conn,))
        timer.daemon = True
        timer.start()

    def _give_up_safely(self, conn: Connection) -> None:
        try:
            self.give_up(conn)
        except Exception:  # a timer thread must not die silently: the session would never end
            logger.exception("session %s: releasing lost stream %s failed", self.name, conn.label)

    def resume_grace_timers(self, grace: float) -> None:
        """After a restart: lost streams still within their grace get ``grace`` seconds more."""
        with self.lock:
            left = list(self._left.values())
        for conn in left:
            self._give_up_later(conn, grace)

    def _rank_ended(self, run: RunState, rank: int) -> tuple[list[Candidate], tuple[str, str] | None]:
        """A rank's stream ended for good: release, compare what is ready, declare (caller holds the lock)."""
        self._aligner(rank).finish(run.name, self.baseline, self.members.compared_runs, not self.candidates)
        self._run_deferred(rank)
        declared = self._declare()
        ended = self._ended_verdict()
        self.last_active = time.monotonic()
        if self.members.all_ended() and not self.ended_at:
            self.ended_at = time.time()
        return declared, ended

    def _after_rank_ended(self, rank: int, declared: list[Candidate], ended: tuple[str, str] | None) -> None:
        self._announce(declared)
        if ended is not None:
            self._alert(*ended)
        if self.ended_at and self._on_ended is not None:
            self._on_ended(self)
        self._update_credits(rank)
        self._publish_progress(force=True)

    def close_stream(self, conn: Connection, message: pb.Close) -> None:
        with self.lock:
            self.members.close(conn, message)
            self._journal(Kind.CLOSE, conn, message.SerializeToString())

    # -- ingest ------------------------------------------------------------------------

    def add_manifest(self, conn: Connection, message: pb.Manifest) -> None:
        with self.lock:
            self.members.rank_of(conn).manifest.add(message)
            self._journal(Kind.MANIFEST, conn, message.SerializeToString())

    def add_health(self, conn: Connection, health: pb.CaptureHealth) -> None:
        """The client's latest word on what it could not capture; watchers hear of each new kind once."""
        if len(health.failures) > _MAX_FAILURE_ENTRIES:
            raise invalid(f"capture health lists {len(health.failures)} failures; at most {_MAX_FAILURE_ENTRIES}")
        with self.lock:
            rank_state = self.members.rank_of(conn)
            before = _failure_kinds(rank_state.health)
            rank_state.health = health
            rank_state.merge_dropped(health.dropped)
            self.coverage.client_missing(conn.run or "", conn.rank, health)
            reported = max((m.last_step for m in health.missing), default=-1)
            rank_state.accounted_step = max(rank_state.accounted_step, reported)
            news = [kind for kind in _failure_kinds(health) if kind not in before]
            self._journal(Kind.HEALTH, conn, health.SerializeToString())
        for kind in news[:MAX_WARNINGS]:
            self._alert("warning", f"run {conn.run!r} rank {conn.rank}: capture is failing: {describe_failure(health, kind)}",
                        kind="capture_failure", run=conn.run or "", rank=conn.rank)
        self._update_credits(conn.rank)  # steps said missing move this run along, as delivered ones do
        self._publish_progress(force=True)

    def add_setup(self, conn: Connection, setup: pb.Setup) -> None:
        """A run's training set-up (docs/preflight.md): diffed against the baseline's, new differences alerted."""
        check_setup(setup)
        if setup.rank != conn.rank:
            raise invalid(f"setup says rank {setup.rank}, but this stream joined as rank {conn.rank}")
        with self.lock:
            self.members.rank_of(conn)
            self._journal(Kind.SETUP, conn, setup.SerializeToString())
            if self.preflight.add(conn.run or "", setup):
                self._refresh_preflight()

    def _refresh_preflight(self) -> None:
        """Diff every candidate's set-up again; alert the warnings not told yet (caller holds the lock)."""
        news = self.preflight.refresh(self.baseline, self.candidates, self.mappings.for_names)
        for finding in news[:MAX_WARNINGS]:
            self._alert("warning", f"run {finding.candidate_run!r}: preflight: {finding.message}", kind="preflight",
                        run=finding.candidate_run)
        if len(news) > MAX_WARNINGS:
            self._alert("warning", f"preflight: {len(news) - MAX_WARNINGS} more set-up differences: see the report",
                        kind="preflight")

    def add_step(self, conn: Connection, message: pb.StepRecords) -> None:
        if message.rank != conn.rank:
            raise invalid(f"step {message.step} says rank {message.rank}, but this stream joined as rank {conn.rank}")
        if message.step < 0:
            raise invalid(f"negative step {message.step}")
        with self.lock:
            rank_state = self.members.rank_of(conn)
            aligner = self._aligner(conn.rank)
            if message.step <= aligner.delivered(conn.run or ""):
                # Sent again after a reconnect: this server holds it (or compared it) already.
                conn.pieces.discard()
                rank_state.steps_resent += 1
                rank_state.last_heard = time.monotonic()
                return
            pieces = conn.pieces.received() if self._journaled else ()
            data = decode_step(message, rank_state.manifest, conn.pieces)
            ops_found = self._operations_of(conn, message) if message.HasField("ops") else []
            # Committed before anything can acknowledge it (credits are computed under this lock).
            self._journal_step(conn, message, pieces)
            self._delivered(conn, rank_state, data.step, message)
            rank_state.records_received += len(message.phase)
            if message.HasField("cost"):
                rank_state.add_cost(message.cost)
            pairs = aligner.add(conn.run or "", data, self.baseline, self.members.compared_runs,
                                keep_baseline=not self.candidates)
            for run_name in self.runs:
                dropped = aligner.take_dropped_steps(run_name)
                if dropped:
                    self.coverage.server_dropped(run_name, conn.rank, dropped)
            self._deferred.setdefault(conn.rank, []).extend(pairs)
            self._run_deferred(conn.rank)
            declared = self._declare()
        self._announce(declared)
        for finding in ops_found:
            self._alert("warning" if finding.status == "found" else "info", f"operations: {finding.message}",
                        kind="operations", run=finding.candidate_run, rank=finding.rank)
        self._update_credits(conn.rank)
        self._publish_progress()

    def _operations_of(self, conn: Connection, message: pb.StepRecords) -> list[pb.OperationFinding]:
        """A step's operation capture (twinstep.server.ops); a malformed one is the session's error, the step goes on."""
        try:
            return self.operations.add(message.ops, conn.run or "", conn.rank, message.step, self.baseline,
                                       list(self.candidates))
        except InputError as bad:
            self._error(f"run {conn.run!r} rank {conn.rank}: its capture of operations was refused ({bad.message}); "
                        "the step's records are compared as usual")
            return []

    def _delivered(self, conn: Connection, rank_state: RankState, step: int, message: pb.StepRecords) -> None:
        rank_state.last_heard = self.last_active = time.monotonic()
        rank_state.merge_dropped(message.dropped)
        if rank_state.last_step >= 0 and step > rank_state.last_step:
            rank_state.stride = step - rank_state.last_step
        rank_state.last_step = max(rank_state.last_step, step)
        rank_state.accounted_step = max(rank_state.accounted_step, step)
        if rank_state.first_step < 0 or step < rank_state.first_step:
            rank_state.first_step = step
        self.coverage.delivered(conn.run or "", conn.rank, step, list(message.incomplete))

    # -- align and compare ---------------------------------------------------------------

    def _run_deferred(self, rank: int) -> None:
        """Compare what is ready; a candidate step waits until every reference has passed it."""
        waiting = []
        deferred = self._deferred.get(rank, [])
        # References first (stable: steps stay in order), so a candidate's step sees its band.
        deferred.sort(key=lambda pair: not self.runs[pair[0]].reference)
        for run, base_step, other_step in deferred:
            if not self.runs[run].reference and len(deferred) <= self.config.window_steps:
                behind = [ref for ref in self.references if self.runs[ref].effective_step(rank) < base_step.step]
                if behind:
                    waiting.append((run, base_step, other_step))
                    continue
            self._compare(run, base_step, other_step)
        self._deferred[rank] = waiting

    def _compare(self, candidate_run: str, base_step, cand_step) -> None:
        base_run, cand_run = self.runs[self.baseline or ""], self.runs[candidate_run]
        ctx = CompareContext(
            base_framework=base_run.framework,
            cand_framework=cand_run.framework,
            candidate_run=candidate_run,
            tolerances=self.config.tolerances,
            mapping=self._mapping_for(candidate_run, cand_step.rank),
            noise=None if cand_run.reference or not self.references else self.noise,
            tf32="tf32" in (base_run.precision, cand_run.precision),
            plans=self.plans,
        )
        comparison = compare_step(base_step, cand_step, ctx)
        self.coverage.compared(candidate_run, cand_step.rank, cand_step.step)
        self.tensor_steps.observe(comparison, base_step, cand_step)
        if self.mappings.wants_proposal(candidate_run, bool(comparison.unmatched_candidate)):
            self.mappings.propose(self.name, candidate_run, base_step, cand_step,
                                  _forward_names(comparison.unmatched_baseline),
                                  _forward_names(comparison.unmatched_candidate))
            ctx.mapping = self._mapping_for(candidate_run, cand_step.rank)
            comparison = compare_step(base_step, cand_step, ctx)
            self._refresh_preflight()  # modules matched automatically pair more hyper-parameters
        if not cand_run.reference:
            self.named_records.add(comparison, base_step, cand_step)
        self.long_run.add(candidate_run, base_step.step, base_step.rank, base_step, cand_step)
        self.history.add(candidate_run, cand_run.reference, comparison, base_step, cand_step)
        if cand_run.reference:
            self.noise.add(comparison)
            return
        self._detect(comparison)

    def _mapping_for(self, run: str, rank: int):
        manifest = self.runs[run].ranks[rank].manifest
        return self.mappings.for_run(run, rank, lambda: {n: t for n, t in manifest.modules.values()},
                                     len(manifest.modules))

    # -- detect ------------------------------------------------------------------------------

    def _detect(self, comparison: StepComparison) -> None:
        self.tracker.add(comparison)
        self.headroom.add(comparison)
        self.stage_errors.add(comparison)
        self.last_comparison = comparison
        for name in comparison.unmatched_baseline:
            if len(self.unmatched_baseline) < _MAX_LISTED:
                self.unmatched_baseline[name] = None
        for name in comparison.unmatched_candidate:
            if len(self.unmatched_candidate) < _MAX_LISTED:
                self.unmatched_candidate[name] = None
        for error in comparison.errors:
            self._error(error)

    def _declare(self) -> list[Candidate]:
        """Declare divergences no earlier one can precede any more (caller holds the lock)."""
        if self.baseline is None:
            return []
        base = self.runs[self.baseline]
        # Candidate steps wait for the references' noise bands, so references bound the frontier too.
        references = [self.runs[name] for name in self.references]
        frontier: dict[str, float] = {}
        for name in self.candidates:
            cand = self.runs[name]
            ranks = range(min(base.world_size, cand.world_size))
            frontier[name] = min(
                (min([base.effective_step(r), cand.effective_step(r)] + [ref.effective_step(r) for ref in references])
                 for r in ranks),
                default=-1,
            )
        declared = self.tracker.declare(frontier)
        for found in declared:
            found.gaps_before, found.gaps_unlisted = self._gaps_before(found)
        return declared

    def _gaps_before(self, found: Candidate) -> tuple[list[pb.Gap], int]:
        """Uncompared steps before a divergence, on every rank (caller holds the lock)."""
        comparison = found.comparison
        gaps: list[pb.Gap] = []
        unlisted = 0
        for rank in self._compared_ranks(comparison.candidate_run):
            base, cand = self._sides(comparison.candidate_run, rank)
            more, extra = find_gaps(self.coverage, base, cand, rank, comparison.step, found.row.phase)
            gaps.extend(more)
            unlisted += extra
        return gaps, unlisted

    def _compared_ranks(self, candidate: str) -> range:
        base = self.runs.get(self.baseline or "")
        cand = self.runs.get(candidate)
        if base is None or cand is None:
            return range(0)
        return range(min(base.world_size, cand.world_size))

    def _sides(self, candidate: str, rank: int) -> tuple[Side, Side]:
        """The baseline and a candidate as the gap finder sees them, for one rank."""
        out = []
        for name in (self.baseline or "", candidate):
            state = self.runs[name].ranks.get(rank)
            out.append(Side(name, self.coverage.rank(name, rank), state is not None and state.state in ENDED))
        return out[0], out[1]

    def coverage_of(self, candidate: str) -> pb.Coverage:
        """What the comparison of ``candidate`` covered so far, and its gaps."""
        with self.lock:
            sides = [(rank, *self._sides(candidate, rank)) for rank in self._compared_ranks(candidate)]
            return describe_coverage(self.coverage, candidate, sides, self.tracker.steps_compared_by(candidate))

    # -- announce ---------------------------------------------------------------------------

    def _announce(self, declared: list[Candidate]) -> None:
        for found in declared:
            row, comparison = found.row, found.comparison
            logger.warning(
                "session %s: first divergence of run %r at step %d rank %d, %s of %r: %s %.3g > %.3g",
                self.name, comparison.candidate_run, comparison.step, comparison.rank, row.phase,
                row.name or "(model)", row.metric, row.value, row.tolerance,
            )
            event = pb.Event(divergence=found.to_proto())
            self.events.publish(event, keep=True)
            self._broadcast(pb.ServerMessage(event=event))
            where = (f"divergence at step {comparison.step}, {row.phase} of {row.name or '(model)'!r} "
                     f"({row.metric} {row.value:.3g} > {row.tolerance:.3g})")
            gap = ""
            if found.after_gap:
                gaps = describe_gaps(found.gaps_before, found.gaps_unlisted)
                gap = f"; it comes after a gap (the earliest among compared steps; it may have begun in {gaps})"
                self._alert("warning", f"run {comparison.candidate_run!r}: first divergence at step "
                            f"{comparison.step} comes after steps that were not compared: {gaps}")
            if not self.config.halt_on_divergence:
                if self.config.auto_zoom and not self.replaying:
                    self.zooms.after_divergence(self, found, self.config.auto_zoom_steps)
                target = ops_target(found) if self.config.auto_ops and not self.replaying else None
                if target is not None:
                    self.zooms.ops_after_divergence(self, found, *target)
                continue
            if found.after_gap and not self.config.halt_after_gap:
                self._alert("warning", f"not halting on the {where}{gap}: halt_after_gap is off, so the "
                            f"decision is yours (twinstep halt {self.name})")
                continue
            if self.config.bundle_on_halt and not self.replaying and self.zooms.halt_with_bundle(self, found,
                                                                                                  where + gap):
                continue  # it halts once every run is told where to write its bundle
            if self._halt_alone(comparison.candidate_run, where + gap):
                continue  # other candidates are within tolerance: the baseline goes on for them
            self.halt(where + gap)

    def _halt_alone(self, candidate: str, reason: str) -> bool:
        """Halt only ``candidate`` while another candidate still needs the baseline; False: halt all.

        Another candidate needs the baseline while it has not diverged and either streams or is
        ahead of the baseline (its comparison is not over).  With one candidate this is never
        the case, so a session halts whole at its first divergence, as it always did.  With
        several, each candidate stops at its own first divergence, and the baseline (and
        references) at the last one's, or at their end.
        """
        with self.lock:
            base = self.runs.get(self.baseline or "")
            healthy = [name for name in self.candidates if name != candidate and name not in self.tracker.declared
                       and (self.runs[name].state not in ENDED
                            or (base is not None and base.last_step < self.runs[name].last_step))]
            if not healthy:
                return False
            run = self.runs[candidate]
            conns = [] if self.replaying else [s.connection for s in run.ranks.values() if s.connection is not None]
        self.halting.halt_one_run(candidate, run.world_size, conns, f"run {candidate!r}: {reason}")
        return True

    def _ended_verdict(self) -> tuple[str, str] | None:
        """Once, when the last run ends without a divergence: the verdict and its reasons (caller holds the lock)."""
        if self._verdict_told or not self.members.all_ended():
            return None
        status, reasons = self.status_and_reasons()
        if status == "diverged":
            return None
        self._verdict_told = True
        if status == "aligned":
            return "info", f"every run has ended: aligned over {self.steps_compared()} compared step(s)"
        more = f" (and {len(reasons) - 3} more: see the report)" if len(reasons) > 3 else ""
        if not self.candidates:  # the baseline may simply have been started first: say what a late candidate gets
            more += (f"; a candidate that joins within session_ttl ({self.config.session_ttl:g} s) is still compared "
                     f"with the last {self.config.window_steps} step(s) the server holds of each run, and the verdict "
                     "is told again when it ends")
        return "warning", f"every run has ended: {status.upper()}: " + "; ".join(reasons[:3]) + more

    def _error(self, message: str) -> None:
        if len(self.errors) < _MAX_LISTED:
            self.errors.append(message)
        self._alert("error", message)

    def _alert(self, level: str, message: str, kind: str = "", run: str = "", rank: int = 0) -> None:
        """Log a line and tell every watcher (kept for watchers who come later)."""
        logger.warning("session %s: %s", self.name, message)
        self.events.publish(pb.Event(alert=pb.AlertNotice(level=level, message=message, kind=kind, run=run, rank=rank)),
                            keep=True)

    def _broadcast(self, message: pb.ServerMessage) -> None:
        with self.lock:
            conns = self.members.connections()
        for conn in conns:
            conn.send(message)

    def _publish_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_progress < _PROGRESS_INTERVAL:
            return
        self._last_progress = now
        self.events.publish(pb.Event(progress=self.progress()))

    def progress(self) -> pb.Progress:
        """What watchers see of the runs now: their status, steps compared, the latest error per stage."""
        with self.lock:
            return pb.Progress(runs=self.run_status(), steps_compared=self.steps_compared(),
                               stages=self.stage_errors.to_proto())

    # -- flow control and halt ----------------------------------------------------------------

    def _update_credits(self, rank: int) -> None:
        """Tell every stream of this rank how far it may run ahead."""
        with self.lock:
            updates = credit_updates(self.runs.values(), rank, self.config.window_steps, self.config.max_inflight_steps)
        for conn, max_step, acked in updates:
            conn.set_credit(max_step, acked)

    def halt(self, reason: str, at_step: int | None = None) -> list[str]:
        """Halt every connected process of every run; ranks of one run stop at one step.

        ``at_step``: every rank of every run stops at the end of that step (one every rank can
        still reach: a halt with reproducer bundles, twinstep.server.control).
        """
        with self.lock:
            if not self.halting.start(reason):
                return []
            self.journal.append(Kind.HALT, 0, reason.encode())
            if self.replaying:
                return []  # its streams are gone; each is told HALT when it rejoins
            plan = [(run.name, run.world_size, [s.connection for s in run.ranks.values() if s.connection is not None])
                    for run in self.runs.values()]
        return self.halting.halt_runs(plan, at_step)

    def halt_ack(self, conn: Connection, ack: pb.HaltAck) -> None:
        if not self.zooms.ack(conn, ack):  # else it answers a halt's question
            self.halting.ack(conn, ack)

    def _announce_halt(self, notice: pb.HaltNotice) -> None:
        self.events.publish(pb.Event(halt=notice), keep=True)

    # -- views ---------------------------------------------------------------------------------

    def run_status(self) -> list[pb.RunStatus]:
        with self.lock:
            return self.members.status_rows(self.dropped_by_reason)

    def dropped_by_reason(self, run: RunState) -> dict[str, int]:
        """Steps of ``run`` lost on its clients (by their reason) or on this server."""
        totals: dict[str, int] = {}
        for state in run.ranks.values():
            for reason, count in state.client_dropped.items():
                totals[reason] = totals.get(reason, 0) + count
        for aligner in self.aligners.values():
            window, unmatched = aligner.dropped_parts(run.name)
            if window:
                totals["server_window"] = totals.get("server_window", 0) + window
            if unmatched:
                totals["unmatched"] = totals.get("unmatched", 0) + unmatched
        return {reason: count for reason, count in totals.items() if count}

    def steps_compared(self) -> int:
        with self.lock:
            world = max((run.world_size for run in self.runs.values()), default=1)
            if self.baseline is not None:
                world = self.runs[self.baseline].world_size
            return self.tracker.steps_compared(world)

    def status(self) -> str:
        return self.status_and_reasons()[0]

    def status_and_reasons(self) -> tuple[str, list[str]]:
        """The verdict, and every shortfall of coverage in sentences.

        ``diverged`` as soon as a first divergence is declared.  Once every run
        has ended: ``aligned`` only when something was compared and nothing
        went missing; otherwise ``incomplete``, with the reasons.  A session
        never stays ``running`` after its runs have ended.  With several
        candidates: ``diverged`` when any candidate diverged; each
        candidate's own verdict is in its report section (candidate_verdict).
        """
        with self.lock:
            reasons = coverage_problems(self, halted_runs=self.halting.runs_halted)
            if self.tracker.first() is not None:
                return "diverged", reasons
            if not self.members.all_ended():
                return "running", reasons
            return ("incomplete" if reasons else "aligned"), reasons

    def snapshot(self, long_run: bool = True) -> SessionSnapshot:
        """Everything a report says, copied under the lock: report building never touches live state.

        ``long_run=False`` leaves the long-run criteria out: their cost grows with the steps compared
        (0.15 s at 20k steps), too much for the dashboard's frequent views.
        """
        with self.lock:
            status, reasons = self.status_and_reasons()
            coverage = {run: self.coverage_of(run) for run in self.candidates}
            reference = next(iter(self.references), None)
            summaries = []
            for run in self.candidates if long_run else ():
                summary = self.long_run.summary(run, reference, self.config.noise_multiple)
                if summary is not None:
                    summary.coverage = coverage[run].summary
                    summaries.append(summary)
            return SessionSnapshot(
                name=self.name,
                status=status,
                status_reasons=tuple(reasons),
                halted=self.halting.halted,
                runs=tuple(self.run_status()),
                steps_compared=self.steps_compared(),
                first=self.tracker.first(),
                last_comparison=self.last_comparison,
                unmatched_baseline=tuple(map(str, self.unmatched_baseline)),
                unmatched_candidate=tuple(map(str, self.unmatched_candidate)),
                errors=tuple(self.errors),
                proposed_mapping=next((self.mappings.proposals[run] for run in self.candidates
                                       if self.mappings.proposals.get(run)), None),
                coverage=tuple(coverage.values()),
                long_run=tuple(summaries),
                headroom=tuple(h for run in self.candidates for h in self.headroom.to_proto(run)),
                records=tuple(r for run in self.candidates for r in self.named_records.to_proto(run)),
                batch_sync=_batch_sync(self.batches),
                zooms=tuple(self.zooms.to_proto()),
                tensor_steps=tuple(self.tensor_steps.to_proto()),
                operations=tuple(self.operations.to_proto()),
                preflight=tuple(self.preflight.to_proto(self.candidates)),
                candidates=tuple(self._candidate_snapshot(run, coverage[run].summary) for run in self.candidates),
            )

    def _candidate_snapshot(self, candidate: str, coverage: str) -> CandidateSnapshot:
        """One candidate's section of the report (caller holds the lock)."""
        first = self.tracker.declared.get(candidate)
        halted_runs = self.halting.runs_halted
        status, reasons = candidate_verdict(self, candidate, first is not None, halted_runs)
        run = self.runs[candidate]
        world = min(run.world_size, self.runs[self.baseline].world_size) if self.baseline in self.runs else 1
        return CandidateSnapshot(
            run=candidate, framework=run.framework, status=status, status_reasons=tuple(reasons),
            halted=self.halting.halted or candidate in halted_runs,
            steps_compared=self.tracker.steps_compared_on_every_rank(candidate, world), first=first,
            last_comparison=self.tracker.last.get(candidate), coverage=coverage)

    # -- journal ---------------------------------------------------------------------------------

    @property
    def _journaled(self) -> bool:
        return not isinstance(self.journal, NoJournal) and not self.journal.failure

    def _journal(self, kind: Kind, conn: Connection, header: bytes) -> None:
        """Commit one accepted input (caller holds the lock); a failing journal is told once, not raised."""
        if not self.journal.append(kind, conn.stream_id, header):
            self._journal_failed()

    def _journal_step(self, conn: Connection, message: pb.StepRecords, pieces) -> None:
        if not self._journaled:
            return
        rows = [(Kind.PIECE, conn.stream_id, header.SerializeToString(), data) for header, data in pieces]
        rows.append((Kind.STEP, conn.stream_id, message.SerializeToString(), None))
        if not self.journal.append_many(rows):
            self._journal_failed()

    def _journal_failed(self) -> None:
        if getattr(self, "_journal_failure_told", False):
            return
        self._journal_failure_told = True
        self.errors.append(f"the journal stopped taking this session ({self.journal.failure}): it goes on in "
                           "memory and will not survive a server restart")
        self.events.publish(pb.Event(alert=pb.AlertNotice(level="error", message=self.errors[-1])), keep=True)

    def expire_absent(self, conns: list[Connection], grace: float) -> None:
        """After a restart: streams that were open before it and did not come back within ``grace`` s are lost."""
        for conn in conns:
            with self.lock:
                run = self.runs.get(conn.run or "")
                state = run.ranks.get(conn.rank) if run else None
                if state is None or state.connection is not conn:
                    continue  # it came back (a newer stream replaced this one)
            self._alert("warning", f"run {conn.run!r} rank {conn.rank} did not reconnect within {grace:g} s of the "
                        "server's restart")
            self.leave(conn, grace=0)

    # -- helpers --------------------------------------------------------------------------------

    def held_bytes(self) -> int:
        """Bytes of steps held for alignment, over every rank, and of batches held for candidates (batch sync)."""
        with self.lock:
            held = sum(aligner.held_bytes() for aligner in self.aligners.values())
        return held + self.batches.snapshot().held_bytes  # published batches count toward the server's budget

    def release_held_steps(self) -> int:
        """Free the held steps once every run has ended (none can find a counterpart); returns bytes freed."""
        with self.lock:
            if not self.members.all_ended():
                return 0
            return sum(aligner.release_all() for aligner in self.aligners.values()) + self.batches.release_all()

    def _aligner(self, rank: int) -> RankAligner:
        aligner = self.aligners.get(rank)
        if aligner is None:
            aligner = self.aligners[rank] = RankAligner(rank, self.config.window_steps, self.config.window_bytes)
        return aligner

    def _lossy_bounds(self) -> dict[str, pb.LossyBound]:
        if self._lossy is None:
            self._lossy = lossy_bounds(self.config.tolerances)
        return self._lossy


def _forward_names(labels: list[RecordLabel]) -> set[str]:
    """Module names of the forward records among ``labels`` ("" is the model's root)."""
    return {label.name for label in labels if label.phase == "forward"}


def _batch_sync(batches: BatchBuffer) -> pb.BatchSync | None:
    """The report's batch-sync line (None while nothing was published or refused)."""
    counts = batches.snapshot()
    return counts.to_proto() if counts.published or counts.refused else None
