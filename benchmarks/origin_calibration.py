"""Calibrate the origin statistic (server/detect/origin.py): faithful envelopes, and bugs over their floors.

    python benchmarks/origin_calibration.py [--steps 50] [--seed 0] [--bugs wd_on_norms adam_eps rope_base]
                                            [--unit-embeddings]

Environment variables PORTS_HIDDEN and PORTS_OPTIMIZER (tests/ports/models.py)
choose the models' width and the optimizer of both jobs.

Runs each real port of tests/ports (transformers vs paddleformers, separate
processes) faithful for --steps steps, then each bug for 12 steps, against an
embedded server with no reference run.  Prints, per parameter group and
metric, the largest faithful value at the calibrated steps (origin.PARAM_ENVELOPE
is the maximum of these over seeds 0 and 1), the largest faithful error over
its floor, and for each bug the origin found and its ratio.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.ports import corpus, models  # noqa: E402
from twinstep.server import serve  # noqa: E402
from twinstep.server.config import config_from_dict  # noqa: E402
from twinstep.server.detect import origin  # noqa: E402


def comparisons(model: str, bug: str | None, steps: int, seed: int, unit_embeddings: bool = False
                ) -> tuple[list, dict]:
    """Every compared step of one pair (observed through the session's tracker), and the report."""
    handle = serve(port=0, config=config_from_dict(corpus.PortCase.config))
    session = f"{model}-{bug or 'faithful'}"
    tracker = handle.registry.get_or_create(session).core.pipeline.tracker
    seen = []
    add = tracker.add
    tracker.add = lambda comparison: (seen.append(comparison), add(comparison))[-1]
    commands = corpus.job_commands
    corpus.job_commands = lambda *a, **k: [c + ["--seed", str(seed)] for c in commands(*a, **k)]
    try:
        corpus.run_pair(handle.address, session, model, steps, bug=bug,
                        embed_std=models.unit_embed_std(model) if unit_embeddings else None)
    finally:
        corpus.job_commands = commands
    report = handle.report(session)
    handle.stop(grace=0.2)
    return seen, report


def forward_envelope(seen: list, steps: int, into: dict[tuple[str, str], np.ndarray]) -> None:
    """Fold the created forward errors of a faithful pair's comparisons into ``into`` ((precision, kind) ->
    largest value per step)."""
    for comparison in seen:
        width = origin.width_class(comparison)
        for k, kind, precision, _, _ in origin.created_errors(comparison):
            for metric in origin.METRICS:
                line = into.setdefault((precision, width, kind, metric), np.zeros(steps))
                line[comparison.step] = max(line[comparison.step], float(comparison.values[metric][k]))


def forward_ratios(comparison) -> list[float]:
    """Each created forward error over its floor (the largest over the statistics metrics)."""
    out = []
    width = origin.width_class(comparison)
    for k, kind, precision, _, _ in origin.created_errors(comparison):
        for metric in origin.METRICS:
            floor = origin.forward_floor(precision, kind, metric, comparison.step, width)
            if floor:
                out.append(float(comparison.values[metric][k]) / floor)
    return out


def envelope_cells(line: np.ndarray, steps: int) -> list[float]:
    """Largest value from each calibrated step to the next (made non-decreasing)."""
    running = np.maximum.accumulate(line)
    calibrated = [s for s in origin.CALIBRATED_STEPS if s < steps]
    return [float(running[s:(calibrated[i + 1] if i + 1 < len(calibrated) else steps)].max())
            for i, s in enumerate(calibrated)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bugs", nargs="*", default=["wd_on_norms", "adam_eps", "rope_base"])
    parser.add_argument("--unit-embeddings", action="store_true",
                        help="embeddings drawn so that the residual stream is of order 1 (models.unit_embed_std)")
    args = parser.parse_args()
    envelope: dict[tuple[str, str], np.ndarray] = {}
    forward: dict[tuple[str, str], np.ndarray] = {}
    worst = worst_forward = 0.0
    false_origins: list[str] = []
    for model in models.MODEL_NAMES:
        seen, _ = comparisons(model, None, args.steps, args.seed, args.unit_embeddings)
        forward_envelope(seen, args.steps, forward)
        tracer = origin.OriginTracer()
        for comparison in seen:
            static = origin._static_rows(comparison)
            for k, row in enumerate(static):
                if row[0] != "param":
                    continue
                group = "1d" if row[6] <= 1 else "nd"
                for metric in origin.METRICS:
                    line = envelope.setdefault((origin.width_class(comparison), group, metric), np.zeros(args.steps))
                    line[comparison.step] = max(line[comparison.step], float(comparison.values[metric][k]))
            found = tracer.observe(comparison)
            if found is not None:
                false_origins.append(f"{model} step {found.comparison.step}: {found.evidence}")
                tracer = origin.OriginTracer()  # keep looking for more
            worst_forward = max([worst_forward] + forward_ratios(comparison))
            for history in tracer._history.values():
                if comparison.step in history.steps:
                    worst = max(worst, float(history.steps[comparison.step].ratio.max()))
    print("faithful parameter errors (largest per calibrated step; origin.PARAM_ENVELOPE):")
    for key, line in sorted(envelope.items()):
        print(f"  {key!r}: (" + ", ".join(f"{v:.1e}" for v in envelope_cells(line, args.steps)) + "),")
    print("faithful created forward errors (largest per calibrated step; origin.FORWARD_ENVELOPE):")
    for key, line in sorted(forward.items()):
        cells = envelope_cells(line, args.steps)
        print(f"  {key!r}: (" + ", ".join(f"{v:.1e}" for v in cells) + "),")
    print(f"largest faithful error / floor: {worst:.3f} (evidence needs {origin.GROWING} growing, {origin.CLEAR} alone)")
    print(f"largest faithful created forward error / floor: {worst_forward:.3f} (an origin needs "
          f"{origin.CLEAR_FORWARD})")
    print(f"false origins on the faithful pairs: {len(false_origins)}")
    for line in false_origins:
        print(f"  {line}")
    for bug in args.bugs:
        for model in models.MODEL_NAMES:
            _, report = comparisons(model, bug, 12, args.seed, args.unit_embeddings)
            first = report["first_divergence"] or {}
            found = first.get("origin")
            where = f"step {first.get('step')} {first.get('phase')} {first.get('module')}" if first else "not found"
            how = f"origin x{found['ratio']:.1f} ({found['rule']}, evidence at step {found['evidence_step']})" \
                if found else "tolerance crossing"
            print(f"{model:<9} {bug:<12} {where}: {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
