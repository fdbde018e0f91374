"""Localization benchmark: does twinstep name the right step, phase and module, and how fast?

    python benchmarks/localization.py [--suite demo|ports|mindspore|all] [--steps 20]

Each case trains a baseline and a candidate (separate processes, real
frameworks) against one embedded server and records: found or not, right
step/phase/module or not, the step it was found at, and seconds from the
jobs' start to the divergence alert.  Faithful cases count false alarms.

Two more columns: "no-ref", whether the right step and phase are found with no
reference rerun (cases run with one are run again without it: the origin
trace-back of server/detect/origin.py), and "preflight", the categories of the
report's preflight findings (the set-up diff before step 0; "-" for none).
And "words": whether every stage, culprit and long-run sentence of the report
is borne out by the numbers beside it (server/report/agreement.py: "yes", "NO",
"-" when the report has no sentence it checks); the sentences that fail are
listed under the table.

The demo suite holds the demo LM's port and a new user's own small pair
(tests/integration/jobs/first_hour_torch.py and first_hour_paddle.py: Linear,
LayerNorm, GELU, Linear; Adam; default settings, no reference run), faithful and
with the port's LayerNorm epsilon at 1e-6 against the baseline's 1e-5.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.integration.jobs.first_hour_paddle import pair_commands  # noqa: E402
from twinstep.server import serve  # noqa: E402
from twinstep.server.config import config_from_dict  # noqa: E402
from twinstep.server.report.agreement import check_words  # noqa: E402


@dataclass
class Case:
    name: str
    commands: Callable[[str, str, int, str], list[list[str]]]  # (server, session, steps, tmp) -> job command lines
    expected: tuple[int, str, str] | None  # (step, phase, baseline module or "*"); None: faithful


def demo_case(name: str, bug: str | None, expected: tuple[int, str, str] | None) -> Case:
    def commands(server: str, session: str, steps: int, tmp: str) -> list[list[str]]:
        base = [sys.executable, "-m", "twinstep.tools.demo.job", "--framework", "torch", "--run", "torch", "--baseline"]
        cand = [sys.executable, "-m", "twinstep.tools.demo.job", "--framework", "paddle", "--run", "paddle"]
        if bug:
            cand += ["--bug", bug]
        common = ["--server", server, "--session", session, "--steps", str(steps)]
        return [base + common, cand + common]

    return Case(name, commands, expected)


def first_hour_case(name: str, norm_eps: float | None, expected: tuple[int, str, str] | None) -> Case:
    """A new user's own torch model and paddle port; ``norm_eps``: the port's LayerNorm epsilon (None: faithful)."""
    def commands(server: str, session: str, steps: int, tmp: str) -> list[list[str]]:
        return pair_commands(server, session, steps, os.path.join(tmp, "weights.npz"), norm_eps)

    return Case(name, commands, expected)


DEMO = [
    demo_case("demo faithful", None, None),
    demo_case("demo gelu_tanh", "gelu_tanh", (0, "forward", "layers.1.mlp.act")),
    demo_case("demo lr 1.1e-3", "lr", (0, "param", "*")),
    first_hour_case("first-hour faithful", None, None),
    first_hour_case("first-hour norm eps 1e-6", 1e-6, (0, "forward", "norm")),
]


def ports_cases() -> list[Case]:
    try:
        from tests.ports.corpus import CASES  # the real-model corpus (transformers vs paddleformers)
    except ImportError:
        return []
    return list(CASES)


def mindspore_cases() -> list[Case]:
    """transformers' Phi3 against its MindSpore port (tests/ports/mindspore_phi3.py); none without mindspore."""
    import importlib.util

    if importlib.util.find_spec("mindspore") is None:
        return []
    from tests.ports.corpus import MINDSPORE_CASES

    return list(MINDSPORE_CASES)


def run_case(case: Case, steps: int) -> dict:
    handle = serve(port=0, config=config_from_dict(getattr(case, "config", None) or {}))
    session = case.name.replace(" ", "-")
    events = handle.registry.get_or_create(session).events.subscribe()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=os.getcwd())
                 for cmd in case.commands(handle.address, session, steps, tmp)]
        detected_at = None
        while any(p.poll() is None for p in procs):
            try:
                event = events.get(timeout=0.1)
            except Exception:
                continue
            if event is not None and event.WhichOneof("body") == "divergence" and detected_at is None:
                detected_at = time.monotonic() - start
        for p in procs:
            p.wait()
    report = handle.report(session)
    handle.stop(grace=0.2)
    first = report["first_divergence"]
    if detected_at is None and first is not None:
        detected_at = time.monotonic() - start
    preflight = sorted({str(f.get("category", "?")) for f in report.get("preflight") or [] if isinstance(f, dict)})
    checks = check_words(report)
    failed = [f"{c.section}: {c.kind}: {c.why}" for c in checks if not c.holds]
    result = {"case": case.name, "found": first is not None, "right": None, "step": None, "seconds": detected_at,
              "false_alarm": case.expected is None and first is not None, "where": "",
              "preflight": ",".join(preflight) or "-", "right_step_phase": None,
              "words": "-" if not checks else ("NO" if failed else "yes"), "words_failed": failed}
    if first is not None:
        result["step"] = first["step"]
        result["where"] = f"{first['phase']} {first['module']}"
        if case.expected is not None:
            step, phase, module = case.expected
            result["right_step_phase"] = (first["step"], first["phase"]) == (step, phase)
            result["right"] = result["right_step_phase"] and _same_module(module, first["module"])
    return result


def without_reference(case: Case, steps: int, result: dict) -> str:
    """Right step and phase with no reference rerun: "yes", "NO", or "-" for a faithful case."""
    if case.expected is None:
        return "-"
    if getattr(case, "reference", False):
        result = run_case(dataclasses.replace(case, reference=False), steps)
    return "yes" if result["right_step_phase"] else "NO"


def _same_module(expected: str, found: str) -> bool:
    """Equal, "*", or one part of a fused group ("a.{gate_proj,up_proj}" holds "a.gate_proj")."""
    if expected in ("*", found):
        return True
    head, _, part = expected.rpartition(".")
    return found.startswith(head + ".{") and part in found[len(head) + 2 : -1].split(",")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("demo", "ports", "mindspore", "all"), default="all")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    cases = (DEMO if args.suite in ("demo", "all") else []) + (ports_cases() if args.suite in ("ports", "all") else [])
    cases += mindspore_cases() if args.suite in ("mindspore", "all") else []
    print(f"{'case':<32}{'found':>6}{'right':>7}{'step':>6}{'seconds':>9}{'no-ref':>8}{'words':>7}  "
          f"{'preflight':<24}where")
    false_alarms = 0
    disagreements: list[str] = []
    for case in cases:
        r = run_case(case, args.steps)
        false_alarms += r["false_alarm"]
        right = "-" if r["right"] is None else ("yes" if r["right"] else "NO")
        seconds = f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"
        step = "-" if r["step"] is None else str(r["step"])
        found = "FALSE ALARM" if r["false_alarm"] else ("yes" if r["found"] else "no")
        no_reference = without_reference(case, args.steps, r)
        print(f"{r['case']:<32}{found:>6}{right:>7}{step:>6}{seconds:>9}{no_reference:>8}{r['words']:>7}  "
              f"{r['preflight']:<24}{r['where']}", flush=True)
        disagreements += [f"  {r['case']}: {line}" for line in r["words_failed"]]
    print(f"false alarms on faithful runs: {false_alarms}")
    if disagreements:
        print("words the numbers do not bear out:")
        print("\n".join(disagreements))
    return 0


if __name__ == "__main__":
    sys.exit(main())
