"""The coordinator of a sharded server: every shard polled, each session's global view kept and acted on.

Once per ``sharding.poll_interval`` every shard is asked (one call each) for
its sessions' digests and the events since the last poll.  From them, per
session (view.py): the first divergence over all shards, declared once every
comparing shard has passed its step; a halt of every rank of every shard at
one step (each shard asked where its ranks are, every shard told the furthest
step any can still reach); the merged progress and the shards' alerts for
watchers; the merged report on demand.  Its state is rebuilt from the shards'
digests, so a restarted coordinator loses nothing the shards hold (they keep
the halt in their journals).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from twinstep.server.alert.events import EventBus
from twinstep.server.config import ServerConfig
from twinstep.server.detect.drift import LongRunTracker
from twinstep.server.shards.ownership import shard_of
from twinstep.server.shards.report import merge_reports, merge_runs
from twinstep.server.shards.view import GlobalFirst, SessionView
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")

#: Seconds a call to every shard (a report, a halt) may take before that shard is left out.
CALL_TIMEOUT = 30.0


def _ranks_of(view: SessionView, index: int) -> str:
    world = max((run["world_size"] for run in view.runs().values()), default=0)
    ranks = [rank for rank in range(world) if shard_of(view.name, rank, view.shards, view.key) == index]
    return ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


class ShardCoordinator:
    """Polls the shards and keeps every session's view (see the module docstring)."""

    def __init__(self, shards: Any, config: ServerConfig, key: str) -> None:
        self.shards = shards
        self.config = config
        self.key = key
        self.views: dict[str, SessionView] = {}
        self.events: dict[str, EventBus] = {}
        self.addresses: list[str] = [""] * shards.count
        self.pids: list[int] = [0] * shards.count
        self.polls = 0
        self.errors: dict[str, list[str]] = {}
        self._cursors = [0] * shards.count
        self._changes = [-1] * shards.count
        self._announced: dict[tuple[str, str], tuple] = {}
        self._halting: set[str] = set()
        self._progress: dict[str, bytes] = {}
        self._listeners: list[Callable[[pb.Event], None]] = []
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._polled = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="twinstep-shard-coordinator", daemon=True)

    def start(self) -> None:
        deadline = time.monotonic() + 120
        self._poll_once()  # every shard's address before the front takes a stream
        while not all(self.addresses) and time.monotonic() < deadline:
            self._poll_once()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for bus in list(self.events.values()):
            bus.close()

    # -- polling ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        # Shards that wait for a change pace the loop themselves (a poll returns on a change or after the
        # interval); otherwise the loop sleeps the interval.  Never faster than every 10 ms.
        interval = self.config.sharding.poll_interval
        waits = getattr(self.shards, "waits", False)
        while not self._stop.wait(min(interval, 0.01) if waits else interval):
            try:
                self._poll_once(wait=interval if waits else 0.0)
            except Exception:  # one bad poll must not end the coordinator
                logger.exception("twinstep: polling the shards failed")

    def _poll_once(self, wait: float = 0.0) -> None:
        with self._poll_lock:  # one poll at a time: the loop's, or one a report asks for
            self._poll_locked(wait)

    def _poll_locked(self, wait: float) -> None:
        interval = self.config.sharding.poll_interval
        results = self.shards.poll(list(self._cursors), list(self._changes), wait,
                                   timeout=max(interval * 4, 1.0))
        acted: list[tuple[str, GlobalFirst]] = []
        with self._lock:
            for index, result in enumerate(results):
                if result is None:
                    continue
                if result["pid"] != self.pids[index] or result["address"] != self.addresses[index]:
                    if self.pids[index]:
                        logger.warning("twinstep shard %d restarted", index)
                    self.pids[index], self.addresses[index] = result["pid"], result["address"]
                    self._cursors[index] = 0
                    logger.warning("twinstep shard %d: pid %d at %s", index, result["pid"], result["address"])
                for name, state in result["sessions"].items():
                    view = self.views.get(name)
                    if view is None:
                        view = self.views[name] = SessionView(name, self.shards.count, self.key)
                    view.update(index, state["digest"])
                    view.progress[index] = state["progress"]
                self._changes[index] = result.get("changes", -1)
                for seq, data in result["events"]:
                    self._cursors[index] = max(self._cursors[index], seq)
                    event = pb.Event.FromString(data)
                    self.bus(event.session).publish(event, keep=event.WhichOneof("body") != "progress")
            for name, view in self.views.items():
                problem = view.layout_problem()
                if problem and problem not in self.errors.setdefault(name, []):
                    self.errors[name].append(problem)
                    logger.warning("session %s: %s", name, problem)
                    self.bus(name).publish(pb.Event(alert=pb.AlertNotice(level="error", message=problem)), keep=True)
                for candidate, found in view.firsts().items():
                    key = tuple(found.divergence["key"])
                    if found.final and self._announced.get((name, candidate)) != key:
                        self._announced[(name, candidate)] = key
                        acted.append((name, found))
                try:
                    self._publish_progress(name, view)
                except Exception:  # a view for watchers must not stop the declarations
                    logger.exception("session %s: merging the shards' progress failed", name)
            self.polls += 1
            self._polled.notify_all()
        for name, found in acted:
            self._declared(name, found)

    def wait_polls(self, count: int, timeout: float) -> bool:
        """Until ``count`` more polls have ended (tests, and a report that must see the latest state)."""
        with self._polled:
            target = self.polls + count
            return self._polled.wait_for(lambda: self.polls >= target, timeout)

    def add_listener(self, listener: Callable[[pb.Event], None]) -> None:
        """Call ``listener`` with every event of every session from now on (the front's webhooks)."""
        self._listeners.append(listener)
        for bus in list(self.events.values()):
            bus.add_listener(listener)

    def bus(self, session: str) -> EventBus:
        """The session's events for watchers: the shards' alerts and halts, the merged progress, the divergences
        final over every shard."""
        bus = self.events.get(session)
        if bus is None:
            bus = self.events[session] = EventBus(session)
            for listener in self._listeners:
                bus.add_listener(listener)
        return bus

    def _publish_progress(self, name: str, view: SessionView) -> None:
        shares = [pb.Progress.FromString(data) for data in view.progress.values()]
        progress = pb.Progress(runs=merge_runs(share.runs for share in shares), steps_compared=view.steps_compared())
        worst: dict[tuple[str, str], pb.StageError] = {}
        for share in shares:  # per run and phase, the worst latest error over the shards' ranks
            for stage in share.stages:
                seen = worst.get((stage.run, stage.phase))
                if seen is None or (stage.step, stage.ratio) > (seen.step, seen.ratio):
                    worst[(stage.run, stage.phase)] = stage
        progress.stages.extend(worst.values())
        data = progress.SerializeToString()
        if self._progress.get(name) != data:
            self._progress[name] = data
            self.bus(name).publish(pb.Event(progress=progress))

    # -- a divergence final over every shard --------------------------------------------------------

    def _declared(self, name: str, found: GlobalFirst) -> None:
        where = found.divergence
        logger.warning("session %s: first divergence of %r at step %d, %s, %r (rank %d, shard %d)", name,
                       found.candidate, where["step"], where["phase"], where["module"], where["rank"], found.shard)
        divergence = self._divergence(name, found)
        if divergence is not None:
            self.bus(name).publish(pb.Event(divergence=divergence), keep=True)
        halt = self.config.halt
        if halt.on_divergence and (halt.after_gap or not where.get("after_gap")) and name not in self._halting:
            self._halting.add(name)
            reason = (f"divergence of {found.candidate!r} at step {where['step']} ({where['phase']}, "
                      f"{where['module']!r}, rank {where['rank']})")
            threading.Thread(target=self.halt, args=(name, reason), name="twinstep-shard-halt", daemon=True).start()

    def _divergence(self, name: str, found: GlobalFirst) -> pb.Divergence | None:
        with self._lock:
            declared = self.views[name].digests.get(found.shard, {}).get("declared", {}).get(found.candidate)
        if declared is not None and tuple(declared["key"]) == tuple(found.divergence["key"]):
            return pb.Divergence.FromString(declared["proto"])  # in the digest: no call to the shard
        try:
            data = self.shards.one(found.shard, lambda s: s.report(name), CALL_TIMEOUT)
        except Exception as error:
            logger.warning("session %s: the report of shard %d could not be read: %s", name, found.shard, error)
            return None
        if data is None:
            return None
        report = pb.Report.FromString(data)
        row = next((c for c in report.candidates if c.candidate_run == found.candidate), None)
        return row.first_divergence if row is not None and row.HasField("first_divergence") else None

    # -- what the front asks -------------------------------------------------------------------------

    def halt(self, session: str, reason: str) -> list[str]:
        """Halt every rank of every shard's runs at one step: the furthest any shard can still reach."""
        reaches = self.shards.each(lambda s: s.reach(session), CALL_TIMEOUT)
        earliest = [reach[0] for reach in reaches if reach is not None and reach[0] >= 0]
        at_step = max(earliest) if earliest else None
        told = self.shards.each(lambda s: s.halt(session, reason, at_step), CALL_TIMEOUT)
        runs = sorted({run for runs in told if runs for run in runs})
        self.bus(session).publish(pb.Event(halt=pb.HaltNotice(reason=reason, at_step=-1 if at_step is None
                                                              else at_step)), keep=True)
        logger.warning("session %s: halted every shard's ranks at step %s: %s", session, at_step, reason)
        return runs

    def report(self, session: str) -> pb.Report | None:
        self._poll_once()  # the view as of now: a report asked right after the last step names its divergence
        parts = self.shards.each(lambda s: s.report_parts(session), CALL_TIMEOUT)
        reports = {index: pb.Report.FromString(part["report"]) for index, part in enumerate(parts) if part is not None}
        if not reports:
            return None
        shares = [part["long_run"] for part in parts if part is not None and part["long_run"] is not None]
        with self._lock:
            view = self.views.get(session) or SessionView(session, self.shards.count, self.key)
            errors = list(self.errors.get(session, []))
            silent = sorted(index for index in view.digests if index not in reports)
        for index in silent:  # a shard that holds some of its ranks did not answer: the report says what it lacks
            errors.append(f"shard {index} did not answer within {CALL_TIMEOUT:g} s (restarting?): the ranks it "
                          f"compares ({_ranks_of(view, index)}) are missing from this report")
        merged = merge_reports(view, reports, errors)
        if shares and len(shares) == len(reports):  # every shard's partial sums: the criteria over every rank
            self._long_run(merged, view, shares)
        return merged

    def _long_run(self, report: pb.Report, view: SessionView, shares: list[dict]) -> None:
        tracker = LongRunTracker.merged(self.config.comparison.drift_window, shares)
        runs = view.runs()
        reference = next((name for name, run in runs.items() if run.get("reference")), None)
        summaries = [tracker.summary(name, reference, self.config.comparison.noise_multiple)
                     for name in view.candidates()]
        coverage = {row.candidate_run: row.summary for row in report.coverage}  # merged: true of every shard
        for summary in summaries:
            if summary is not None:
                summary.coverage = coverage.get(summary.candidate_run, "")
        del report.long_run[:]
        report.long_run.extend(summary for summary in summaries if summary is not None)

    def sessions(self) -> pb.SessionList:
        lists = [pb.SessionList.FromString(data) for data in self.shards.each(lambda s: s.sessions(), CALL_TIMEOUT)
                 if data is not None]
        out = pb.SessionList(journal=lists[0].journal if lists else "")
        merged: dict[str, pb.SessionSummary] = {}
        for listing in lists:
            for summary in listing.sessions:
                seen = merged.get(summary.name)
                if seen is None:
                    merged[summary.name] = seen = pb.SessionSummary()
                    seen.CopyFrom(summary)
                    continue
                for run in summary.runs:
                    if run not in seen.runs:
                        seen.runs.append(run)
                seen.created_unix = min(seen.created_unix, summary.created_unix)
                seen.last_active_unix = max(seen.last_active_unix, summary.last_active_unix)
        with self._lock:
            for name, summary in merged.items():
                view = self.views.get(name)
                if view is None:
                    continue
                firsts = {c: f for c, f in view.firsts().items() if f.final}
                summary.steps_compared = view.steps_compared()
                if firsts:
                    first = min(firsts.values(), key=lambda f: tuple(f.divergence["key"])).divergence
                    summary.status = "diverged"
                    summary.first_divergence = (f"step {first['step']}, {first['phase']}, {first['module']!r}, "
                                                f"rank {first['rank']}")
                elif summary.status == "diverged":
                    summary.status, summary.first_divergence = "running", ""
        out.sessions.extend(merged.values())
        return out
