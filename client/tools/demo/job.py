"""Demo training job: `python -m twinstep.tools.demo.job --framework torch|paddle|mindspore ...`.

Trains the spec.py LM in one framework, optionally under twinstep, so two of these
jobs (e.g. torch baseline vs paddle port, or with an injected --bug) can be compared
live. The loss is computed here rather than in the model so both ports share one
definition of the training objective.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from typing import Any

from . import spec

LR = 1e-3
BUGGY_LR = 1.1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01


class TorchTrainer:
    """Torch model, optional DDP wrapper and AdamW; imports torch only when a torch job runs."""

    def __init__(self, cfg: spec.ModelConfig, lr: float, world_size: int, dist_init: str = "env://") -> None:
        import torch

        from .model_torch import build_model

        torch.set_num_threads(1)
        torch.manual_seed(cfg.seed)
        self.torch = torch
        self.inner = build_model(cfg, spec.init_weights(cfg))
        self.model: Any = self.inner
        self.distributed = world_size > 1
        if self.distributed:
            # RANK/WORLD_SIZE come from the environment; the rendezvous from dist_init (env://: MASTER_ADDR/PORT).
            torch.distributed.init_process_group(backend="gloo", init_method=dist_init,
                                                 rank=int(os.environ["RANK"]), world_size=world_size)
            self.model = torch.nn.parallel.DistributedDataParallel(self.inner)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
        )

    def train_step(self, ids: Any, tgt: Any) -> Any:
        """Forward, next-token cross-entropy, backward and optimizer step; returns the loss tensor."""
        torch = self.torch
        logits = self.model(torch.from_numpy(ids))
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.from_numpy(tgt).reshape(-1)
        )
        loss.backward()
        self.opt.step()
        return loss

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def close(self) -> None:
        if self.distributed:
            self.torch.distributed.destroy_process_group()


class PaddleTrainer:
    """Paddle model and AdamW; imports paddle only when a paddle job runs."""

    def __init__(self, cfg: spec.ModelConfig, lr: float, world_size: int, dist_init: str = "env://") -> None:
        if world_size > 1:
            raise SystemExit("twinstep demo: multi-rank training is only implemented for --framework torch")
        # OpenMP reads this at import time; one thread keeps two jobs light on a small box.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="No ccache found")
            import paddle

        from .model_paddle import build_model

        paddle.set_device("cpu")
        paddle.seed(cfg.seed)
        self.paddle = paddle
        self.inner = build_model(cfg, spec.init_weights(cfg))
        self.model = self.inner
        # Paddle's AdamW kernel decays decoupled with the raw lr (p *= 1 - lr*wd), as torch does.
        self.opt = paddle.optimizer.AdamW(
            learning_rate=lr,
            parameters=self.model.parameters(),
            beta1=BETAS[0],
            beta2=BETAS[1],
            epsilon=EPS,
            weight_decay=WEIGHT_DECAY,
        )

    def train_step(self, ids: Any, tgt: Any) -> Any:
        """Forward, next-token cross-entropy, backward and optimizer step; returns the loss tensor."""
        paddle = self.paddle
        logits = self.model(paddle.to_tensor(ids))
        loss = paddle.nn.functional.cross_entropy(
            logits.reshape([-1, logits.shape[-1]]), paddle.to_tensor(tgt).reshape([-1])
        )
        loss.backward()
        self.opt.step()
        return loss

    def zero_grad(self) -> None:
        self.opt.clear_grad()

    def close(self) -> None:
        pass


class MindSporeTrainer:
    """MindSpore model (PyNative) and AdamW; imports MindSpore only when a MindSpore job runs.

    MindSpore returns the gradients from ``value_and_grad`` and the optimizer takes them
    as its argument; the monitor follows that call (attach's ``optimizer=``).
    """

    def __init__(self, cfg: spec.ModelConfig, lr: float, world_size: int, dist_init: str = "env://") -> None:
        if world_size > 1:
            raise SystemExit("twinstep demo: multi-rank training is only implemented for --framework torch")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import mindspore
        from mindspore.experimental import optim

        from .model_mindspore import build_model

        mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
        mindspore.set_seed(cfg.seed)
        self.mindspore = mindspore
        self.inner = build_model(cfg, spec.init_weights(cfg))
        self.model = self.inner
        # torch's AdamW, bias correction and decoupled decay included (nn.AdamWeightDecay has no bias correction).
        self.opt = optim.AdamW(self.inner.trainable_params(), lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

        def loss_of(ids: Any, tgt: Any) -> Any:
            logits = self.inner(ids)
            return mindspore.ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

        self._value_and_grad = mindspore.value_and_grad(loss_of, None, self.opt.parameters)

    def train_step(self, ids: Any, tgt: Any) -> Any:
        """Forward, next-token cross-entropy, gradients and optimizer step; returns the loss tensor."""
        Tensor = self.mindspore.Tensor
        loss, grads = self._value_and_grad(Tensor(ids), Tensor(tgt))
        self.opt(grads)
        return loss

    def zero_grad(self) -> None:
        pass  # MindSpore's gradients are values, not state on the parameters

    def close(self) -> None:
        pass


_TRAINERS = {"torch": TorchTrainer, "paddle": PaddleTrainer, "mindspore": MindSporeTrainer}


class _NoMonitor:
    """Stands in for the twinstep monitor when the job trains on its own (--no-monitor)."""

    def step(self, loss: Any) -> None:
        pass

    def close(self) -> None:
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m twinstep.tools.demo.job", description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=tuple(_TRAINERS), required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--session", default=os.environ.get("TWINSTEP_SESSION", "demo"))
    p.add_argument("--run", default=None, help="run name (default: the framework)")
    p.add_argument("--baseline", action="store_true", help="this run is the one the others are judged against")
    p.add_argument("--reference", action="store_true", help="this run is a rerun of the baseline measuring its noise")
    p.add_argument("--server", default=os.environ.get("TWINSTEP_SERVER"))
    p.add_argument("--bug", choices=("none", "gelu_tanh", "lr", "attn_scale"), default="none",
                   help="inject a divergence: tanh GELU in layers.1.mlp.act (MindSpore's nn.GELU default), "
                        "or lr 1.1e-3, or (paddle) "
                        "attention scores divided by sqrt(head_dim + 1) inline in layers.0.attn's forward")
    p.add_argument("--capture", choices=("stats", "tensors", "lossy"), default="stats")
    p.add_argument("--sketch", action="store_true", help="also send a count-sketch of every floating tensor")
    p.add_argument("--sender", choices=("auto", "thread", "process"), default="auto",
                   help="where full tensors are encoded and sent (twinstep.attach's sender)")
    p.add_argument("--no-monitor", action="store_true", help="train without twinstep")
    p.add_argument("--step-delay", type=float, default=0.0, metavar="SECONDS",
                   help="sleep per step (simulate a slow job)")
    p.add_argument("--lockstep", type=int, default=0, metavar="N",
                   help="wait while this run leads the other by N steps (0: never wait)")
    p.add_argument("--every", type=int, default=1, metavar="N", help="capture every N-th step (twinstep.attach's every)")
    p.add_argument("--start-step", type=int, default=0, metavar="N",
                   help="train N steps before attaching, then attach with start_step=N (a run that joins late)")
    p.add_argument("--max-queue-steps", type=int, default=256, metavar="N",
                   help="steps held while the server is behind or away (twinstep.attach's max_queue_steps)")
    p.add_argument("--dist-init", default="env://", metavar="URL",
                   help="torch.distributed rendezvous for multi-rank runs (env://, or file:///path shared by the ranks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--share-weights", action="store_true",
                   help="baseline: share the initial weights with candidates that ask for them (docs/weight-sync.md)")
    p.add_argument("--init-from-baseline", action="store_true",
                   help="start from other random weights, then load the baseline's through twinstep "
                        "(the baseline runs with --share-weights)")
    p.add_argument("--result-file", default=None, metavar="PATH", help="write a JSON summary here at exit")
    p.add_argument("--quiet", action="store_true",
                   help="no twinstep warnings and a short halt line: `twinstep demo` shows the server's events itself")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = args.run or args.framework
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # torchrun's RANK, else paddle.distributed.launch's PADDLE_TRAINER_ID: each rank trains on its own batches.
    rank = int(os.environ.get("RANK", os.environ.get("PADDLE_TRAINER_ID", "0")))
    prefix = f"[{run}]" if world_size == 1 else f"[{run}:{rank}]"
    cfg = spec.ModelConfig(seed=args.seed, tanh_gelu_layers=(1,) if args.bug == "gelu_tanh" else (),
                           attn_scale_layers=(0,) if args.bug == "attn_scale" else ())
    lr = BUGGY_LR if args.bug == "lr" else LR

    # --init-from-baseline: the model starts from weights of another seed; only twinstep makes them the baseline's.
    model_cfg = dataclasses.replace(cfg, seed=cfg.seed + 1) if args.init_from_baseline else cfg
    trainer = _TRAINERS[args.framework](model_cfg, lr, world_size, args.dist_init)
    losses: list[float] = []
    for step in range(min(args.start_step, args.steps)):  # before attaching: no twinstep at all
        ids, tgt = spec.batch(step, rank, cfg)
        losses.append(float(trainer.train_step(ids, tgt).item()))
        print(f"{prefix} step {step} loss {losses[-1]:.6f} (not attached yet)", flush=True)
        trainer.zero_grad()
    if args.no_monitor:
        mon: Any = _NoMonitor()
        halted_type: Any = ()  # an empty tuple in `except` catches nothing
    else:
        import logging

        import twinstep

        if args.quiet:  # the demo prints every divergence and halt once, from the server's events
            logging.getLogger("twinstep").setLevel(logging.ERROR)
        mon = twinstep.attach(
            trainer.inner, session=args.session, run=run, baseline=args.baseline, reference=args.reference,
            server=args.server, capture=args.capture, sketch=args.sketch, lockstep=args.lockstep, sender=args.sender,
            every=args.every, start_step=args.start_step, max_queue_steps=args.max_queue_steps,
            # MindSpore's parameter gradients are captured where its optimizer receives them
            # (and every framework's optimizer set-up is diffed before step 0: docs/preflight.md)
            optimizer=trainer.opt,
            share_weights=args.share_weights or None, init_from_baseline=args.init_from_baseline or None,
        )
        halted_type = twinstep.Halted

    halted, halt_reason, halt_step = False, None, None
    try:
        for step in range(args.start_step, args.steps):
            ids, tgt = spec.batch(step, rank, cfg)
            loss = trainer.train_step(ids, tgt)
            losses.append(float(loss.item()))
            print(f"{prefix} step {step} loss {losses[-1]:.6f}", flush=True)
            mon.step(loss=loss)
            trainer.zero_grad()
            if args.step_delay > 0:
                time.sleep(args.step_delay)
    except halted_type as h:
        halted, halt_reason, halt_step = True, h.reason, h.step
        print(f"{prefix} halted at step {h.step}" + ("" if args.quiet else f": {h.reason}"), flush=True)
    finally:
        mon.close()
        trainer.close()
        if args.result_file:
            result = {
                "steps_completed": len(losses),  # optimizer steps taken, including a step whose report halted
                "halted": halted,
                "halt_reason": halt_reason,
                "halt_step": halt_step,
                "losses": losses,
                "rank": rank,
            }
            if not args.no_monitor:
                stats = mon.stats
                result.update(steps_sent=stats.steps_sent, dropped=dict(stats.dropped), tensor_bytes=stats.tensor_bytes,
                              bundles=mon.bundles)
            with open(args.result_file, "w") as f:
                json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
