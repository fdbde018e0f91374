"""Baseline job of the real-model test bed: a transformers (torch) model trained under twinstep.

    python -m tests.ports.torch_job --model phi3 --weights /tmp/w.npz --baseline --server HOST:PORT

It creates the random initial weights (seeded by --seed), writes them to --weights
in torch names and layouts for the paddle job to load, then trains with AdamW on
models.batch() data. This process never imports paddle nor paddleformers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import loop, models


class TorchPort:
    """A transformers causal LM, its AdamW and the job's loss; imports torch on construction."""

    def __init__(self, spec: models.ModelSpec, seed: int) -> None:
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
        self._init_weights(seed)
        self.model.train()
        params = dict(self.model.named_parameters())
        groups = [
            {"params": [p for n, p in params.items() if models.decays(n)], "weight_decay": models.WEIGHT_DECAY},
            {"params": [p for n, p in params.items() if not models.decays(n)], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=models.LR, betas=models.BETAS, eps=models.EPS)

    def _init_weights(self, seed: int) -> None:
        """Draw every parameter from models.init_std with a generator of its own, in name order,
        so the weights depend only on the seed, not on the library's init code."""
        gen = self.torch.Generator().manual_seed(seed)
        with self.torch.no_grad():
            for name, p in sorted(self.model.named_parameters()):
                std = models.init_std(name, tuple(p.shape))
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
        """Forward, next-token cross-entropy (mean over all B*S tokens), backward, AdamW step."""
        logits = self.logits(ids)
        loss = self.torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        loss.backward()
        self.opt.step()
        return loss

    def zero_grad(self) -> None:
        self.opt.zero_grad()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return loop.parser("python -m tests.ports.torch_job", __doc__.splitlines()[0], "torch").parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = models.spec(args.model)
    trainer = TorchPort(spec, args.seed)
    models.save_weights(args.weights, trainer.state(), {"model": spec.name, "seed": args.seed})
    return loop.run(args, trainer, {"framework": "torch"})


if __name__ == "__main__":
    sys.exit(main())
