"""The baselines' published initial parameters, held for candidates within a server-wide byte budget.

One publication per session, tied to the session object it was published
for: a baseline that uploads again replaces it, and a later session of the
same name (the old one archived) never sees it.  They live in memory only (a
restarted server has none; the baseline publishes at attach), and they
outlive the baseline's run, so a candidate that starts after the baseline
finished still gets them.  Room for an upload is reserved
before its first piece is read; publications are evicted oldest first to make
room, and an upload larger than the whole budget is refused at once.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from twinstep.server.weights.convert import Param

logger = logging.getLogger("twinstep.server")


@dataclass
class Publication:
    """One baseline's initial parameters: flat storage arrays by parameter id."""

    session: str
    run: str
    framework: str
    parameters: list[Param]
    arrays: dict[int, np.ndarray]
    nbytes: int
    owner: "weakref.ref[Any]"
    """The Session it was published for: a publication of another session of the same name is stale."""
    published: float = field(default_factory=time.time)


class WeightStore:
    """Publications by session, and why the latest upload of a session failed (candidates stop waiting)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._cond = threading.Condition()
        self._held: OrderedDict[str, Publication] = OrderedDict()  # oldest first
        self._reserved = 0
        self._failed: dict[str, str] = {}

    @property
    def held_bytes(self) -> int:
        with self._cond:
            return sum(p.nbytes for p in self._held.values())

    def reserve(self, session: str, nbytes: int) -> str:
        """Room for an upload of ``nbytes``; '' when granted, else why not.  Evicts the oldest publications."""
        with self._cond:
            if nbytes > self.budget_bytes:
                return (f"the baseline's parameters take {nbytes / 2**20:.1f} MiB, more than the server's "
                        f"weights_budget_bytes ({self.budget_bytes / 2**20:.1f} MiB): raise it in the server config")
            self._held.pop(session, None)  # a new upload supersedes the last one at once
            held = sum(p.nbytes for p in self._held.values())
            while self._held and held + self._reserved + nbytes > self.budget_bytes:
                name, old = self._held.popitem(last=False)
                held -= old.nbytes
                logger.info("weights of session %s (%.1f MiB) dropped to make room under weights_budget_bytes",
                            name, old.nbytes / 2**20)
            if held + self._reserved + nbytes > self.budget_bytes:
                return (f"uploads in progress hold the server's weights_budget_bytes ({self.budget_bytes / 2**20:.1f} "
                        "MiB); retry later or raise it")
            self._reserved += nbytes
            self._failed.pop(session, None)
            return ""

    def publish(self, publication: Publication, reserved: int) -> None:
        with self._cond:
            self._reserved -= reserved
            self._held.pop(publication.session, None)
            self._held[publication.session] = publication
            self._failed.pop(publication.session, None)
            self._cond.notify_all()

    def fail(self, session: str, reserved: int, reason: str) -> None:
        """An upload broke off: its room is freed and waiting candidates are told why."""
        with self._cond:
            self._reserved -= reserved
            self._failed[session] = reason
            self._cond.notify_all()

    def forget(self, session: str) -> None:
        """Drop the session's publication (its baseline no longer shares, or it belongs to an older session)."""
        with self._cond:
            self._held.pop(session, None)

    def wait(self, session: str, owner: Any, timeout: float) -> Publication | str | None:
        """The publication of session object ``owner``, why its upload failed, or None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = self._held.get(session)
                if found is not None and found.owner() is not owner:
                    del self._held[session]  # published for an older session of this name
                    found = None
                if found is not None:
                    return found
                failed = self._failed.get(session)
                if failed is not None:
                    return failed
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
