"""Long runs: loss and global gradient norm against porting guides' acceptance criteria.

Single-step alarms suit the first steps; over thousands of steps two correct
trainings drift apart, so porting guides judge long runs by windowed averages
(MindSpore's migration standard): first loss within 0.005 absolute or 0.5%
relative; mean loss error below 0.01 absolute or 1% relative; mean relative
error of the global gradient norm at most 10%.  With a reference rerun the
candidate is also judged against the baseline's own run-to-run error, a band
never narrower than float rounding of the loss (a deterministic rerun's error
is exactly 0, and no port of another framework matches to the last bit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from twinstep.server.ingest.step import StepData
from twinstep.v1 import twinstep_pb2 as pb

FIRST_LOSS_ABS, FIRST_LOSS_REL = 0.005, 0.005
MEAN_LOSS_ABS, MEAN_LOSS_REL = 0.01, 0.01
GRAD_NORM_MEAN_REL = 0.10
#: The sign of the loss error is worth a sentence only when the error is at least this share of the mean loss
#: error's limit (by the looser of its absolute and relative readings, as the criterion judges it), over at
#: least BIAS_MIN_STEPS steps: a faithful float32 port's 1e-7 (1e-5 of the limit, or exactly 0) has a sign that
#: says nothing; a twentieth of the limit (5e-4 on a loss of order 1) is ~1000x over float32 rounding.
BIAS_PREMISE = 0.05
BIAS_MIN_STEPS = 3
#: The noise band is floored at this many roundings of the mean loss (relative machine epsilon of the loss's
#: dtype, float32's at least): a faithful float32 port's loss errors are one or two roundings, 1e-7 relative.
NOISE_FLOOR_ULPS = 4
#: Relative machine epsilon per floating dtype (bfloat16 has 8 significant bits, float16 11).
_EPSILON = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def loss_and_grad_norm(data: StepData) -> tuple[float, float]:
    """The step's loss (NaN when not sent) and global gradient norm (NaN without gradients)."""
    loss_rows = data.phase == pb.LOSS
    loss = float(data.table["sum"][loss_rows][0]) if loss_rows.any() else math.nan
    grad_rows = data.phase == pb.GRAD
    norm = float(np.sqrt(data.table["sum_sq"][grad_rows].sum())) if grad_rows.any() else math.nan
    return loss, norm


