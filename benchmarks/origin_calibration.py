"""Calibrate the origin statistic (server/detect/origin.py): faithful envelopes, and bugs over their floors.

    python benchmarks/origin_calibration.py [--steps 50] [--seed 0] [--bugs wd_on_norms adam_eps rope_base]

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


def comparisons(model: str, bug: str | None, steps: int, seed: int) -> tuple[list, dict]:
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
        corpus.run_pair(handle.address, session, model, steps, bug=bug)
    finally:
        corpus.job_commands = commands
    report = handle.report(session)
    handle.stop(grace=0.2)
    return seen, report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bugs", nargs="*", default=["wd_on_norms", "adam_eps", "rope_base"])
    args = parser.parse_args()
    envelope: dict[tuple[str, str], np.ndarray] = {}
    worst = 0.0
    for model in models.MODEL_NAMES:
        seen, _ = comparisons(model, None, args.steps, args.seed)
        tracer = origin.OriginTracer()
        for comparison in seen:
            static = origin._static_rows(comparison)
            for k, row in enumerate(static):
                if row[0] != "param":
                    continue
                group = "1d" if row[6] <= 1 else "nd"
                for metric in origin.METRICS:
                    line = envelope.setdefault((group, metric), np.zeros(args.steps))
                    line[comparison.step] = max(line[comparison.step], float(comparison.values[metric][k]))
            found = tracer.observe(comparison)
            assert found is None, f"{model}: a faithful pair raised an origin: {found.evidence}"
            for history in tracer._history.values():
                if comparison.step in history.steps:
                    worst = max(worst, float(history.steps[comparison.step].ratio.max()))
    print("faithful envelope (largest value over the models, per calibrated step; from each step to the next):")
    for (group, metric), line in sorted(envelope.items()):
        running = np.maximum.accumulate(line)
        steps = [s for s in origin.CALIBRATED_STEPS if s < args.steps]
        cells = [running[s:(steps[i + 1] if i + 1 < len(steps) else args.steps)].max() for i, s in enumerate(steps)]
        print(f"  {group} {metric:<8}" + " ".join(f"{s}:{v:.1e}" for s, v in zip(steps, cells)))
    print(f"largest faithful error / floor: {worst:.3f} (evidence needs {origin.GROWING} growing, {origin.CLEAR} alone)")
    for bug in args.bugs:
        for model in models.MODEL_NAMES:
            _, report = comparisons(model, bug, 12, args.seed)
            first = report["first_divergence"] or {}
            found = first.get("origin")
            where = f"step {first.get('step')} {first.get('phase')} {first.get('module')}" if first else "not found"
            how = f"origin x{found['ratio']:.1f} ({found['rule']}, evidence at step {found['evidence_step']})" \
                if found else "tolerance crossing"
            print(f"{model:<9} {bug:<12} {where}: {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
