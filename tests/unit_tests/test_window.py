"""server/align/window.py: RankAligner lines up steps of a baseline and candidates."""

from __future__ import annotations

import numpy as np

from twinstep.server.align.window import RankAligner
from twinstep.server.ingest.step import StepData

BASE, CAND, CAND2 = "base", "cand", "cand2"


def step(s: int, run: str = "", nbytes: int = 100) -> StepData:
    return StepData(
        step=s, rank=0, phase=np.zeros(0, dtype=np.int64), names=[run], types=[], call_index=np.zeros(0),
        slot=np.zeros(0), dtypes=[], shapes=[], table={}, payloads={}, nbytes=nbytes,
    )


def add(aligner: RankAligner, run: str, s: int, candidates=(CAND,), nbytes: int = 100):
    pairs = aligner.add(run, step(s, run, nbytes), BASE, list(candidates))
    return [(c, b.step, d.step, b.names[0], d.names[0]) for c, b, d in pairs]


def test_candidate_ahead_then_baseline_catches_up():
    a = RankAligner(rank=0, window_steps=10, window_bytes=1 << 30)
    for s in range(4):
        assert add(a, CAND, s) == []
    assert a.pending_steps(CAND) == 4
    produced = []
    for s in range(4):
        pairs = add(a, BASE, s)
        assert pairs == [(CAND, s, s, BASE, CAND)]  # right objects from each run
        produced.extend(p[1] for p in pairs)
    assert produced == [0, 1, 2, 3]
    assert a.pending_steps(CAND) == 0 and a.pending_steps(BASE) == 0
    assert a.dropped(CAND) == 0 and a.dropped(BASE) == 0


def test_baseline_ahead_then_candidate_catches_up():
    a = RankAligner(rank=0, window_steps=10, window_bytes=1 << 30)
    for s in range(3):
        assert add(a, BASE, s) == []
    assert a.pending_steps(BASE) == 3
    assert [add(a, CAND, s) for s in range(3)] == [[(CAND, s, s, BASE, CAND)] for s in range(3)]
    assert a.pending_steps(BASE) == 0 and a.pending_steps(CAND) == 0


def test_interleaved_lockstep():
    # alternate who is first each step
    a = RankAligner(rank=0, window_steps=2, window_bytes=1 << 30)
    out = []
    for s in range(10):
        first, second = (BASE, CAND) if s % 2 else (CAND, BASE)
        out += add(a, first, s)
        out += add(a, second, s)
    assert [p[1] for p in out] == list(range(10))
    assert a.dropped(CAND) == 0 and a.pending_steps(BASE) == 0


def test_window_steps_bound_drops_oldest_and_counts():
    a = RankAligner(rank=0, window_steps=3, window_bytes=1 << 30)
    for s in range(7):
        add(a, CAND, s)
    assert a.pending_steps(CAND) == 3
    assert a.dropped(CAND) == 4
    # the oldest went: the baseline's steps 0..3 find nothing, 4..6 pair
    paired = []
    for s in range(7):
        paired += [p[1] for p in add(a, BASE, s)]
    assert paired == [4, 5, 6]
    assert a.pending_steps(BASE) == 0  # steps the candidate passed are released
    assert a.dropped(CAND) == 4


def test_window_bytes_bound_drops_oldest_but_keeps_one():
    a = RankAligner(rank=0, window_steps=100, window_bytes=250)
    for s in range(5):
        add(a, CAND, s, nbytes=100)
    assert a.pending_steps(CAND) == 2
    assert a.dropped(CAND) == 3
    a = RankAligner(rank=0, window_steps=100, window_bytes=10)
    add(a, CAND, 0, nbytes=1000)  # bigger than the whole window: still kept
    assert a.pending_steps(CAND) == 1
    assert add(a, BASE, 0) != []


def test_step_skipped_by_baseline_released_as_unmatched():
    a = RankAligner(rank=0, window_steps=10, window_bytes=1 << 30)
    for s in range(4):
        add(a, CAND, s)
    assert add(a, BASE, 0) == [(CAND, 0, 0, BASE, CAND)]
    assert a.pending_steps(CAND) == 3  # 1, 2, 3 wait
    # The baseline skips 1 and 2 (captured every other step, or dropped)
    assert [p[1] for p in add(a, BASE, 3)] == [3]
    assert a.pending_steps(CAND) == 0
    assert a.dropped(CAND) == 2  # steps 1 and 2: unmatched
    assert a.dropped(BASE) == 0


def test_step_not_released_before_baseline_passes_it():
    a = RankAligner(rank=0, window_steps=10, window_bytes=1 << 30)
    add(a, CAND, 0)
    add(a, CAND, 1)
    add(a, CAND, 2)
    add(a, BASE, 0)
    # baseline at 0: steps 1 and 2 may still come
    assert a.pending_steps(CAND) == 2 and a.dropped(CAND) == 0
    assert [p[1] for p in add(a, BASE, 1)] == [1]
    assert a.pending_steps(CAND) == 1 and a.dropped(CAND) == 0


def test_baseline_finish_releases_the_rest():
    a = RankAligner(rank=0, window_steps=10, window_bytes=1 << 30)
    add(a, BASE, 0)
    for s in range(3):
        add(a, CAND, s)
    assert a.pending_steps(CAND) == 2
    a.finish(BASE, BASE, [CAND])
    assert a.pending_steps(CAND) == 0
    assert a.dropped(CAND) == 2


def test_candidate_skipped_step_frees_baseline_without_counting():
    a = RankAligner(rank=0, window_steps=10, window_bytes=1 << 30)
    for s in range(3):
        add(a, BASE, s)
    assert [p[1] for p in add(a, CAND, 0)] == [0]
    assert [p[1] for p in add(a, CAND, 2)] == [2]
    assert a.pending_steps(BASE) == 0
    assert a.dropped(CAND) == 0


def test_duplicate_resent_step_ignored():
    a = RankAligner(rank=0, window_steps=10, window_bytes=1 << 30)
    add(a, CAND, 0)
    add(a, CAND, 1)
    assert add(a, CAND, 1) == [] and add(a, CAND, 0) == []
    assert a.pending_steps(CAND) == 2
    assert a.delivered(CAND) == 1
    assert [p[1] for p in add(a, BASE, 0)] == [0]
    # resend of a step already compared: not compared again
    assert add(a, CAND, 0) == []
    assert add(a, BASE, 0) == []
    assert [p[1] for p in add(a, BASE, 1)] == [1]
    assert a.pending_steps(CAND) == 0 and a.pending_steps(BASE) == 0
    assert a.dropped(CAND) == 0 and a.dropped(BASE) == 0


def test_two_candidates_baseline_kept_until_both_passed():
    a = RankAligner(rank=0, window_steps=10, window_bytes=1 << 30)
    both = (CAND, CAND2)
    add(a, BASE, 0, candidates=both)
    assert add(a, CAND, 0, candidates=both) == [(CAND, 0, 0, BASE, CAND)]
    assert a.pending_steps(BASE) == 1  # cand2 still needs it
    assert add(a, CAND2, 0, candidates=both) == [(CAND2, 0, 0, BASE, CAND2)]
    assert a.pending_steps(BASE) == 0


def test_no_baseline_yet_and_unknown_runs():
    a = RankAligner(rank=3, window_steps=10, window_bytes=1 << 30)
    assert a.delivered("nobody") == -1
    assert a.pending_steps("nobody") == 0 and a.dropped("nobody") == 0
    assert a.add(CAND, step(0), None, [CAND]) == []
    assert a.pending_steps(CAND) == 1
