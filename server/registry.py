"""All sessions of one server: created by the first stream that names them, restored after a restart,
and archived (out of memory, report kept) a while after their runs end."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import grpc

from twinstep.server.config import ServerConfig
from twinstep.server.errors import InputError, invalid
from twinstep.server.journal.replay import replay
from twinstep.server.journal.store import JournalStore, StoredSession
from twinstep.server.report.builder import build_report
from twinstep.server.session import Session
from twinstep.server.shards.ownership import WHOLE, RankShare
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")

_SWEEP_SECONDS = 10.0


@dataclass
class _Archived:
    """A session that left memory, as kept without a journal."""

    summary: pb.SessionSummary
    report: bytes


class SessionRegistry:
    """The sessions of one server, and what outlives them in memory (the journal, or archived reports)."""

    def __init__(self, config: ServerConfig, share: RankShare = WHOLE) -> None:
        self.config = config
        self.share = share
        """The ranks of every session this server compares: all, or one shard's (twinstep.server.shards)."""
        self._lock = threading.Condition()
        self._sessions: dict[str, Session] = {}
        self._archived: OrderedDict[str, _Archived] = OrderedDict()
        self.store = JournalStore(config.journal.directory, config.journal.sync) if config.journal.directory else None
        self._stopped = threading.Event()
        self._timers: list[threading.Timer] = []
        self._session_listeners: list[Callable[[Session], None]] = []
        if self.store is not None:
            self._restore()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="twinstep-session-ttl", daemon=True)
        self._sweeper.start()

    # -- lookups ----------------------------------------------------------------------------

    def get(self, name: str) -> Session | None:
        with self._lock:
            return self._sessions.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def get_or_create(self, name: str) -> Session:
        if not name:
            raise invalid("session name must not be empty")
        if len(name) > 256:
            raise invalid("session name longer than 256 characters")
        with self._lock:
            session = self._sessions.get(name)
            if session is None:
                if len(self._sessions) >= self.config.limits.max_sessions:
                    raise InputError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"this server holds {len(self._sessions)} sessions (max_sessions); "
                                     f"session {name!r} is refused")
                session = self._sessions[name] = self._new_session(name)
                for listener in self._session_listeners:
                    self._tell_listener(listener, session)
                if name in self._archived or (self.store is not None and self.store.report(name) is not None):
                    logger.warning("session %s: a new session takes the name of an archived one; the archived "
                                   "report stays listed by `twinstep sessions`", name)
                self._lock.notify_all()
            return session

    def wait_for(self, name: str, timeout: float) -> Session | None:
        """The session, once a stream creates it (None after ``timeout`` seconds); never creates one."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while name not in self._sessions:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._lock.wait(remaining)
            return self._sessions[name]

    def archived_report(self, name: str) -> pb.Report | None:
        """The kept report of a session that left memory (the newest of that name)."""
        with self._lock:
            kept = self._archived.get(name)
        if kept is not None:
            return pb.Report.FromString(kept.report)
        data = self.store.report(name) if self.store is not None else None
        return None if data is None else pb.Report.FromString(data)

    def list_sessions(self, only: str | None = None) -> pb.SessionList:
        """Every session in memory, then those that left it (newest last); ``only``: that name alone."""
        with self._lock:
            live = list(self._sessions.values())
            kept = [a.summary for a in self._archived.values()]
        listing = pb.SessionList(journal=str(self.store.directory) if self.store is not None else "")
        rows = [_summary(session) for session in live]
        if self.store is not None:
            live_ids = {session.journal.session_id for session in live}
            rows += [_stored_summary(s) for s in self.store.sessions() if s.archived and s.id not in live_ids]
        rows += kept
        listing.sessions.extend(row for row in rows if only is None or row.name == only)
        return listing

    def add_session_listener(self, listener: Callable[[Session], None]) -> None:
        """Call ``listener`` with every session in memory now (restored ones too), then with each one created later.

        It runs under the registry's lock (no session can be missed between the two): it must be quick
        and not block, e.g. add a listener to the session's event bus.
        """
        with self._lock:
            self._session_listeners.append(listener)
            for session in self._sessions.values():
                self._tell_listener(listener, session)

    def _tell_listener(self, listener: Callable[[Session], None], session: Session) -> None:
        try:
            listener(session)
        except Exception:  # a listener's fault must not refuse a session
            logger.exception("session %s: a session listener failed", session.name)

    # -- lifetime -----------------------------------------------------------------------------

    def session_ended(self, session: Session) -> None:
        """Every run of ``session`` has ended: enforce the memory budget, keep its report in the journal."""
        self.enforce_memory_budget()
        self._save(session)

    def enforce_memory_budget(self) -> int:
        """Past memory_budget_bytes, free the held steps of ended sessions, least recently active first.

        Returns bytes freed.  Their reports stay; sessions still streaming keep their per-rank windows.
        """
        with self._lock:
            sessions = list(self._sessions.values())
        held = sum(session.held_bytes() for session in sessions)
        freed = 0
        for session in sorted(sessions, key=lambda s: s.last_active):
            if held - freed <= self.config.memory.budget_bytes:
                break
            released = session.release_held_steps()
            if released:
                logger.warning("session %s: freed %d bytes of held steps (its runs have ended; memory_budget_bytes)",
                               session.name, released)
            freed += released
        return freed

    def archive_expired(self, now: float | None = None) -> list[str]:
        """Move sessions whose runs ended more than session_ttl seconds ago out of memory; returns their names."""
        now = time.time() if now is None else now
        with self._lock:
            expired = [s for s in self._sessions.values()
                       if s.ended_at and now - s.ended_at >= self.config.sessions.ttl and s.all_ended()]
        archived = []
        for session in expired:
            report = build_report(session.snapshot())
            # Kept (journal or memory) before it leaves the registry: GetReport finds it in one or the other.
            with self._lock:
                if self._sessions.get(session.name) is not session:
                    continue
                if not session.archive_if_ended(lambda: self._keep_archived(session, report)):
                    continue  # a run rejoined meanwhile
                del self._sessions[session.name]
            session.events.close()
            archived.append(session.name)
            logger.info("session %s left memory (%s s after its runs ended); its report stays readable",
                        session.name, f"{self.config.sessions.ttl:g}")
        return archived

    def freeze(self) -> None:
        """The server is stopping: save every session's report and stop journaling (and so accepting) inputs.

        Streams still open then end with UNAVAILABLE; their clients reconnect to the next server on this
        journal and resend what was not acknowledged.
        """
        self._stopped.set()
        for timer in self._timers:
            timer.cancel()
        if self.store is None:
            return
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.close_journal(lambda: self._save(session))

    def close(self) -> None:
        """After the RPCs have ended: close the journal file (its data stays on disk)."""
        self.freeze()
        if self.store is not None:
            self.store.close()

    # -- internals ------------------------------------------------------------------------------

    def _new_session(self, name: str) -> Session:
        session = Session(name, self.config, self.session_ended, self.share)
        if self.store is not None:
            session.journal = self.store.open_session(name)
        return session

    def _restore(self) -> None:
        """Replay every session that was in memory when the last server on this journal stopped."""
        assert self.store is not None
        stored_sessions = list(self.store.live_sessions())
        if stored_sessions:  # a long journal takes a while to replay: say so before, not only after
            logger.warning("restoring %d session(s) from the journal; streams are accepted once it is done",
                           len(stored_sessions))
        for stored in stored_sessions:
            started = time.monotonic()
            session = Session(stored.name, self.config, self.session_ended, self.share)
            session.created = stored.created
            result = replay(session, self.store.entries(stored.id))
            session.journal = self.store.resume(stored)
            if session.all_ended():
                session.ended_at = stored.ended or time.time()
            with self._lock:
                previous = self._sessions.get(stored.name)
                if previous is not None:  # two live generations of a name: keep the newer, archive the older
                    self.store.archive(previous.journal.session_id)
                self._sessions[stored.name] = session
            logger.warning("session %s: restored from the journal (%d entries%s, %.1f s); %d stream(s) that were "
                           "open may reconnect within %g s", stored.name, result.entries,
                           f", {result.failed} refused" if result.failed else "", time.monotonic() - started,
                           len(result.open_streams), self.config.sessions.resume_grace)
            session.resume_grace_timers(self.config.sessions.reconnect_grace)
            if result.open_streams:
                timer = threading.Timer(self.config.sessions.resume_grace, session.expire_absent,
                                        args=(result.open_streams, self.config.sessions.resume_grace))
                timer.daemon = True
                timer.start()
                self._timers.append(timer)

    def _save(self, session: Session, report: pb.Report | None = None) -> None:
        if self.store is None or session.journal.failure or session.journal.closed or not session.journal.session_id:
            return
        report = report or build_report(session.snapshot())
        try:
            self.store.save_summary(
                session.journal.session_id, status=report.status, runs=[r.name for r in report.runs],
                steps_compared=report.steps_compared, first_divergence=_divergence_words(report),
                last_active=time.time(), ended=session.ended_at, report=report.SerializeToString())
        except Exception as exc:  # the journal failing must not take a stream down
            logger.error("journal: cannot save the report of session %s: %s", session.name, exc)

    def _keep_archived(self, session: Session, report: pb.Report) -> None:
        """Keep the report of a session leaving memory: in the journal, or else in memory."""
        if self.store is not None and not session.journal.failure:
            self._save(session, report)
            self.store.archive(session.journal.session_id)
        else:
            self._keep(session, report)

    def _keep(self, session: Session, report: pb.Report) -> None:
        summary = _summary(session, report)
        summary.in_memory = False
        with self._lock:
            self._archived.pop(session.name, None)
            self._archived[session.name] = _Archived(summary, report.SerializeToString())
            while len(self._archived) > self.config.sessions.max_archived:
                self._archived.popitem(last=False)

    def _sweep_loop(self) -> None:
        interval = max(0.05, min(_SWEEP_SECONDS, self.config.sessions.ttl / 4))
        while not self._stopped.wait(interval):
            try:
                self.archive_expired()
            except Exception:  # never let the sweeper die silently: sessions would stay in memory forever
                logger.exception("archiving expired sessions failed; trying again in %.0f s", interval)


def _summary(session: Session, report: pb.Report | None = None) -> pb.SessionSummary:
    if report is None:
        status = session.status()
        runs = session.run_names()
        steps = session.steps_compared()
        first = session.first_divergence()
        words = ""
        if first is not None:
            words = _divergence_words(pb.Report(first_divergence=first.to_proto()))
    else:
        status, runs, steps, words = report.status, [r.name for r in report.runs], report.steps_compared, \
            _divergence_words(report)
    return pb.SessionSummary(name=session.name, status=status, runs=runs, steps_compared=steps, in_memory=True,
                             created_unix=session.created,
                             last_active_unix=time.time() - (time.monotonic() - session.last_active),
                             ended_unix=session.ended_at, first_divergence=words)


def _stored_summary(stored: StoredSession) -> pb.SessionSummary:
    return pb.SessionSummary(name=stored.name, status=stored.status, runs=stored.runs,
                             steps_compared=stored.steps_compared, in_memory=False, created_unix=stored.created,
                             last_active_unix=stored.last_active, ended_unix=stored.ended,
                             first_divergence=stored.first_divergence)


def _divergence_words(report: pb.Report) -> str:
    if not report.HasField("first_divergence"):
        return ""
    d = report.first_divergence
    return (f"run {d.candidate_run!r} step {d.step} rank {d.rank}: {d.phase} of {d.module or '(model)'!r}, "
            f"{d.metric} {d.value:.3g} > {d.tolerance:.3g}")
