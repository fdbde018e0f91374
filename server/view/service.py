"""Views of a server's sessions for the dashboard: built from copies, cached, and throttled.

However many pages poll, a session's view is built at most once per ``min_interval`` seconds, and
never more often than keeps building under ``max_share`` of the time (a build that took 50 ms waits
0.5 s before the next): a session's lock is held only to copy its snapshot and history, and browsers
can never take more than that share of it from ingestion.  Every page gets the same cached bytes;
the ETag lets an unchanged view answer with "not modified".
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from twinstep.server.registry import SessionRegistry
from twinstep.server.report.builder import build_report
from twinstep.server.view.history import HistoryCopy
from twinstep.server.view.model import LiveFacts, build_view
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")

#: Seconds of run progress the speed (steps per second) is measured over.
RATE_WINDOW = 10.0
_MAX_CACHED = 256


@dataclass
class _Cached:
    body: bytes
    etag: str
    built: float
    ready_at: float
    """monotonic time before which the cached body is served instead of a new build."""


class _RateMeter:
    """Steps per second of each run, from the last steps seen at successive builds."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, dict[str, int]]] = deque()

    def rates(self, now: float, runs: list[pb.RunStatus]) -> dict[str, float]:
        self._samples.append((now, {r.name: r.last_step for r in runs}))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW:
            self._samples.popleft()
        out = {}
        for r in runs:
            if r.state != "streaming":
                continue
            # The oldest sample in the window where the run had a step (it may have joined since).
            then = next(((t, steps[r.name]) for t, steps in self._samples if steps.get(r.name, -1) >= 0), None)
            if then is not None and now - then[0] >= 0.5:
                out[r.name] = max(0.0, (r.last_step - then[1]) / (now - then[0]))
        return out


class ViewService:
    """The dashboard's data: session lists, views (JSON bytes with an ETag) and halts."""

    def __init__(self, registry: SessionRegistry, *, halt_enabled: bool, halt_message: str, auth_required: bool,
                 min_interval: float = 1.0, max_share: float = 0.1) -> None:
        self.registry = registry
        self.halt_enabled = halt_enabled
        self.halt_message = halt_message
        self.auth_required = auth_required
        self.min_interval = min_interval
        self.max_share = max_share
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}
        self._cache: dict[str, _Cached] = {}
        self._rates: dict[str, _RateMeter] = {}
        self.builds = 0
        self.build_seconds = 0.0

    def sessions(self, only: str | None = None) -> list[dict[str, Any]]:
        """Sessions in memory and kept ones (``only``: that name alone, for a session token)."""
        listing = self.registry.list_sessions(only=only)
        return [{"name": s.name, "status": s.status, "runs": list(s.runs), "steps_compared": s.steps_compared,
                 "in_memory": s.in_memory, "created_unix": s.created_unix, "ended_unix": s.ended_unix or None,
                 "first_divergence": s.first_divergence or None} for s in listing.sessions]

    def view(self, name: str) -> tuple[bytes, str] | None:
        """The session's view as JSON bytes and its ETag; None when the server has no such session."""
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(name)
            if cached is not None and now < cached.ready_at:
                return cached.body, cached.etag
            building = self._building.setdefault(name, threading.Lock())
        with building:  # one build per session at a time; those who waited take its result
            with self._lock:
                cached = self._cache.get(name)
                if cached is not None and cached.built >= now:
                    return cached.body, cached.etag
            started = time.monotonic()
            view = self._build(name, started)
            if view is None:
                return None
            body = json.dumps(view, separators=(",", ":"), allow_nan=False).encode()
            cost = time.monotonic() - started
            entry = _Cached(body, '"' + hashlib.sha1(body).hexdigest() + '"', started,
                            started + max(self.min_interval, cost / self.max_share))
            with self._lock:
                self.builds += 1
                self.build_seconds += cost
                if len(self._cache) >= _MAX_CACHED and name not in self._cache:
                    oldest = min(self._cache, key=lambda k: self._cache[k].built)
                    self._cache.pop(oldest)
                    self._rates.pop(oldest, None)
                    self._building.pop(oldest, None)
                self._cache[name] = entry
        return entry.body, entry.etag

    def view_dict(self, name: str) -> dict[str, Any] | None:
        found = self.view(name)
        return None if found is None else json.loads(found[0])

    def _build(self, name: str, now: float) -> dict[str, Any] | None:
        session = self.registry.get(name)
        history: HistoryCopy | None = None
        if session is None:
            report = self.registry.archived_report(name)
            if report is None:
                return None
        else:
            # One consistent moment; no long-run criteria (kept reports have them).
            snapshot, history = session.snapshot_and_history()
            report = build_report(snapshot)
        with self._lock:
            meter = self._rates.setdefault(name, _RateMeter())
        live = LiveFacts(steps_per_second=meter.rates(now, list(report.runs)), halt_enabled=self.halt_enabled,
                         halt_message=self.halt_message, auth_required=self.auth_required)
        return build_view(report, history, live)

    def halt(self, name: str, reason: str) -> list[str] | None:
        """Halt every run of the session (None: no such session in memory)."""
        session = self.registry.get(name)
        if session is None:
            return None
        runs = session.halt(reason)
        with self._lock:
            self._cache.pop(name, None)  # the next view shows the halt at once
        return runs
