"""An unmodified paddle training: the demo LM ported, a plain loop, no twinstep in it (``twinstep run`` attaches).

    python tests/integration/jobs/plain_paddle.py --steps 5 [--bug gelu_tanh] [--accumulate 2]
    python -m paddle.distributed.launch --nproc_per_node 2 tests/integration/jobs/plain_paddle.py  # DataParallel, CPU

The twin of plain_torch.py (same weights, same batches); ``--explicit-attach``
writes ``twinstep.attach(model)`` and ``mon.step(loss)`` into the same loop.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when paddle loads

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="No ccache found")
    import paddle

from twinstep.tools.demo import spec  # noqa: E402
from twinstep.tools.demo.model_paddle import build_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bug", choices=("none", "gelu_tanh", "lr"), default="none")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches (backward calls) per optimizer step")
    p.add_argument("--explicit-attach", action="store_true")
    p.add_argument("--hidden", type=int, default=spec.ModelConfig.hidden, help="model width (benchmarks/zero_code.py)")
    p.add_argument("--quiet", action="store_true", help="no line per step")
    args = p.parse_args()

    paddle.set_device("cpu")
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    world_size = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    cfg = spec.ModelConfig(hidden=args.hidden, tanh_gelu_layers=(1,) if args.bug == "gelu_tanh" else ())
    model = build_model(cfg, spec.init_weights(cfg))
    inner = model
    if world_size > 1:
        paddle.distributed.init_parallel_env()
        model = paddle.DataParallel(model)
    opt = paddle.optimizer.AdamW(learning_rate=1.1e-3 if args.bug == "lr" else 1e-3, parameters=model.parameters(),
                                 beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.01)
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
            logits = model(paddle.to_tensor(ids))
            loss = paddle.nn.functional.cross_entropy(logits.reshape([-1, cfg.vocab]), paddle.to_tensor(tgt).reshape([-1]))
            loss = loss / args.accumulate
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        opt.step()
        if mon is not None:
            mon.step(loss=total)
        opt.clear_grad()
        if not args.quiet:
            print(f"[paddle:{rank}] step {step} loss {float(total):.6f}", flush=True)
    if args.steps > 1:
        print(f"[paddle:{rank}] {(args.steps - 1) / (time.perf_counter() - started):.2f} steps/s after step 0", flush=True)
    if mon is not None:
        mon.close()


if __name__ == "__main__":
    main()
