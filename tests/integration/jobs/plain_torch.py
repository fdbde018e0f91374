"""An unmodified torch training: the demo LM, a plain loop, no twinstep in it (``twinstep run`` attaches).

    python tests/integration/jobs/plain_torch.py --steps 5 [--bug gelu_tanh] [--accumulate 2]
    torchrun --nproc_per_node 2 tests/integration/jobs/plain_torch.py   # DDP over gloo, CPU

Weights and batches come from twinstep.tools.demo.spec, so this job and plain_paddle.py
compute the same thing.  ``--explicit-attach`` is the same loop with
``twinstep.attach(model)`` and ``mon.step(loss)`` written in (its settings from
the environment): the twin that ``twinstep run``'s verdicts are checked against.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from twinstep.tools.demo import spec
from twinstep.tools.demo.model_torch import build_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bug", choices=("none", "gelu_tanh", "lr"), default="none")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches (backward calls) per optimizer step")
    p.add_argument("--explicit-attach", action="store_true")
    p.add_argument("--hidden", type=int, default=spec.ModelConfig.hidden, help="model width (benchmarks/zero_code.py)")
    p.add_argument("--quiet", action="store_true", help="no line per step")
    args = p.parse_args()

    torch.set_num_threads(1)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cfg = spec.ModelConfig(hidden=args.hidden, tanh_gelu_layers=(1,) if args.bug == "gelu_tanh" else ())
    model = build_model(cfg, spec.init_weights(cfg))
    inner = model
    if world_size > 1:
        torch.distributed.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1.1e-3 if args.bug == "lr" else 1e-3, betas=(0.9, 0.999),
                            eps=1e-8, weight_decay=0.01)
    mon = None
    if args.explicit_attach:
        import twinstep

        mon = twinstep.attach(inner)
    started = time.perf_counter()
    for step in range(args.steps):
        if step == 1:  # the rate leaves out step 0 (attach, first-call costs)
            started = time.perf_counter()
        total = None
        for micro in range(args.accumulate):
            ids, tgt = spec.batch(step * args.accumulate + micro, rank, cfg)
            logits = model(torch.from_numpy(ids))
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), torch.from_numpy(tgt).reshape(-1))
            loss = loss / args.accumulate
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        opt.step()
        if mon is not None:
            mon.step(loss=total)
        opt.zero_grad()
        if not args.quiet:
            print(f"[torch:{rank}] step {step} loss {float(total):.6f}", flush=True)
    if args.steps > 1:
        print(f"[torch:{rank}] {(args.steps - 1) / (time.perf_counter() - started):.2f} steps/s after step 0", flush=True)
    if mon is not None:
        mon.close()
    if world_size > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
