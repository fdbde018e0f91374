"""Baseline job of the real-model test bed: a transformers (torch) model trained under twinstep.

    python -m tests.ports.torch_job --model phi3 --weights /tmp/w.npz --baseline --server HOST:PORT

It creates the random initial weights (seeded by --seed; --embed-std sets the
embeddings' scale), writes them to --weights in torch names and layouts for the
paddle job to load, then trains with the optimizer of models.OPTIMIZER (AdamW by
default; --warmup adds a linear warmup) on models.batch() data. This process never
imports paddle nor paddleformers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import loop, models


class TorchPort:
    """A transformers causal LM, its optimizer and the job's loss; imports torch on construction."""

    def __init__(self, spec: models.ModelSpec, seed: int, embed_std: float | None = None, warmup: int = 0) -> None:
        import torch

        # paddleformers' dependencies may install a `torchcodec` stand-in that breaks
        # `import transformers`; this job needs no codec, so make the import fail softly.
        sys.modules.setdefault("torchcodec", None)  # type: ignore[arg-type]
        import transformers

        torch.set_num_threads(1)  # two jobs share a small machine; one thread is also deterministic
        self.torch = torch
        self.spec = spec
        self.seed = seed
        config = getattr(transformers, spec.torch_config_class)(**spec.torch_config)
        # The eager path is the reference formula (softmax(QK^T * scale) V); SDPA would pick a
        # kernel by platform. paddleformers is configured the same way.
        config._attn_implementation = "eager"
        torch.manual_seed(seed)
        self.model = getattr(transformers, spec.torch_class)(config)
        self._init_weights(seed, embed_std)
        self.model.train()
        params = dict(self.model.named_parameters())
        if models.OPTIMIZER == "adamw":
            groups = [
                {"params": [p for n, p in params.items() if models.decays(n)], "weight_decay": models.WEIGHT_DECAY},
                {"params": [p for n, p in params.items() if not models.decays(n)], "weight_decay": 0.0},
            ]
            self.opt = torch.optim.AdamW(groups, lr=models.LR, betas=models.BETAS, eps=models.EPS)
        elif models.OPTIMIZER == "adam":
            self.opt = torch.optim.Adam(list(params.values()), lr=models.LR, betas=models.BETAS, eps=models.EPS,
                                        weight_decay=0.0)
        else:
            self.opt = torch.optim.SGD(list(params.values()), lr=models.LR)
        # Advanced after every optimizer step (train_step), as paddle_job's LambdaDecay.
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, models.warmup_factor(warmup)) if warmup else None

    def _init_weights(self, seed: int, embed_std: float | None = None) -> None:
        """Draw every parameter from models.init_std with a generator of its own, in name order,
        so the weights depend only on the seed, not on the library's init code."""
        gen = self.torch.Generator().manual_seed(seed)
        with self.torch.no_grad():
            for name, p in sorted(self.model.named_parameters()):
                std = models.init_std(name, tuple(p.shape), embed_std)
                if std is not None:
                    p.copy_(self.torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)

    def state(self) -> dict[str, Any]:
        """The full state dict as float32 numpy arrays (torch names and layouts)."""
        sd = self.model.state_dict()
        named = dict(self.model.named_parameters())
        if set(sd) != set(named):
            raise RuntimeError(f"state_dict holds non-parameters: {sorted(set(sd) ^ set(named))}")
        return {k: v.detach().cpu().numpy().copy() for k, v in sd.items()}

    def batch(self, step: int) -> tuple[Any, Any]:
        ids, tgt = models.batch(step, self.seed)
        return self.torch.from_numpy(ids), self.torch.from_numpy(tgt)

    def logits(self, ids: Any) -> Any:
        return self.model(input_ids=ids).logits

    def train_step(self, ids: Any, tgt: Any) -> Any:
        """Forward, next-token cross-entropy (mean over all B*S tokens), backward, optimizer step."""
        logits = self.logits(ids)
        loss = self.torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        loss.backward()
        self.opt.step()
        if self.schedule is not None:
            self.schedule.step()
        return loss

    def zero_grad(self) -> None:
        self.opt.zero_grad()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return loop.parser("python -m tests.ports.torch_job", __doc__.splitlines()[0], "torch").parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = models.spec(args.model)
    trainer = TorchPort(spec, args.seed, args.embed_std, args.warmup)
    models.save_weights(args.weights, trainer.state(), {"model": spec.name, "seed": args.seed})
    return loop.run(args, trainer, {"framework": "torch"})


if __name__ == "__main__":
    sys.exit(main())
