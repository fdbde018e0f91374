"""Measure how far a faithful pair drifts in each precision: the low-precision tolerance factors.

    python benchmarks/calibrate_dtype.py [--steps 10] [--dtypes float32 bfloat16 float16]

Paddle has no bfloat16/float16 CPU kernels for matmul, so a torch-vs-paddle port
cannot run in low precision on this machine.  The pair here is the closest
faithful stand-in that can: Hugging Face Phi3 (tests/ports) with the eager
attention formula on one thread, against the same weights with PyTorch's SDPA
kernel on two threads (another attention kernel and another GEMM blocking,
so accumulation orders differ as they do between frameworks).  Both train
with AdamW on the same data under ``torch.autocast`` (mixed precision: float32
master weights, low-precision products), attached to one embedded twinstep
server.  The server's headroom (worst value of every metric per phase, over all
steps) is printed per precision, with the factor over the float32 defaults that
leaves the same 10x headroom the float32 defaults leave on real ports; then the
errors its modules create (the forward floors of server/detect/origin.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.modules.setdefault("torchcodec", None)  # type: ignore[arg-type]  # see tests/ports/torch_job.py

import numpy as np  # noqa: E402

from benchmarks.origin_calibration import envelope_cells, forward_envelope  # noqa: E402
from tests.ports import models  # noqa: E402
from tests.ports.torch_job import TorchPort  # noqa: E402

PHASES = ("forward", "loss", "backward", "grad", "param")
#: The float32 defaults leave at least this much room on the faithful ports (docs/tolerances.md).
HEADROOM = 10.0


def train_pair(dtype: str, steps: int, server: str, session: str, capture: str) -> None:
    import torch

    import twinstep

    autocast = None if dtype == "float32" else getattr(torch, dtype)
    spec = models.spec("phi3")
    runs = []
    for name, attention, threads in (("eager", "eager", 1), ("sdpa", "sdpa", 2)):
        port = TorchPort(spec, seed=0)
        port.model.config._attn_implementation = attention
        # precision="fp32": the CPU has no TF32; the low-precision records say bfloat16/float16 themselves.
        mon = twinstep.attach(port.model, session=session, run=name, baseline=name == "eager", server=server,
                              precision="fp32", capture=capture)
        runs.append((port, mon, threads))
    for step in range(steps):
        for port, mon, threads in runs:
            torch.set_num_threads(threads)
            ids, tgt = port.batch(step)
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                logits = port.logits(ids)
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
            loss.backward()
            port.opt.step()
            mon.step(loss=loss)
            port.zero_grad()
    for _, mon, _ in runs:
        mon.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    p.add_argument("--capture", choices=("stats", "tensors"), default="tensors",
                   help="tensors: also the element-wise metrics (rel_l2, cosine)")
    args = p.parse_args(argv)

    from twinstep.server import serve
    from twinstep.server.compare.tolerance import DTYPE_SCALE, ToleranceConfig

    defaults = ToleranceConfig()
    handle = serve(port=0)
    needed: dict[str, float] = {}
    created: dict[tuple[str, str, str], np.ndarray] = {}
    try:
        for dtype in args.dtypes:
            session = f"calibrate-{dtype}"
            start = time.perf_counter()
            tracker = handle.registry.get_or_create(session).core.pipeline.tracker
            seen: list = []
            add = tracker.add
            tracker.add = lambda comparison, add=add, seen=seen: (seen.append(comparison), add(comparison))[-1]
            train_pair(dtype, args.steps, handle.address, session, args.capture)
            deadline = time.monotonic() + 30
            report = handle.report_proto(session)
            while report.steps_compared < args.steps and time.monotonic() < deadline:
                time.sleep(0.2)  # the last steps may still be in flight to the server
                report = handle.report_proto(session)
            print(f"\n{dtype}: {report.steps_compared} steps compared in {time.perf_counter() - start:.0f} s, "
                  f"status {report.status}")
            print(f"  {'phase':<8} {'metric':<8} {'worst':>9}  {'fp32 default':>12}  {'factor for 10x room':>19}  where")
            worst_factor = 0.0
            for phase in PHASES:
                for h in sorted((h for h in report.headroom if h.phase == phase), key=lambda h: h.metric):
                    default = defaults.for_record(phase, h.module, "float32").get(h.metric, math.inf)
                    if not math.isfinite(default) or default <= 0:
                        continue
                    factor = h.value * HEADROOM / default
                    worst_factor = max(worst_factor, factor)
                    print(f"  {phase:<8} {h.metric:<8} {h.value:9.2e}  {default:12.1e}  {factor:19.2f}  "
                          f"{h.module or '(model)'} step {h.step} ({h.dtype})")
            needed[dtype] = worst_factor
            forward_envelope(seen, args.steps, created)
        print("\nfactor over the float32 defaults that leaves 10x room on this pair, against the one in use:")
        for dtype, factor in needed.items():
            print(f"  {dtype:<9} needs {factor:8.2f}   DTYPE_SCALE[{dtype!r}] = {DTYPE_SCALE.get(dtype, {})}")
        print("\ncreated forward errors on this pair (largest per calibrated step; origin.FORWARD_ENVELOPE):")
        for key, line in sorted(created.items()):
            print(f"  {key!r}: (" + ", ".join(f"{v:.1e}" for v in envelope_cells(line, args.steps)) + "),")
    finally:
        handle.stop(grace=0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
