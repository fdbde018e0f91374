"""Run the whole test suite in every supported environment: the README's test command and CI's.

    python3 tests/envs/run.py                  every leg, each with its tests (below)
    python3 tests/envs/run.py --legs latest    some legs only
    python3 tests/envs/run.py --tiers unit     some tiers only (unit, integration, ports)
    python3 tests/envs/run.py -- -x -k halt    extra pytest arguments for every leg

Each leg is a virtual environment built by ``tests/envs/build.sh LEG`` from the
pinned versions in ``tests/envs/LEG.txt`` (rebuilt only when those change).
The first leg's tests run while the later legs build, since building is mostly
download and unpacking and the tests mostly CPU.  Needs only Python 3 with
``venv`` and the leg interpreters (pyenv's, or pythonX.Y on PATH).

The last line is the total over every leg, ``N passed, N failed, N skipped``;
the exit status is non-zero when any leg failed to build or any test failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

#: The tiers, each its own pytest run: unit (no process, no network beyond an in-process
#: server; under a minute), integration (real jobs in real processes over loopback) and the
#: real ports (Hugging Face transformers vs paddleformers).
TIERS = {"unit": "tests/unit_tests", "integration": "tests/integration", "ports": "tests/ports"}


@dataclass(frozen=True)
class Leg:
    name: str
    what: str
    """What the leg proves."""
    tiers: tuple[tuple[str, tuple[str, ...]], ...]
    """(tier, extra pytest arguments selecting within it), in the order they run."""
    disk_gb: float
    """Free disk its build needs: the environment plus pip's downloads, which sit beside it until installed
    (measured sizes: latest 2.3 GB, paddleformers 5.5, oldest 8.4 and newest-python 5.8, the last two with
    torch's CUDA wheels from PyPI)."""


#: Issue 16's user-facing surfaces whose code does not vary with numpy, torch or paddle versions run
#: in the latest leg only: the dashboard in a real browser, the docs pages' examples (transformers'
#: and paddleformers' Trainers among them) and the alert paths beyond their unit tests (about 75 s a
#: leg).  Their unit tests run in every leg.
_LATEST_ONLY = ("--ignore=tests/integration/test_dashboard.py", "--ignore=tests/integration/test_docs.py",
                "--ignore=tests/integration/test_alerts.py")
#: Issue 17's end-to-end tests (zoom across ranks, reproducer bundles, named records and batch sync) and
#: `twinstep run` under the launchers depend on torch's and paddle's versions, whose extremes are the
#: latest and oldest legs; the paddleformers leg differs from those by numpy 1.26.4 and paddleformers'
#: dependencies only, newest-python by Python 3.13 (which keeps `twinstep run`: its bootstrap is a
#: sitecustomize, Python's own business).  Their unit tests run in every leg.  About 40 s a leg.
_EXTREMES_ONLY = ("--ignore=tests/integration/test_zoom.py", "--ignore=tests/integration/test_reproduce.py",
                  "--ignore=tests/integration/test_records_and_batches.py",
                  # issue 18 and 19's end-to-end tests on torch and paddle (preflight, a module's operations,
                  # three-way sessions): the same reasoning, about 90 s a leg
                  "--ignore=tests/integration/test_preflight.py", "--ignore=tests/integration/test_operations.py",
                  "--ignore=tests/integration/test_three_way.py")
_ALL = (("unit", ()), ("integration", _LATEST_ONLY))
#: The fault and load tests check the server, whose code is the same in every leg; they run where the
#: lowest and the newest grpcio and protobuf are (oldest, latest), not again where only numpy,
#: paddleformers or Python differ (about 3 minutes a leg: chaos, load, record and replay, and the server killed mid-run;
#: the journal's in-process tests run everywhere, sqlite3 comes with each Python).
_NO_FAULTS_ARGS = ("--ignore=tests/integration/test_chaos.py", "--ignore=tests/integration/test_load.py",
                  # recordings are the server's files: as the journal, lowest and newest grpcio/protobuf
                  # (their unit tests run everywhere)
                  "--ignore=tests/integration/test_record_replay.py", *_LATEST_ONLY, *_EXTREMES_ONLY)
#: The server's edge behaviours (bad input and fuzzing, limits, TLS and tokens, policies, session status, the
#: journal across restarts): server code, the same in every leg, over grpcio, protobuf and sqlite3, whose lowest
#: and newest versions are in oldest and latest; not again where only numpy, paddleformers or Python differ
#: (about 70 s a leg; their unit tests run everywhere).
_SERVER_EDGE = tuple(f"--ignore=tests/integration/test_{name}.py" for name in (
    "bad_input", "fuzz", "limits", "security", "server_policies", "session_status", "durable_sessions"))
#: MindSpore (issue 19) is installed in the two numpy-1.x legs only (its wheels need numpy 1.x): paddleformers
#: (MindSpore 2.10) and oldest (2.7).  The paddleformers leg also runs the MindSpore docs page, which the
#: latest leg, where every other page runs, skips for want of MindSpore.
_MINDSPORE_DOCS_TOO = ("-k", "not test_docs or mindspore")
_NO_FAULTS = (("unit", ()), ("integration", (*_NO_FAULTS_ARGS, *_SERVER_EDGE)))

#: In the order they run.  Why each runs what it runs: README, "Supported environments".
LEGS = (
    Leg("latest", "numpy 2.x, torch 2.13, paddle 3.3.1, the real-port test bed (paddleformers without its pins)",
        (("unit", ()), ("integration", ()), ("ports", ())), 4),
    Leg("paddleformers", "paddleformers installed the ordinary way: numpy 1.26.4, real ports faithful and buggy",
        # Every model faithful, every bug of the corpus on Phi3: the code paths of all three models, in a third
        # of the time; both libraries' Trainers with twinstep's callbacks, with paddleformers' own dependencies;
        # and the MindSpore port (MindSpore needs numpy 1.x: this leg and oldest have it, oldest has no ports).
        (("unit", ()),
         ("integration", (*[a for a in _NO_FAULTS_ARGS if a != "--ignore=tests/integration/test_docs.py"],
                          "--ignore=tests/integration/test_zero_code.py", *_SERVER_EDGE, *_MINDSPORE_DOCS_TOO)),
         ("ports", ("-k", "faithful or phi3 or trainer or mindspore"))), 8),
    Leg("oldest", "the lowest supported versions: Python 3.10, numpy 1.26.0, torch 2.4.1, paddle 3.0.0, grpcio 1.85.1",
        _ALL, 13),
    Leg("newest-python", "Python 3.13 with numpy 2.5, torch 2.13, paddle 3.3.1", _NO_FAULTS, 10),
)

_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected)")


