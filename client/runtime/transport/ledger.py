"""What a sender did not deliver, and why; shared by the thread sender and the sender process's client.

Both senders drop rather than block (see :mod:`twinstep.runtime.transport.base`).  A
:class:`DropLedger` holds the one account of it: how many steps per reason,
which steps (a :class:`~twinstep.runtime.capture.health.MissingSteps` list the server
is sent in-band), and one warning per reason.  :class:`WarnOnce` and
:func:`at_fork_in_child` are the other two pieces both senders need.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Callable

from twinstep.runtime.capture.health import MissingSteps
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

#: Reasons whose drops are said by a message of their own (or, for a forked child, on purpose not at all).
QUIET_REASONS = frozenset({"shutdown", "forked_child", "server_rejected", "sender_lost", "server_error"})


#: Why steps were not sent, in words: (one step, several steps), after "because".
_NOT_SENT_WORDS: dict[str, tuple[str, str]] = {
    "queue_full": ("the queue was full while the server was behind or away (max_queue_steps, max_queue_bytes)",) * 2,
    "shutdown": ("the training ended before it was delivered", "the training ended before they were delivered"),
    "already_shutdown": ("it came after the monitor was closed", "they came after the monitor was closed"),
    "oversized": ("it was larger than a message may be", "they were larger than a message may be"),
    "server_rejected": ("the server refused this run",) * 2,
    "server_error": ("the server failed while taking it", "the server failed while taking them"),
    "sender_lost": ("the sender process ended",) * 2,
    "forked_child": ("it was recorded in a forked process, which sends nothing",
                     "they were recorded in a forked process, which sends nothing"),
}


def not_sent_in_words(counts: dict[str, int], *, reached: bool) -> str:
    """Steps not sent, counted in words with their reasons, largest first ("" when none):
    "30 steps not sent: the training ended before the server was reached".

    ``reached``: the server answered this run at least once; if not, steps still queued at the end
    were never sendable, and are said so.
    """
    counts = {reason: count for reason, count in counts.items() if count > 0}
    if not counts:
        return ""
    total = sum(counts.values())

    def why(reason: str, count: int) -> str:
        if reason == "shutdown" and not reached:
            return "the training ended before the server was reached"
        return _NOT_SENT_WORDS.get(reason, (reason, reason))[count > 1]

    head = f"{total} step{'s' if total > 1 else ''} not sent"
    if len(counts) == 1:
        (reason, count), = counts.items()
        return f"{head}: {why(reason, count)}"
    ordered = sorted(counts.items(), key=lambda item: -item[1])
    return f"{head}: " + ", ".join(f"{count} because {why(reason, count)}" for reason, count in ordered)


def at_fork_in_child(method: Callable[[], None]) -> None:
    """Call ``method`` (a bound method) in the child after a fork, without keeping its object alive.

    Data-loader workers fork the training process: a child must not share its
    parent's locks, queues, sockets or connection.
    """
    if hasattr(os, "register_at_fork"):
        ref = weakref.WeakMethod(method)
        os.register_at_fork(after_in_child=lambda: (m := ref()) is not None and m())


class WarnOnce:
    """One log warning per key; later ones of the same key are counted elsewhere, not logged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: set[str] = set()

    def __call__(self, key: str, message: str, *args: object, exc_info: bool = False) -> bool:
        """Log ``message`` unless ``key`` was warned already; True if it was logged."""
        with self._lock:
            if key in self._keys:
                return False
            self._keys.add(key)
        logger.warning(message, *args, exc_info=exc_info)
        return True

    def forget(self, key: str) -> bool:
        """The condition of ``key`` is over (reconnected, say): warn again next time. True if it had been warned."""
        with self._lock:
            if key not in self._keys:
                return False
            self._keys.discard(key)
            return True

    def after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork


class DropLedger:
    """Counts of dropped steps per reason, the list of steps not delivered, one warning per reason.

    Thread-safe (its own lock, taken last: callers may hold theirs).
    """

    def __init__(self, warn: WarnOnce | None = None) -> None:
        self.warn = warn or WarnOnce()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._remote: dict[str, int] = {}  # counted by the sender process (SidecarClient)
        self._told: dict[str, int] = {}  # counted by the training process, listed and told from here
        self._missing = MissingSteps()
        self._unreported = False

    def drop(self, reason: str, step: int | None = None, *, count: int = 1, detail: str = "") -> None:
        """``count`` steps (``step``, if known) will not be delivered, for ``reason``; warned once per reason."""
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + count
            if step is not None:
                self._missing.add(step, reason, detail)
                self._unreported = True
        if reason not in QUIET_REASONS:
            self.warn("drop:" + reason, "twinstep: dropping steps (%s); counted in the report, warned once", reason)

    def mark_missing(self, step: int, reason: str, detail: str = "", *, dropped: bool = False) -> None:
        """List a step the server will not get, counted elsewhere: by the capture health, or, with
        ``dropped``, as a drop of the training process (SidecarClient), which the server is told here."""
        with self._lock:
            self._missing.add(step, reason, detail)
            if dropped:
                self._told[reason] = self._told.get(reason, 0) + 1
            self._unreported = True

    def set_remote(self, counts: dict[str, int]) -> None:
        """The sender process's own counts (cumulative), added to ours in :meth:`counts`."""
        with self._lock:
            self._remote = dict(counts)

    def counts(self) -> dict[str, int]:
        """Steps dropped per reason by this sender (and its sender process), non-zero only."""
        with self._lock:
            merged = dict(self._remote)
            for reason, count in self._counts.items():
                merged[reason] = merged.get(reason, 0) + count
        return {k: v for k, v in merged.items() if v}

    def reported_counts(self) -> dict[str, int]:
        """What the server is told: our counts and those of the training process we list for it."""
        with self._lock:
            merged = dict(self._counts)
            for reason, count in self._told.items():
                merged[reason] = merged.get(reason, 0) + count
        return {k: v for k, v in merged.items() if v}

    def missing(self) -> list[pb.MissingSteps]:
        """The steps not delivered, as ranges per reason."""
        health = pb.CaptureHealth()
        with self._lock:
            self._missing.fill(health)
        return list(health.missing)

    @property
    def unreported(self) -> bool:
        """Something was listed since the server last heard the list."""
        return self._unreported

    def report(self, health: pb.CaptureHealth) -> None:
        """Replace the list and the counts in ``health`` with ours; the server now has them."""
        counts = self.reported_counts()
        del health.missing[:]
        health.dropped.clear()
        with self._lock:
            self._missing.fill(health)
            self._unreported = False
        health.dropped.update(counts)

    def resend(self) -> None:
        """A new stream: the server must hear the list again, if there is one."""
        with self._lock:
            self._unreported = self._missing.listed

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        self.warn.after_fork()
