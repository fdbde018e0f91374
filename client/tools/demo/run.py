"""``twinstep demo``: an embedded server and two real training processes.

The torch job is the baseline; the paddle job (or a MindSpore job, or both:
``--candidate paddle,mindspore``, a three-way session) is its port, carrying
one porting bug unless ``--no-bug``.  All run in lockstep (each may lead the
others by one step) so the halt visibly stops every job.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading

from twinstep.cli.main import format_event
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.server.report.render import render_text
from twinstep.server import serve
from twinstep.server.memory import retain_freed_memory

_SESSION = "demo"
_JOB_TIMEOUT = 600.0
#: A line of progress every this many compared steps: the jobs print their own steps.
_PROGRESS_EVERY = 5
#: The demo's last lines: where to go from here, with one's own model.
NEXT_STEPS = (
    'next: your own model and its port: docs/getting-started.md ("Your own two trainings")',
    "  without editing a script: twinstep serve, then twinstep run --server 127.0.0.1:50051 --session S "
    "--run torch --baseline -- python train.py",
)


class DemoEvents:
    """The server's events as the demo shows them: each halt once, progress now and then.

    The server publishes one halt per run and a progress event per step; the demo's
    reader wants to see what happened once, between the jobs' own step lines.
    """

    def __init__(self) -> None:
        self._halts: set[str] = set()
        self._compared = 0

    def line(self, event: pb.Event) -> str:
        kind = event.WhichOneof("body")
        if kind == "progress":
            compared = event.progress.steps_compared
            if compared < self._compared + _PROGRESS_EVERY:
                return ""
            self._compared = compared
            runs = ", ".join(f"{r.name} at step {r.last_step}" for r in event.progress.runs)
            return f"[demo] {compared} steps compared ({runs})"
        if kind == "halt":
            if event.halt.reason in self._halts:
                return ""
            self._halts.add(event.halt.reason)
            return f"[demo] HALT every run of the session: {event.halt.reason}"
        if kind == "alert" and event.alert.kind == "preflight":
            # A set-up difference found before step 0 (docs/preflight.md): a finding of the demo, not a log line.
            return f"[demo] PREFLIGHT {event.alert.message.replace('preflight: ', '', 1)}"
        return format_event(event)


def job_command(framework: str, server: str, *, steps: int, bug: str | None, capture: str, baseline: bool, extra: list[str] | None = None) -> list[str]:
    """Command line of one demo training job (also used by the tests)."""
    cmd = [
        sys.executable, "-m", "twinstep.tools.demo.job",
        "--framework", framework,
        "--run", framework,
        "--server", server,
        "--steps", str(steps),
        "--capture", capture,
    ]
    if baseline:
        cmd.append("--baseline")
    if bug:
        cmd += ["--bug", bug]
    return cmd + (extra or [])


def _pipe(process: subprocess.Popen[str], lock: threading.Lock) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        with lock:
            print("  " + line.rstrip(), flush=True)


#: Frameworks a demo candidate can be written in (client/tools/demo/model_*.py).
CANDIDATES = ("paddle", "mindspore")


def parse_candidates(text: str, bug: str | None) -> tuple[list[str], dict[str, str | None]]:
    """(candidate frameworks, the bug each carries) from ``--candidate``; ValueError saying what is wrong."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CANDIDATES]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"--candidate takes {' or '.join(CANDIDATES)}, or both comma-separated, got {text!r}")
    return names, {name: bug for name in names}  # every candidate carries the bug


def mindspore_refusal(mindspore_version: str | None, numpy_version: str | None) -> str | None:
    """Why a MindSpore candidate cannot run here, with the fix, or None (versions as installed; None: absent).

    MindSpore 2.x wheels are built against numpy 1.x: under numpy 2 the job would start, warn, fail in
    MindSpore's own operators and leave the demo INCOMPLETE (twinstep.runtime.environment).
    """
    from twinstep.runtime.environment import parse_version

    if mindspore_version is None:
        return ("MindSpore is not installed: pip install 'twinstep[mindspore]' (it brings the numpy<2 "
                "MindSpore 2.x needs)")
    if parse_version(mindspore_version)[:1] == (2,) and numpy_version and parse_version(numpy_version) >= (2,):
        return (f"MindSpore 2.x needs numpy<2: pip install 'numpy<2' (installed here: mindspore {mindspore_version} "
                f"with numpy {numpy_version}, under which MindSpore's own operators fail)")
    return None


