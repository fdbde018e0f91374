"""Fan-out of live events to watchers, never blocking the publisher.

Each watcher owns a bounded queue; a watcher too slow to keep up loses its
oldest events (progress is superseded by the next one anyway), never the
publisher's time.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable

from twinstep.v1 import twinstep_pb2 as pb

_WATCHER_QUEUE = 1024
#: Kept events replayed to a watcher who comes later: every divergence and halt (a few per run)
#: up to the first bound, the latest alerts up to the second.  Older ones are forgotten.
MAX_KEPT_VERDICTS = 128
MAX_KEPT_ALERTS = 384


class EventBus:
    def __init__(self, session: str) -> None:
        self._session = session
        self._lock = threading.Lock()
        self._watchers: set[queue.Queue[pb.Event | None]] = set()
        self._verdicts: deque[pb.Event] = deque(maxlen=MAX_KEPT_VERDICTS)
        self._alerts: deque[pb.Event] = deque(maxlen=MAX_KEPT_ALERTS)
        self._listeners: list[Callable[[pb.Event], None]] = []

    @property
    def history(self) -> list[pb.Event]:
        """The kept events, oldest first: divergences, halts and alerts, bounded."""
        with self._lock:
            return self._history_locked()

    def _history_locked(self) -> list[pb.Event]:
        return sorted([*self._verdicts, *self._alerts], key=lambda event: event.time)

    def subscribe(self) -> "queue.Queue[pb.Event | None]":
        q: queue.Queue[pb.Event | None] = queue.Queue(maxsize=_WATCHER_QUEUE)
        with self._lock:  # replay and join at once: no event falls between the two
            self._watchers.add(q)
            for event in self._history_locked():
                q.put_nowait(event)
        return q

    def unsubscribe(self, q: "queue.Queue[pb.Event | None]") -> None:
        with self._lock:
            self._watchers.discard(q)

    def add_listener(self, listener: Callable[[pb.Event], None]) -> None:
        """Call ``listener`` with every event published from now on (no replay), on the publisher's thread.

        For in-process consumers with a queue of their own (webhooks): ``listener`` must not block
        (a put_nowait that drops and counts); its exceptions are swallowed, never the publisher's.
        """
        with self._lock:
            self._listeners.append(listener)

    def publish(self, event: pb.Event, keep: bool = False) -> None:
        event.time = time.time()
        event.session = self._session
        with self._lock:
            if keep:
                (self._alerts if event.WhichOneof("body") == "alert" else self._verdicts).append(event)
            watchers = list(self._watchers)
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a consumer's fault is its own: the session goes on
                pass
        for q in watchers:  # outside the lock: never hold it across a send
            try:
                q.put_nowait(event)
            except queue.Full:
                try:
                    q.get_nowait()
                    q.put_nowait(event)
                except (queue.Empty, queue.Full):
                    pass

    def close(self) -> None:
        with self._lock:
            watchers = list(self._watchers)
        for q in watchers:
            try:
                q.put_nowait(None)
            except queue.Full:
                pass