@dataclass
class Outcome:
    leg: str
    counts: dict[str, int] = field(default_factory=dict)
    build_seconds: float = 0.0
    test_seconds: float = 0.0
    tiers: dict[str, float] = field(default_factory=dict)
    """Seconds of each tier's pytest run."""
    problem: str = ""


#: The dashboard's browser test drives Debian's Chromium through its chromedriver.
BROWSER = ("/usr/bin/chromium", "/usr/bin/chromedriver")
BROWSER_PACKAGES = ("chromium", "chromium-driver")


def _install_browser() -> subprocess.Popen | None:
    """Start installing Chromium and chromedriver when missing (Debian, as root); None when not needed or not possible.

    It runs while the first leg builds; the integration tier waits for it.
    """
    if all(os.path.exists(path) for path in BROWSER):
        return None
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/apt-get"):
        print(f"== browser: {' and '.join(BROWSER)} missing and cannot be installed here (needs root and apt-get): "
              "the dashboard's browser test will be skipped", flush=True)
        return None
    print(f"== browser: installing {' '.join(BROWSER_PACKAGES)} (apt-get) in the background", flush=True)
    log = open(ROOT / ".venvs" / "browser.install.log", "w")
    script = f"apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {' '.join(BROWSER_PACKAGES)}"
    return subprocess.Popen(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT)


