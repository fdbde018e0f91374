"""What a zoom costs a training: step time of zoomed steps against the others.

    python benchmarks/zoom_cost.py [--framework torch|paddle] [--hidden 256] [--layers 4] [--steps 120]
                                   [--module 'layers.1.*'] [--zoom-steps 20]

One training (the demo transformer, AdamW, one thread) attached with
capture="stats", timed in this process; a second run of the same model (the
candidate, in the same framework) trains in a process of its own (in
lockstep by default: then the timed run also waits for the candidate and the
server to keep up), and the server (`twinstep serve`) runs in a third, so it compares
what it gets without sharing this process.  ``--no-candidate`` times the run
alone with the server: what the zoom itself costs a training (on this 2-core
machine the two trainings, their senders and the server's full-tensor
comparisons otherwise compete for the cores).
From the baseline's step 20 a zoom asks for full tensors of ``--module`` for
``--zoom-steps`` steps (the server picks the first step, as twinstep zoom
does).  Prints the median step time (forward, backward, optimizer and
mon.step) outside and inside the window, for the module and for every module
('*'), and the tensor bytes sent.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time


def build(framework: str, hidden: int, layers: int):
    from twinstep.tools.demo import spec
    from twinstep.tools.demo.job import PaddleTrainer, TorchTrainer

    cfg = spec.ModelConfig(hidden=hidden, layers=layers, seq=64, batch=8, heads=4)
    trainer = (TorchTrainer if framework == "torch" else PaddleTrainer)(cfg, 1e-3, 1)
    return cfg, trainer


def train(framework, hidden, layers, steps, session, run, baseline, address, times, started, lockstep):
    import twinstep
    from twinstep.tools.demo import spec

    cfg, trainer = build(framework, hidden, layers)
    mon = twinstep.attach(trainer.inner, session=session, run=run, baseline=baseline, server=address, lockstep=lockstep)
    if started is not None:
        started.set()
    for step in range(steps):
        ids, tgt = spec.batch(step, 0, cfg)
        t0 = time.perf_counter()
        loss = trainer.train_step(ids, tgt)
        mon.step(loss=loss)
        trainer.zero_grad()
        times.append(time.perf_counter() - t0)
    times.append(mon.stats.tensor_bytes)
    mon.close()


def measure(args, module: str, session: str, address: str) -> tuple[float, float, int, tuple[int, int]]:
    import multiprocessing

    import grpc

    from twinstep.v1 import twinstep_pb2 as pb
    from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

    times: list = []
    answers: list = []
    candidate = multiprocessing.get_context("spawn").Process(
        target=train, args=(args.framework, args.hidden, args.layers, args.steps, session, "cand", False,
                            address, [], None, args.lockstep))
    if not args.no_candidate:
        candidate.start()

    def zoom_at_step_20() -> None:  # the timed training stays on the main thread (paddle's dygraph mode is per thread)
        while len(times) < 20:
            time.sleep(0.01)
        with grpc.insecure_channel(address) as channel:
            answers.append(pb_grpc.TwinstepStub(channel).Zoom(
                pb.ZoomRequest(session=session, modules=[module], capture="tensors", steps=args.zoom_steps),
                timeout=30))

    asker = threading.Thread(target=zoom_at_step_20, daemon=True)
    asker.start()
    train(args.framework, args.hidden, args.layers, args.steps, session, "base", True, address, times, None,
          args.lockstep)
    asker.join(30)
    if not args.no_candidate:
        candidate.join()
    answer = answers[0]
    step_times, tensor_bytes = times[:-1], times[-1]
    window = range(answer.first_step, answer.last_step + 1)
    inside = [t for s, t in enumerate(step_times) if s in window]
    outside = [t for s, t in enumerate(step_times) if s not in window and s >= 5]
    return statistics.median(outside), statistics.median(inside), tensor_bytes, (answer.first_step, answer.last_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "paddle"), default="torch")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--module", default="layers.1.*")
    parser.add_argument("--zoom-steps", type=int, default=20)
    parser.add_argument("--no-candidate", action="store_true",
                        help="the timed run alone with the server (what the zoom costs the training itself)")
    parser.add_argument("--lockstep", type=int, default=2,
                        help="attach's lockstep for both runs (0: the timed run never waits for the other or the server)")
    args = parser.parse_args()

    import re
    import subprocess
    import sys

    server = subprocess.Popen([sys.executable, "-m", "twinstep", "serve", "--port", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        for line in server.stdout:
            found = re.search(r"listening on (\S+)", line)
            if found:
                address = found.group(1)
                threading.Thread(target=server.stdout.read, daemon=True).start()
                break
        else:
            raise SystemExit("twinstep serve did not start")
        for number, module in enumerate((args.module, "*")):
            outside, inside, sent, window = measure(args, module, f"zoom-cost-{number}", address)
            print(f"{args.framework} hidden {args.hidden} x {args.layers} layers, zoom {module!r} in tensors, steps "
                  f"{window[0]}-{window[1]}: median step {outside * 1e3:.1f} ms outside the window, "
                  f"{inside * 1e3:.1f} ms inside ({inside / outside:.2f}x); {sent / 1e6:.1f} MB of tensors sent")
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
