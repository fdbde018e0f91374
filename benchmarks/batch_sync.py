"""What batch sync costs per step: the baseline's publish_batch, the candidate's baseline_batch, the wire.

    python benchmarks/batch_sync.py [--steps 50] [--batch 8] [--seq 2048] [--candidate torch|paddle] [--lockstep]

A server in a process of its own (``twinstep serve``, loopback).  A torch
baseline publishes {"input_ids", "labels"} (int64 [batch, seq], token ids
below 32,000) every step; then a candidate fetches every step's batch as its
framework's tensors.  Printed: the baseline's training-thread time per
publish_batch (the host copy; encoding and sending run on a background
thread), the candidate's time per baseline_batch once the batch waits on the
server (one round trip, decompression, the tensors built), and the bytes on
the wire against the raw bytes.  ``--lockstep`` runs both at once, the
candidate one step behind at most, and prints the candidate's wait per step
as well.

Measured here (a 2-core CPU box under a load average of 4.5 from other work,
so the tails are noisy; Python 3.11, torch 2.13, paddle 3.3.1; 8 x 2048 int64
input ids and labels, 256 KiB raw per step, 50 steps; `python
benchmarks/batch_sync.py`, `--candidate paddle`, `--lockstep`):

    baseline publish_batch (training thread):  median 0.18-0.28 ms, p90 2.3-7.6 ms
    candidate baseline_batch, torch:           median 2.6 ms, p90 6.6 ms (lockstep: 3.9 ms, 9.1 ms)
    candidate baseline_batch, paddle:          median 1.8 ms, p90 7.0 ms
    wire: 65 KiB per step for 256 KiB raw (zstd, 4.0x)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import twinstep  # noqa: E402


def start_server() -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "twinstep", "serve", "--port", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        found = re.search(r"listening on (\S+)", line)
        if found:
            threading.Thread(target=process.stdout.read, daemon=True).start()
            return process, found.group(1)
    raise SystemExit("twinstep serve did not start")


def describe(label: str, seconds: list[float]) -> str:
    ms = sorted(s * 1e3 for s in seconds)
    return (f"{label:<44} median {statistics.median(ms):.2f} ms, mean {statistics.fmean(ms):.2f} ms, "
            f"p90 {ms[int(0.9 * (len(ms) - 1))]:.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--candidate", choices=("torch", "paddle"), default="torch")
    p.add_argument("--lockstep", action="store_true", help="baseline and candidate at once")
    args = p.parse_args()

    process, address = start_server()
    rng = np.random.default_rng(0)
    batches = [{"input_ids": torch.from_numpy(rng.integers(0, 32_000, size=(args.batch, args.seq))),
                "labels": torch.from_numpy(rng.integers(0, 32_000, size=(args.batch, args.seq)))}
               for _ in range(args.steps)]
    raw = sum(t.numel() * t.element_size() for t in batches[0].values())
    if args.candidate == "paddle":
        import paddle

        cand_model = paddle.nn.Linear(2, 2)
    else:
        cand_model = torch.nn.Linear(2, 2)
    base = twinstep.attach(torch.nn.Linear(2, 2), session="bench", run="torch", baseline=True, server=address)
    cand = twinstep.attach(cand_model, session="bench", run=f"port-{args.candidate}", server=address,
                           lockstep=1 if args.lockstep else 0)
    publish: list[float] = []
    fetch: list[float] = []

    def baseline() -> None:
        for batch in batches:
            started = time.perf_counter()
            base.publish_batch(batch)
            publish.append(time.perf_counter() - started)
            base.step()
        base.close(timeout=60)

    try:
        if args.lockstep:
            thread = threading.Thread(target=baseline)
            thread.start()
        else:
            baseline()
        for _ in range(args.steps):
            started = time.perf_counter()
            got = cand.baseline_batch(timeout=60)
            fetch.append(time.perf_counter() - started)
            cand.step()
        if args.lockstep:
            thread.join()
        cand.close(timeout=10)
        print(f"{args.steps} steps of {args.batch} x {args.seq} int64 input_ids and labels ({raw / 1024:.0f} KiB raw "
              f"per step), candidate {args.candidate}{', lockstep' if args.lockstep else ''}")
        print(describe("baseline publish_batch (training thread)", publish[1:]))
        print(describe(f"candidate baseline_batch ({args.candidate})", fetch[1:]))
        wire = base.batch_stats
        stats = base._batches.publish_stats  # bytes sent, for this figure only
        print(f"wire: {stats.bytes_sent / args.steps / 1024:.0f} KiB per step for {raw / 1024:.0f} KiB raw "
              f"({raw * args.steps / max(stats.bytes_sent, 1):.1f}x); published {wire['published']}, "
              f"dropped {wire['dropped'] or 'none'}; last batch dtype {got['input_ids'].dtype}")
    finally:
        process.terminate()
        process.wait(10)


if __name__ == "__main__":
    main()
