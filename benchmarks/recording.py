"""Recording size per step, and how fast recordings are compared and replayed.

    python benchmarks/recording.py [--steps 50] [--capture stats|tensors] [--hidden 64]

Records the demo pair (torch baseline, paddle port with the GELU-tanh bug in
layer 1, real processes) on a server started with ``record=``, then prints:

- the recording's bytes per step and run, and what the same entries take
  uncompressed (the journal stores them so);
- ``twinstep compare-recordings`` of the two recorded runs in this process:
  steps per second through the session's comparison;
- a replay: a new server plays the recorded baseline while a second player,
  standing in for a live candidate, plays the recorded candidate as fast as
  the server takes it (both through the session's own methods): steps per
  second of the player at the candidate's pace, and that its report matches.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.conftest import Job, wait_for  # noqa: E402
from twinstep.server import ServerConfig, serve  # noqa: E402
from twinstep.server.config import RecordingConfig
from twinstep.server.record.catalog import scan  # noqa: E402
from twinstep.server.record.compare import compare_sides, resolve  # noqa: E402
from twinstep.server.record.format import RecordingReader  # noqa: E402
from twinstep.server.record.player import RecordingPlayer  # noqa: E402

DETERMINISTIC = {"TWINSTEP_JIT": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CPU_NUM": "1"}


def record(tmp: pathlib.Path, steps: int, capture: str, hidden: int) -> tuple[pathlib.Path, dict]:
    handle = serve(port=0, config=ServerConfig(recording=RecordingConfig(directory=str(tmp / "recordings"))))
    try:
        extra = ["--hidden", str(hidden)] if hidden else []
        jobs = [Job(tmp, "torch", server=handle.address, session="bench", baseline=True, steps=steps, capture=capture,
                    extra=extra, env=DETERMINISTIC),
                Job(tmp, "paddle", server=handle.address, session="bench", steps=steps, capture=capture,
                    bug="gelu_tanh", extra=extra, env=DETERMINISTIC)]
        for job in jobs:
            result = job.wait()
            assert result.returncode == 0, result.output
        wait_for(lambda: all(r["state"] != "streaming" for r in handle.report("bench")["runs"]), timeout=60)
        live = handle.report("bench")
    finally:
        handle.stop(grace=2.0)
    (path,) = (tmp / "recordings").glob("*.twrec")
    return path, live


def sizes(path: pathlib.Path) -> None:
    index = scan(path)
    stored = {name: 0 for name in index.runs}
    raw = dict(stored)
    steps = dict(stored)
    owner = {stream: name for name, run in index.runs.items() for streams in run.streams.values() for stream in streams}
    with RecordingReader(path) as reader:
        for frame in reader.frames():
            if frame.entry is None:
                continue
            name = owner[frame.head.stream]
            stored[name] += reader.position - frame.head.offset
            raw[name] += len(frame.entry.header) + len(frame.entry.payload or b"")
            steps[name] += frame.head.kind == 5
    print(f"recording {path.name}: {path.stat().st_size} bytes")
    for name in index.runs:
        print(f"  run {name:8} {steps[name]:4d} steps  {stored[name] / steps[name]:10.0f} bytes/step recorded  "
              f"{raw[name] / steps[name]:10.0f} bytes/step uncompressed ({raw[name] / stored[name]:.1f}x)")


def offline(path: pathlib.Path) -> None:
    sides = resolve(str(path), None)
    started = time.perf_counter()
    report, problems = compare_sides(sides)
    seconds = time.perf_counter() - started
    steps = sum(run.last_step + 1 for run in report.runs)
    print(f"compare-recordings: {report.steps_compared} pairs ({steps} run-steps) in {seconds:.2f} s: "
          f"{steps / seconds:.0f} run-steps/s ({report.status}, first divergence at step "
          f"{report.first_divergence.step}){' PROBLEMS: ' + '; '.join(problems) if problems else ''}")


def replay(path: pathlib.Path, live: dict) -> None:
    index = scan(path)
    handle = serve(port=0, config=ServerConfig(recording=RecordingConfig(replay={"bench": f"{path}:torch"})))
    try:
        session = handle.registry.get("bench")
        started = time.perf_counter()
        RecordingPlayer(session, path, index.run("paddle"), baseline=False).start()
        wait_for(lambda: len(rows := session.run_status()) == 2 and all(r.state != "streaming" for r in rows),
                 timeout=120)
        seconds = time.perf_counter() - started
        report = handle.report("bench")
    finally:
        handle.stop(grace=2.0)
    base = handle.recording.players["bench"]
    print(f"replay: baseline played {base.steps_played} steps at the pace of a candidate played as fast as the "
          f"server takes it: {base.steps_played / seconds:.0f} steps/s; same first divergence as live: "
          f"{report['first_divergence'] == live['first_divergence']}, steps compared {report['steps_compared']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--capture", choices=("stats", "tensors"), default="stats")
    parser.add_argument("--hidden", type=int, default=0, help="model width (default: the demo's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, live = record(pathlib.Path(tmp), args.steps, args.capture, args.hidden)
        sizes(path)
        offline(path)
        replay(path, live)


if __name__ == "__main__":
    main()
