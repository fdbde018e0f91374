"""Where every rank's training is, and the first step a command can still reach on all of them.

A command sent now reaches a rank some milliseconds later, while its training
keeps stepping.  So every open stream is asked twice for the step in progress
(STEP_QUERY, answered by HaltAck, as a multi-rank halt does): the two answers
give each rank's pace, and the step chosen is the furthest rank's step plus
the steps the fastest could take while the command travels (four round trips
and a quarter of a second, at least two steps).  Answers are awaited on the
caller's thread, never under the session's lock, and for at most ``timeout``.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass

from twinstep.server.connection import Connection
from twinstep.v1 import twinstep_pb2 as pb

#: Request ids of step queries start here, apart from the halt's (which count from 1): an ack names its asker.
_FIRST_ID = 1 << 40
#: Seconds between the two questions: long enough to see a pace, short enough for a command line.
_PACE_INTERVAL = 0.15
#: Travel allowance: round trips of the slowest answer, plus a fixed margin in seconds.
_ROUND_TRIPS = 4
_MARGIN_SECONDS = 0.25
MIN_LEAD_STEPS = 2


@dataclass
class Reach:
    """What the step queries found."""

    earliest: int
    """The first step every answering rank can still apply a command at."""
    furthest: int
    """The furthest step a rank reported (-1: none answered)."""
    answered: int
    asked: int


class StepQuery:
    """STEP_QUERY round trips to a set of streams (thread-safe; acks come on stream reader threads)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._ids = itertools.count(_FIRST_ID)
        self._cond = threading.Condition()
        self._answers: dict[int, dict[int, int]] = {}

    def ack(self, ack: pb.HaltAck, stream_id: int) -> bool:
        """Take an answer; False when it answers no query of this object (a halt's)."""
        with self._cond:
            answers = self._answers.get(ack.request_id)
            if answers is None:
                return ack.request_id >= _FIRST_ID  # a late answer to a finished query is still ours
            answers[stream_id] = ack.current_step
            self._cond.notify_all()
            return True

    def ask(self, conns: list[Connection]) -> tuple[dict[int, int], float]:
        """Each stream's step in progress (by stream id) and the seconds the slowest answer took."""
        request_id = next(self._ids)
        with self._cond:
            self._answers[request_id] = {}
        query = pb.ServerMessage(command=pb.Command(kind=pb.Command.STEP_QUERY, request_id=request_id))
        start = time.monotonic()
        for conn in conns:
            conn.send(query)
        deadline = start + self.timeout
        with self._cond:
            while len(self._answers[request_id]) < len(conns):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            answers = self._answers.pop(request_id)
        return answers, time.monotonic() - start

    def reach(self, conns: list[Connection]) -> Reach:
        """Ask twice, and name the first step every answering rank can still apply a command at."""
        first, _ = self.ask(conns)
        time.sleep(_PACE_INTERVAL)
        started = time.monotonic()
        second, round_trip = self.ask(conns)
        elapsed = max(time.monotonic() - started + _PACE_INTERVAL, 1e-3)
        return earliest_step(first, second, elapsed, round_trip, len(conns))


def earliest_step(first: dict[int, int], second: dict[int, int], elapsed: float, round_trip: float,
                  asked: int) -> Reach:
    """The first step every rank reaches no sooner than a command sent now (see the module docstring)."""
    furthest = max(second.values(), default=max(first.values(), default=-1))
    travel = _ROUND_TRIPS * round_trip + _MARGIN_SECONDS
    earliest = furthest + MIN_LEAD_STEPS
    for stream, step in second.items():
        pace = max(step - first.get(stream, step), 0) / elapsed  # steps per second
        earliest = max(earliest, step + MIN_LEAD_STEPS + math.ceil(pace * travel))
    return Reach(earliest=max(earliest, 0), furthest=furthest, answered=len(second), asked=asked)