@dataclass
class _Series:
    # step -> rank -> (baseline loss, other loss, baseline grad norm, other grad norm)
    steps: dict[int, dict[int, tuple[float, float, float, float]]] = field(default_factory=dict)
    loss_dtype: str = ""
    """The baseline loss's dtype, as first seen ("" until a loss arrives)."""
    earlier: int = 0
    """Steps summed elsewhere and not held here (a merge of shards' partial sums keeps the first and the window)."""

    def add(self, step: int, rank: int, base: StepData, other: StepData) -> None:
        if not self.loss_dtype:
            at = np.flatnonzero(base.phase == pb.LOSS)
            self.loss_dtype = base.dtypes[at[0]] if at.size else ""
        bl, bg = loss_and_grad_norm(base)
        ol, og = loss_and_grad_norm(other)
        self.steps.setdefault(step, {})[rank] = (bl, ol, bg, og)

    def count(self) -> int:
        return len(self.steps) + self.earlier

    def partial(self, window: int) -> dict:
        """Per step, the four columns summed over this server's ranks and how many ranks: the first step and the
        latest ``window`` (what a summary reads), for a sharded server to merge (twinstep.server.shards)."""
        steps = sorted(self.steps)
        kept = sorted({*steps[:1], *(steps[-window:] if window else steps)})
        return {"dtype": self.loss_dtype, "count": len(steps),
                "steps": {step: (np.sum(list(self.steps[step].values()), axis=0).tolist(), len(self.steps[step]))
                          for step in kept}}

    def arrays(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """Per step (rank-averaged): columns baseline loss, other loss, baseline norm, other norm."""
        steps = sorted(self.steps)
        rows = np.array([np.mean(list(self.steps[s].values()), axis=0) for s in steps]) if steps else np.zeros((0, 4))
        return np.array(steps[-window:] if window else steps), rows[-window:] if window else rows


class LongRunTracker:
    def __init__(self, window: int) -> None:
        self.window = window
        self._series: dict[str, _Series] = {}

    def add(self, run: str, step: int, rank: int, base: StepData, other: StepData) -> None:
        self._series.setdefault(run, _Series()).add(step, rank, base, other)

    def partials(self) -> dict[str, dict]:
        """Every run's partial sums (see _Series.partial)."""
        return {run: series.partial(self.window) for run, series in self._series.items()}

    @classmethod
    def merged(cls, window: int, shares: list[dict[str, dict]]) -> "LongRunTracker":
        """A tracker of the rank-averaged series over several servers' partial sums (a sharded session)."""
        tracker = cls(window)
        for run in {run for share in shares for run in share}:
            parts = [share[run] for share in shares if run in share]
            totals: dict[int, tuple[np.ndarray, int]] = {}
            for part in parts:
                for step, (sums, count) in part["steps"].items():
                    held = totals.get(int(step))
                    sums = np.asarray(sums, dtype=np.float64)
                    totals[int(step)] = (sums, count) if held is None else (held[0] + sums, held[1] + count)
            series = tracker._series[run] = _Series(loss_dtype=next((p["dtype"] for p in parts if p["dtype"]), ""))
            for step, (sums, count) in totals.items():
                series.steps[step] = {0: tuple((sums / count).tolist())}
            series.earlier = max((part["count"] for part in parts), default=0) - len(series.steps)
        return tracker

    def summary(self, run: str, reference: str | None, noise_multiple: float) -> pb.LongRun | None:
        series = self._series.get(run)
        if series is None or not series.steps:
            return None
        all_steps, all_rows = series.arrays(0)
        steps, rows = series.arrays(self.window)
        out = pb.LongRun(candidate_run=run, steps=series.count(), window=len(steps),
                         reference_loss_mean_abs=-1.0, reference_grad_norm_mean_rel=-1.0)
        first = all_rows[0]
        first_abs, first_rel = _abs_rel(first[0], first[1])
        out.first_loss_abs, out.first_loss_rel = float(first_abs), float(first_rel)
        loss_abs, loss_rel = _abs_rel(rows[:, 0], rows[:, 1])
        out.loss_mean_abs = _mean(loss_abs)
        out.loss_mean_rel = _mean(loss_rel)
        out.loss_mean_signed = _mean(rows[:, 1] - rows[:, 0])
        out.grad_norm_mean_rel = _mean(_abs_rel(rows[:, 2], rows[:, 3])[1])
        if math.isnan(out.loss_mean_abs):  # no step with a loss from both runs (mon.step() without one, a dump)
            verdicts = ["loss criteria not judged: no compared step has a loss from both runs"]
        else:
            verdicts = [
                _verdict("first loss", out.first_loss_abs <= FIRST_LOSS_ABS or out.first_loss_rel <= FIRST_LOSS_REL,
                         f"|Δ| {out.first_loss_abs:.3g}, {100 * out.first_loss_rel:.3g}% (limit 0.005 or 0.5%)"),
                _verdict("mean loss error", out.loss_mean_abs <= MEAN_LOSS_ABS or out.loss_mean_rel <= MEAN_LOSS_REL,
                         f"|Δ| {out.loss_mean_abs:.3g}, {100 * out.loss_mean_rel:.3g}% over {len(steps)} steps "
                         "(limit 0.01 or 1%)"),
            ]
        if math.isfinite(out.grad_norm_mean_rel):
            verdicts.append(_verdict("global grad norm", out.grad_norm_mean_rel <= GRAD_NORM_MEAN_REL,
                                     f"mean relative error {100 * out.grad_norm_mean_rel:.3g}% (limit 10%)"))
        share = loss_error_share(out.loss_mean_abs, out.loss_mean_rel)
        with_loss = int(np.count_nonzero(~np.isnan(rows[:, 1] - rows[:, 0])))
        if share >= BIAS_PREMISE and with_loss >= BIAS_MIN_STEPS:
            bias = abs(out.loss_mean_signed) / out.loss_mean_abs
            verdicts.append(f"loss error {'oscillates around 0' if bias < 0.5 else 'is biased to one side'} "
                            f"(mean signed / mean absolute = {bias:.2f}; mean |Δ| at {share:.2f} of its limit)")
        ref = self._series.get(reference) if reference else None
        if ref is not None and ref.steps:
            _, ref_rows = ref.arrays(self.window)
            out.reference_loss_mean_abs = _mean(_abs_rel(ref_rows[:, 0], ref_rows[:, 1])[0])
            out.reference_grad_norm_mean_rel = _mean(_abs_rel(ref_rows[:, 2], ref_rows[:, 3])[1])
            band = noise_multiple * out.reference_loss_mean_abs
            if math.isfinite(band):
                detail = (f"mean loss |Δ| {out.loss_mean_abs:.3g} vs {noise_multiple:g} x reference "
                          f"{out.reference_loss_mean_abs:.3g}")
                name, epsilon = _rounding(series.loss_dtype)
                mean_loss = _mean(np.abs(rows[:, 0]))
                floor = NOISE_FLOOR_ULPS * epsilon * mean_loss
                if band < floor:  # NaN (no loss) compares False: no floor
                    band = floor
                    detail += (f", floored at {name} rounding {floor:.3g} ({NOISE_FLOOR_ULPS} x {epsilon:.3g} x "
                               f"mean loss {mean_loss:.3g})")
                verdicts.append(_verdict("within the baseline's own noise", out.loss_mean_abs <= band, detail))
        out.verdicts.extend(verdicts)
        return out


def _rounding(dtype: str) -> tuple[str, float]:
    """(dtype, relative epsilon) of the rounding a loss of ``dtype`` carries: float32's at least."""
    epsilon = _EPSILON.get(dtype, 0.0)
    return (dtype, epsilon) if epsilon > _EPSILON["float32"] else ("float32", _EPSILON["float32"])


def loss_error_share(mean_abs: float, mean_rel: float) -> float:
    """The mean loss error as a share of its limit (0.01 absolute or 1% relative: the looser reading); 0 for NaN."""
    share = min(mean_abs / MEAN_LOSS_ABS, mean_rel / MEAN_LOSS_REL)
    return 0.0 if math.isnan(share) else share


def _abs_rel(base, other):
    base = np.asarray(base, dtype=np.float64)
    diff = np.abs(np.asarray(other, dtype=np.float64) - base)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(np.abs(base) > 0, diff / np.abs(base), np.where(diff > 0, np.inf, 0.0))
    return diff, np.where(np.isnan(diff), np.nan, rel)


def _mean(values) -> float:
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    return float(values.mean()) if values.size else math.nan


def _verdict(name: str, ok: bool, detail: str) -> str:
    return f"{'PASS' if ok else 'FAIL'} {name}: {detail}"
