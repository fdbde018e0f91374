"""Trace a divergence back to the step that caused it, with no reference run.

Flat tolerances miss porting bugs whose first effect is small (weight decay on
norm weights, another Adam epsilon, a rotary base off by one): they cross a
tolerance steps later, in whichever module first amplifies them.  This module
holds a statistic that tells such a systematic difference from rounding noise:
each record's error over a *faithful floor*, the largest error a faithful
torch-vs-paddle pair shows at that step for that kind of record, times
``FLOOR_MULTIPLE``.

- Parameters after an update (statistics metrics rms, mean, extrema; groups:
  1-D parameters, matrices).  A parameter whose error stands ``CLEAR`` times
  over its floor, or ``GROWING`` times over it after growing at least linearly
  for ``GROWTH_STEPS`` steps, is a systematic difference; its origin is the
  first step of the run of steps, walked back, where it stood over the floor.
- Forward outputs of parameter-free modules whose every input matches exactly
  (a rotary embedding fed exact positions): their own added error, over the
  float32 rounding floor.

Calibration (``python benchmarks/origin_calibration.py --seed 0`` and ``--seed 1``):
the corpus' three faithful ports (phi3, ernie4_5, gemma3: transformers vs
paddleformers, float32, AdamW), 50 steps each, statistics capture.  The
envelopes below are the largest values seen from each calibrated step to the
next, over the three models and both seeds.  Faithful errors stay below 0.34 of
every floor (seeds 0, 1); held out, seed 2 reaches 1.0 once (ernie4_5, step 1,
the mean of a matrix: the noisiest signal) and 0.4 otherwise; evidence needs 2
(growing linearly) or 10.  Separations, error / floor where the origin is declared:
weight decay on norms 20x at step 0 (phi3, ernie4_5; every norm weight shrinks
by exactly lr*wd = 1e-5 per step); gemma3's norm weights start at 0, so decay
first shows at step 1, 1.6x the floor, growing linearly: declared at step 4
(3x), traced back to step 1; Adam epsilon 1e-6: 17x (phi3) and 22x (ernie4_5)
at step 0; rotary base 10001: rotary_emb's cos/sin 16x the float32 rounding
floor at step 0 (faithful: 3.7e-8).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from twinstep.server.compare.comparator import Row, Rows, StepComparison
from twinstep.server.compare.tolerance import ToleranceConfig

#: The arithmetic the floors were calibrated for: records of other dtypes (bfloat16, float16, a tf32 run's
#: float32 matmuls) round far more coarsely, and are left to their tolerances (and a reference run's bands).
CALIBRATED_DTYPES = frozenset({"float32"})
#: Metrics every capture mode has (statistics); full-tensor metrics are not used: Adam turns rounding
#: noise in near-zero gradients into full-size element updates (rel_l2 4.8e-5 after one faithful step).
METRICS = ("rms", "mean", "extrema")
#: Steps of the calibration table; between them the envelope is interpolated, after the last it grows
#: by the slope of the last interval (faithful trajectories drift apart linearly).
CALIBRATED_STEPS = (0, 1, 2, 4, 8, 16, 32, 48)
#: (group, metric) -> largest faithful value at each CALIBRATED_STEPS step (made non-decreasing).
#: "1d": biases and norm weights (gemma3's zero-initialised norm weights dominate from step 1);
#: "nd": matrices and embeddings.
PARAM_ENVELOPE: dict[tuple[str, str], tuple[float, ...]] = {
    ("1d", "rms"): (1.7e-7, 1.5e-6, 3.2e-6, 3.5e-6, 4.2e-6, 4.3e-6, 4.4e-6, 4.9e-6),
    ("1d", "mean"): (1.7e-7, 1.1e-6, 2.5e-6, 2.6e-6, 2.6e-6, 3.3e-6, 4.8e-6, 4.8e-6),
    ("1d", "extrema"): (3.5e-7, 1.9e-6, 4.3e-6, 4.4e-6, 6.0e-6, 8.8e-6, 1.2e-5, 1.3e-5),
    ("nd", "rms"): (4.6e-8, 5.2e-8, 8.9e-8, 1.3e-7, 2.4e-7, 4.6e-7, 6.8e-7, 7.1e-7),
    ("nd", "mean"): (2.9e-8, 2.9e-8, 3.4e-8, 3.5e-8, 7.2e-8, 1.1e-7, 1.8e-7, 2.0e-7),
    ("nd", "extrema"): (1.1e-7, 1.5e-7, 2.3e-7, 3.9e-7, 8.1e-7, 1.4e-6, 2.1e-6, 2.1e-6),
}
#: A parameter-free module's own error on exactly equal inputs: at most 3.7e-8 faithful (rotary
#: tables, one float32 rounding apart); the floor is float32's machine epsilon.
FORWARD_OWN_FLOOR = 1.2e-7
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

    @property
    def evidence(self) -> str:
        row = self.row
        if row.phase == "forward":
            return (f"{row.name} has no parameters and its inputs match exactly, yet its own {row.metric} error is "
                    f"{row.value:.3g}, {self.ratio:.0f}x the float32 rounding floor ({row.tolerance:.3g})")
        grown = (f"grew at least linearly from step {self.comparison.step} to step {self.evidence_step}"
                 if self.rule == "growth" else f"stood {self.ratio:.0f}x over it at step {self.evidence_step}")
        return (f"{self.involved_total} parameter(s) left a faithful pair's floor after the update of step "
                f"{self.comparison.step} ({row.name}: {row.metric} {row.value:.3g} > {row.tolerance:.3g}) and "
                f"{grown}; rounding noise does neither")


def param_floor(group: str, metric: str, step: int) -> float:
    """The faithful floor of one parameter group and metric at ``step``."""
    table = PARAM_ENVELOPE[(group, metric)]
    if step <= CALIBRATED_STEPS[-1]:
        return FLOOR_MULTIPLE * float(np.interp(step, CALIBRATED_STEPS, table))
    slope = (table[-1] - table[-2]) / (CALIBRATED_STEPS[-1] - CALIBRATED_STEPS[-2])
    return FLOOR_MULTIPLE * (table[-1] + max(slope, 0.0) * (step - CALIBRATED_STEPS[-1]))


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


class OriginTracer:
    """Per candidate run and rank: parameter errors over their floors, step by step; the first origin found."""

    def __init__(self, tolerances: ToleranceConfig | None = None) -> None:
        self._history: dict[tuple[str, int], _RankHistory] = {}
        self._tolerances = tolerances or ToleranceConfig()
        """Records whose tolerance the config sets are left to it (ToleranceConfig.set_by_user)."""
        self.found: dict[str, Origin] = {}

    def observe(self, comparison: StepComparison) -> Origin | None:
        """Fold one compared step in; the origin its evidence points to (once per run), or None."""
        run = comparison.candidate_run
        if run in self.found or not comparison.values or not len(comparison.rows):
            return None
        static = _static_rows(comparison)
        origin = self._forward_origin(comparison, static)
        param = self._param_origin(comparison, static)
        if param is not None and (origin is None or param.comparison.step < origin.comparison.step):
            origin = param
        if origin is not None:
            self.found[run] = origin
            self._history = {k: v for k, v in self._history.items() if k[0] != run}
        return origin

    # -- forward: a parameter-free module's own error on exact inputs -----------------------------

    def _forward_origin(self, comparison: StepComparison, static: list[tuple]) -> Origin | None:
        worst = np.max(np.stack([comparison.values[m] for m in METRICS]), axis=0)
        inputs: dict[tuple[str, int], float] = {}
        has_params: set[str] = set()
        for k, row in enumerate(static):
            if row[0] == "input":
                inputs[(row[1], row[4])] = max(inputs.get((row[1], row[4]), 0.0), float(worst[k]))
            elif row[0] == "param":
                has_params.add(row[1])
        for k, row in enumerate(static):
            phase, name, call = row[0], row[1], row[4]
            if phase != "forward" or not name or row[7] not in CALIBRATED_DTYPES or worst[k] < CLEAR * FORWARD_OWN_FLOOR:
                continue
            if self._tolerances.set_by_user(phase, name):
                continue
            given = inputs.get((name, call))
            if given is None or given > EXACT_INPUT or not np.isfinite(worst[k]):
                continue
            prefix = name + "."
            if any(p.startswith(prefix) for p in has_params):
                continue
            rows = list(comparison.rows)
            metric = METRICS[int(np.argmax([comparison.values[m][k] for m in METRICS]))]
            rows[k] = replace(rows[k], metric=metric, value=float(worst[k]), tolerance=FORWARD_OWN_FLOOR, divergent=True)
            step = StepComparison(comparison.step, comparison.rank, comparison.candidate_run, rows,
                                  values=comparison.values, tolerance=comparison.tolerance, keys=comparison.keys)
            return Origin(step, rows[k], comparison.step, float(worst[k]) / FORWARD_OWN_FLOOR, "clear",
                          [name], 1)
        return None

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
        floors = np.stack([np.where(groups == "1d", param_floor("1d", m, comparison.step),
                                    param_floor("nd", m, comparison.step)) for m in METRICS])
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
                      float(at.value[metric, column]), param_floor(group, METRICS[metric], origin_step),
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
