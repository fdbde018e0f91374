"""One shard: an ordinary twinstep server that compares its share of every session's ranks.

Its gRPC ingress takes the streams the front sent it (TLS and tokens as the
front has them); its journal (``JOURNAL/shard-I``) lets a restarted shard come
back with every session it held, so the clients' reconnects and resends make
its report the one it would have been.  The coordinator reads it through
:meth:`ShardServer.poll` (one call per poll: every session's digest and the
events since the last call) and acts through :meth:`reach` and :meth:`halt`.
The same object runs inside a Ray actor (runtime.py) or a thread of the test
runtime.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import threading
import time
from collections import deque
from typing import Any

from twinstep.server.app import ServerHandle, serve
from twinstep.server.config import ServerConfig
from twinstep.server.report.builder import build_report
from twinstep.server.security import ServerSecurity
from twinstep.server.session import Session
from twinstep.server.shards.ownership import RankShare
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")

#: Events a shard keeps for the coordinator between polls; beyond it the oldest go (and are counted).
MAX_PENDING_EVENTS = 4096
#: Kinds the coordinator makes itself from every shard's view: a shard's own would contradict it.
_GLOBAL_KINDS = ("progress", "divergence")


def shard_config(config: ServerConfig, share: RankShare) -> ServerConfig:
    """The settings of one shard: the server's, with what only the coordinator may decide taken away."""
    mine = copy.deepcopy(config)
    mine.halt.on_divergence = False  # every rank of every shard halts at one step: the coordinator's call
    mine.halt.bundle = False
    mine.dashboard.port = None  # the front serves the views of the whole session
    mine.alerts.webhooks, mine.alerts.webhook_urls = [], []  # the front sends them, once, from the session's view
    mine.recording.directory = None
    mine.recording.replay = {}
    if config.journal.directory:
        mine.journal.directory = os.path.join(config.journal.directory, f"shard-{share.index}")
    return mine


class ShardServer:
    """A server for one share of the ranks, and what the coordinator asks of it."""

    def __init__(self, share: RankShare, config: ServerConfig, host: str, port: int = 0,
                 security: ServerSecurity | None = None) -> None:
        self.share = share
        self.config = shard_config(config, share)
        self.handle: ServerHandle = serve(port, host, self.config, security=security, share=share)
        self.pid = os.getpid()
        self._events: deque[tuple[int, bytes]] = deque(maxlen=MAX_PENDING_EVENTS)
        self._seq = itertools.count(1)
        self._events_lock = threading.Condition()
        self._changes = 0
        """Counts the events that should reach the coordinator at once (a divergence, an alert, a halt)."""
        self._changed: set[str] = set()
        """Sessions with such an event since the last poll: a poll woken by one reads those only."""
        self._full_at = 0.0
        self.handle.registry.add_session_listener(self._listen)
        logger.info("twinstep shard %d: pid %d at %s", share.index, self.pid, self.handle.address)

    @property
    def address(self) -> str:
        return self.handle.address

    def info(self) -> dict[str, Any]:
        return {"index": self.share.index, "pid": self.pid, "address": self.address}

    def _listen(self, session: Session) -> None:
        def keep(event: pb.Event) -> None:
            kind = event.WhichOneof("body")
            if kind == "progress":
                return
            with self._events_lock:
                if kind not in _GLOBAL_KINDS:
                    self._events.append((next(self._seq), event.SerializeToString()))
                self._changes += 1  # a divergence too: the coordinator's waiting poll returns now
                self._changed.add(event.session)
                self._events_lock.notify_all()
        session.events.add_listener(keep)

    # -- what the coordinator reads --------------------------------------------------------------

    def poll(self, after: int = 0, wait: float = 0.0, seen: int = -1) -> dict[str, Any]:
        """Every session's digest and progress, and the events numbered after ``after``.

        ``wait``: first wait up to that many seconds for a change past ``seen`` (a divergence declared, an
        alert, a halt), so that the coordinator hears of it at once rather than at its next poll.
        """
        woken = False
        if wait > 0:
            with self._events_lock:
                woken = self._events_lock.wait_for(lambda: self._changes != seen, timeout=wait)
        with self._events_lock:
            changed, self._changed = self._changed, set()
        registry = self.handle.registry
        now = time.monotonic()
        # Woken by an event: the sessions it concerns only, so that a divergence in a small session is not held
        # up by the lock of a busy one; every session at least once per ``wait``.
        names = registry.names()
        if woken and now - self._full_at < wait:
            names = [name for name in names if name in changed]
        else:
            self._full_at = now
        sessions = {}
        for name in names:
            session = registry.get(name)
            if session is None:
                continue
            sessions[name] = {"digest": session.shard_digest(),
                              "progress": session.progress().SerializeToString()}
        with self._events_lock:
            events = [(seq, data) for seq, data in self._events if seq > after]
            changes = self._changes
        return {"shard": self.share.index, "pid": self.pid, "address": self.address, "sessions": sessions,
                "events": events, "changes": changes}

    def report(self, session: str) -> bytes | None:
        """The shard's report of ``session`` (its ranks only), or None when it holds no such session."""
        parts = self.report_parts(session)
        return None if parts is None else parts["report"]

    def report_parts(self, session: str) -> dict[str, Any] | None:
        """The report, and the long-run partial sums over this shard's ranks (the session's criteria average
        every rank: twinstep.server.detect.drift.LongRunTracker.merged)."""
        registry = self.handle.registry
        found = registry.get(session)
        if found is not None:
            report = build_report(found.snapshot()).SerializeToString()
            return {"report": report, "long_run": found.long_run_partials()}
        archived = registry.archived_report(session)
        return None if archived is None else {"report": archived.SerializeToString(), "long_run": None}

    def sessions(self) -> bytes:
        return self.handle.registry.list_sessions().SerializeToString()

    # -- what the coordinator does --------------------------------------------------------------

    def reach(self, session: str) -> tuple[int, int]:
        """(earliest, furthest): the first step every rank here can still halt at, and the furthest reported."""
        found = self.handle.registry.get(session)
        if found is None:
            return -1, -1
        reach = found.reach()
        return reach.earliest, reach.furthest

    def halt(self, session: str, reason: str, at_step: int | None = None) -> list[str]:
        found = self.handle.registry.get(session)
        return found.halt(reason, at_step) if found is not None else []

    def stop(self, grace: float = 2.0) -> None:
        self.handle.stop(grace)
