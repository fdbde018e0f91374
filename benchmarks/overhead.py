"""Step-time overhead of twinstep's hooks: hooked vs unhooked, measured in one run.

    python benchmarks/overhead.py [--framework torch|paddle|both] [--hidden 256] [--steps 20]

The model is the demo transformer at issue 4's reference size (4 layers, hidden
256, seq 128, batch 8, CPU).  Two copies with identical weights train side by
side; blocks of plain and hooked steps alternate so machine noise hits both.
The server runs in its own process, as it would in production.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twinstep.demo import spec  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_trainer(framework: str, cfg: spec.ModelConfig):
    from twinstep.demo.job import PaddleTrainer, TorchTrainer

    return (TorchTrainer if framework == "torch" else PaddleTrainer)(cfg, 1e-3, 1)


def time_steps(trainer, mon, cfg, steps: list[int]) -> list[float]:
    times = []
    for step in steps:
        ids, tgt = spec.batch(step, 0, cfg)
        start = time.perf_counter()
        loss = trainer.train_step(ids, tgt)
        if mon is not None:
            mon.step(loss=loss)
        trainer.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def measure(framework: str, cfg: spec.ModelConfig, server: str, capture: str, steps: int, block: int) -> dict[str, float]:
    import twinstep

    plain = make_trainer(framework, cfg)
    hooked = make_trainer(framework, cfg)
    mon = twinstep.attach(hooked.inner, session=f"bench-{framework}-{capture}-{time.time()}", run=framework,
                          baseline=True, server=server, capture=capture)
    time_steps(plain, None, cfg, range(2))  # warm up both
    time_steps(hooked, mon, cfg, range(2))
    t_plain: list[float] = []
    t_hooked: list[float] = []
    for start in range(2, 2 + steps, block):
        chunk = list(range(start, min(start + block, 2 + steps)))
        t_plain += time_steps(plain, None, cfg, chunk)
        t_hooked += time_steps(hooked, mon, cfg, chunk)
    mon.close()
    sent = mon.stats.steps_sent
    return {
        "plain_ms": 1000 * statistics.median(t_plain),
        "hooked_ms": 1000 * statistics.median(t_hooked),
        "ratio": statistics.median(t_hooked) / statistics.median(t_plain),
        "sent": sent,
        "dropped": sum(mon.stats.dropped.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "paddle", "both"), default="both")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--capture", choices=("stats", "tensors", "both"), default="both")
    args = parser.parse_args()
    cfg = spec.ModelConfig(vocab=512, hidden=args.hidden, heads=4, layers=args.layers, seq=args.seq, batch=args.batch)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "twinstep", "serve", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        frameworks = ("torch", "paddle") if args.framework == "both" else (args.framework,)
        captures = ("stats", "tensors") if args.capture == "both" else (args.capture,)
        print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}; "
              f"{args.steps} timed steps per side, median")
        print(f"{'framework':<10}{'capture':<9}{'unhooked ms':>12}{'hooked ms':>11}{'ratio':>8}{'sent':>6}{'dropped':>9}")
        for framework in frameworks:
            for capture in captures:
                r = measure(framework, cfg, f"127.0.0.1:{port}", capture, args.steps, args.block)
                print(f"{framework:<10}{capture:<9}{r['plain_ms']:>12.1f}{r['hooked_ms']:>11.1f}{r['ratio']:>8.3f}"
                      f"{r['sent']:>6}{r['dropped']:>9}", flush=True)
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
