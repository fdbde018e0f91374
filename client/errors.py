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
