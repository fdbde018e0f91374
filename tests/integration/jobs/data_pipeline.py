"""A training whose data pipeline and learning-rate schedule can differ from its twin's (docs/records-and-batches.md).

    python -m tests.integration.jobs.data_pipeline --framework torch --baseline --publish --record ids ...
    python -m tests.integration.jobs.data_pipeline --framework paddle --order-bug 2 --sync --record ids ...

The demo LM (twinstep.tools.demo) in torch or paddle, trained by a loop written out
here so that values are recorded where a training would record them: the
batch's input ids and labels before the forward (``--record ids``), the
learning rate after the backward (``--record lr``).  Its data loader may hand
out batches in another order from step K on (``--order-bug K``: steps K and
K+1 swapped), and its schedule may halve the learning rate one step early
(``--lr-bug``: from step DECAY_AT-1).  ``--publish`` (a baseline) publishes
each batch; ``--sync`` (a candidate) trains on the baseline's batch instead
of its own loader's.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import twinstep
from twinstep.tools.demo import spec
from twinstep.tools.demo.job import LR, PaddleTrainer, TorchTrainer

#: The schedule: constant, halved from this step on (the buggy run halves one step early).
DECAY_AT = 4


def learning_rate(step: int, bug: bool) -> float:
    return LR * (0.5 if step >= DECAY_AT - (1 if bug else 0) else 1.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=("torch", "paddle"), required=True)
    p.add_argument("--server", required=True)
    p.add_argument("--session", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--order-bug", type=int, default=-1, metavar="K", help="the loader swaps steps K and K+1")
    p.add_argument("--lr-bug", action="store_true", help="the schedule decays one step early")
    p.add_argument("--record", action="append", default=[], choices=("ids", "lr"))
    p.add_argument("--publish", action="store_true", help="publish each batch (a baseline)")
    p.add_argument("--sync", action="store_true", help="train on the baseline's batches (a candidate)")
    p.add_argument("--result-file", required=True)
    args = p.parse_args()

    cfg = spec.ModelConfig()
    trainer = (TorchTrainer if args.framework == "torch" else PaddleTrainer)(cfg, LR, 1)
    fw = trainer.torch if args.framework == "torch" else trainer.paddle
    mon = twinstep.attach(trainer.inner, session=args.session, run=args.run, baseline=args.baseline,
                          server=args.server, batch_timeout=60)
    order = list(range(args.steps + 1))
    if args.order_bug >= 0:
        order[args.order_bug], order[args.order_bug + 1] = order[args.order_bug + 1], order[args.order_bug]
    losses = []
    for step in range(args.steps):
        ids, labels = spec.batch(order[step], 0, cfg)
        batch = {"input_ids": fw.to_tensor(ids) if args.framework == "paddle" else fw.from_numpy(ids),
                 "labels": fw.to_tensor(labels) if args.framework == "paddle" else fw.from_numpy(labels)}
        if args.publish:
            mon.publish_batch(batch)
        if args.sync:
            batch = mon.baseline_batch()
        if "ids" in args.record:
            mon.record("input_ids", batch["input_ids"])
            mon.record("labels", batch["labels"])
        logits = trainer.model(batch["input_ids"])
        if args.framework == "torch":
            loss = fw.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), batch["labels"].reshape(-1))
        else:
            loss = fw.nn.functional.cross_entropy(logits.reshape([-1, cfg.vocab]), batch["labels"].reshape([-1]))
        loss.backward()
        lr = learning_rate(step, args.lr_bug)
        if "lr" in args.record:
            mon.record("lr", lr)
        if args.framework == "torch":
            for group in trainer.opt.param_groups:
                group["lr"] = lr
        else:
            trainer.opt.set_lr(lr)
        trainer.opt.step()
        losses.append(float(loss.item()))
        mon.step(loss=loss)
        trainer.zero_grad()
    mon.close()
    with open(args.result_file, "w") as f:
        json.dump({"losses": losses, "batch_stats": mon.batch_stats,
                   "dtypes": [str(batch["input_ids"].dtype), str(batch["labels"].dtype)],
                   "ids_sum": int(np.asarray(batch["input_ids"].numpy()).sum())}, f)


if __name__ == "__main__":
    main()
