"""Retries with jittered exponential backoff, one deadline and a stop that cuts a wait short.

Shared by the training side (the gRPC stream, the weight and batch uploads, the batch fetch) and the
server (webhooks), so it depends on nothing but the standard library: no framework, no gRPC (a
status code is read from the error by duck typing), no runtime module.

- :class:`Backoff` is the schedule: ``initial * factor**n`` capped at ``maximum``, times a random
  factor from ``jitter`` (so processes that lost the same server do not come back in step), and
  never more than ``maximum``.
- :class:`Retry` is one operation's retries: which errors are worth another try, at most how many
  attempts, a deadline for the whole operation (a retry whose wait would end past it is not made),
  and a stop event whose setting ends a wait at once.  After a failed attempt the caller asks
  :meth:`Retry.again`: True once the backoff has passed; False, without waiting, when there is no
  retry to make, and :attr:`Retry.ended` says why.

The clock, the random factor and the stop event are injected for tests (no test needs to sleep).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Protocol

__all__ = ["Backoff", "Retry", "retry_on", "retry_unless", "status_code"]


class StopEvent(Protocol):
    """What :class:`Retry` needs of a stop: ``threading.Event``'s ``is_set`` and ``wait``."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass(frozen=True)
class Backoff:
    """Delays between attempts: exponential, capped, jittered."""

    initial: float
    """The first delay in seconds (before the jitter)."""
    maximum: float
    """No delay is longer, jitter included."""
    factor: float = 2.0
    jitter: tuple[float, float] = (0.8, 1.2)
    """Each delay is multiplied by a uniform random factor in this range (then capped at ``maximum``)."""

    def __post_init__(self) -> None:
        low, high = self.jitter
        if not (0 <= self.initial <= self.maximum and self.factor >= 1 and 0 <= low <= high):
            raise ValueError(f"invalid backoff {self}")

    def nominal(self, retry: int) -> float:
        """The delay before retry number ``retry`` (0: the first) without jitter."""
        try:
            return min(self.maximum, self.initial * self.factor ** retry)
        except OverflowError:  # a stream that has reconnected for days
            return self.maximum

    def delay(self, retry: int, uniform: Callable[[float, float], float] = random.uniform) -> float:
        """The delay before retry number ``retry``, jittered: within ``nominal * jitter`` and at most ``maximum``."""
        return min(self.maximum, self.nominal(retry) * uniform(*self.jitter))


def status_code(error: BaseException) -> Any:
    """The status code of an error that has one (``grpc.RpcError.code()``), else None."""
    code = getattr(error, "code", None)
    try:
        return code() if callable(code) else None
    except Exception:  # an RpcError that is not a Call
        return None


def retry_on(codes: Collection[Any]) -> Callable[[BaseException], bool]:
    """Retry an error whose status code is one of ``codes`` (the server is away or busy); nothing else."""
    codes = frozenset(codes)
    return lambda error: status_code(error) in codes


def retry_unless(codes: Collection[Any]) -> Callable[[BaseException], bool]:
    """Retry any error but one whose status code is one of ``codes`` (refusals no retry can change)."""
    codes = frozenset(codes)
    return lambda error: status_code(error) not in codes


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return False


class Retry:
    """The retries of one operation (one upload, one delivery, one connection's reconnects).

    ``retryable``: which errors are worth another attempt (default: any).  ``timeout``: seconds from
    now within which every wait must end (default: no deadline).  ``attempts``: at most this many
    attempts (default: no limit).  ``stop``: an event whose setting ends a wait at once; once set, no
    retry is made.  ``on_retry(error, delay)`` is called before each wait (a warning, a counter).
    Not thread-safe: one operation, one thread.
    """

    def __init__(
        self,
        backoff: Backoff,
        *,
        retryable: Callable[[BaseException], bool] | None = None,
        timeout: float | None = None,
        attempts: int | None = None,
        stop: StopEvent | None = None,
        on_retry: Callable[[BaseException | None, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        uniform: Callable[[float, float], float] = random.uniform,
    ) -> None:
        if attempts is not None and attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {attempts}")
        self.backoff = backoff
        self._retryable = retryable
        self._attempts = attempts
        self._stop = stop
        self._on_retry = on_retry
        self._clock = clock
        self._uniform = uniform
        self.deadline = math.inf if timeout is None else clock() + timeout
        """When every wait must have ended (the clock's time; inf: never)."""
        self.retries = 0
        """Retries made so far (since the last :meth:`reset`)."""
        self.ended: str | None = None
        """Why :meth:`again` last said no: "not_retryable", "stopped", "attempts" or "deadline"; None while it says yes."""

    @property
    def attempts_made(self) -> int:
        """Attempts so far, the one that just failed included (retries + 1)."""
        return self.retries + 1

    def remaining(self) -> float:
        """Seconds left before the deadline (inf without one, 0 past it)."""
        return max(0.0, self.deadline - self._clock())

    def retryable(self, error: BaseException) -> bool:
        """Whether ``error`` is worth another attempt (by the ``retryable`` given; any without one)."""
        return self._retryable is None or bool(self._retryable(error))

    def reset(self) -> None:
        """Start the backoff over (a connection proved healthy); the deadline stays."""
        self.retries = 0
        self.ended = None

    def again(self, error: BaseException | None = None, *, at_least: float = 0.0) -> bool:
        """After a failed attempt: wait the backoff and return True, to try again.

        False, without waiting, when ``error`` is not retryable, the stop is set, the attempts are
        spent, or the wait would end past the deadline; False too when the stop is set during the
        wait, which then ends at once.  ``at_least``: the wait is no shorter (a server's Retry-After).
        """
        if error is not None and not self.retryable(error):
            return self._no("not_retryable")
        if self._stop is not None and self._stop.is_set():
            return self._no("stopped")
        if self._attempts is not None and self.attempts_made >= self._attempts:
            return self._no("attempts")
        delay = max(self.backoff.delay(self.retries, self._uniform), at_least)
        if self._clock() + delay > self.deadline:
            return self._no("deadline")
        self.retries += 1
        if self._on_retry is not None:
            self._on_retry(error, delay)
        if (self._stop.wait(delay) if self._stop is not None else _sleep(delay)):
            return self._no("stopped")
        self.ended = None
        return True

    def _no(self, why: str) -> bool:
        self.ended = why
        return False
