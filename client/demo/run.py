"""``twinstep demo``: an embedded server and two real training processes.

The torch job is the baseline; the paddle job is its port, carrying one
porting bug unless ``--no-bug``.  Both run in lockstep (each may lead the other
by one step) so the halt visibly stops both.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading

from twinstep.cli.main import format_event
from twinstep.server.report.render import render_text
from twinstep.server import serve
from twinstep.server.memory import retain_freed_memory

_SESSION = "demo"
_JOB_TIMEOUT = 600.0


def job_command(framework: str, server: str, *, steps: int, bug: str | None, capture: str, baseline: bool, extra: list[str] | None = None) -> list[str]:
    """Command line of one demo training job (also used by the tests)."""
    cmd = [
        sys.executable, "-m", "twinstep.demo.job",
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


def run_demo(bug: str | None, steps: int = 20, capture: str = "stats") -> int:
    retain_freed_memory()  # the demo's process is the server's own; its jobs are separate processes
    handle = serve(port=0, halt_on_divergence=True)
    print(f"twinstep demo: server on {handle.address}; torch baseline vs paddle port "
          f"({'porting bug: ' + bug if bug else 'faithful port'}), {steps} steps", flush=True)
    session = handle.registry.get_or_create(_SESSION)
    events = session.events.subscribe()
    lock = threading.Lock()
    stop = threading.Event()

    def show_events() -> None:
        while not stop.is_set():
            try:
                event = events.get(timeout=0.2)
            except Exception:
                continue
            if event is None:
                return
            line = format_event(event)
            if line:
                with lock:
                    print(line, flush=True)

    watcher = threading.Thread(target=show_events, name="twinstep-demo-watch", daemon=True)
    watcher.start()
    env = dict(os.environ, TWINSTEP_SESSION=_SESSION, PYTHONUNBUFFERED="1")
    processes = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for framework, job_bug, baseline in (("torch", None, True), ("paddle", bug, False)):
                cmd = job_command(framework, handle.address, steps=steps, bug=job_bug, capture=capture,
                                  baseline=baseline, extra=["--lockstep", "1", "--session", _SESSION])
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
    return 0
