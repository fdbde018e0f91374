"""``twinstep reproduce BUNDLE [BUNDLE]``: run a divergent module's call again, both sides, in seconds.

Reads the reproducer bundles the runs wrote (a halt with bundle_on_halt, or
twinstep zoom --bundle), rebuilds the baseline's and the candidate's module,
runs each on the recorded inputs in this process and prints the server's
metrics between them (twinstep.tools.reproduce.replay).  Given one bundle, its
counterpart (the other role, same session, rank and step) is looked for in
the same folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

EXAMPLES = """\
examples:
  twinstep reproduce twinstep-bundles/demo-paddle-rank0-step5-layers.1.mlp.act.twinstep-bundle.zip
  twinstep reproduce base.twinstep-bundle.zip cand.twinstep-bundle.zip --json
  twinstep reproduce cand.twinstep-bundle.zip --candidate-factory my_port.fixes:build_mlp   # a fixed constructor

exit status: 0 the module agrees with the baseline's on the same inputs, 1 it differs (the bug
is in it), 2 a bundle or option could not be used.  See docs/zoom-and-reproduce.md.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "reproduce", help="rerun a divergent module from its reproducer bundles and compare both sides",
        description="Rebuild the baseline's and the candidate's module from their reproducer bundles (the module "
                    "object, its classes imported as they are now; or a factory), run each on the recorded inputs "
                    "in this process, and compare the outputs with the server's metrics and forward tolerances.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+", metavar="BUNDLE", help="one bundle, or the baseline's and a candidate's")
    parser.add_argument("--baseline-factory", metavar="MODULE:FUNCTION",
                        help="build the baseline's module (or a model holding it by name) instead of unpickling it")
    parser.add_argument("--candidate-factory", metavar="MODULE:FUNCTION",
                        help="build the candidate's module (a fixed port) instead of unpickling it")
    parser.add_argument("--config", metavar="FILE", help="server config YAML whose tolerances judge the outputs")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--eval", dest="training", action="store_false", default=None,
                      help="run the modules in eval mode (no dropout) whatever the bundle recorded")
    mode.add_argument("--train", dest="training", action="store_true", help="run them in training mode")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def run(args: argparse.Namespace) -> int:
    from twinstep.tools.reproduce.bundle import BundleError
    from twinstep.tools.reproduce.replay import reproduce

    if len(args.bundles) > 2:
        return _fail("give one bundle, or two: the baseline's and a candidate's")
    tolerances = None
    if args.config:
        from twinstep.server.config import load_config

        tolerances = load_config(args.config).tolerances
    if args.baseline_factory or args.candidate_factory:
        sys.path.insert(0, os.getcwd())  # a factory in the user's own code, as `python -m` would find it
    try:
        result = reproduce(args.bundles, baseline_factory=args.baseline_factory,
                           candidate_factory=args.candidate_factory, tolerances=tolerances, training=args.training)
    except BundleError as error:
        return _fail(str(error))
    if args.json:
        print(json.dumps(to_dict(result), indent=2))
    else:
        print(render(result))
    return 1 if result.module_diverges else 0


def _fail(message: str) -> int:
    print(f"twinstep reproduce: {message}", file=sys.stderr)
    return 2


def _side_dict(side: Any) -> dict[str, Any] | None:
    if side is None:
        return None
    m = side.bundle.meta
    return {"bundle": str(side.bundle.path), "run": m["run"], "rank": m["rank"], "framework": m["framework"],
            "framework_version": m.get("framework_version", ""), "module": m["module"],
            "module_class": m.get("module_class", ""), "step": m["step"], "divergent_step": m.get("divergent_step"),
            "built_from": side.built_from, "missing": list(m["missing"]), "notes": side.notes}


def to_dict(result: Any) -> dict[str, Any]:
    return {
        "baseline": _side_dict(result.baseline),
        "candidate": _side_dict(result.candidate),
        "comparisons": [{"label": c.label, "what": c.what, "values": {k: _finite(v) for k, v in c.values.items()},
                         "tolerance": {k: _finite(v) for k, v in c.tolerance.items()}, "exceeded": c.exceeded,
                         "note": c.note or None} for c in result.comparisons],
        "verdict": result.verdict,
        "module_diverges": result.module_diverges,
    }


def render(result: Any) -> str:
    from twinstep.tools.reproduce.replay import SHOWN

    first = result.baseline or result.candidate
    m = first.bundle.meta
    divergent = m.get("divergent_step")
    lines = [f"reproducing {m['module'] or '(model)'!r} ({m.get('module_type', '')}) of session {m['session']!r}, "
             f"step {m['step']}" + (f" (divergence at step {divergent})" if divergent is not None else "")]
    for role, side in (("baseline", result.baseline), ("candidate", result.candidate)):
        if side is None:
            continue
        sm = side.bundle.meta
        lines.append(f"  {role:9} run {sm['run']!r} rank {sm['rank']}, {sm['framework']} "
                     f"{sm.get('framework_version', '')}: built from {side.built_from}")
        for text in sm["missing"]:
            lines.append(f"    missing: {text}")
        for text in side.notes:
            lines.append(f"    note: {text}")
    lines.append("")
    lines.append(f"  {'':18}" + "".join(f"{name:>11}" for name in SHOWN))
    for c in result.comparisons:
        if c.note:
            lines.append(f"  {c.label:18} {c.note}")
            continue
        cells = []
        for name in SHOWN:
            value = c.values.get(name)
            mark = "*" if name in c.exceeded else " "
            cells.append(f"{value:>10.3g}{mark}" if value is not None else f"{'-':>11}")
        lines.append(f"  {c.label:18}" + "".join(cells))
    judged = next((c for c in result.comparisons if c.tolerance), None)
    if judged is not None:
        limits = ", ".join(f"{k} {v:.3g}" for k, v in judged.tolerance.items() if math.isfinite(v) and v > 0)
        lines.append(f"  (* over the server's forward tolerance: {limits})")
    lines.append("")
    lines.append(f"verdict: {result.verdict}")
    return "\n".join(lines)


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf" if value < 0 else "nan")
