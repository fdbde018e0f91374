"""The retry helper both sides share (twinstep._retry): a fake clock and a fake stop, so nothing sleeps."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from twinstep._retry import Backoff, Retry, retry_on, retry_unless, status_code


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Stop:
    """A stop: its wait advances the fake clock by the whole timeout, unless ``set_after`` waits were made."""

    def __init__(self, clock: Clock, set_after: int | None = None) -> None:
        self.clock, self.set_after, self.waits = clock, set_after, []
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        if self.set_after is not None and len(self.waits) > self.set_after:
            self._set = True  # set during this wait: it ends at once
            return True
        self.clock.now += timeout
        return False


class Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def middle(low: float, high: float) -> float:
    return (low + high) / 2


def test_the_backoff_doubles_from_initial_up_to_the_maximum():
    backoff = Backoff(0.5, 10.0, jitter=(1.0, 1.0))
    assert [backoff.delay(n) for n in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff.nominal(10_000) == 10.0  # no overflow after days of reconnecting
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)
    with pytest.raises(ValueError):
        Backoff(0.5, 1.0, jitter=(1.2, 0.8))


@pytest.mark.parametrize("jitter", [(0.8, 1.2), (0.5, 1.0)])
def test_jitter_stays_within_its_bounds_and_never_past_the_maximum(jitter):
    backoff = Backoff(0.5, 10.0, jitter=jitter)
    low, high = jitter
    for n in range(8):
        nominal = backoff.nominal(n)
        assert backoff.delay(n, lambda a, b: a) == pytest.approx(nominal * low)  # the extremes of the draw
        assert backoff.delay(n, lambda a, b: b) == pytest.approx(min(10.0, nominal * high))
    draws = random.Random(7)
    for n in range(8):
        nominal = backoff.nominal(n)
        for _ in range(200):
            assert nominal * low <= backoff.delay(n, draws.uniform) <= min(10.0, nominal * high)


def test_only_retryable_errors_are_retried():
    clock = Clock()
    retry = Retry(Backoff(0.5, 10.0), retryable=retry_on({grpc.StatusCode.UNAVAILABLE}), stop=Stop(clock),
                  clock=clock, uniform=middle)
    assert retry.again(Failed(grpc.StatusCode.UNAVAILABLE)) and retry.retries == 1
    assert not retry.again(Failed(grpc.StatusCode.INVALID_ARGUMENT)) and retry.ended == "not_retryable"
    assert not retry.again(ValueError("no status code")) and retry.ended == "not_retryable"
    assert retry.retries == 1 and clock.now == 1000.5  # one wait only

    unless = retry_unless({grpc.StatusCode.PERMISSION_DENIED})
    assert unless(Failed(grpc.StatusCode.INTERNAL)) and unless(grpc.RpcError())  # no code: retried
    assert not unless(Failed(grpc.StatusCode.PERMISSION_DENIED))
    assert status_code(Failed(grpc.StatusCode.UNAVAILABLE)) is grpc.StatusCode.UNAVAILABLE
    assert status_code(OSError()) is None


def test_the_deadline_bounds_the_whole_operation():
    clock = Clock()
    stop = Stop(clock)
    retry = Retry(Backoff(0.5, 10.0), timeout=30.0, stop=stop, clock=clock, uniform=middle)
    start = clock.now
    attempts = 0
    while True:
        attempts += 1
        clock.now += 0.3  # the attempt itself takes time
        if not retry.again(Failed(grpc.StatusCode.UNAVAILABLE)):
            break
    assert retry.ended == "deadline"
    assert clock.now - start <= 30.0  # no wait ran past it
    # 7 attempts of 0.3 s and 25.5 s of waits: 27.6 s; another 10 s wait would end past the deadline.
    assert stop.waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert attempts == 7 and retry.attempts_made == 7
    assert retry.remaining() == pytest.approx(30.0 - (clock.now - start))


def test_attempts_bound_the_retries_and_a_hint_lengthens_a_wait():
    clock = Clock()
    stop = Stop(clock)
    seen = []
    retry = Retry(Backoff(0.5, 30.0, jitter=(0.5, 1.0)), attempts=3, stop=stop, clock=clock, uniform=lambda a, b: b,
                  on_retry=lambda error, delay: seen.append(delay))
    assert retry.again(at_least=5.0)  # a Retry-After of 5 s beats the 0.5 s backoff
    assert retry.again()
    assert not retry.again() and retry.ended == "attempts"
    assert stop.waits == seen == [5.0, 1.0]
    retry.reset()
    assert retry.again() and stop.waits[-1] == 0.5  # a reset starts the backoff over


def test_a_stop_ends_a_wait_at_once_and_allows_no_further_retry():
    clock = Clock()
    stop = Stop(clock, set_after=1)  # set during the second wait
    retry = Retry(Backoff(5.0, 60.0), stop=stop, clock=clock, uniform=middle)
    assert retry.again()
    assert not retry.again() and retry.ended == "stopped"
    assert clock.now == 1005.0  # the second wait took no time
    assert not retry.again() and retry.ended == "stopped" and len(stop.waits) == 2  # set: no wait at all


def test_a_real_event_set_from_another_thread_interrupts_a_long_backoff():
    stop = threading.Event()
    waiting = threading.Event()
    retry = Retry(Backoff(60.0, 60.0), stop=stop, on_retry=lambda error, delay: waiting.set())
    result = {}

    def wait_it_out() -> None:
        started = time.monotonic()
        result["again"] = retry.again()
        result["took"] = time.monotonic() - started

    thread = threading.Thread(target=wait_it_out)
    thread.start()
    assert waiting.wait(10)  # about to wait 60 s (48 to 60 with the jitter)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    assert result["again"] is False and retry.ended == "stopped" and result["took"] < 10
