"""Sessions: the runs that joined, their per-rank alignment, and the verdict.

A session is created by the first Hello naming it.  One run is the baseline,
the others are candidates.  All state changes happen under the session's lock;
messages to clients and watchers are queued, never sent under it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping

import grpc

from twinstep._version import PROTOCOL_VERSION, SUPPORTED_PROTOCOL_VERSIONS
from twinstep.server.align.window import RankAligner
from twinstep.server.alert.events import EventBus
from twinstep.server.compare import automatch
from twinstep.server.compare.comparator import CompareContext, StepComparison, compare_step
from twinstep.server.compare.lossy import lossy_bounds
from twinstep.server.compare.mapping import NameMapping
from twinstep.server.compare.records import Manifest, decode_step
from twinstep.server.compare.tolerance import PRECISIONS
from twinstep.server.config import ServerConfig
from twinstep.server.connection import Connection
from twinstep.server.detect.drift import LongRunTracker
from twinstep.server.detect.first_divergence import Candidate, FirstDivergenceTracker
from twinstep.server.align.coverage import CoverageLedger
from twinstep.server.detect.coverage import coverage_problems, describe_coverage, describe_failure
from twinstep.server.detect.coverage import failure_kinds as _failure_kinds
from twinstep.server.detect.gaps import Side, find_gaps
from twinstep.server.detect.gaps import describe as describe_gaps
from twinstep.server.detect.headroom import HeadroomTracker
from twinstep.server.detect.noise import NoiseBands
from twinstep.server.errors import InputError, invalid
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")

_INF = float("inf")
_PROGRESS_INTERVAL = 0.25
_MAX_LISTED = 200
_ENDED = ("finished", "halted", "lost")
_MAX_TEXT = 500
_MAX_WARNINGS = 16
_MAX_FAILURE_ENTRIES = 1024


@dataclass
class RankState:
    connection: Connection | None = None
    state: str = "streaming"
    first_step: int = -1
    last_step: int = -1
    accounted_step: int = -1
    """The highest step this rank delivered or said it will not deliver: how far it has got."""
    client_dropped: dict[str, int] = field(default_factory=dict)
    """Steps the client dropped, by reason (cumulative, as the client last said)."""
    manifest: Manifest = field(default_factory=Manifest)
    health: pb.CaptureHealth | None = None
    """What the client could not capture (its latest cumulative snapshot)."""
    warnings: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)


@dataclass
class RunState:
    name: str
    baseline: bool
    framework: str
    framework_version: str
    world_size: int
    capture: str
    max_lead: int
    reference: bool = False
    precision: str = "fp32"
    """Arithmetic of float32 matrix products: "fp32" or "tf32"."""
    ranks: dict[int, RankState] = field(default_factory=dict)

    @property
    def state(self) -> str:
        states = {r.state for r in self.ranks.values()}
        if "streaming" in states or not states:
            return "streaming"
        for final in ("halted", "lost"):
            if final in states:
                return final
        return "finished"

    @property
    def last_step(self) -> int:
        return max((r.last_step for r in self.ranks.values()), default=-1)

    def effective_step(self, rank: int) -> float:
        """Highest step this rank will ever have delivered by now (inf once its stream ended)."""
        state = self.ranks.get(rank)
        if state is None:
            return -1
        return _INF if state.state in _ENDED else state.accounted_step


class Session:
    def __init__(self, name: str, config: ServerConfig) -> None:
        self.name = name
        self.config = config
        self.created = time.time()
        self.lock = threading.RLock()
        self.runs: dict[str, RunState] = {}
        self.baseline: str | None = None
        self.aligners: dict[int, RankAligner] = {}
        self.tracker = FirstDivergenceTracker()
        self.events = EventBus(name)
        self.halted = False
        self.halt_reason = ""
        self.errors: list[str] = []
        self.last_comparison: StepComparison | None = None
        self.unmatched_baseline: dict[str, None] = {}
        self.unmatched_candidate: dict[str, None] = {}
        self._last_progress = 0.0
        self._bound_mappings: dict[tuple[str, int], tuple[int, object]] = {}
        self._deferred: dict[int, list] = {}
        self.auto_mappings: dict[str, dict[str, str]] = {}
        self._auto_bound: dict[str, NameMapping] = {}
        self.noise = NoiseBands(config.noise_multiple, config.noise_floor)
        self.long_run = LongRunTracker(config.drift_window)
        self.headroom = HeadroomTracker()
        self._lossy: dict[str, pb.LossyBound] | None = None
        self._halt_ids = itertools.count(1)
        self._halt_acks: dict[int, dict[int, int]] = {}
        self._halt_cond = threading.Condition(self.lock)
        self._verdict_told = False
        self.coverage = CoverageLedger()

    # -- membership -------------------------------------------------------------

    @property
    def candidates(self) -> list[str]:
        """Runs judged against the baseline."""
        return [name for name, run in self.runs.items() if not run.baseline and not run.reference]

    @property
    def references(self) -> list[str]:
        """Reruns of the baseline that measure its own noise."""
        return [name for name, run in self.runs.items() if run.reference]

    @property
    def _compared_runs(self) -> list[str]:
        return [name for name, run in self.runs.items() if not run.baseline]

    def join(self, conn: Connection, hello: pb.Hello) -> pb.ServerMessage:
        if hello.protocol_version not in SUPPORTED_PROTOCOL_VERSIONS:
            raise InputError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"unsupported protocol version {hello.protocol_version}; this server speaks "
                f"{', '.join(map(str, SUPPORTED_PROTOCOL_VERSIONS))}",
            )
        if not hello.run:
            raise invalid("hello needs a run name")
        if hello.world_size < 1 or hello.rank >= hello.world_size:
            raise invalid(f"rank {hello.rank} is outside world size {hello.world_size}")
        if hello.baseline and hello.reference:
            raise invalid("a run is either the baseline or a reference rerun of it, not both")
        precision = hello.precision or "fp32"
        if precision not in PRECISIONS:
            raise invalid(f"unknown precision {hello.precision!r}; expected one of {', '.join(PRECISIONS)}")
        with self.lock:
            run = self.runs.get(hello.run)
            if hello.baseline and self.baseline not in (None, hello.run):
                raise InputError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"session {self.name!r} already has baseline run {self.baseline!r}; "
                    f"join {hello.run!r} as a candidate (baseline=False) or use another session",
                )
            if run is None:
                run = RunState(
                    name=hello.run,
                    baseline=hello.baseline,
                    framework=hello.framework,
                    framework_version=hello.framework_version,
                    world_size=hello.world_size,
                    capture=hello.capture,
                    max_lead=hello.max_lead,
                    reference=hello.reference,
                    precision=precision,
                )
                self.runs[hello.run] = run
                if hello.baseline:
                    self.baseline = hello.run
            elif (run.baseline, run.reference, run.world_size, run.framework) != (
                hello.baseline, hello.reference, hello.world_size, hello.framework
            ):
                raise InputError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"run {hello.run!r} joined as baseline={run.baseline}, world_size={run.world_size}, "
                    f"framework={run.framework!r}; this process says baseline={hello.baseline}, "
                    f"world_size={hello.world_size}, framework={hello.framework!r}",
                )
            rank_state = run.ranks.get(hello.rank)
            if rank_state is None:
                rank_state = run.ranks[hello.rank] = RankState()
            elif rank_state.connection is not None and rank_state.connection is not conn:
                # A reconnect whose old stream is not yet known dead: the newest wins.
                rank_state.connection.finish()
            rank_state.connection = conn
            rank_state.state = "streaming"
            self._verdict_told = False  # a run (re)joined: the verdict is told again when all have ended
            rank_state.manifest = Manifest()  # a reconnecting client resends its manifest in full
            rank_state.warnings = [w[:_MAX_TEXT] for w in hello.warnings[:_MAX_WARNINGS]]
            rank_state.environment = {k[:64]: v[:_MAX_TEXT] for k, v in list(hello.environment.items())[:32]}
            self.coverage.declare(hello.run, hello.rank, hello)
            conn.session, conn.run, conn.rank = self.name, hello.run, hello.rank
            aligner = self._aligner(hello.rank)
            aligner.reopen(hello.run)
            received = aligner.delivered(hello.run)
            halted = self.halted
        logger.info("session %s: run %r rank %d joined (%s %s)", self.name, hello.run, hello.rank, hello.framework, hello.framework_version)
        for warning in hello.warnings[:_MAX_WARNINGS]:
            self._alert("warning", f"run {hello.run!r} rank {hello.rank}: {warning[:_MAX_TEXT]}")
        self._publish_progress(force=True)
        if halted:
            conn.send(_halt_command(-1, self.halt_reason))
        else:
            self._update_credits(hello.rank)
        welcome = pb.Welcome(protocol_version=PROTOCOL_VERSION, last_step_received=received,
                             max_step_tensor_bytes=self.config.window_bytes)
        if hello.capture == "lossy":
            for phase, bound in self._lossy_bounds().items():
                welcome.lossy[phase].CopyFrom(bound)
        return pb.ServerMessage(welcome=welcome)

    def _lossy_bounds(self) -> dict[str, pb.LossyBound]:
        if self._lossy is None:
            self._lossy = lossy_bounds(self.config.tolerances)
        return self._lossy

    def leave(self, conn: Connection) -> None:
        """The stream of ``conn`` ended, cleanly (after Close) or not."""
        with self.lock:
            run = self.runs.get(conn.run or "")
            if run is None:
                return
            rank_state = run.ranks.get(conn.rank)
            if rank_state is None or rank_state.connection is not conn:
                return  # replaced by a newer stream
            rank_state.connection = None
            if not conn.closed_cleanly:
                rank_state.state = "lost"
            self._aligner(conn.rank).finish(run.name, self.baseline, self._compared_runs, not self.candidates)
            self._run_deferred(conn.rank)
            declared = self._declare()
            ended = self._ended_verdict()
        self._announce(declared)
        if ended is not None:
            self._alert(*ended)
        self._update_credits(conn.rank)
        self._publish_progress(force=True)

    def _ended_verdict(self) -> tuple[str, str] | None:
        """Once, when the last run ends without a divergence: the verdict and its reasons (caller holds the lock)."""
        if self._verdict_told or not all(r.state in _ENDED for r in self.runs.values()):
            return None
        status, reasons = self.status_and_reasons()
        if status == "diverged":
            return None
        self._verdict_told = True
        if status == "aligned":
            return "info", f"every run has ended: aligned over {self.steps_compared()} compared step(s)"
        more = f" (and {len(reasons) - 3} more: see the report)" if len(reasons) > 3 else ""
        return "warning", f"every run has ended: {status.upper()}: " + "; ".join(reasons[:3]) + more

    def close_stream(self, conn: Connection, message: pb.Close) -> None:
        with self.lock:
            rank_state = self._rank_state(conn)
            conn.closed_cleanly = True
            conn.close_reason = message.reason
            rank_state.state = "halted" if message.reason == "halted" else "finished"
            _merge_counts(rank_state.client_dropped, message.dropped)

    def add_health(self, conn: Connection, health: pb.CaptureHealth) -> None:
        """The client's latest word on what it could not capture; watchers hear of each new kind once."""
        if len(health.failures) > _MAX_FAILURE_ENTRIES:
            raise invalid(f"capture health lists {len(health.failures)} failures; at most {_MAX_FAILURE_ENTRIES}")
        with self.lock:
            rank_state = self._rank_state(conn)
            before = _failure_kinds(rank_state.health)
            rank_state.health = health
            _merge_counts(rank_state.client_dropped, health.dropped)
            self.coverage.client_missing(conn.run or "", conn.rank, health)
            reported = max((m.last_step for m in health.missing), default=-1)
            rank_state.accounted_step = max(rank_state.accounted_step, reported)
            news = [kind for kind in _failure_kinds(health) if kind not in before]
            label = f"run {conn.run!r} rank {conn.rank}"
        for kind in news[:_MAX_WARNINGS]:
            self._alert("warning", f"{label}: capture is failing: {describe_failure(health, kind)}")
        self._update_credits(conn.rank)  # steps said missing move this run along, as delivered ones do
        self._publish_progress(force=True)

    # -- data -----------------------------------------------------------------------

    def add_manifest(self, conn: Connection, message: pb.Manifest) -> None:
        with self.lock:
            self._rank_state(conn).manifest.add(message)

    def add_step(self, conn: Connection, message: pb.StepRecords) -> None:
        if message.rank != conn.rank:
            raise invalid(f"step {message.step} says rank {message.rank}, but this stream joined as rank {conn.rank}")
        if message.step < 0:
            raise invalid(f"negative step {message.step}")
        with self.lock:
            rank_state = self._rank_state(conn)
            data = decode_step(message, rank_state.manifest, conn.pieces)
            _merge_counts(rank_state.client_dropped, message.dropped)
            if data.step > rank_state.last_step:
                rank_state.last_step = data.step
            rank_state.accounted_step = max(rank_state.accounted_step, data.step)
            if rank_state.first_step < 0 or data.step < rank_state.first_step:
                rank_state.first_step = data.step
            self.coverage.delivered(conn.run or "", conn.rank, data.step, list(message.incomplete))
            aligner = self._aligner(conn.rank)
            pairs = aligner.add(
                conn.run or "", data, self.baseline, self._compared_runs, keep_baseline=not self.candidates
            )
            for run_name in self.runs:
                dropped = aligner.take_dropped_steps(run_name)
                if dropped:
                    self.coverage.server_dropped(run_name, conn.rank, dropped)
            self._deferred.setdefault(conn.rank, []).extend(pairs)
            self._run_deferred(conn.rank)
            declared = self._declare()
        self._announce(declared)
        self._update_credits(conn.rank)
        self._publish_progress()

    def _run_deferred(self, rank: int) -> None:
        """Compare what is ready; a candidate step waits until every reference has passed it."""
        waiting = []
        deferred = self._deferred.get(rank, [])
        # References first (stable: steps stay in order), so a candidate's step sees its band.
        deferred.sort(key=lambda pair: not self.runs[pair[0]].reference)
        for run, base_step, other_step in deferred:
            if not self.runs[run].reference and len(deferred) <= self.config.window_steps:
                behind = [
                    ref for ref in self.references
                    if self.runs[ref].effective_step(rank) < base_step.step
                ]
                if behind:
                    waiting.append((run, base_step, other_step))
                    continue
            self._compare(run, base_step, other_step)
        self._deferred[rank] = waiting

    def _compare(self, candidate_run: str, base_step, cand_step) -> None:
        base_run = self.runs[self.baseline or ""]
        reference = self.runs[candidate_run].reference
        ctx = CompareContext(
            base_framework=base_run.framework,
            cand_framework=self.runs[candidate_run].framework,
            candidate_run=candidate_run,
            tolerances=self.config.tolerances,
            mapping=self._mapping_for(candidate_run, cand_step.rank),
            noise=None if reference or not self.references else self.noise,
            tf32="tf32" in (base_run.precision, self.runs[candidate_run].precision),
        )
        comparison = compare_step(base_step, cand_step, ctx)
        self.coverage.compared(candidate_run, cand_step.rank, cand_step.step)
        if candidate_run not in self.auto_mappings and self.config.auto_mapping and comparison.unmatched_candidate:
            ctx.mapping = self._propose_mapping(candidate_run, ctx.mapping, base_step, cand_step, comparison)
            comparison = compare_step(base_step, cand_step, ctx)
        self.long_run.add(candidate_run, base_step.step, base_step.rank, base_step, cand_step)
        if reference:
            self.noise.add(comparison)
            return
        self.tracker.add(comparison)
        self.headroom.add(comparison)
        self.last_comparison = comparison
        for name in comparison.unmatched_baseline:
            if len(self.unmatched_baseline) < _MAX_LISTED:
                self.unmatched_baseline[name] = None
        for name in comparison.unmatched_candidate:
            if len(self.unmatched_candidate) < _MAX_LISTED:
                self.unmatched_candidate[name] = None
        for error in comparison.errors:
            self._error(error)

    def _propose_mapping(self, run: str, mapping: NameMapping, base_step, cand_step, comparison) -> NameMapping:
        """Names differ: align the modules automatically, once per run, and use the result."""
        unmatched_base = _forward_names(comparison.unmatched_baseline)
        unmatched_cand = _forward_names(comparison.unmatched_candidate)
        proposal = {
            c: b for c, b in automatch.propose(base_step, cand_step).items() if c in unmatched_cand and b in unmatched_base
        }
        self.auto_mappings[run] = proposal
        if proposal:
            logger.info("session %s: matched %d renamed modules of run %r automatically (twinstep mapping %s)",
                        self.name, len(proposal), run, self.name)
        return self._mapping_for(run, cand_step.rank)

    def _mapping_for(self, run: str, rank: int) -> NameMapping:
        """The user's mapping, plus automatic matches, bound to the candidate's module classes."""
        auto = self.auto_mappings.get(run)
        if auto:
            combined = self._auto_bound.get(run)
            if combined is None:
                user = self.config.mapping
                combined = NameMapping(exact={**auto, **user.exact}, prefix=user.prefix, regex=user.regex,
                                       fused=user.fused, permuted=user.permuted)
                self._auto_bound[run] = combined
            return combined
        mapping = self.config.mapping
        if not mapping.layer_mapping:
            return mapping
        manifest = self.runs[run].ranks[rank].manifest
        cached = self._bound_mappings.get((run, rank))
        if cached is None or cached[0] != len(manifest.modules):
            cached = (len(manifest.modules), mapping.bind({n: t for n, t in manifest.modules.values()}))
            self._bound_mappings[(run, rank)] = cached
        return cached[1]

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
            out.append(Side(name, self.coverage.rank(name, rank), state is not None and state.state in _ENDED))
        return out[0], out[1]

    def coverage_of(self, candidate: str) -> pb.Coverage:
        """What the comparison of ``candidate`` covered so far, and its gaps."""
        with self.lock:
            sides = [(rank, *self._sides(candidate, rank)) for rank in self._compared_ranks(candidate)]
            return describe_coverage(self.coverage, candidate, sides, self.tracker.steps_compared_by(candidate))

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
                gap = (f"; it comes after a gap (the earliest among compared steps; it may have begun in "
                       f"{describe_gaps(found.gaps_before, found.gaps_unlisted)})")
                self._alert("warning", f"run {comparison.candidate_run!r}: first divergence at step "
                            f"{comparison.step} comes after steps that were not compared: "
                            f"{describe_gaps(found.gaps_before, found.gaps_unlisted)}")
            if not self.config.halt_on_divergence:
                continue
            if found.after_gap and not self.config.halt_after_gap:
                self._alert("warning", f"not halting on the {where}{gap}: halt_after_gap is off, so the "
                            f"decision is yours (twinstep halt {self.name})")
                continue
            self.halt(where + gap)

    # -- flow control -------------------------------------------------------------

    def _update_credits(self, rank: int) -> None:
        """Tell every stream of this rank how far it may run ahead."""
        updates = []
        with self.lock:
            for run in self.runs.values():
                state = run.ranks.get(rank)
                if state is None or state.connection is None:
                    continue
                lead = run.max_lead or self.config.window_steps
                others = [other.ranks[rank] for other in self.runs.values() if other is not run and rank in other.ranks]
                streaming = [other.accounted_step for other in others if other.state == "streaming"]
                if streaming:
                    pace = min(streaming)
                elif others or not run.max_lead:
                    pace = state.accounted_step  # nobody left to wait for
                else:
                    pace = -1  # lockstep: wait for the other runs to join
                updates.append((state.connection, pace + lead, state.last_step))
        for conn, max_step, acked in updates:
            conn.set_credit(max_step, acked)

    # -- halt --------------------------------------------------------------------------

    def halt(self, reason: str) -> list[str]:
        """Halt every connected process of every run; ranks of one run stop at one step."""
        with self.lock:
            if self.halted:
                return []
            self.halted = True
            self.halt_reason = reason
            plan = [
                (run.name, [s.connection for s in run.ranks.values() if s.connection is not None])
                for run in self.runs.values()
            ]
        logger.warning("session %s: halting all runs: %s", self.name, reason)
        halted_runs = []
        for run_name, conns in plan:
            if not conns:
                continue
            halted_runs.append(run_name)
            if len(conns) == 1 and self.runs[run_name].world_size == 1:
                conns[0].send(_halt_command(-1, reason))
                self.events.publish(pb.Event(halt=pb.HaltNotice(reason=reason, run=run_name, at_step=-1)), keep=True)
            else:
                threading.Thread(
                    target=self._coordinate_halt, args=(run_name, conns, reason), name="twinstep-halt", daemon=True
                ).start()
        return halted_runs

    def _coordinate_halt(self, run_name: str, conns: list[Connection], reason: str) -> None:
        """Ask every rank for its current step, then halt all at one step past the furthest."""
        request_id = next(self._halt_ids)
        with self.lock:
            self._halt_acks[request_id] = {}
        prepare = pb.ServerMessage(
            command=pb.Command(kind=pb.Command.HALT_PREPARE, reason=reason, request_id=request_id)
        )
        for conn in conns:
            conn.send(prepare)
        deadline = time.monotonic() + self.config.halt_prepare_timeout
        with self._halt_cond:
            while len(self._halt_acks[request_id]) < len(conns):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._halt_cond.wait(remaining)
            acks = self._halt_acks.pop(request_id)
        # One step of slack: a rank may finish the step it reported before HALT arrives.
        at_step = max(acks.values()) + 1 if acks else -1
        if len(acks) < len(conns):
            logger.warning("session %s: %d of %d ranks of %r answered the halt; halting at step %d", self.name, len(acks), len(conns), run_name, at_step)
        for conn in conns:
            conn.send(_halt_command(at_step, reason))
        self.events.publish(pb.Event(halt=pb.HaltNotice(reason=reason, run=run_name, at_step=at_step)), keep=True)

    def halt_ack(self, conn: Connection, ack: pb.HaltAck) -> None:
        with self._halt_cond:
            acks = self._halt_acks.get(ack.request_id)
            if acks is not None:
                acks[conn.rank] = ack.current_step
                self._halt_cond.notify_all()

    # -- helpers -----------------------------------------------------------------------

    def _aligner(self, rank: int) -> RankAligner:
        aligner = self.aligners.get(rank)
        if aligner is None:
            aligner = self.aligners[rank] = RankAligner(rank, self.config.window_steps, self.config.window_bytes)
        return aligner

    def _rank_state(self, conn: Connection) -> RankState:
        run = self.runs.get(conn.run or "")
        state = run.ranks.get(conn.rank) if run else None
        if state is None or state.connection is not conn:
            raise InputError(grpc.StatusCode.FAILED_PRECONDITION, "stream is not joined (send Hello first)")
        return state

    def _error(self, message: str) -> None:
        if len(self.errors) < _MAX_LISTED:
            self.errors.append(message)
        self._alert("error", message)

    def _alert(self, level: str, message: str) -> None:
        """Log a line and tell every watcher (kept for watchers who come later)."""
        logger.warning("session %s: %s", self.name, message)
        self.events.publish(pb.Event(alert=pb.AlertNotice(level=level, message=message)), keep=True)

    def _broadcast(self, message: pb.ServerMessage) -> None:
        with self.lock:
            conns = [s.connection for run in self.runs.values() for s in run.ranks.values() if s.connection]
        for conn in conns:
            conn.send(message)

    def run_status(self) -> list[pb.RunStatus]:
        with self.lock:
            out = []
            # The baseline first, then reference reruns, then candidates, each in the order they joined.
            for run in sorted(self.runs.values(), key=lambda r: (not r.baseline, not r.reference)):
                by_reason = self.dropped_by_reason(run)
                status = pb.RunStatus(
                    name=run.name,
                    baseline=run.baseline,
                    reference=run.reference,
                    framework=run.framework,
                    ranks=run.world_size,
                    last_step=run.last_step,
                    state=run.state,
                    dropped=sum(by_reason.values()),
                    dropped_by_reason=by_reason,
                    first_step=min((r.first_step for r in run.ranks.values() if r.first_step >= 0), default=-1),
                )
                for rank, state in sorted(run.ranks.items()):
                    if state.health is not None:
                        status.health.append(pb.RankHealth(rank=rank, capture=state.health))
                    for warning in state.warnings:
                        if warning not in status.warnings:
                            status.warnings.append(warning)
                first_rank = run.ranks.get(0) or next(iter(run.ranks.values()), None)
                if first_rank is not None:
                    status.environment.update(first_rank.environment)
                out.append(status)
            return out

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

    def _publish_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_progress < _PROGRESS_INTERVAL:
            return
        self._last_progress = now
        with self.lock:
            progress = pb.Progress(runs=self.run_status(), steps_compared=self.steps_compared())
        self.events.publish(pb.Event(progress=progress))

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
        never stays ``running`` after its runs have ended.
        """
        with self.lock:
            reasons = coverage_problems(self)
            if self.tracker.first() is not None:
                return "diverged", reasons
            runs = list(self.runs.values())
            if not runs or not all(r.state in _ENDED for r in runs):
                return "running", reasons
            return ("incomplete" if reasons else "aligned"), reasons


def _forward_names(labels: list[str]) -> set[str]:
    """Module names of "forward:<name>" labels ("(model)" is the root, named "")."""
    names = {label.split(":", 1)[1] for label in labels if label.startswith("forward:")}
    return {"" if name == "(model)" else name for name in names}


def _merge_counts(into: dict[str, int], counts: Mapping[str, int]) -> None:
    """Cumulative counters from the client, by key: keep the largest seen (messages may come in any order)."""
    for key, count in counts.items():
        if count > into.get(key, 0):
            into[key] = count


def _halt_command(at_step: int, reason: str) -> pb.ServerMessage:
    return pb.ServerMessage(command=pb.Command(kind=pb.Command.HALT, reason=reason, at_step=at_step))


class SessionRegistry:
    """All sessions of one server, created on first mention."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def get(self, name: str) -> Session | None:
        with self._lock:
            return self._sessions.get(name)

    def get_or_create(self, name: str) -> Session:
        if not name:
            raise invalid("session name must not be empty")
        if len(name) > 256:
            raise invalid("session name longer than 256 characters")
        with self._lock:
            session = self._sessions.get(name)
            if session is None:
                session = self._sessions[name] = Session(name, self.config)
            return session

    def names(self) -> list[str]:
        with self._lock:
            return list(self._sessions)
