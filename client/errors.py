"""Exceptions a training script may see."""

from __future__ import annotations


class Halted(RuntimeError):
    """Raised by ``Monitor.step()`` when the comparison server halts this run.

    Every rank of a run raises at the same step boundary, so no rank is left
    waiting in a collective.
    """

    def __init__(self, reason: str, step: int) -> None:
        super().__init__(f"twinstep halted this run at step {step}: {reason}")
        self.reason = reason
        self.step = step


class BatchSyncError(RuntimeError):
    """Raised by ``Monitor.baseline_batch()`` (and by a model attached with ``sync_batches=True``) when
    the baseline's batch for this step cannot be had: not published within the timeout, dropped by the
    server, or the baseline ended without it.  Batch sync is an explicit opt-in: training stops here
    rather than run on other data."""


class WeightSyncError(RuntimeError):
    """Raised by ``twinstep.attach(..., init_from_baseline=True)`` when the baseline's initial parameters
    cannot be loaded: none shared within ``init_timeout``, or a shape that no mapping or layout rule
    reconciles.  Nothing was loaded (the model is as it was): a candidate that asked to start from the
    baseline's weights and trained from its own would diverge from step 0 everywhere, so it stops here."""