def _wait_for_browser(install: subprocess.Popen | None, since: float) -> None:
    if install is None or install.returncode is not None:
        return
    code = install.wait()
    ok = code == 0 and all(os.path.exists(path) for path in BROWSER)
    print(f"== browser: {'installed' if ok else f'install failed (exit {code}; .venvs/browser.install.log)'} "
          f"{time.monotonic() - since:.0f} s after the start", flush=True)


def _free_gb() -> float:
    return shutil.disk_usage(ROOT / ".venvs").free / 2**30


def _make_room(leg: Leg, tested: list[str], testing: str | None) -> bool:
    """Remove the environments of legs already tested while the disk cannot hold ``leg``'s build.

    Four legs take about 22 GB, two of them with torch's CUDA wheels; a machine with less free disk would
    fail the later builds half-way.  A removed environment is rebuilt by the next run, which costs minutes;
    a failed build costs the leg.  False: still short, and the leg ``testing`` now will free its share
    once its tests end, so the build should wait for that rather than start.
    """
    existing = ROOT / ".venvs" / leg.name
    # An up-to-date environment is kept (nothing to download); a stale one is removed before the rebuild.
    held = sum(f.stat().st_size for f in existing.rglob("*") if f.is_file() and not f.is_symlink()) / 2**30 \
        if existing.is_dir() else 0.0
    need = max(0.0, leg.disk_gb - held)
    free = _free_gb()
    while free < need and tested:
        victim = tested.pop(0)
        shutil.rmtree(ROOT / ".venvs" / victim, ignore_errors=True)
        now = _free_gb()
        print(f"== disk: {free:.1f} GB free, leg {leg.name} needs about {need:.0f} GB more: removed .venvs/{victim} "
              f"(tested; the next run rebuilds it), {now:.1f} GB free", flush=True)
        free = now
    if free < need and testing:
        print(f"== disk: {free:.1f} GB free, leg {leg.name} needs about {need:.0f} GB more: it builds once leg "
              f"{testing}'s tests end", flush=True)
        return False
    if free < need:
        print(f"== disk: WARNING: {free:.1f} GB free, leg {leg.name} needs about {need:.0f} GB more; "
              "building anyway", flush=True)
    return True


