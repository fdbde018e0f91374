"""The compare pipeline of one session: align the runs' steps, compare the pairs, keep what detection needs.

A step goes in per rank (twinstep.server.align.window lines it up with the
other runs' same step); each pair that is ready is compared under the
candidate's mapping (twinstep.server.compare), then fed to detection
(twinstep.server.detect: first divergence, headroom, noise bands, long-run
drift) and to the dashboard's history.  A candidate's step waits until every
reference rerun has passed it, so its comparison sees the references' noise band.

State only: the session core calls it under its coordinator's lock; what it
has to say (errors, a mapping proposed) goes to the core's hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from twinstep.server.align.coverage import CoverageLedger
from twinstep.server.align.window import RankAligner
from twinstep.server.compare.comparator import CompareContext, StepComparison, compare_step
from twinstep.server.compare.join import RecordLabel
from twinstep.server.compare.mapping_resolver import MappingResolver
from twinstep.server.compare.plan import PlanCache
from twinstep.server.config import ServerConfig
from twinstep.server.control import TensorStepLedger
from twinstep.server.detect.coverage import describe_coverage
from twinstep.server.detect.drift import LongRunTracker
from twinstep.server.detect.first_divergence import Candidate, FirstDivergenceTracker
from twinstep.server.detect.gaps import Side, find_gaps
from twinstep.server.detect.headroom import HeadroomTracker
from twinstep.server.detect.noise import NoiseBands
from twinstep.server.detect.records import NamedRecordTracker
from twinstep.server.detect.stage_errors import StageErrors
from twinstep.server.ingest.step import StepData
from twinstep.server.layouts.gather import StepGather
from twinstep.server.layouts.ledger import LayoutLedger
from twinstep.server.layouts.merge import StepMerger, select
from twinstep.server.layouts.mesh import LOGICAL, RANKS, RunLayout, decide
from twinstep.server.runs.membership import ENDED, Membership, RunState
from twinstep.server.shards.ownership import WHOLE, RankShare
from twinstep.server.view.history import SessionHistory
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.wire import phases

if TYPE_CHECKING:
    from twinstep.server.session.actions import Actions

MAX_LISTED = 200
"""Unmatched names and errors a report lists at most."""


class ComparePipeline:
    """Alignment windows per rank, the comparisons, and detection's bookkeeping."""

    def __init__(self, name: str, config: ServerConfig, members: Membership, coverage: CoverageLedger,
                 mappings: MappingResolver, on_error: Callable[[str, "Actions"], None],
                 on_mapping_proposed: Callable[["Actions"], None], share: RankShare = WHOLE) -> None:
        self.name = name
        self.config = config
        self.share = share
        """The ranks this server compares: all of them, or one shard's (twinstep.server.shards)."""
        self.members = members
        self.coverage = coverage
        self.mappings = mappings
        self._on_error = on_error
        self._on_mapping_proposed = on_mapping_proposed  # modules matched automatically pair more set-up values
        self.aligners: dict[int, RankAligner] = {}
        self.plans = PlanCache()
        self.tracker = FirstDivergenceTracker(trace_origins=config.diagnosis.trace_origins, tolerances=config.tolerances)
        self.noise = NoiseBands(config.comparison.noise_multiple, config.comparison.noise_floor)
        self.long_run = LongRunTracker(config.comparison.drift_window)
        self.headroom = HeadroomTracker()
        self.history = SessionHistory(name, config.dashboard.history_steps, config.dashboard.history_rows, config.comparison.noise_multiple)
        """The dashboard's bounded heatmap and curves (twinstep.server.view); read by copying under the lock."""
        self.stage_errors = StageErrors()
        """The latest compared step's worst error per phase, for live views (Progress.stages)."""
        self.named_records = NamedRecordTracker()
        """Per candidate and name: the values the runs named (Monitor.record), for the report's own section."""
        self.tensor_steps = TensorStepLedger()
        """Which compared steps carried full tensors, per candidate rank (what a zoom really brought)."""
        self.last_comparison: StepComparison | None = None
        self.unmatched_baseline: dict[RecordLabel, None] = {}
        self.unmatched_candidate: dict[RecordLabel, None] = {}
        self._deferred: dict[int, list] = {}
        self.layout_mode: str | None = None if config.comparison.layouts == "auto" else config.comparison.layouts
        """"ranks" or "logical" once decided (twinstep.server.layouts.mesh); None until two runs have joined."""
        self.layout_summary = "" if self.layout_mode is None else decide(self.layout_mode, {})[1].rstrip("; ")
        self.layouts = LayoutLedger()
        self._gathers: dict[str, StepGather] = {}
        self._mergers: dict[str, StepMerger] = {}
        self._replica_watch: dict[str, tuple[StepGather, StepMerger]] = {}
        """Runs compared rank by rank (or not yet compared) whose layout has replicas: their gradients and
        parameters, gathered over ranks only to check that replicas agree (no baseline needed)."""

    @property
    def runs(self) -> dict[str, RunState]:
        return self.members.runs

    # -- steps in, pairs compared ------------------------------------------------------------------

    def aligner(self, rank: int) -> RankAligner:
        aligner = self.aligners.get(rank)
        if aligner is None:
            aligner = self.aligners[rank] = RankAligner(rank, self.config.window.steps, self.config.window.bytes)
        return aligner

    # -- layouts: rank by rank, or each run's ranks merged per logical tensor ----------------------------

    @property
    def logical(self) -> bool:
        return self.layout_mode == LOGICAL

    def decide_layout(self, out: "Actions") -> None:
        """Once the baseline and another run have joined, decide how ranks line up; steps held meanwhile go on."""
        layouts = {run.name: run.layout or RunLayout(run.world_size) for run in self.members.ordered()}
        if self.layout_mode is not None:
            if self.layout_mode == RANKS and len({layout.shape for layout in layouts.values()}) > 1 \
                    and self.config.comparison.layouts == "auto" and "differ" not in self.layout_summary:
                self.layout_summary = (f"{self.layout_summary}; a run of another layout joined after the comparison "
                                       "began rank by rank: records whose shapes differ are named as layout "
                                       "differences (comparison.layouts: logical merges them)")
                self._on_error(self.layout_summary, out)
            return
        if self.members.baseline is None or len(layouts) < 2:
            return
        self.layout_mode, self.layout_summary = decide(self.config.comparison.layouts, layouts)
        if self.logical and not self.share.whole and self.share.key == "rank":
            # This shard holds some ranks of each run: merging needs them all (the coordinator says so too).
            self.layout_mode = RANKS
            self.layout_summary += ("; but this server's shards hold a share of the ranks each, so they are "
                                    "compared rank by rank (twinstep serve --shard-by session merges them)")
            self._on_error(self.layout_summary, out)
            return
        if self.logical:  # steps held rank by rank until now are merged instead
            self._replica_watch.clear()  # the merge checks replicas now
            held = sorted(((data.step, rank, run, data) for rank, aligner in self.aligners.items()
                           for run, data in aligner.take_held()), key=lambda item: item[:2])
            for _, rank, run, data in held:
                self.add(run, rank, data, out)

    def layout_words(self) -> str:
        """How the runs lined up, and which records merging left out as partial sums (the report's summary)."""
        partial = self.layouts.partial_words()
        return f"{self.layout_summary}; {partial}" if partial else self.layout_summary

    def delivered(self, run: str, rank: int) -> int:
        """The highest step of ``run``'s ``rank`` this session holds or compared (a lower one is a resend)."""
        if self.logical:
            gather = self._gathers.get(run)
            return gather.delivered(rank) if gather is not None else -1
        return self.aligner(rank).delivered(run)

    def merged_from(self, candidate: str, row) -> str:
        """What a candidate's row and its baseline counterpart were merged from, in words ("": rank by rank)."""
        if not self.logical:
            return ""
        cand = self.layouts.provenance(candidate, row.phase, row.candidate_name)
        base = self.layouts.provenance(self.members.baseline or "", row.phase, row.name)
        if not (cand or base):
            return ""
        return f"{candidate!r}: {cand or 'as sent'}; baseline {self.members.baseline!r}: {base or 'as sent'}"

    def pending_steps(self, run: str, rank: int) -> int:
        """Steps of ``run``'s ``rank`` held for a counterpart (lined up, waiting for other ranks, or undecided)."""
        held = self.aligner(rank).pending_steps(run) if not self.logical else self.aligner(0).pending_steps(run)
        gather = self._gathers.get(run)
        return held + (gather.pending_steps(rank) if gather is not None else 0)

    def rank_rejoined(self, run: str, rank: int) -> None:
        gather = self._gathers.get(run)
        if gather is not None:
            gather.reopen(rank)

    def _gather(self, run: str) -> StepGather:
        found = self._gathers.get(run)
        if found is None:
            found = self._gathers[run] = StepGather(self.runs[run].world_size, self.config.window.steps)
            self._mergers[run] = StepMerger(run)
        return found

    def _merged(self, run: str, wholes: list[dict[int, StepData]], out: "Actions") -> None:
        for parts in wholes:
            merged = self._mergers[run].merge(parts, self.runs[run].world_size)
            layout = self.runs[run].layout
            if layout is None or not layout.checks_replicas:
                merged.replicas = []  # ranks that may each train on their own: differing gradients are no alarm
            for mismatch in self.layouts.add(run, merged.data.step, merged):
                out.alert("error", mismatch.text, kind="replica", run=run)
            self._add_aligned(run, 0, merged.data, out)

    def add(self, run: str, rank: int, data: StepData, out: "Actions") -> None:
        """A decoded step of ``run``: line it up, compare what is ready (what it says goes to ``out``)."""
        if self.logical:  # undecided (one side joined so far) lines up rank by rank, as most sessions will
            self._merged(run, self._gather(run).add(rank, data), out)
            return
        self._watch_replicas(run, rank, data, out)
        self._add_aligned(run, rank, data, out)

    def _watch_replicas(self, run: str, rank: int, data: StepData | None, out: "Actions") -> None:
        """Rank by rank, a run with replicas still has them checked: its gradients and parameters over its ranks."""
        state = self.runs[run]
        layout = state.layout
        if layout is None or state.world_size < 2 or not layout.checks_replicas:
            return
        watch = self._replica_watch.get(run)
        if watch is None:
            watch = self._replica_watch[run] = (StepGather(state.world_size, self.config.window.steps),
                                               StepMerger(run))
        gather, merger = watch
        if data is None:
            wholes = gather.end(rank)
        else:
            params = (data.phase == phases.GRAD) | (data.phase == phases.PARAM)
            wholes = gather.add(rank, select(data, params) if not params.all() else data)
        for parts in wholes:
            merged = merger.merge(parts, state.world_size)
            for mismatch in self.layouts.add_replicas(run, merged.data.step, merged):
                out.alert("error", mismatch.text, kind="replica", run=run)

    def _add_aligned(self, run: str, rank: int, data: StepData, out: "Actions") -> None:
        aligner = self.aligner(rank)
        pairs = aligner.add(run, data, self.members.baseline, self.members.compared_runs,
                            keep_baseline=not self.members.candidates)
        for run_name in self.runs:
            dropped = aligner.take_dropped_steps(run_name)
            if dropped:
                self.coverage.server_dropped(run_name, rank, dropped)
        self._deferred.setdefault(rank, []).extend(pairs)
        self.run_deferred(rank, out)

    def rank_ended(self, run: str, rank: int, out: "Actions") -> None:
        """A rank's stream ended for good: release what can no longer match, compare what is ready."""
        if self.logical:
            gather = self._gather(run)
            self._merged(run, gather.end(rank), out)
            if not gather.all_ended():
                return
            rank = 0
        else:
            self._watch_replicas(run, rank, None, out)
        self.aligner(rank).finish(run, self.members.baseline, self.members.compared_runs,
                                  not self.members.candidates)
        self.run_deferred(rank, out)

    def run_deferred(self, rank: int, out: "Actions") -> None:
        """Compare what is ready; a candidate step waits until every reference has passed it."""
        waiting = []
        deferred = self._deferred.get(rank, [])
        # References first (stable: steps stay in order), so a candidate's step sees its band.
        deferred.sort(key=lambda pair: not self.runs[pair[0]].reference)
        for run, base_step, other_step in deferred:
            if not self.runs[run].reference and len(deferred) <= self.config.window.steps:
                behind = [ref for ref in self.members.references
                          if self.runs[ref].effective_step(rank) < base_step.step]
                if behind:
                    waiting.append((run, base_step, other_step))
                    continue
            self._compare(run, base_step, other_step, out)
        self._deferred[rank] = waiting

    def _compare(self, candidate_run: str, base_step, cand_step, out: "Actions") -> None:
        base_run, cand_run = self.runs[self.members.baseline or ""], self.runs[candidate_run]
        ctx = CompareContext(
            base_framework=base_run.framework,
            cand_framework=cand_run.framework,
            candidate_run=candidate_run,
            tolerances=self.config.tolerances,
            mapping=self.mapping_for(candidate_run, cand_step.rank),
            noise=None if cand_run.reference or not self.members.references else self.noise,
            tf32="tf32" in (base_run.precision, cand_run.precision),
            plans=self.plans,
            shapes_are_layout=self._layouts_differ(base_run, cand_run),
        )
        comparison = compare_step(base_step, cand_step, ctx)
        self.coverage.compared(candidate_run, cand_step.rank, cand_step.step)
        self.tensor_steps.observe(comparison, base_step, cand_step)
        if self.mappings.wants_proposal(candidate_run, bool(comparison.unmatched_candidate)):
            self.mappings.propose(self.name, candidate_run, base_step, cand_step,
                                  _forward_names(comparison.unmatched_baseline),
                                  _forward_names(comparison.unmatched_candidate))
            ctx.mapping = self.mapping_for(candidate_run, cand_step.rank)
            comparison = compare_step(base_step, cand_step, ctx)
            self._on_mapping_proposed(out)
        for phase, name, base_shape, cand_shape in comparison.layout_mismatches:
            self.layouts.difference(candidate_run, base_step.step, phase, name, _shape_words(
                self.members.baseline or "", base_run, base_shape, candidate_run, cand_run, cand_shape, self.logical))
        if not cand_run.reference:
            self.named_records.add(comparison, base_step, cand_step)
        self.long_run.add(candidate_run, base_step.step, base_step.rank, base_step, cand_step)
        self.history.add(candidate_run, cand_run.reference, comparison, base_step, cand_step)
        if cand_run.reference:
            self.noise.add(comparison)
            return
        self._detect(comparison, out)

    def _layouts_differ(self, base: RunState, cand: RunState) -> bool:
        a, b = base.layout or RunLayout(base.world_size), cand.layout or RunLayout(cand.world_size)
        return a.shape != b.shape

    def mapping_for(self, run: str, rank: int):
        """The names ``run``'s rank compares under (a user's mapping, or one proposed for it)."""
        manifest = self.runs[run].ranks[rank].manifest
        return self.mappings.for_run(run, rank, lambda: {n: t for n, t in manifest.modules.values()},
                                     len(manifest.modules))

    def _detect(self, comparison: StepComparison, out: "Actions") -> None:
        self.tracker.add(comparison)
        self.headroom.add(comparison)
        self.stage_errors.add(comparison)
        self.last_comparison = comparison
        for name in comparison.unmatched_baseline:
            if len(self.unmatched_baseline) < MAX_LISTED:
                self.unmatched_baseline[name] = None
        for name in comparison.unmatched_candidate:
            if len(self.unmatched_candidate) < MAX_LISTED:
                self.unmatched_candidate[name] = None
        for error in comparison.errors:
            self._on_error(error, out)

    # -- declaring --------------------------------------------------------------------------------

    def frontier(self) -> dict[str, float]:
        """Per candidate, the step every compared rank here (and every reference) has passed or ended at."""
        baseline = self.members.baseline
        if baseline is None:
            return {}
        base = self.runs[baseline]
        # Candidate steps wait for the references' noise bands, so references bound the frontier too.
        references = [self.runs[name] for name in self.members.references]
        frontier: dict[str, float] = {}
        for name in self.members.candidates:
            cand = self.runs[name]
            if self.logical:  # a logical step is whole once every rank of every run has passed it
                frontier[name] = min(self._whole_run_step(run) for run in [base, cand, *references])
                continue
            frontier[name] = min(
                (min([base.effective_step(r), cand.effective_step(r)] + [ref.effective_step(r) for ref in references])
                 for r in self.compared_ranks(name)),
                default=-1,
            )
        return frontier

    def declare(self) -> list[Candidate]:
        """Declare divergences no earlier one can precede any more."""
        declared = self.tracker.declare(self.frontier())
        for found in declared:
            found.gaps_before, found.gaps_unlisted = self._gaps_before(found)
        return declared

    def _gaps_before(self, found: Candidate) -> tuple[list[pb.Gap], int]:
        """Uncompared steps before a divergence, on every rank."""
        comparison = found.comparison
        gaps: list[pb.Gap] = []
        unlisted = 0
        for rank in self.compared_ranks(comparison.candidate_run):
            base, cand = self.sides(comparison.candidate_run, rank)
            more, extra = find_gaps(self.coverage, base, cand, rank, comparison.step, found.row.phase)
            gaps.extend(more)
            unlisted += extra
        return gaps, unlisted

    @staticmethod
    def _whole_run_step(run: RunState) -> float:
        return min((run.effective_step(r) for r in range(run.world_size)), default=-1)

    def compared_ranks(self, candidate: str) -> range | list[int]:
        """The ranks ``candidate`` is compared on here (a shard's share of them on a sharded server)."""
        base = self.runs.get(self.members.baseline or "")
        cand = self.runs.get(candidate)
        if base is None or cand is None:
            return range(0)
        if self.logical:
            return range(1)  # one logical rank: each run's ranks merged
        world = min(base.world_size, cand.world_size)
        return range(world) if self.share.whole else self.share.ranks(self.name, world)

    def compared_count(self, world: int) -> int:
        """How many of ``world`` ranks are compared here: a step is compared on every rank once on that many."""
        if self.logical:
            return 1
        return world if self.share.whole else len(self.share.ranks(self.name, world))

    def compared_world(self, run: RunState) -> int:
        """Ranks a step of ``run`` is compared on: 1 when runs' ranks are merged per logical tensor."""
        return 1 if self.logical else run.world_size

    def sides(self, candidate: str, rank: int) -> tuple[Side, Side]:
        """The baseline and a candidate as the gap finder sees them, for one rank."""
        out = []
        for name in (self.members.baseline or "", candidate):
            state = self.runs[name].ranks.get(rank)
            out.append(Side(name, self.coverage.rank(name, rank), state is not None and state.state in ENDED))
        return out[0], out[1]

    # -- what it holds ------------------------------------------------------------------------------

    def coverage_of(self, candidate: str) -> pb.Coverage:
        """What the comparison of ``candidate`` covered so far, and its gaps."""
        sides = [(rank, *self.sides(candidate, rank)) for rank in self.compared_ranks(candidate)]
        return describe_coverage(self.coverage, candidate, sides, self.tracker.steps_compared_by(candidate))

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
        world = max((run.world_size for run in self.runs.values()), default=1)
        if self.members.baseline is not None:
            world = self.runs[self.members.baseline].world_size
        return self.tracker.steps_compared(self.compared_count(world))

    def held_bytes(self) -> int:
        return (sum(aligner.held_bytes() for aligner in self.aligners.values())
                + sum(gather.held_bytes() for gather in self._gathers.values())
                + sum(gather.held_bytes() for gather, _ in self._replica_watch.values()))

    def release_all(self) -> int:
        freed = sum(aligner.release_all() for aligner in self.aligners.values())
        freed += sum(gather.release_all() for gather in self._gathers.values())
        freed += sum(gather.release_all() for gather, _ in self._replica_watch.values())
        return freed


def _forward_names(labels: list[RecordLabel]) -> set[str]:
    """Module names of the forward records among ``labels`` ("" is the model's root)."""
    return {label.name for label in labels if label.phase == "forward"}


def _shape_words(base_name: str, base: RunState, base_shape: tuple, cand_name: str, cand: RunState,
                 cand_shape: tuple, merged: bool) -> str:
    """Why a record is a layout difference, in words: which runs, what each holds."""
    def side(name: str, run: RunState, shape: tuple) -> str:
        layout = run.layout or RunLayout(run.world_size)
        return f"{list(shape)} on {name!r} ({layout.text()})"

    how = "after merging each run's ranks" if merged else "rank by rank"
    return (f"shapes differ {how}: {side(base_name, base, base_shape)} against {side(cand_name, cand, cand_shape)}; "
            "the layouts differ and this record's placement is not known, so it is not compared (declare it in "
            "the layout settings)")