def run_demo(bug: str | None, steps: int = 20, capture: str = "stats", http_port: int | None = None,
             candidates: str = "paddle") -> int:
    """``http_port``: also serve the dashboard there (0: a free port); on a terminal it stays up after the
    runs end until Ctrl-C, so the diverged session can be looked at.  ``candidates``: "paddle",
    "mindspore" or "paddle,mindspore" (a three-way session)."""
    try:
        ports, bugs = parse_candidates(candidates, bug)
    except ValueError as error:
        print(f"twinstep demo: {error}", file=sys.stderr)
        return 2
    if "mindspore" in ports:  # refused before any server or job starts, with the fix
        from twinstep.runtime.environment import installed_version

        refusal = mindspore_refusal(installed_version("mindspore"), installed_version("numpy"))
        if refusal is not None:
            print(f"twinstep demo: {refusal}", file=sys.stderr)
            return 2
    retain_freed_memory()  # the demo's process is the server's own; its jobs are separate processes
    # The server's log repeats the events shown below; keep only its errors on the terminal.
    logging.getLogger("twinstep.server").setLevel(logging.ERROR)
    handle = serve(port=0, halt_on_divergence=True, http_port=http_port)
    print(f"twinstep demo: server on {handle.address}; torch baseline vs {' and '.join(ports)} "
          f"port{'s' if len(ports) > 1 else ''} ({'porting bug: ' + bug if bug else 'faithful'}), {steps} steps",
          flush=True)
    if handle.http_url:
        print(f"twinstep demo: dashboard at {handle.http_url}sessions/{_SESSION}", flush=True)
    session = handle.registry.get_or_create(_SESSION)
    events = session.events.subscribe()
    lock = threading.Lock()
    stop = threading.Event()
    shown = DemoEvents()

    def show_events() -> None:
        while not stop.is_set():
            try:
                event = events.get(timeout=0.2)
            except Exception:
                continue
            if event is None:
                return
            line = shown.line(event)
            if line:
                with lock:
                    print(line, flush=True)

    watcher = threading.Thread(target=show_events, name="twinstep-demo-watch", daemon=True)
    watcher.start()
    env = dict(os.environ, TWINSTEP_SESSION=_SESSION, PYTHONUNBUFFERED="1")
    processes = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for framework, job_bug, baseline in (("torch", None, True), *((p, bugs[p], False) for p in ports)):
                cmd = job_command(framework, handle.address, steps=steps, bug=job_bug, capture=capture,
                                  baseline=baseline, extra=["--lockstep", "1", "--session", _SESSION, "--quiet"])
                process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp)
                processes.append(process)
                threading.Thread(target=_pipe, args=(process, lock), daemon=True).start()
            codes = [p.wait(timeout=_JOB_TIMEOUT) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
        stop.set()
        session.events.unsubscribe(events)
        watcher.join(1.0)
    report = handle.report_proto(_SESSION)
    if handle.http_url and sys.stdin.isatty():
        print("twinstep demo: the dashboard stays up; press Ctrl-C to stop", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
    handle.stop(grace=1.0)
    print()
    print(render_text(report), flush=True)
    if any(codes):
        print(f"twinstep demo: a training job failed (exit codes {codes})", file=sys.stderr)
        return 1
    expected = "diverged" if bug else "aligned"
    if report.status != expected or (bug and not all(r.state == "halted" for r in report.runs)):
        print(f"twinstep demo: expected the session to be {expected}"
              f"{' with both jobs halted' if bug else ''}, got {report.status}", file=sys.stderr)
        return 1
    print()
    print("\n".join(NEXT_STEPS), flush=True)
    return 0