def _build(leg: str) -> subprocess.Popen:
    log = open(ROOT / ".venvs" / f"{leg}.build.log", "w")
    return subprocess.Popen(["bash", str(HERE / "build.sh"), leg], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _counts(output: str) -> dict[str, int]:
    """The counts of pytest's closing line."""
    lines = [line for line in output.splitlines() if " in " in line and _SUMMARY.search(line)]
    if not lines:
        return {}
    counts: dict[str, int] = {}
    for number, word in _SUMMARY.findall(lines[-1]):
        key = "errors" if word.startswith("error") else word
        counts[key] = counts.get(key, 0) + int(number)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--legs", default=",".join(leg.name for leg in LEGS),
                        help="comma-separated legs (default: all): " + ", ".join(leg.name for leg in LEGS))
    parser.add_argument("--tiers", default=",".join(TIERS), help="comma-separated tiers (default: all): "
                        + ", ".join(TIERS))
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments for every leg")
    args = parser.parse_args(argv)
    tiers = args.tiers.split(",")
    if set(tiers) - set(TIERS):
        parser.error(f"unknown tier(s) {', '.join(sorted(set(tiers) - set(TIERS)))}")
    chosen = [leg for leg in LEGS if leg.name in args.legs.split(",")]
    unknown = set(args.legs.split(",")) - {leg.name for leg in LEGS}
    if unknown or not chosen:
        parser.error(f"unknown leg(s) {', '.join(sorted(unknown)) or '(none)'}")
    (ROOT / ".venvs").mkdir(exist_ok=True)

    started = time.monotonic()
    browser = _install_browser() if "integration" in tiers else None
    # Build the first leg now, the others one after another in the background.
    builds: dict[str, tuple[subprocess.Popen, float]] = {}
    pending = list(chosen)
    tested: list[str] = []
    """Legs whose tests have finished, oldest first: their environments may go when the disk is short."""
    outcomes: list[Outcome] = []

    def start_next_build(testing: str | None = None) -> None:
        """Start the next pending build unless one is running (or the disk waits for ``testing`` to end)."""
        if pending and not any(proc is not None and proc.poll() is None for proc, _ in builds.values()):
            if _make_room(pending[0], tested, testing):
                leg = pending.pop(0)
                builds[leg.name] = (_build(leg.name), time.monotonic())

    for leg in chosen:
        outcome = Outcome(leg.name)
        outcomes.append(outcome)
        while leg.name not in builds or builds[leg.name][0].poll() is None:
            start_next_build()
            time.sleep(1)
        proc, _ = builds[leg.name]
        log = (ROOT / ".venvs" / f"{leg.name}.build.log").read_text()
        built = re.search(r"built in (\d+)s", log)
        outcome.build_seconds = float(built.group(1)) if built else 0.0  # 0: up to date
        print(f"== leg {leg.name}: {leg.what}", flush=True)
        print("\n".join("   " + line for line in log.strip().splitlines()[-3:]), flush=True)
        if proc.returncode != 0:
            outcome.problem = f"build failed (exit {proc.returncode}); see .venvs/{leg.name}.build.log"
            print(f"== leg {leg.name}: {outcome.problem}\n{log[-4000:]}", flush=True)
            tested.append(leg.name)  # a half-built environment is only in the way
            start_next_build()
            continue
        start_next_build(testing=leg.name)  # the next leg builds while this one tests
        python = ROOT / ".venvs" / leg.name / "bin" / "python"
        for tier, selection in [(t, sel) for t, sel in leg.tiers if t in tiers]:
            if tier == "integration":
                _wait_for_browser(browser, started)
            command = [str(python), "-m", "pytest", "-p", "no:cacheprovider", TIERS[tier], *selection,
                       *args.pytest_args]
            print(f"== leg {leg.name}, tier {tier}: {' '.join(command[1:])}", flush=True)
            tests_started = time.monotonic()
            result = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, "TWINSTEP_TEST_LEG": leg.name})
            seconds = time.monotonic() - tests_started
            outcome.test_seconds += seconds
            outcome.tiers[tier] = seconds
            sys.stdout.write(result.stdout)
            counts = _counts(result.stdout)
            for key, value in counts.items():
                outcome.counts[key] = outcome.counts.get(key, 0) + value
            if result.returncode not in (0, 5) and not counts.get("failed") and not counts.get("errors"):
                outcome.problem = outcome.problem or f"pytest exited {result.returncode} in tier {tier}"
            if not counts.get("passed"):
                outcome.problem = outcome.problem or f"no test ran in tier {tier}"
        tested.append(leg.name)
        start_next_build()

    print("\n== summary (seconds to build the leg, 0 when up to date / seconds of tests)", flush=True)
    totals = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for outcome in outcomes:
        for key in totals:
            totals[key] += outcome.counts.get(key, 0)
        shown = ", ".join(f"{n} {k}" for k, n in outcome.counts.items()) or "no tests"
        tiers = " ".join(f"{tier} {seconds:.0f}" for tier, seconds in outcome.tiers.items())
        print(f"  {outcome.leg:<14} {outcome.build_seconds:6.0f} {outcome.test_seconds:6.0f}  ({tiers})  {shown}"
              + (f"  PROBLEM: {outcome.problem}" if outcome.problem else ""))
    print(f"  wall time {time.monotonic() - started:.0f} s")
    failed = totals["failed"] + totals["errors"]
    ok = not failed and not any(o.problem for o in outcomes)
    print(f"{totals['passed']} passed, {failed} failed, {totals['skipped']} skipped", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
