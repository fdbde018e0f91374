"""A session's coordinator: its lock, its core fed under it, the core's actions carried out after it.

Each input takes the lock, goes through the core (core.py), and the journal
entries it returns are committed while the lock is still held: the journal
holds inputs in the order the core took them, and nothing can acknowledge an
input before it is committed.  Every other action is queued, still under the
lock, and carried out after it is released (live.py: in the core's order
across threads, so a stream's Welcome comes before any credit).

Everything else reads the session through typed queries answered under the
lock; nothing outside this module takes it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, TypeVar

from twinstep.server.alert.events import EventBus
from twinstep.server.batches.buffer import BatchBuffer
from twinstep.server.compare.comparator import StepComparison
from twinstep.server.config import ServerConfig
from twinstep.server.connection import Connection
from twinstep.server.control.steps import Reach
from twinstep.server.control.zoom import PerRun, Window
from twinstep.server.detect.first_divergence import Candidate
from twinstep.server.journal.store import JournalClosed, NoJournal, SessionJournal
from twinstep.server.report.snapshot import SessionSnapshot
from twinstep.server.session import views
from twinstep.server.session.actions import Action, Commit, CommitStep, HaltRuns, Moment
from twinstep.server.session.core import SessionCore
from twinstep.server.session.live import LiveHandler
from twinstep.server.session.verdict import status_and_reasons
from twinstep.server.session.views import BaselineRank, MetricsView
from twinstep.server.shards.ownership import WHOLE, RankShare
from twinstep.server.view.history import HistoryCopy
from twinstep.v1 import twinstep_pb2 as pb

T = TypeVar("T")


class Session:
    """One comparison of a baseline with its candidates: the core, and everything around it that waits or sends."""

    def __init__(self, name: str, config: ServerConfig, on_ended: Callable[["Session"], object] | None = None,
                 share: RankShare = WHOLE) -> None:
        self.name = name
        self.config = config
        self.core = SessionCore(name, config, Moment.now(), share)
        """The session's state.  Not thread-safe: read it directly only where no input can arrive (tests)."""
        self.journal: SessionJournal | NoJournal = NoJournal()
        """Where accepted inputs are committed before they are acknowledged (see twinstep.server.journal)."""
        self.created = time.time()
        self.events = EventBus(name)
        self.batches = BatchBuffer(config.sync.batch_buffer_bytes)
        """Batches the baseline published for candidates (batch sync; its own lock, not journaled)."""
        self._lock = threading.RLock()
        self._live = LiveHandler(self, on_ended)

    # -- inputs ------------------------------------------------------------------------------------

    def join(self, conn: Connection, hello: pb.Hello) -> None:
        """Admit a stream; its Welcome is the first message it is sent (then a halt, or its credit)."""
        self._take(lambda now: self.core.join(conn, hello, now))

    def leave(self, conn: Connection, silent_for: float | None = None, grace: float | None = None) -> None:
        """The stream of ``conn`` ended (see SessionCore.leave); nothing happens once the server is stopping."""
        self._take(lambda now: self.core.leave(conn, now, silent_for, grace), stopping=True)

    def give_up(self, conn: Connection) -> None:
        """The reconnect grace of lost stream ``conn`` ran out."""
        self._take(lambda now: self.core.give_up(conn, now))

    def close_stream(self, conn: Connection, message: pb.Close) -> None:
        self._take(lambda now: self.core.close_stream(conn, message))

    def add_manifest(self, conn: Connection, message: pb.Manifest) -> None:
        self._take(lambda now: self.core.add_manifest(conn, message))

    def add_health(self, conn: Connection, health: pb.CaptureHealth) -> None:
        self._take(lambda now: self.core.add_health(conn, health))

    def add_setup(self, conn: Connection, setup: pb.Setup) -> None:
        self._take(lambda now: self.core.add_setup(conn, setup))

    def add_step(self, conn: Connection, message: pb.StepRecords) -> None:
        self._take(lambda now: self.core.add_step(conn, message, now))

    def halt(self, reason: str, at_step: int | None = None) -> list[str]:
        """Halt every connected process of every run; returns the runs told.

        ``at_step``: every rank of every run stops at the end of that step (one every rank can
        still reach: a halt with reproducer bundles, twinstep.server.control).
        """
        actions = self._take(lambda now: self.core.halt(reason, at_step))
        return next((action.told for action in actions if isinstance(action, HaltRuns)), [])

    def halt_ack(self, conn: Connection, ack: pb.HaltAck) -> None:
        """An answer to a question a waiting thread asked (a zoom's step query, a halt's): no state of the session."""
        self._live.ack(conn, ack)

    def expire_absent(self, conns: list[Connection], grace: float) -> None:
        """After a restart: streams that were open before it and did not come back within ``grace`` s are lost."""
        for conn in conns:
            self._take(lambda now: self.core.absent(conn, grace, now), stopping=True)

    def resume_grace_timers(self, grace: float) -> None:
        """After a restart: lost streams still within their grace get ``grace`` seconds more."""
        with self._lock:
            waiting = self.core.waiting_streams()
        for conn in waiting:
            self._live.give_up_later(conn, grace)

    def zoom(self, request: pb.ZoomRequest) -> pb.ZoomResponse:
        """An operator's Zoom RPC (raises control.ZoomRefused)."""
        return self._live.zooms.request(self, request)

    def tell_zoom(self, spec: pb.ZoomSpec, origin: str, per_run: PerRun) -> Window:
        """Number a zoom window and tell it to every open stream, in each run's own names."""
        told: list[Window] = []

        def take(now: Moment) -> list[Action]:
            window, actions = self.core.tell_zoom(spec, origin, per_run)
            told.append(window)
            return actions

        self._take(take, journaled=False)
        return told[0]

    def skip_zoom(self, spec: pb.ZoomSpec, origin: str, why: str) -> Window:
        """Keep a zoom window the session decided on and asked of no run, with why (the report lists it)."""
        kept: list[Window] = []

        def take(now: Moment) -> list[Action]:
            window, actions = self.core.skip_zoom(spec, origin, why)
            kept.append(window)
            return actions

        self._take(take, journaled=False)
        return kept[0]

    def note_error(self, message: str, kind: str = "") -> None:
        """An error found beside the streams (a damaged recording): in the report's errors, told to watchers."""
        self._take(lambda now: self.core.note_error(message, kind), journaled=False)

    def add_errors(self, errors: Iterable[str]) -> None:
        """Errors met before the inputs (reading recorded runs): listed in the report, told to nobody."""
        self._locked(lambda: self.core.errors.extend(errors))

    # -- queries -------------------------------------------------------------------------------------

    @property
    def baseline(self) -> str | None:
        return self.core.baseline

    @property
    def halted(self) -> bool:
        return self.core.halted

    @property
    def archived(self) -> bool:
        """Left the registry (its runs had ended): a stream that still holds it must join the name afresh."""
        return self.core.archived

    @property
    def ended_at(self) -> float:
        """time.time() when every run had ended (0 while one streams)."""
        return self.core.ended_at

    @ended_at.setter
    def ended_at(self, value: float) -> None:
        self.core.ended_at = value

    @property
    def last_active(self) -> float:
        """time.monotonic() when a stream last delivered or ended (the memory budget's eviction order)."""
        return self.core.last_active

    def snapshot(self, long_run: bool = True) -> SessionSnapshot:
        """Everything a report says, copied under the lock: report building never touches live state.

        ``long_run=False`` leaves the long-run criteria out: their cost grows with the steps compared
        (0.15 s at 20k steps), too much for the dashboard's frequent views.  Once the session's time to
        live is over, its verdict is final (a session that waited for a run says it never came).
        """
        with self._lock:
            return views.snapshot(self.core, long_run, _batch_sync(self.batches), final=self._final())

    def _final(self) -> bool:
        """No run can join any more: it left the registry, or its time to live is over (caller holds the lock)."""
        ended = self.core.ended_at
        return self.core.archived or bool(ended and time.time() - ended >= self.config.sessions.ttl)

    def snapshot_and_history(self) -> tuple[SessionSnapshot, HistoryCopy]:
        """One consistent moment for the dashboard: the report's snapshot (no long-run criteria) and the history."""
        with self._lock:
            return self.snapshot(long_run=False), self.core.pipeline.history.copy()

    def history(self) -> HistoryCopy:
        """The dashboard's bounded heatmap and curves (twinstep.server.view), copied."""
        with self._lock:
            return self.core.pipeline.history.copy()

    def progress(self) -> pb.Progress:
        """What watchers see of the runs now: their status, steps compared, the latest error per stage."""
        return self._locked(lambda: views.progress(self.core))

    def run_status(self) -> list[pb.RunStatus]:
        return self._locked(lambda: views.run_status(self.core))

    def run_names(self) -> list[str]:
        return self._locked(lambda: list(self.core.runs))

    def run_roles(self) -> dict[str, str]:
        """Each run's role: "baseline", "reference" or "candidate"."""
        return self._locked(lambda: {name: "baseline" if run.baseline else "reference" if run.reference
                                     else "candidate" for name, run in self.core.runs.items()})

    def last_step(self, run: str) -> int:
        """The highest step ``run`` delivered (-1: none, or no such run)."""
        return self._locked(lambda: self.core.runs[run].last_step if run in self.core.runs else -1)

    def steps_compared(self) -> int:
        return self._locked(self.core.pipeline.steps_compared)

    def status(self) -> str:
        return self.status_and_reasons()[0]

    def status_and_reasons(self) -> tuple[str, list[str]]:
        """The verdict, and every shortfall of coverage in sentences (see verdict.status_and_reasons)."""
        return self._locked(lambda: status_and_reasons(self.core, final=self._final()))

    def first_divergence(self) -> Candidate | None:
        return self._locked(self.core.pipeline.tracker.first)

    def latest_comparison(self) -> StepComparison | None:
        """The latest candidate step compared, with every metric per row."""
        return self._locked(lambda: self.core.pipeline.last_comparison)

    def coverage_of(self, candidate: str) -> pb.Coverage:
        """What the comparison of ``candidate`` covered so far, and its gaps."""
        return self._locked(lambda: self.core.coverage_of(candidate))

    def all_ended(self) -> bool:
        return self._locked(self.core.members.all_ended)

    def metrics_view(self) -> MetricsView:
        """What /metrics says of this session, copied at one moment."""
        with self._lock:
            return views.metrics(self.core, self.held_bytes())

    def shard_digest(self) -> dict:
        """What a shard tells its coordinator of this session (twinstep.server.shards.digest), under the lock."""
        from twinstep.server.shards.digest import of_core  # the shards package builds on this one

        return self._locked(lambda: of_core(self.core))

    def long_run_partials(self) -> dict[str, dict]:
        """The long-run criteria's per-step sums over this server's ranks (a sharded session merges them)."""
        return self._locked(self.core.pipeline.long_run.partials)

    def reach(self) -> "Reach":
        """Ask every open stream where its training is: the first step a command sent now reaches on all."""
        return self._live.zooms.steps.reach([conn for conn, _ in self.open_streams()])

    def open_streams(self) -> list[tuple[Connection, str]]:
        """Every stream still streaming, with its run's name (those a zoom or a bundle asks where they are)."""
        return self._locked(self.core.open_streams)

    def module_names(self, run: str) -> list[str]:
        """Every module name ``run``'s ranks declared, in the order first produced."""
        return self._locked(lambda: self.core.module_names(run))

    def baseline_rank(self, rank: int) -> BaselineRank:
        """One rank of the baseline, as a candidate fetching its batches needs to know it."""
        return self._locked(lambda: views.baseline_rank(self.core, rank))

    def weights_declined_by(self) -> str:
        """The baseline's name when its rank 0 joined without sharing its weights ("" otherwise)."""
        def declined() -> str:
            base = self.core.runs.get(self.core.baseline or "")
            # Rank 0 shares (a data-parallel run's ranks hold the same values): its Hello decides.
            return base.name if base is not None and 0 in base.ranks and not base.share_weights else ""
        return self._locked(declined)

    def counterpart_joined(self, rank: int, baseline: bool) -> bool:
        """A run of the other side (candidates for the baseline) joined on ``rank``, or none will
        (every such run has fewer ranks)."""
        def joined() -> bool:
            others = [run for run in self.core.runs.values() if run.baseline != baseline]
            return any(rank in run.ranks or run.world_size <= rank for run in others)
        return self._locked(joined)

    # -- memory and lifetime ----------------------------------------------------------------------------

    def held_bytes(self) -> int:
        """Bytes of steps held for alignment, over every rank, and of batches held for candidates (batch sync)."""
        held = self._locked(self.core.pipeline.held_bytes)
        return held + self.batches.snapshot().held_bytes  # published batches count toward the server's budget

    def release_held_steps(self) -> int:
        """Free the held steps once every run has ended (none can find a counterpart); returns bytes freed."""
        with self._lock:
            if not self.core.members.all_ended():
                return 0
            return self.core.pipeline.release_all() + self.batches.release_all()

    def archive_if_ended(self, keep: Callable[[], None]) -> bool:
        """If every run has still ended: ``keep`` the report, then refuse any later join; False when one rejoined.

        A verdict that waited for a baseline or a candidate is told as final then (watchers and the log).
        """
        with self._lock:
            if not self.core.members.all_ended():
                return False
            keep()
            self._live.queue(self.core.archive())
        self._live.carry_out_queue()
        return True

    def close_journal(self, save: Callable[[], None]) -> None:
        """The server is stopping: ``save`` the report, then take no more inputs (they could not be journaled)."""
        with self._lock:
            save()
            self.journal.close()

    # -- under the lock ---------------------------------------------------------------------------------

    def _locked(self, read: Callable[[], T]) -> T:
        with self._lock:
            return read()

    def _take(self, take: Callable[[Moment], list[Action]], stopping: bool = False,
              journaled: bool = True) -> list[Action]:
        """Feed one input to the core; commit its journal entries under the lock, carry out the rest after it.

        Once the server stops journaling, a ``journaled`` input is refused with JournalClosed (it could not
        survive the restart), or ignored when ``stopping`` (a stream ending then is no loss: its client comes
        back to the next server).
        """
        with self._lock:
            if journaled and self.journal.closed:
                if stopping:
                    return []
                raise JournalClosed()
            actions = take(Moment.now())
            self._live.queue(self._commit(actions))
        self._live.carry_out_queue()
        return actions

    def _commit(self, actions: list[Action]) -> list[Action]:
        """Journal the Commit actions (caller holds the lock); the other actions, and what a failure says."""
        rest: list[Action] = []
        for action in actions:
            if not isinstance(action, (Commit, CommitStep)):
                rest.append(action)
                continue
            if isinstance(self.journal, NoJournal) or (isinstance(action, CommitStep) and self.journal.failure):
                continue
            if not self.journal.append_many(action.rows()):
                rest.extend(self.core.journal_failed(self.journal.failure))
        return rest


def _batch_sync(batches: BatchBuffer) -> pb.BatchSync | None:
    """The report's batch-sync line (None while nothing was published or refused)."""
    counts = batches.snapshot()
    return counts.to_proto() if counts.published or counts.refused else None
