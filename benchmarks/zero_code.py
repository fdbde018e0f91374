"""What ``twinstep run`` costs over ``twinstep.attach`` written into the script, and what its bootstrap costs at start.

    python benchmarks/zero_code.py [--framework torch|paddle|both] [--steps 200] [--hidden 64 256]
                                   [--repeat 3] [--starts 7]

Step rate: the same unmodified script (tests/integration/jobs/plain_<framework>.py:
the demo transformer, AdamW, one thread) runs three ways against an embedded server,
``--repeat`` times each, interleaved, and the median steps/s after step 0 is shown:

    unhooked        the script alone
    explicit        the script with twinstep.attach(model) and mon.step(loss) written in
    twinstep run    the script unmodified, under `twinstep run`

The two twinstep rows capture the same records; what differs is how step boundaries
and the loss are found (an optimizer step hook and a wrapper of backward), so
``twinstep run / explicit`` is the zero-code path's own cost.  Each row streams to a
session of its own (the server stores and compares nothing), and the order of the
rows alternates between repeats.

Start-up: the median wall time of ``--starts`` starts of

    python -c pass                              the interpreter alone
    bootstrap armed, python -c pass             sitecustomize + twinstep.runtime.autoattach, no framework
    twinstep run -- python -c pass              the launcher too (it execs the command)
    python -c "import torch" (or paddle)        with and without the armed bootstrap: the probe's install
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import logging

from twinstep.runtime.autoattach import BOOTSTRAP_DIR, ENV_ACTIVE
from twinstep.server import serve

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "tests" / "integration" / "jobs"


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINSTEP_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def armed_env() -> dict[str, str]:
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *filter(None, [env.get("PYTHONPATH")])])
    env[ENV_ACTIVE] = "1"
    return env


def rate(command: list[str], env: dict[str, str]) -> float:
    out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    found = re.search(r"([\d.]+) steps/s", out.stdout)
    if out.returncode != 0 or not found:
        raise SystemExit(f"{' '.join(command)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return float(found.group(1))


def step_rates(framework: str, hidden: int, steps: int, repeat: int, server: str) -> dict[str, float]:
    job = [sys.executable, str(JOBS / f"plain_{framework}.py"), "--steps", str(steps), "--hidden", str(hidden),
           "--quiet"]
    rows: dict[str, list[float]] = {"unhooked": [], "explicit": [], "twinstep run": []}
    for attempt in range(repeat):
        # A session per row, each run a baseline: the server only stores, so no row pays for comparisons.
        def named(row: str) -> dict[str, str]:
            return {**base_env(), "TWINSTEP_SESSION": f"bench-{framework}-{hidden}-{attempt}-{row}",
                    "TWINSTEP_RUN": row, "TWINSTEP_BASELINE": "1", "TWINSTEP_SERVER": server}

        commands = {"unhooked": (job, base_env()),
                    "explicit": ([*job, "--explicit-attach"], named("explicit")),
                    "twinstep run": ([sys.executable, "-m", "twinstep", "run", "--", *job], named("zero-code"))}
        order = list(commands) if attempt % 2 == 0 else list(reversed(commands))  # no row always runs last
        for row in order:
            rows[row].append(rate(*commands[row]))
    return {name: statistics.median(values) for name, values in rows.items()}


def wall(command: list[str], env: dict[str, str], starts: int) -> float:
    times = []
    for _ in range(starts):
        begin = time.perf_counter()
        subprocess.run(command, env=env, cwd="/", check=True, capture_output=True, timeout=300)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("torch", "paddle", "both"), default="both")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 256])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--starts", type=int, default=7)
    args = p.parse_args()
    frameworks = ("torch", "paddle") if args.framework == "both" else (args.framework,)
    logging.getLogger("twinstep.server").setLevel(logging.ERROR)  # the embedded server's session lines
    server = serve(port=0)
    try:
        print(f"step rate, median of {args.repeat} runs of {args.steps} steps (steps/s after step 0):")
        print(f"{'framework':10} {'hidden':>6} {'unhooked':>9} {'explicit':>9} {'twinstep run':>13} {'run/explicit':>13}")
        for framework in frameworks:
            for hidden in args.hidden:
                r = step_rates(framework, hidden, args.steps, args.repeat, server.address)
                print(f"{framework:10} {hidden:>6} {r['unhooked']:>9.1f} {r['explicit']:>9.1f} "
                      f"{r['twinstep run']:>13.1f} {r['twinstep run'] / r['explicit']:>13.3f}", flush=True)
    finally:
        server.stop()
    print(f"\nstart-up, median of {args.starts} starts (seconds):")
    python = [sys.executable, "-c", "pass"]
    launcher = [sys.executable, "-m", "twinstep", "run", "--session", "s", "--run", "r", "--server", "127.0.0.1:9",
                "--", *python]
    rows = [("python -c pass", python, base_env()), ("bootstrap armed, python -c pass", python, armed_env()),
            ("twinstep run -- python -c pass", launcher, base_env())]
    for framework in frameworks:
        imported = [sys.executable, "-c", f"import {framework}"]
        rows += [(f"python -c 'import {framework}'", imported, base_env()),
                 (f"bootstrap armed, import {framework} (probe installed)", imported, armed_env())]
    for name, command, env in rows:
        print(f"  {name:52} {wall(command, env, args.starts):.3f}", flush=True)


if __name__ == "__main__":
    main()
