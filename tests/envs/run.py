"""Run the whole test suite in every supported environment: the README's test command and CI's.

    python3 tests/envs/run.py                  every leg, each with its tests (below)
    python3 tests/envs/run.py --quick          the quick loop while developing: the latest leg's unit
                                               tier and the integration tests marked quick (2 to 3 minutes)
    python3 tests/envs/run.py --legs latest    some legs only
    python3 tests/envs/run.py --tiers unit     some tiers only (unit, integration, ports)
    python3 tests/envs/run.py -- -x -k halt    extra pytest arguments for every leg
    python3 tests/envs/run.py --list           which legs run each integration module, and why

A leg runs the unit tier, its integration modules (the table INTEGRATION in this
file) and the real ports where it has them: a leg exists to prove versions, so a
test runs again only in the legs whose versions it exercises.

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

#: What differs between the legs (tests/envs/LEG.txt), so what a test can prove by running in more than one:
#:   torch, paddle   oldest 2.4.1, 3.0.0; latest, paddleformers and newest-python 2.13, 3.3.1
#:   numpy           oldest 1.26.0, paddleformers 1.26.4, latest 2.4, newest-python 2.5
#:   Python          oldest 3.10, latest and paddleformers 3.11, newest-python 3.13
#:   MindSpore       paddleformers 2.10, oldest 2.7 (its wheels need numpy 1.x; none elsewhere)
#:   grpcio/protobuf oldest 1.85.1/7.35.1, the others 1.85.3/7.36.2
#: The unit tier runs in every leg (about a minute: in-process servers over real gRPC, reconnects, the journal,
#: every codec and kernel), so an integration module runs again only where the versions it exercises differ.
EVERY = ("latest", "paddleformers", "oldest", "newest-python")
VERSIONS = ("latest", "oldest", "newest-python")
"""Both ends of torch's and paddle's ranges, and of numpy's and Python's."""
FRAMEWORKS = ("latest", "oldest")
"""Both ends of torch's and paddle's ranges."""
MINDSPORE = ("paddleformers", "oldest")
ONCE = ("latest",)
"""Code that does not vary with any version the legs differ in: run once."""


@dataclass(frozen=True)
class Row:
    legs: tuple[str, ...]
    why: str
    quick: bool = False
    """Also in the quick loop (--quick): the unit tier and these, 2 to 3 minutes on two cores."""


#: Which legs run each integration module, and why: the one place that says it (a unit test checks that every
#: module of tests/integration has its row).  A key is a file of tests/integration, or a test of one.
INTEGRATION: dict[str, Row] = {
    # The pair every user runs: each leg's torch, paddle, numpy and Python, end to end, in every capture mode.
    "test_end_to_end.py": Row(EVERY, "the demo pair (torch, paddle) in stats, tensor, lossy and sketch capture; a halt",
                              quick=True),
    "test_compare_inprocess.py": Row(EVERY, "twinstep.compare: a torch model and its paddle port in one process",
                                     quick=True),
    # Python's and numpy's ends too.
    "test_sender_process.py": Row(VERSIONS, "a sender process over shared memory: Python's multiprocessing, numpy"),
    "test_zero_code.py": Row(VERSIONS, "`twinstep run`: a sitecustomize bootstrap (Python's) and import hooks into "
                             "torch and paddle"),
    "test_weight_sync.py": Row(VERSIONS, "weights converted between torch's and paddle's layouts"),
    # torch's and paddle's APIs beyond the demo's: their ends.
    "test_capture_health.py": Row(FRAMEWORKS, "capture that fails inside a framework's hooks", quick=True),
    "test_multirank_and_failures.py": Row(FRAMEWORKS, "torch.distributed ranks halted at one step; trainings "
                                          "that outlive their server"),
    "test_zoom.py": Row(FRAMEWORKS, "full tensors of one module on request, across ranks"),
    "test_reproduce.py": Row(FRAMEWORKS, "reproducer bundles: a framework's module pickled and replayed"),
    "test_records_and_batches.py": Row(FRAMEWORKS, "named records and batch sync through each framework"),
    "test_preflight.py": Row(FRAMEWORKS, "optimizer set-ups read from torch and paddle", quick=True),
    "test_while_it_runs.py": Row(FRAMEWORKS, "verdicts that can still change, zooms that never ran, training-side "
                                 "log lines under paddle's logging"),
    "test_first_hour_pair.py": Row(FRAMEWORKS, "a new user's own small torch/paddle pair: a norm epsilon found where "
                                   "it starts, tied to its preflight finding"),
    "test_operations.py": Row(FRAMEWORKS, "operations inside a module, traced in each framework"),
    "test_three_way.py": Row(FRAMEWORKS, "several candidates, MindSpore's among them where installed", quick=True),
    # Parallel layouts: run in the latest leg only (torch 2.13); torch 2.4's DTensor lives in torch.distributed._tensor,
    # which the capture code also reads, untested.
    "test_parallel_layouts.py": Row(ONCE, "TP=2 and DP=2 against one process under torch.distributed.run "
                                    "(parallelize_module, DTensor, DDP): merged per logical tensor; torch 2.4's "
                                    "tensor-parallel API is not exercised"),
    "test_capture_parallel.py": Row(ONCE, "placements captured from DTensors, torch tensor parallelism, DDP, paddle "
                                    "fleet and a declared layout, in real processes over gloo"),
    "test_capture_megatron.py": Row(ONCE, "Megatron-core's parallel layers (skipped where megatron-core is not "
                                    "installed, as in CI)"),
    "test_mindspore_demo.py": Row(MINDSPORE, "the MindSpore port of the demo (skips where MindSpore is not)"),
    "test_weight_sync_mindspore_demo.py": Row(MINDSPORE, "weights into MindSpore's parameter names"),
    # The server over raw streams: its code is the same in every leg, but what it parses is protobuf's, whose
    # lowest version is oldest's (seconds in all).
    "test_bad_input.py": Row(FRAMEWORKS, "bad input: clear statuses", quick=True),
    "test_fuzz.py": Row(FRAMEWORKS, "hostile bytes and messages from hypothesis", quick=True),
    "test_tensor_pieces.py": Row(FRAMEWORKS, "tensors in pieces; malformed pieces refused", quick=True),
    "test_limits.py": Row(FRAMEWORKS, "limits, memory budget", quick=True),
    "test_session_status.py": Row(FRAMEWORKS, "a session's verdict once its runs end", quick=True),
    "test_server_policies.py": Row(FRAMEWORKS, "renamed modules, bounded windows, late joiners", quick=True),
    "test_layout_sessions.py": Row(ONCE, "runs of different layouts merged per logical tensor, raw streams",
                                   quick=True),
    "test_mapping_resolution.py": Row(FRAMEWORKS, "the mapping a candidate is compared with", quick=True),
    "test_watch.py": Row(FRAMEWORKS, "watching a session before it exists", quick=True),
    # Once: faults, load and restarts of the server (grpcio's reconnects and sqlite3 are the unit tier's in every
    # leg), and the user-facing surfaces (command line, docs, alerts, dashboard), none of which varies with a
    # framework's version.  Their unit tests run everywhere.
    "test_chaos.py": Row(ONCE, "links cut, delayed and held; processes killed and stopped"),
    "test_load.py": Row(ONCE, "64 streams against one server process"),
    "test_durable_sessions.py": Row(ONCE, "a server killed mid-run and restarted on its journal"),
    # Ray is installed (the `ray` extra) in this leg only; the module skips where it is not.
    "test_sharded_server.py": Row(("paddleformers",), "the comparison sharded on Ray: the embedded server's report, "
                                                      "a shard killed and one stopped"),
    "test_sharded_sessions.py": Row(ONCE, "the sharded server's coordinator, front and merges (shards in one process)"),
    "test_shards_on_ray.py": Row(("paddleformers",), "shards as Ray actors: a local instance's CPUs, a shard Ray "
                                                     "restarts, a cluster of its own that outlives the front"),
    "test_record_replay.py": Row(ONCE, "record and replay across server processes"),
    "test_security.py": Row(ONCE, "TLS, mutual TLS and tokens"),
    "test_coverage.py": Row(ONCE, "gaps named and coverage said: the server's bookkeeping, the client's queue"),
    "test_cli.py": Row(ONCE, "the command line against a server process"),
    "test_never_reached.py": Row(ONCE, "a run that never reaches its server ends at once and says so"),
    "test_live_views.py": Row(ONCE, "steps behind and halts in the dashboard and watch"),
    "test_reading_the_report.py": Row(ONCE, "the demo's report read as a user reads it, and the kept page"),
    "test_alerts.py": Row(ONCE, "Prometheus, webhooks, the terminal watch"),
    "test_dashboard.py": Row(ONCE, "the dashboard in a headless Chromium"),
    "test_docs.py": Row(ONCE, "the docs pages' examples and command lines"),
    # The MindSpore page's examples need MindSpore, which latest lacks.
    "test_docs.py::test_python_examples_run[mindspore]": Row(("paddleformers",), "docs/mindspore.md's examples"),
    "test_docs.py::test_command_lines_parse[mindspore]": Row(("paddleformers",), "docs/mindspore.md's commands"),
    "test_docs.py::test_python_examples_run[scale]": Row(("paddleformers",), "docs/scale.md's example (Ray)"),
}


def table() -> str:
    """INTEGRATION as text: per module, a column per leg (x: runs there, q: and in the quick loop), and why."""
    names = [leg.name for leg in LEGS]
    width = max(map(len, INTEGRATION))
    lines = [f"{'tests/integration/':<{width}}  " + "  ".join(names) + "  why"]
    for key, row in INTEGRATION.items():
        marks = "  ".join(f"{(('q' if row.quick else 'x') if name in row.legs else '.'):^{len(name)}}"
                          for name in names)
        lines.append(f"{key:<{width}}  {marks}  {row.why}")
    lines.append("x: runs in that leg; q: and in the quick loop (--quick); every leg runs the whole unit tier")
    return "\n".join(lines)


def integration(leg: str, quick: bool = False) -> tuple[str, ...]:
    """The integration tier's pytest arguments for ``leg``: its files and tests of INTEGRATION, in table order."""
    return tuple(f"{TIERS['integration']}/{key}" for key, row in INTEGRATION.items()
                 if leg in row.legs and (row.quick or not quick))


