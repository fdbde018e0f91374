"""How far each run has got, in the terms every view uses: the dashboard, `twinstep watch` (live and plain).

One definition, so no two views disagree on a sign: a run is **behind** by the steps between its last step
and the furthest run's, never negative, and said on the row of the run that lags (the furthest run is 0
behind, whichever run is the baseline).  A run that has not delivered a step yet is behind by no number:
it has "no step yet".
"""

from __future__ import annotations

from typing import Sequence

NO_STEP_YET = "no step yet"
#: The column's heading wherever runs are listed.
STEPS_BEHIND = "steps behind"


def steps_behind(last_steps: Sequence[int]) -> list[int | None]:
    """Per run (given its last step, -1 for none yet): the steps it is behind the furthest run, or None."""
    furthest = max(last_steps, default=-1)
    return [None if last < 0 else furthest - last for last in last_steps]


def step_words(last_step: int) -> str:
    """"step 12", or "no step yet"."""
    return NO_STEP_YET if last_step < 0 else f"step {last_step}"
