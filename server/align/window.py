"""Line up the steps of several runs for one rank, whichever run is ahead.

Each run's steps for a rank arrive in order.  A step is compared as soon as
the baseline and a candidate both hold it.  Unmatched steps wait in a bounded
window per run; beyond it the oldest is dropped and counted.  A run that has
delivered step s will never deliver a step below s, which is how steps the
other side skipped (dropped, or captured every N steps) are released.

State is per (session, rank) so ranks can later be sharded across processes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from twinstep.server.ingest.step import StepData


@dataclass
class _RunSteps:
    steps: "OrderedDict[int, StepData]" = field(default_factory=OrderedDict)
    nbytes: int = 0
    delivered: int = -1  # highest step received
    done: bool = False  # the stream for this rank ended; nothing more will come
    dropped: int = 0  # steps dropped from the window
    dropped_steps: list[int] = field(default_factory=list)  # their numbers, until the session takes them
    unmatched: int = 0  # steps released without a counterpart


class RankAligner:
    """Pending steps of every run for one rank."""

    def __init__(self, rank: int, window_steps: int, window_bytes: int) -> None:
        self.rank = rank
        self.window_steps = window_steps
        self.window_bytes = window_bytes
        self._runs: dict[str, _RunSteps] = {}

    def run(self, name: str) -> _RunSteps:
        found = self._runs.get(name)
        if found is None:
            found = self._runs[name] = _RunSteps()
        return found

    def delivered(self, name: str) -> int:
        return self.run(name).delivered if name in self._runs else -1

    def add(self, run: str, data: StepData, baseline: str | None, candidates: list[str],
            keep_baseline: bool = False) -> list[tuple[str, StepData, StepData]]:
        """Store a step; return the (candidate, baseline step, candidate step) pairs now comparable.

        ``keep_baseline`` holds baseline steps even once every listed run has passed them
        (a session whose only other run is a reference still waits for its candidate).
        """
        state = self.run(run)
        if data.step <= state.delivered:
            return []  # a resend after reconnect: already held or compared
        state.delivered = data.step
        state.steps[data.step] = data
        state.nbytes += data.nbytes
        ready: list[tuple[str, StepData, StepData]] = []
        if baseline is not None and baseline in self._runs:
            base = self._runs[baseline]
            for cand in candidates:
                cs = self._runs.get(cand)
                if cs is None:
                    continue
                for step in [s for s in cs.steps if s in base.steps]:
                    ready.append((cand, base.steps[step], self._pop(cs, step)))
        self._release(baseline, candidates, keep_baseline)
        self._enforce_window(state)
        return ready

    def finish(self, run: str, baseline: str | None, candidates: list[str], keep_baseline: bool = False) -> None:
        """The stream of ``run`` for this rank ended."""
        self.run(run).done = True
        self._release(baseline, candidates, keep_baseline)

    def reopen(self, run: str) -> None:
        self.run(run).done = False

    def pending_steps(self, run: str) -> int:
        return len(self._runs[run].steps) if run in self._runs else 0

    def held_bytes(self) -> int:
        """Bytes of every run's held steps."""
        return sum(state.nbytes for state in self._runs.values())

    def take_held(self) -> list[tuple[str, StepData]]:
        """Every held step of every run, handed over and forgotten (the session now merges ranks instead)."""
        out = []
        for name, state in self._runs.items():
            out.extend((name, data) for data in state.steps.values())
            state.steps.clear()
            state.nbytes = 0
            state.delivered = -1
        return out

    def release_all(self) -> int:
        """Free every held step (the session's runs have ended: none can find a counterpart); returns bytes freed."""
        freed = 0
        for state in self._runs.values():
            freed += state.nbytes
            state.steps.clear()
            state.nbytes = 0
        return freed

    def take_dropped_steps(self, run: str) -> list[int]:
        """Numbers of the steps of ``run`` dropped from the window since the last call."""
        state = self._runs.get(run)
        if state is None or not state.dropped_steps:
            return []
        steps, state.dropped_steps = state.dropped_steps, []
        return steps

    def dropped_parts(self, run: str) -> tuple[int, int]:
        """(steps dropped from the window, steps released without a counterpart)."""
        state = self._runs.get(run)
        return (state.dropped, state.unmatched) if state else (0, 0)

    def dropped(self, run: str) -> int:
        state = self._runs.get(run)
        return (state.dropped + state.unmatched) if state else 0

    def _pop(self, state: _RunSteps, step: int) -> StepData:
        data = state.steps.pop(step)
        state.nbytes -= data.nbytes
        return data

    def _release(self, baseline: str | None, candidates: list[str], keep_baseline: bool = False) -> None:
        """Free steps that can no longer find a counterpart."""
        if baseline is None or baseline not in self._runs:
            return
        base = self._runs[baseline]
        for cand in candidates:
            cs = self._runs.get(cand)
            if cs is None:
                continue
            for step in [s for s in cs.steps if s <= base.delivered or base.done]:
                if step not in base.steps:
                    self._pop(cs, step)
                    cs.unmatched += 1
        # A baseline step is kept until every candidate has passed it.
        for step in list(base.steps):
            passed = all(
                cand in self._runs
                and (self._runs[cand].delivered >= step or self._runs[cand].done)
                and step not in self._runs[cand].steps
                for cand in candidates
            )
            if passed and candidates and not keep_baseline:
                self._pop(base, step)

    def _enforce_window(self, state: _RunSteps) -> None:
        while len(state.steps) > 1 and (len(state.steps) > self.window_steps or state.nbytes > self.window_bytes):
            oldest = next(iter(state.steps))
            self._pop(state, oldest)
            state.dropped += 1
            state.dropped_steps.append(oldest)