@dataclass(frozen=True)
class Leg:
    name: str
    what: str
    """What the leg proves."""
    tiers: tuple[tuple[str, tuple[str, ...]], ...]
    """(tier, pytest arguments: what to run of it), in the order they run."""
    disk_gb: float
    """Free disk its build needs: the environment plus pip's downloads, which sit beside it until installed
    (measured sizes: latest 2.3 GB, paddleformers 5.5, oldest 8.4 and newest-python 5.8, the last two with
    torch's CUDA wheels from PyPI)."""


def _tiers(leg: str, ports: tuple[str, ...] | None = None) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The unit tier, the leg's integration modules, and the ports (``ports``: pytest arguments) where it has them."""
    tiers = (("unit", (TIERS["unit"],)), ("integration", integration(leg)))
    return tiers if ports is None else (*tiers, ("ports", (TIERS["ports"], *ports)))


#: In the order they run.  Why each runs what it runs: docs/testing.md, "Legs", and INTEGRATION above.
LEGS = (
    Leg("latest", "numpy 2.x, torch 2.13, paddle 3.3.1, the real-port test bed (paddleformers without its pins)",
        _tiers("latest", ports=()), 4),
    # Of the ports: every model faithful (the code paths of all three models with paddleformers' own dependencies),
    # both libraries' Trainers with twinstep's callbacks, and the MindSpore port with its bugs and its benchmark
    # twin (MindSpore needs numpy 1.x: this leg and oldest have it, oldest has no ports).  The torch/paddle bug
    # corpus runs in latest: the same model code, its bugs found by the same server.
    Leg("paddleformers", "paddleformers installed the ordinary way: numpy 1.26.4, real ports, MindSpore 2.10",
        _tiers("paddleformers", ports=("-k", "faithful or trainer or mindspore or ms_phi3")), 8),
    Leg("oldest", "the lowest supported versions: Python 3.10, numpy 1.26.0, torch 2.4.1, paddle 3.0.0, grpcio 1.85.1",
        _tiers("oldest"), 13),
    Leg("newest-python", "Python 3.13 with numpy 2.5, torch 2.13, paddle 3.3.1", _tiers("newest-python"), 10),
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
    summary, _, usage = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(description=summary, epilog=usage,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="the quick loop: the unit tier and the integration tests marked quick, in the latest leg "
                             "(or those --legs names); 2 to 3 minutes")
    parser.add_argument("--legs", default=None,
                        help="comma-separated legs (default: all; latest with --quick): "
                             + ", ".join(leg.name for leg in LEGS))
    parser.add_argument("--tiers", default=None, help="comma-separated tiers (default: all; unit,integration with "
                        "--quick): " + ", ".join(TIERS))
    parser.add_argument("--list", action="store_true", help="print which legs run each integration module, and why")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments for every leg")
    args = parser.parse_args(argv)
    if args.list:
        print(table())
        return 0
    if args.legs is None:
        args.legs = "latest" if args.quick else ",".join(leg.name for leg in LEGS)
    if args.tiers is None:
        args.tiers = "unit,integration" if args.quick else ",".join(TIERS)
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
                if args.quick:
                    selection = integration(leg.name, quick=True)
            command = [str(python), "-m", "pytest", "-p", "no:cacheprovider", *selection, *args.pytest_args]
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
