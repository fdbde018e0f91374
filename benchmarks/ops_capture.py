"""What capturing one module's operations costs: the step that captures them, and every step after (nothing).

    python benchmarks/ops_capture.py [--framework torch|paddle] [--module layers.0.attn] [--steps 30] [--hidden 256]

The demo LM (twinstep.tools.demo, CPU, one thread) trains with AdamW; the module's
operations are captured (twinstep.runtime.capture.ops, as ``twinstep zoom --ops``
arms it: full values within bounds) in one step out of every five.  Printed:
the median step time of plain steps before any capture, of the capturing
steps, and of plain steps after captures (the wrappers and the mode are gone:
the same time as before), plus the operations per capture and the bytes of
the trace a step carries.

Measured here under a load average of 14-16 on 2 cores from other work (so
only the sign and rough size hold; rerun on a quiet machine): Python 3.11,
torch 2.13, paddle 3.3.1, hidden 256, batch 4 x 16, 30 steps:

    torch  layers.0.attn: plain 27.9-29.4 ms, capturing 52.8-79.2 ms (20 operations), after every capture
           29.4-31.5 ms; trace 1.1 MB
    paddle layers.0.attn: plain 76.7 ms, capturing 96.3 ms (+19.6 ms, 19 operations), after every capture
           73.3 ms; trace 1.0 MB

A step with no capture asked installs nothing (no mode, no wrapper, no hook):
"after every capture" is "plain" within the noise.  The steps between
captures measured slower under this load (torch 44-54 ms), not explained yet.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "paddle"), default="torch")
    parser.add_argument("--module", default="layers.0.attn")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()

    from twinstep.runtime.capture.ops import OpsCapture
    from twinstep.tools.demo import spec
    from twinstep.v1 import twinstep_pb2 as pb

    cfg = spec.ModelConfig(hidden=args.hidden)
    weights = spec.init_weights(cfg)
    if args.framework == "torch":
        import torch

        from twinstep.runtime.capture.torch import TorchBackend
        from twinstep.tools.demo.model_torch import build_model

        torch.set_num_threads(1)
        model, backend = build_model(cfg, weights), TorchBackend()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(i: int) -> None:
            ids, tgt = (torch.tensor(a) for a in spec.batch(i, 0, cfg))
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        import paddle

        from twinstep.runtime.capture.paddle import PaddleBackend
        from twinstep.tools.demo.model_paddle import build_model

        model, backend = build_model(cfg, weights), PaddleBackend()
        opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())

        def step(i: int) -> None:
            ids, tgt = (paddle.to_tensor(a) for a in spec.batch(i, 0, cfg))
            logits = model(ids)
            loss = paddle.nn.functional.cross_entropy(logits.reshape([-1, cfg.vocab]), tgt.reshape([-1]))
            loss.backward()
            opt.step()
            opt.clear_grad()

    module = dict(backend.named_modules(model))[args.module]
    for i in range(3):  # warm-up
        step(i)
    before, capturing, after, sizes, calls = [], [], [], [], []
    for i in range(args.steps):
        start = time.perf_counter()
        step(i)
        before.append(time.perf_counter() - start)
    for i in range(args.steps):
        capture = None
        if i % 5 == 0:
            capture = OpsCapture(backend, module, args.module, pb.ZoomSpec(id=i + 1, capture="tensors"), i)
            capture.arm()
        start = time.perf_counter()
        step(i)
        if capture is not None:
            trace = capture.finish()
            capturing.append(time.perf_counter() - start)
            sizes.append(len(trace))
            calls.append(len(pb.OpTrace.FromString(trace).calls))
        else:
            after.append(time.perf_counter() - start)
    done = []
    for i in range(args.steps):  # plain steps once every capture is over: nothing of them is left
        start = time.perf_counter()
        step(i)
        done.append(time.perf_counter() - start)
    plain, during, between, later = (statistics.median(x) * 1e3 for x in (before, capturing, after, done))
    print(f"{args.framework} {args.module}: plain {plain:.1f} ms, capturing {during:.1f} ms "
          f"(+{during - plain:.1f} ms, {calls[0]} operations), between captures {between:.1f} ms, "
          f"after every capture {later:.1f} ms; trace {statistics.median(sizes) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
