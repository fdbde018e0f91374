"""What could not be captured, and why: counted on the training thread, reported in-band.

Capture is fail-open: a hook or a statistic that raises must never break the
training step.  But a silent failure leaves the server comparing nothing
while the report says ``running``.  The ledger keeps, per (phase, module or
parameter), how many records failed, between which steps, and the first
error; whole steps whose capture failed are counted apart.  The monitor sends
its snapshot to the server whenever it changed, so the report and the watch
stream can name the run, the module and the reason.

Logging stays at one warning per kind of failure (phase and exception type):
the ledger, not the log, holds the counts.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from twinstep.wire import phases
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

#: Most distinct (phase, name) entries kept; later ones are folded into one "(other)" entry per phase.
MAX_ENTRIES = 512
#: Most ranges of missing steps listed; steps past it are counted (``missing_unlisted``).
MAX_MISSING_RANGES = 1024
_ERROR_CHARS = 300


@dataclass
class _Entry:
    count: int
    first_step: int
    last_step: int
    error: str


def describe_error(error: BaseException) -> str:
    """ "Type: message", bounded in length."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 3] + "..."


class CaptureHealth:
    """The failure ledger of one training process; safe to call from hooks on any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, str], _Entry] = {}
        self._failed_steps = 0
        self._first_failed_step = -1
        self._last_failed_step = -1
        self._step_error = ""
        self._changed = False
        self._warned: set[tuple[str, str]] = set()

    def record_failure(self, phase: int, name: str, step: int, error: BaseException) -> None:
        """A record of ``name`` (module or parameter) in ``phase`` could not be captured."""
        with self._lock:
            key = (phase, name)
            if key not in self._entries and len(self._entries) >= MAX_ENTRIES:
                key = (phase, "(other)")
            entry = self._entries.get(key)
            if entry is None:
                self._entries[key] = _Entry(1, step, step, describe_error(error))
            else:
                entry.count += 1
                entry.last_step = max(entry.last_step, step)
            self._changed = True
        self._warn_once(phases.describe(phase), error,
                        "twinstep: could not capture %s records (first: %r at step %d: %s); training continues, "
                        "the server's report counts every such record", phases.describe(phase),
                        name or "(model)", step, describe_error(error))

    def record_step_failure(self, step: int, error: BaseException) -> None:
        """The capture of a whole step failed: nothing of it is delivered."""
        with self._lock:
            self._failed_steps += 1
            if self._first_failed_step < 0:
                self._first_failed_step = step
                self._step_error = describe_error(error)
            self._last_failed_step = max(self._last_failed_step, step)
            self._changed = True
        self._warn_once("step", error, "twinstep: could not record step %d (%s); training continues, "
                        "later failures of this kind are counted, not logged", step, describe_error(error),
                        exc_info=error)

    @property
    def failed(self) -> bool:
        with self._lock:
            return bool(self._entries or self._failed_steps)

    def take_changes(self) -> pb.CaptureHealth | None:
        """The cumulative snapshot if anything changed since the last call (else None).

        Drop counts and missing steps are the sender's to add (its DropLedger): it fills them in.
        """
        with self._lock:
            if not self._changed:
                return None
            self._changed = False
            return self._snapshot_locked()

    def snapshot(self) -> pb.CaptureHealth:
        with self._lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> pb.CaptureHealth:
        return pb.CaptureHealth(
            failures=[
                pb.CaptureFailure(phase=phase, name=name, count=e.count, first_step=e.first_step,
                                  last_step=e.last_step, error=e.error)
                for (phase, name), e in self._entries.items()
            ],
            failed_steps=self._failed_steps,
            first_failed_step=self._first_failed_step,
            last_failed_step=self._last_failed_step,
            step_error=self._step_error,
        )

    def _warn_once(self, kind: str, error: BaseException, message: str, *args: object,
                   exc_info: BaseException | None = None) -> None:
        key = (kind, type(error).__name__)
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.warning(message, *args, exc_info=exc_info)


class MissingSteps:
    """Steps this process did not deliver, as ranges per reason: gaps the server knows, not infers.

    Not thread-safe: its owner (the sender) calls it under its own lock.
    """

    def __init__(self) -> None:
        self._ranges: list[pb.MissingSteps] = []
        self.unlisted = 0

    def add(self, step: int, reason: str, detail: str = "") -> None:
        if step < 0:
            return
        for item in reversed(self._ranges[-8:]):  # drops come in order, per reason
            if item.reason == reason and item.first_step - 1 <= step <= item.last_step + 1:
                item.first_step = min(item.first_step, step)
                item.last_step = max(item.last_step, step)
                return
        if len(self._ranges) >= MAX_MISSING_RANGES:
            self.unlisted += 1
            return
        self._ranges.append(pb.MissingSteps(first_step=step, last_step=step, reason=reason, detail=detail[:_ERROR_CHARS]))

    @property
    def listed(self) -> bool:
        return bool(self._ranges or self.unlisted)

    def fill(self, health: pb.CaptureHealth) -> None:
        """Put the list into a health message."""
        health.missing.extend(self._ranges)
        health.missing_unlisted = self.unlisted
