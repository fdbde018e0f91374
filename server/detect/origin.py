"""Trace a divergence back to where it started, with no reference run.

Flat tolerances miss porting bugs whose first effect is small (an RMSNorm
epsilon on a residual stream of order 1, weight decay on norm weights, another
Adam epsilon, a rotary base off by one): they cross a tolerance later, in
whichever module first amplifies them.  This module tells such a systematic
difference from rounding noise: each record's error over a *faithful floor*,
``FLOOR_MULTIPLE`` times the largest error faithful torch-vs-paddle pairs show
at that step for that kind of record, per statistics metric.

- Forward records of a module that creates its error (output error at least
  evidence.CREATES times its input's, on the one scale of
  twinstep.server.detect.evidence): ``CLEAR_FORWARD`` times over the floor of
  its precision, width class and kind of module (module_kind) is an origin,
  the first such record in the order the forward ran.  After step 0 a module
  with parameters counts only when they stood within their floors after the
  step before (its error may otherwise be its weights', moved apart earlier).
- Parameters after an update (groups: 1-D parameters, matrices).  A parameter
  whose error stands ``CLEAR`` times over its floor, or ``GROWING`` times over
  it after growing at least linearly for ``GROWTH_STEPS`` steps, is a
  systematic difference; its origin is the first step of the run of steps,
  walked back, where it stood over the floor.  It replaces a forward origin
  found at a later step.

Calibration: benchmarks/calibration/*.log, merged by benchmarks/merge_calibration.py
(a unit test checks the tables below are that merge).  float32: the corpus'
three faithful ports (phi3, ernie4_5, gemma3: transformers vs paddleformers),
50 steps, statistics capture; width 64 (AdamW seeds 0, 1, 2; embeddings of
std 0.02 and of order 1; Adam; SGD seeds 0, 2) and width 1024 (AdamW seeds 0,
1; Adam; SGD).  bfloat16 and float16: benchmarks/calibrate_dtype.py (phi3,
torch eager against SDPA under autocast) at widths 64 and 1024.  Held out
(benchmarks/calibration/heldout-*.log): seed 3 at width 64 stays below 0.37 of
the parameter floors and 0.84 of the forward floors, seed 2 at width 1024 below
1.03 and 2.6; evidence needs 2 (growing linearly), 10 (parameters) or 5
(forward).  Separations where the origin is declared (width 64, seed 0,
``--bugs``): RMSNorm epsilon 1e-5 against 1e-6 on a residual stream of order 1
24x at step 0, forward of the first norm (all three models); rotary base 10001
10x at step 0; Adam epsilon 1e-6 17x (phi3) and 38x (ernie4_5) at step 0;
weight decay on norms from step 0 (phi3, ernie4_5) or 1 (gemma3, whose norm
weights start at 0), declared by linear growth at step 3 or 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from twinstep.server.compare.comparator import Row, Rows, StepComparison
from twinstep.server.compare.tolerance import ToleranceConfig
from twinstep.server.detect import evidence
from twinstep.server.detect.evidence import Error, growth_words

#: The arithmetic the floors were calibrated for: records of other dtypes (bfloat16, float16, a tf32 run's
#: float32 matmuls) round far more coarsely, and are left to their tolerances (and a reference run's bands).
CALIBRATED_DTYPES = frozenset({"float32"})
#: Metrics every capture mode has (statistics); full-tensor metrics are not used: Adam turns rounding
#: noise in near-zero gradients into full-size element updates (rel_l2 4.8e-5 after one faithful step).
METRICS = ("rms", "mean", "extrema")
#: Steps of the calibration table; between them the envelope is interpolated, after the last it grows
#: by the slope of the last interval (faithful trajectories drift apart linearly).
CALIBRATED_STEPS = (0, 1, 2, 4, 8, 16, 32, 48)
#: A model this wide or wider (JoinPlan.width: a transformer's hidden size) is judged by the "wide" tables,
#: calibrated at width 1024; a narrower one by the "narrow" tables, calibrated at width 64.
WIDE = 512
#: (width class, group, metric) -> largest faithful value at each CALIBRATED_STEPS step (made non-decreasing;
#: benchmarks/merge_calibration.py over the runs listed in the module docstring).
#: "1d": biases and norm weights (gemma3's zero-initialised norm weights dominate from step 1);
#: "nd": matrices and embeddings.
PARAM_ENVELOPE: dict[tuple[str, str, str], tuple[float, ...]] = {
    ("narrow", "1d", "extrema"): (2.0e-06, 2.3e-06, 4.4e-06, 5.0e-06, 6.7e-06, 6.7e-06, 8.6e-06, 8.6e-06),
    ("narrow", "1d", "mean"): (6.7e-07, 1.1e-06, 2.6e-06, 2.6e-06, 2.6e-06, 2.6e-06, 2.6e-06, 2.6e-06),
    ("narrow", "1d", "rms"): (6.1e-07, 1.7e-06, 3.3e-06, 3.6e-06, 3.6e-06, 3.6e-06, 3.6e-06, 3.6e-06),
    ("narrow", "nd", "extrema"): (1.1e-07, 1.7e-07, 3.1e-07, 4.9e-07, 1.0e-06, 2.0e-06, 2.1e-06, 2.1e-06),
    ("narrow", "nd", "mean"): (1.1e-07, 1.1e-07, 1.1e-07, 1.1e-07, 1.1e-07, 1.2e-07, 1.2e-07, 1.2e-07),
    ("narrow", "nd", "rms"): (9.1e-08, 1.0e-07, 1.2e-07, 1.7e-07, 2.9e-07, 5.0e-07, 7.4e-07, 7.6e-07),
    ("wide", "1d", "extrema"): (2.0e-06, 3.3e-06, 3.4e-05, 3.9e-04, 9.9e-04, 1.8e-03, 3.7e-03, 4.0e-03),
    ("wide", "1d", "mean"): (3.1e-07, 1.0e-05, 1.0e-05, 6.3e-05, 1.8e-04, 4.8e-04, 9.5e-04, 1.0e-03),
    ("wide", "1d", "rms"): (1.3e-06, 1.4e-05, 2.2e-05, 6.6e-05, 4.1e-04, 5.3e-04, 7.0e-04, 7.0e-04),
    ("wide", "nd", "extrema"): (9.7e-08, 1.5e-06, 5.1e-05, 1.7e-04, 2.8e-04, 9.9e-04, 1.5e-03, 1.6e-03),
    ("wide", "nd", "mean"): (5.4e-08, 2.9e-07, 8.9e-07, 3.4e-06, 8.3e-06, 1.2e-05, 1.5e-05, 1.7e-05),
    ("wide", "nd", "rms"): (1.1e-07, 2.3e-07, 8.3e-07, 3.3e-06, 1.1e-05, 1.7e-05, 2.0e-05, 2.1e-05),
}
#: Forward records whose module creates its error (output error on the one scale of
#: twinstep.server.detect.evidence at least evidence.CREATES times its input's): on faithful ports, the largest
#: value of each statistics metric from each calibrated step to the next, per precision and kind of module
#: (module_kind).  Per metric, because errors differ in shape: an epsilon or a scale moves every element by
#: the same relative amount (rms), a rounding difference moves a few (extrema).
#: (precision, width class, kind, metric) -> values at CALIBRATED_STEPS.  Low precision comes from
#: benchmarks/calibrate_dtype.py (torch eager against SDPA under autocast: no cross-framework low-precision
#: pair runs on a CPU), whose matrix products agree exactly at step 0: the UNIT_ROUNDOFF floor stands in for
#: the one rounding a cross-framework product adds.
FORWARD_ENVELOPE: dict[tuple[str, str, str, str], tuple[float, ...]] = {
    ("bfloat16", "narrow", "block", "extrema"): (4.4e-03, 8.6e-03, 1.3e-02, 1.3e-02, 4.7e-02, 4.7e-02, 1.1e-01, 1.1e-01),
    ("bfloat16", "narrow", "block", "mean"): (5.8e-05, 3.8e-04, 6.3e-04, 6.3e-04, 2.8e-03, 3.2e-03, 8.2e-03, 8.2e-03),
    ("bfloat16", "narrow", "block", "rms"): (4.7e-04, 4.7e-04, 4.7e-04, 9.5e-04, 3.8e-03, 3.8e-03, 1.2e-02, 1.2e-02),
    ("bfloat16", "narrow", "embedding", "extrema"): (0.0e+00, 0.0e+00, 0.0e+00, 5.8e-05, 1.3e-03, 3.7e-03, 2.4e-02, 2.4e-02),
    ("bfloat16", "narrow", "embedding", "mean"): (0.0e+00, 1.4e-09, 1.0e-04, 3.1e-04, 5.8e-04, 9.8e-04, 1.4e-03, 1.4e-03),
    ("bfloat16", "narrow", "embedding", "rms"): (0.0e+00, 1.2e-04, 1.2e-04, 4.0e-04, 1.2e-03, 1.5e-03, 2.1e-03, 2.1e-03),
    ("bfloat16", "narrow", "linear", "extrema"): (0.0e+00, 1.1e-02, 1.1e-02, 1.1e-02, 1.8e-02, 3.6e-02, 3.6e-02, 3.6e-02),
    ("bfloat16", "narrow", "linear", "mean"): (0.0e+00, 1.8e-04, 1.8e-04, 1.8e-04, 2.7e-04, 6.3e-04, 8.9e-04, 8.9e-04),
    ("bfloat16", "narrow", "linear", "rms"): (0.0e+00, 1.4e-04, 1.4e-04, 1.4e-04, 2.6e-04, 2.3e-03, 2.3e-03, 2.3e-03),
    ("bfloat16", "narrow", "norm", "extrema"): (0.0e+00, 1.2e-03, 1.8e-03, 1.8e-03, 1.8e-03, 2.9e-02, 2.9e-02, 2.9e-02),
    ("bfloat16", "narrow", "norm", "mean"): (0.0e+00, 4.8e-05, 7.1e-05, 7.1e-05, 7.1e-05, 1.6e-03, 1.6e-03, 1.6e-03),
    ("bfloat16", "narrow", "norm", "rms"): (0.0e+00, 3.7e-05, 3.7e-05, 3.7e-05, 3.7e-05, 3.7e-05, 3.7e-05, 3.7e-05),
    ("bfloat16", "wide", "block", "extrema"): (6.3e-03, 6.3e-03, 6.4e-03, 1.6e-02, 3.6e-02, 3.6e-02, 5.6e-02, 5.6e-02),
    ("bfloat16", "wide", "block", "mean"): (3.0e-05, 1.6e-04, 4.5e-04, 4.5e-04, 8.2e-04, 1.8e-03, 2.7e-03, 3.9e-03),
    ("bfloat16", "wide", "block", "rms"): (1.7e-04, 2.3e-04, 2.4e-04, 4.9e-04, 2.1e-03, 6.8e-03, 1.1e-02, 1.1e-02),
    ("bfloat16", "wide", "embedding", "extrema"): (0.0e+00, 0.0e+00, 0.0e+00, 7.2e-04, 7.2e-04, 1.9e-02, 1.9e-02, 1.9e-02),
    ("bfloat16", "wide", "embedding", "mean"): (1.1e-10, 6.1e-06, 1.7e-05, 1.2e-04, 2.1e-04, 2.1e-04, 4.3e-04, 4.3e-04),
    ("bfloat16", "wide", "embedding", "rms"): (6.8e-09, 1.7e-05, 4.4e-05, 4.7e-05, 1.3e-04, 2.5e-04, 3.1e-04, 3.1e-04),
    ("bfloat16", "wide", "linear", "extrema"): (7.2e-03, 7.2e-03, 7.2e-03, 7.2e-03, 1.2e-02, 1.8e-02, 1.8e-02, 1.8e-02),
    ("bfloat16", "wide", "linear", "mean"): (2.0e-05, 2.0e-05, 5.5e-05, 5.5e-05, 2.7e-04, 5.4e-04, 1.4e-03, 1.4e-03),
    ("bfloat16", "wide", "linear", "rms"): (5.5e-05, 5.5e-05, 5.5e-05, 5.5e-05, 2.4e-04, 1.2e-03, 1.2e-03, 1.2e-03),
    ("bfloat16", "wide", "norm", "extrema"): (2.0e-03, 2.0e-03, 6.8e-03, 3.0e-02, 3.0e-02, 3.0e-02, 3.0e-02, 3.0e-02),
    ("bfloat16", "wide", "norm", "mean"): (3.0e-05, 3.0e-05, 2.2e-04, 3.7e-04, 3.7e-04, 3.7e-04, 3.7e-04, 3.7e-04),
    ("bfloat16", "wide", "norm", "rms"): (1.5e-08, 1.2e-06, 3.4e-06, 3.9e-06, 6.3e-06, 6.3e-06, 6.3e-06, 6.3e-06),
    ("float16", "narrow", "block", "extrema"): (2.8e-04, 7.0e-03, 7.0e-03, 7.0e-03, 2.8e-02, 5.0e-02, 5.0e-02, 5.0e-02),
    ("float16", "narrow", "block", "mean"): (1.2e-05, 1.2e-04, 5.1e-04, 5.7e-04, 9.9e-04, 2.1e-03, 2.3e-03, 2.3e-03),
    ("float16", "narrow", "block", "rms"): (2.3e-05, 5.3e-04, 5.3e-04, 5.3e-04, 6.6e-04, 5.3e-03, 7.6e-03, 7.6e-03),
    ("float16", "narrow", "embedding", "extrema"): (0.0e+00, 0.0e+00, 0.0e+00, 8.0e-05, 2.3e-04, 1.5e-03, 5.4e-03, 5.5e-03),
    ("float16", "narrow", "embedding", "mean"): (0.0e+00, 2.0e-08, 6.5e-05, 1.8e-04, 1.8e-04, 1.0e-03, 1.3e-03, 1.3e-03),
    ("float16", "narrow", "embedding", "rms"): (0.0e+00, 1.3e-04, 1.3e-04, 2.0e-04, 2.4e-04, 6.1e-04, 1.1e-03, 1.1e-03),
    ("float16", "narrow", "linear", "extrema"): (0.0e+00, 7.0e-03, 7.0e-03, 7.0e-03, 2.8e-02, 2.8e-02, 7.4e-02, 7.4e-02),
    ("float16", "narrow", "linear", "mean"): (0.0e+00, 2.1e-04, 2.1e-04, 2.1e-04, 6.0e-04, 9.1e-04, 9.1e-04, 9.1e-04),
    ("float16", "narrow", "linear", "rms"): (0.0e+00, 2.8e-04, 2.8e-04, 2.8e-04, 6.9e-04, 6.9e-04, 8.3e-04, 8.3e-04),
    ("float16", "narrow", "norm", "extrema"): (5.4e-04, 5.4e-04, 5.4e-04, 5.4e-03, 7.8e-03, 2.9e-02, 2.9e-02, 2.9e-02),
    ("float16", "narrow", "norm", "mean"): (1.9e-05, 1.9e-05, 1.9e-05, 1.7e-04, 2.5e-04, 1.1e-03, 1.1e-03, 1.1e-03),
    ("float16", "narrow", "norm", "rms"): (1.5e-08, 1.5e-08, 2.4e-07, 4.9e-06, 7.3e-06, 1.2e-05, 1.5e-05, 1.5e-05),
    ("float16", "wide", "block", "extrema"): (4.0e-04, 2.1e-03, 3.2e-03, 4.6e-03, 8.4e-03, 2.1e-02, 3.2e-02, 3.2e-02),
    ("float16", "wide", "block", "mean"): (7.1e-06, 7.3e-05, 1.6e-04, 1.6e-04, 1.6e-04, 8.1e-04, 1.1e-03, 1.1e-03),
    ("float16", "wide", "block", "rms"): (2.7e-05, 8.2e-05, 8.9e-05, 1.8e-04, 2.9e-04, 1.5e-03, 3.7e-03, 3.7e-03),
    ("float16", "wide", "embedding", "extrema"): (0.0e+00, 0.0e+00, 0.0e+00, 1.5e-04, 7.1e-04, 1.4e-02, 1.4e-02, 1.4e-02),
    ("float16", "wide", "embedding", "mean"): (0.0e+00, 3.0e-06, 9.4e-06, 2.9e-05, 1.1e-04, 1.2e-04, 4.5e-04, 4.5e-04),
    ("float16", "wide", "embedding", "rms"): (0.0e+00, 5.4e-06, 1.4e-05, 1.4e-05, 1.4e-04, 1.5e-04, 2.8e-04, 2.8e-04),
    ("float16", "wide", "linear", "extrema"): (0.0e+00, 9.6e-04, 9.6e-04, 4.1e-03, 4.1e-03, 6.5e-03, 8.7e-03, 8.7e-03),
    ("float16", "wide", "linear", "mean"): (0.0e+00, 1.9e-05, 1.9e-05, 8.7e-05, 8.7e-05, 1.1e-04, 1.2e-04, 1.2e-04),
    ("float16", "wide", "linear", "rms"): (0.0e+00, 6.4e-06, 6.4e-06, 1.4e-04, 1.4e-04, 1.4e-04, 2.1e-04, 2.1e-04),
    ("float16", "wide", "norm", "extrema"): (4.0e-04, 4.0e-04, 4.0e-04, 4.0e-04, 1.3e-03, 4.4e-03, 1.9e-02, 1.9e-02),
    ("float16", "wide", "norm", "mean"): (7.1e-06, 7.1e-06, 9.1e-06, 9.1e-06, 1.1e-04, 1.1e-04, 6.1e-04, 6.1e-04),
    ("float16", "wide", "norm", "rms"): (1.4e-08, 1.4e-08, 2.2e-06, 2.2e-06, 2.2e-06, 2.7e-06, 8.8e-06, 8.8e-06),
    ("float32", "narrow", "block", "extrema"): (1.0e-06, 2.8e-06, 3.0e-06, 5.3e-06, 5.3e-06, 1.1e-05, 1.3e-05, 4.8e-05),
    ("float32", "narrow", "block", "mean"): (2.8e-08, 1.9e-07, 1.9e-07, 2.6e-07, 3.1e-07, 4.0e-07, 8.4e-07, 8.4e-07),
    ("float32", "narrow", "block", "rms"): (9.3e-08, 9.3e-08, 3.6e-07, 3.6e-07, 7.5e-07, 1.8e-06, 2.6e-06, 3.1e-06),
    ("float32", "narrow", "embedding", "extrema"): (0.0e+00, 1.1e-07, 2.0e-07, 6.6e-07, 1.1e-06, 2.8e-06, 3.7e-06, 3.7e-06),
    ("float32", "narrow", "embedding", "mean"): (0.0e+00, 4.2e-09, 1.1e-08, 2.2e-08, 1.2e-07, 1.2e-07, 2.0e-07, 2.6e-07),
    ("float32", "narrow", "embedding", "rms"): (0.0e+00, 3.0e-08, 8.7e-08, 1.2e-07, 2.3e-07, 4.6e-07, 7.8e-07, 7.8e-07),
    ("float32", "narrow", "linear", "extrema"): (6.4e-07, 3.2e-06, 3.2e-06, 3.2e-06, 3.4e-06, 8.2e-06, 1.3e-05, 4.8e-05),
    ("float32", "narrow", "linear", "mean"): (3.7e-09, 7.2e-08, 9.8e-08, 9.8e-08, 1.1e-07, 1.3e-07, 1.4e-07, 4.4e-07),
    ("float32", "narrow", "linear", "rms"): (1.5e-08, 8.1e-08, 8.1e-08, 8.1e-08, 3.0e-07, 4.3e-07, 6.2e-07, 3.1e-06),
    ("float32", "narrow", "norm", "extrema"): (1.6e-07, 6.9e-07, 6.9e-07, 1.2e-06, 1.8e-06, 9.2e-06, 9.2e-06, 9.2e-06),
    ("float32", "narrow", "norm", "mean"): (6.5e-09, 7.5e-09, 2.2e-08, 2.4e-08, 6.2e-08, 6.2e-08, 1.8e-07, 1.8e-07),
    ("float32", "narrow", "norm", "rms"): (4.5e-08, 6.0e-08, 6.0e-08, 6.0e-08, 6.0e-08, 6.1e-08, 6.1e-08, 6.1e-08),
    ("float32", "narrow", "rotary", "extrema"): (0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00),
    ("float32", "narrow", "rotary", "mean"): (0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00, 6.8e-08, 6.8e-08, 6.8e-08, 6.8e-08),
    ("float32", "narrow", "rotary", "rms"): (7.7e-08, 7.7e-08, 7.7e-08, 7.7e-08, 7.7e-08, 7.7e-08, 7.7e-08, 7.7e-08),
    ("float32", "wide", "block", "extrema"): (7.6e-07, 5.8e-05, 8.3e-04, 1.9e-03, 5.0e-03, 7.5e-03, 1.4e-02, 1.4e-02),
    ("float32", "wide", "block", "mean"): (1.3e-08, 2.0e-06, 6.6e-06, 7.6e-05, 8.1e-05, 5.4e-04, 5.4e-04, 5.4e-04),
    ("float32", "wide", "block", "rms"): (1.3e-07, 2.7e-06, 1.8e-05, 2.9e-05, 1.5e-04, 6.7e-04, 3.5e-03, 3.5e-03),
    ("float32", "wide", "embedding", "extrema"): (0.0e+00, 8.5e-08, 2.4e-07, 1.6e-04, 2.7e-04, 1.5e-03, 1.5e-03, 1.5e-03),
    ("float32", "wide", "embedding", "mean"): (2.5e-09, 5.5e-09, 1.9e-06, 1.7e-05, 3.8e-05, 5.7e-05, 7.2e-05, 7.2e-05),
    ("float32", "wide", "embedding", "rms"): (0.0e+00, 1.5e-08, 2.4e-06, 1.7e-05, 3.3e-05, 5.0e-05, 8.0e-05, 8.0e-05),
    ("float32", "wide", "linear", "extrema"): (0.0e+00, 5.8e-05, 3.6e-04, 2.3e-03, 5.0e-03, 5.8e-03, 7.5e-03, 7.5e-03),
    ("float32", "wide", "linear", "mean"): (0.0e+00, 1.5e-06, 1.5e-06, 2.5e-05, 9.0e-05, 9.7e-05, 3.7e-04, 3.7e-04),
    ("float32", "wide", "linear", "rms"): (0.0e+00, 2.7e-06, 2.7e-06, 2.7e-05, 1.0e-04, 4.1e-04, 4.9e-04, 4.9e-04),
    ("float32", "wide", "norm", "extrema"): (4.4e-07, 1.9e-05, 8.3e-04, 1.8e-03, 4.7e-03, 1.3e-02, 1.3e-02, 1.3e-02),
    ("float32", "wide", "norm", "mean"): (2.6e-09, 1.1e-07, 6.3e-06, 7.6e-05, 8.8e-05, 1.4e-04, 1.4e-04, 1.4e-04),
    ("float32", "wide", "norm", "rms"): (1.0e-07, 1.1e-07, 1.1e-07, 6.1e-07, 6.1e-07, 1.5e-06, 5.6e-06, 5.6e-06),
    ("float32", "wide", "rotary", "extrema"): (0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00),
    ("float32", "wide", "rotary", "mean"): (6.5e-08, 6.5e-08, 6.5e-08, 6.5e-08, 6.5e-08, 6.5e-08, 6.5e-08, 6.5e-08),
    ("float32", "wide", "rotary", "rms"): (3.6e-08, 3.6e-08, 3.6e-08, 3.6e-08, 3.6e-08, 3.6e-08, 3.6e-08, 3.6e-08),
}
#: Each precision's unit roundoff: no forward floor is below FLOOR_MULTIPLE times it (a module the calibration
#: saw create exactly 0 can still round once).
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
#: Error / floor that makes a created forward error an origin on its own.
CLEAR_FORWARD = 5.0
#: Kinds of module, by words of their type name: each creates errors of its own size (a matrix product
#: rounds over its reduction, a norm over one division, a rotary table over a sine).
_KIND_WORDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("norm", ("norm",)),
    ("rotary", ("rotary", "rope")),
    ("embedding", ("embedding",)),
    ("linear", ("linear", "conv", "dense", "proj")),
    ("activation", ("gelu", "silu", "relu", "activation", "tanh", "sigmoid", "swish", "softmax", "glu")),
)
#: Precisions with floors of their own; float64 records use float32's, tf32 ones float32's times TF32_FACTOR
#: (a tf32 matmul rounds its inputs to 10 mantissa bits).
PRECISIONS = ("float32", "bfloat16", "float16")
TF32_FACTOR = 8.0
#: Floors are this multiple of the faithful envelope.
FLOOR_MULTIPLE = 3.0
#: Error / floor from which a record counts as part of the error's run back to its origin.
ONSET = 1.0
#: Error / floor that is evidence alone.
CLEAR = 10.0
#: Error / floor that is evidence after GROWTH_STEPS steps of (at least) linear growth from the onset.
GROWING = 2.0
GROWTH_STEPS = 4
#: An input whose worst statistics metric is at most this matches exactly (the same tensor).
EXACT_INPUT = 1e-9
#: Steps of parameter history kept per candidate rank; an origin is traced back at most this far.
MAX_HISTORY = 64
#: Parameters listed by name in an origin; the rest are counted.
MAX_INVOLVED = 16


@dataclass
class Origin:
    """Where a systematic difference began, and the evidence for it."""

    comparison: StepComparison
    """The origin step (for a parameter origin: its parameter rows, rebuilt from the history)."""
    row: Row
    """The representative record (its value: the metric at the origin step; tolerance: the floor there)."""
    evidence_step: int
    ratio: float
    """Error over floor at the evidence step."""
    rule: str
    """"clear" or "growth"."""
    involved: list[str] = field(default_factory=list)
    involved_total: int = 0
    one_dimensional: bool = False
    shrink: float | None = None
    """Candidate/baseline RMS per step shared by every involved parameter, when it shrinks (decay)."""
    created: "tuple[Error, Error, str, str] | None" = None
    """For a forward origin: (output error, input error, module kind, precision)."""

    @property
    def evidence(self) -> str:
        row = self.row
        if row.phase == "forward" and self.created is not None:
            output, given, kind, precision = self.created
            received = "matches exactly" if given.value == 0 else f"is off by {given}"
            return (f"{row.name}'s input {received} and its output is off by {output}, growth "
                    f"{growth_words(output.value, given.value)}; its {row.metric} error {row.value:.3g} is "
                    f"{self.ratio:.0f}x the faithful floor of {precision} {kind} modules at step "
                    f"{self.comparison.step} ({row.tolerance:.3g})")
        grown = (f"grew at least linearly from step {self.comparison.step} to step {self.evidence_step}"
                 if self.rule == "growth" else f"stood {self.ratio:.0f}x over it at step {self.evidence_step}")
        return (f"{self.involved_total} parameter(s) left a faithful pair's floor after the update of step "
                f"{self.comparison.step} ({row.name}: {row.metric} {row.value:.3g} > {row.tolerance:.3g}) and "
                f"{grown}; rounding noise does neither")


def module_kind(type_name: str) -> str:
    """"norm", "rotary", "embedding", "linear", "activation" or "block" (a composition of modules)."""
    lowered = type_name.lower()
    for kind, words in _KIND_WORDS:
        if any(w in lowered for w in words):
            return kind
    return "block"


def precision_of(dtype: str) -> str | None:
    """The precision whose floors apply to a record of ``dtype``; None for a dtype without floors."""
    if dtype in PRECISIONS or dtype in ("float64", "tf32"):
        return dtype
    return None


def forward_floor(precision: str, kind: str, metric: str, step: int, width: str = "narrow") -> float | None:
    """The faithful floor of the ``metric`` error a ``kind`` module creates at ``step`` in a model of ``width``
    (width_class); None where not calibrated."""
    factor = TF32_FACTOR if precision == "tf32" else 1.0
    if precision in ("float64", "tf32"):
        precision = "float32"
    table = (FORWARD_ENVELOPE.get((precision, width, kind, metric))
             or FORWARD_ENVELOPE.get((precision, width, "block", metric)))
    if table is None:
        return None
    return factor * max(_interpolate(table, step), FLOOR_MULTIPLE * UNIT_ROUNDOFF[precision])


def _interpolate(table: tuple[float, ...], step: int) -> float:
    """FLOOR_MULTIPLE times a calibration table at ``step``: interpolated between calibrated steps, after the
    last growing by the slope of the last interval (faithful trajectories drift apart linearly)."""
    if step <= CALIBRATED_STEPS[-1]:
        return FLOOR_MULTIPLE * float(np.interp(step, CALIBRATED_STEPS, table))
    slope = (table[-1] - table[-2]) / (CALIBRATED_STEPS[-1] - CALIBRATED_STEPS[-2])
    return FLOOR_MULTIPLE * (table[-1] + max(slope, 0.0) * (step - CALIBRATED_STEPS[-1]))


def created_errors(comparison: StepComparison, static: list[tuple] | None = None
                   ) -> list[tuple[int, str, str, Error, Error]]:
    """Forward records whose module creates its error (output at least evidence.CREATES times its captured
    input's, on the one scale), in record order: (row index, module kind, precision, output, input)."""
    static = _static_rows(comparison) if static is None else static
    worst, which = evidence.errors(comparison)
    given: dict[tuple[str, int], tuple[float, int]] = {}
    for k, row in enumerate(static):
        if row[0] == "input":
            key = (row[1], row[4])
            if key not in given or worst[k] > given[key][0]:
                given[key] = (float(worst[k]), int(which[k]))
    out = []
    for k, row in enumerate(static):
        if row[0] != "forward" or not row[1]:
            continue
        received = given.get((row[1], row[4]))
        precision = precision_of(row[7])
        value = float(worst[k])
        if received is None or precision is None or not np.isfinite(value):
            continue
        if not evidence.creates(value, received[0]):
            continue
        out.append((k, module_kind(row[3]), precision,
                    Error(value, evidence.EVIDENCE_METRICS[int(which[k])]),
                    Error(received[0], evidence.EVIDENCE_METRICS[received[1]])))
    return out


def param_floor(group: str, metric: str, step: int, width: str = "narrow") -> float:
    """The faithful floor of one parameter group and metric at ``step``, for a model of ``width``
    (width_class)."""
    return _interpolate(PARAM_ENVELOPE[(width, group, metric)], step)


def width_class(comparison: StepComparison) -> str:
    """"wide" for a model whose width (JoinPlan.width) is WIDE or more, else "narrow": faithful noise grows with
    width (a faithful AdamW pair of width 1024 drifts apart 10 to 1000 times faster than one of width 64)."""
    rows = comparison.rows
    width = rows.plan.width if isinstance(rows, Rows) else 0
    return "wide" if width >= WIDE else "narrow"


@dataclass
class _Step:
    """One compared step's parameter evidence, columns in the rank's parameter order."""

    ratio: np.ndarray  # worst error/floor over METRICS
    metric: np.ndarray  # index into METRICS of that worst
    value: np.ndarray  # [len(METRICS), P]
    scale: np.ndarray


@dataclass
class _RankHistory:
    keys: dict[tuple[str, str, int, int], int] = field(default_factory=dict)
    rows: list[tuple] = field(default_factory=list)  # static row of each column
    steps: dict[int, _Step] = field(default_factory=dict)
    width: str = "narrow"


class OriginTracer:
    """Per candidate run and rank: parameter errors over their floors, step by step; the first origin found."""

    def __init__(self, tolerances: ToleranceConfig | None = None) -> None:
        self._history: dict[tuple[str, int], _RankHistory] = {}
        self._tolerances = tolerances or ToleranceConfig()
        """Records whose tolerance the config sets are left to it (ToleranceConfig.set_by_user)."""
        self.found: dict[str, Origin] = {}

    def observe(self, comparison: StepComparison) -> Origin | None:
        """Fold one compared step in; the origin its evidence points to, or None.

        Once per run, except that a forward origin gives way to a parameter origin found later whose update came
        before it: parameters within their floors after the step before can still differ systematically, and the
        linear growth that proves it takes a few steps to show.
        """
        run = comparison.candidate_run
        if not comparison.values or not len(comparison.rows):
            return None
        found = self.found.get(run)
        if found is not None and found.row.phase != "forward":
            return None
        static = _static_rows(comparison)
        origin = self._forward_origin(comparison, static) if found is None else None
        param = self._param_origin(comparison, static)
        if param is not None and found is not None and not param.comparison.step < found.comparison.step:
            param = None
        if param is not None and (origin is None or param.comparison.step < origin.comparison.step):
            origin = param
        if origin is not None:
            self.found[run] = origin
            if origin.row.phase != "forward":
                self._history = {k: v for k, v in self._history.items() if k[0] != run}
        return origin

    # -- forward: a module that creates an error far above what faithful ports create ----------------

    def _forward_origin(self, comparison: StepComparison, static: list[tuple]) -> Origin | None:
        width = width_class(comparison)
        for k, kind, precision, output, given in created_errors(comparison, static):
            best: tuple[float, str, float] | None = None  # (ratio, metric, floor)
            for metric in METRICS:
                floor = forward_floor(precision, kind, metric, comparison.step, width)
                if floor is None or floor <= 0:
                    continue
                ratio = float(comparison.values[metric][k]) / floor
                if best is None or ratio > best[0]:
                    best = (ratio, metric, floor)
            if best is None or not best[0] >= CLEAR_FORWARD:
                continue
            name = static[k][1]
            if self._tolerances.set_by_user("forward", name):
                continue
            if comparison.step > 0 and not self._weights_matched(comparison, static, name):
                continue
            ratio, metric, floor = best
            rows = list(comparison.rows)
            rows[k] = replace(rows[k], metric=metric, value=float(comparison.values[metric][k]), tolerance=floor,
                              divergent=True)
            step = StepComparison(comparison.step, comparison.rank, comparison.candidate_run, rows,
                                  values=comparison.values, tolerance=comparison.tolerance, keys=comparison.keys)
            step.evidence = comparison.evidence
            return Origin(step, rows[k], comparison.step, ratio, "clear", [name], 1,
                          created=(output, given, kind, precision))
        return None

    def _weights_matched(self, comparison: StepComparison, static: list[tuple], module: str) -> bool:
        """Whether ``module``'s parameters (its own and its children's) stood within their floors after the step
        before: after step 0 a module with parameters creates an error of its own only then.  Otherwise the
        error may be its weights' (moved apart by an earlier difference), and a step not compared (a gap) or
        parameters not traced (another dtype, a tolerance the user set) leave that open: no claim."""
        prefix = module + "." if module else ""
        owned = {row[1] for row in static if row[0] == "param" and row[1].startswith(prefix)}
        if not owned:
            return True  # parameter-free: its error is its computation's
        history = self._history.get((comparison.candidate_run, comparison.rank))
        before = history.steps.get(comparison.step - 1) if history is not None else None
        if before is None:
            return False
        columns = [column for key, column in history.keys.items() if key[1] in owned]
        if len(columns) < len(owned) or any(column >= len(before.ratio) for column in columns):
            return False
        return bool(np.all(before.ratio[columns] < ONSET))

    # -- parameters: an update's systematic difference ---------------------------------------------

    def _param_origin(self, comparison: StepComparison, static: list[tuple]) -> Origin | None:
        history = self._history.setdefault((comparison.candidate_run, comparison.rank), _RankHistory())
        index = [k for k, row in enumerate(static) if row[0] == "param" and row[7] in CALIBRATED_DTYPES
                 and not self._tolerances.set_by_user("param", row[1])]
        if not index:
            return None
        columns = np.array([history.keys.setdefault(_key(static[k]), len(history.keys)) for k in index])
        while len(history.rows) < len(history.keys):
            history.rows.append(None)
        for k, column in zip(index, columns.tolist()):
            history.rows[column] = static[k]
        width = len(history.keys)
        value = np.full((len(METRICS), width), np.nan)
        value[:, columns] = np.stack([np.asarray(comparison.values[m])[index] for m in METRICS])
        groups = np.array(["1d" if (r is not None and r[6] <= 1) else "nd" for r in history.rows])
        wide = history.width = width_class(comparison)
        floors = np.stack([np.where(groups == "1d", param_floor("1d", m, comparison.step, wide),
                                    param_floor("nd", m, comparison.step, wide)) for m in METRICS])
        with np.errstate(invalid="ignore"):
            ratios = np.nan_to_num(value / floors, nan=0.0, posinf=0.0)
        scale = np.ones(width)
        scale[columns] = np.asarray(_scales(comparison))[index]
        now = _Step(ratios.max(axis=0), ratios.argmax(axis=0), value, scale)
        history.steps[comparison.step] = now
        for old in [s for s in history.steps if s <= comparison.step - MAX_HISTORY]:
            del history.steps[old]
        return self._trace(comparison, history)

    def _trace(self, comparison: StepComparison, history: _RankHistory) -> Origin | None:
        step = comparison.step
        now = history.steps[step]
        suspects = np.flatnonzero(now.ratio >= GROWING)
        involved: list[tuple[int, int, str]] = []  # (onset, column, rule)
        for column in suspects.tolist():
            onset = _onset(history, step, column)
            if onset is None:
                continue  # the error began before what was compared: no claim across a gap
            if now.ratio[column] >= CLEAR:
                involved.append((onset, column, "clear"))
            elif step - onset + 1 >= GROWTH_STEPS and _grows(history, onset, step, column):
                involved.append((onset, column, "growth"))
        if not involved:
            return None
        origin_step = min(onset for onset, _, _ in involved)
        at = history.steps[origin_step]
        first_column = min((c for onset, c, _ in involved if onset == origin_step), key=lambda c: c)
        rule = "clear" if any(r == "clear" for _, _, r in involved) else "growth"
        columns = sorted(c for _, c, _ in involved)
        rows = []
        representative = None
        for column, static in enumerate(history.rows):
            if static is None:
                continue
            metric = int(at.metric[column])
            group = "1d" if static[6] <= 1 else "nd"
            row = Row(static[0], static[1], static[2], static[3], static[4], static[5], METRICS[metric],
                      float(at.value[metric, column]), param_floor(group, METRICS[metric], origin_step,
                                                                   history.width),
                      column in columns, static[6], float(at.scale[column]), -1.0, static[7])
            rows.append(row)
            if column == first_column:
                representative = row
        assert representative is not None
        origin_comparison = StepComparison(origin_step, comparison.rank, comparison.candidate_run, rows)
        names = [history.rows[c][1] for c in columns]
        one_d = all(history.rows[c][6] <= 1 for c in columns)
        return Origin(origin_comparison, representative, step, float(now.ratio[first_column]), rule,
                      names[:MAX_INVOLVED], len(names), one_d, _common_shrink(history, columns, origin_step, step))


def _onset(history: _RankHistory, step: int, column: int) -> int | None:
    """The first step of the unbroken run of steps up to ``step`` where ``column`` stood over ONSET;
    None when that run reaches back past the steps compared (a gap, or the history's start after step 0)."""
    onset = step
    while True:
        before = history.steps.get(onset - 1)
        if before is None:
            return onset if onset == 0 else None
        if before.ratio[column] < ONSET:
            return onset
        onset -= 1


def _grows(history: _RankHistory, onset: int, step: int, column: int) -> bool:
    """At least linear growth: never falling by more than 10%, and ending at >= half of (steps x first)."""
    metric = int(history.steps[step].metric[column])
    series = [float(history.steps[s].value[metric, column]) for s in range(onset, step + 1)]
    if not all(np.isfinite(series)) or series[0] <= 0:
        return False
    steady = all(b >= 0.9 * a for a, b in zip(series, series[1:]))
    return steady and series[-1] >= 0.5 * len(series) * series[0]


def _common_shrink(history: _RankHistory, columns: list[int], origin_step: int, step: int) -> float | None:
    """The per-step factor every involved parameter's RMS shrank by, when they share one (weight decay)."""
    if step <= origin_step:
        factors = history.steps[step].scale[columns]
    else:
        steps = step - origin_step + 1
        factors = history.steps[step].scale[columns] ** (1.0 / steps)
    low, high = float(factors.min()), float(factors.max())
    if not (0 < low <= high < 1.0) or (1.0 - low) > 1.5 * (1.0 - high):
        return None
    return float(np.exp(np.mean(np.log(factors))))


def _key(static: tuple) -> tuple[str, str, int, int]:
    return (static[0], static[1], static[4], static[5])


def _static_rows(comparison: StepComparison) -> list[tuple]:
    rows = comparison.rows
    if isinstance(rows, Rows):
        return rows.plan.static_rows
    return [(r.phase, r.name, r.candidate_name, r.type, r.call_index, r.slot, r.ndim, r.dtype) for r in rows]


def _scales(comparison: StepComparison) -> np.ndarray:
    rows = comparison.rows
    if isinstance(rows, Rows):
        return rows.scale
    return np.array([r.scale for r in rows])
