"""Candidate job of the real-model test bed: a MindSpore port of Phi3 under twinstep.

    python -m tests.ports.mindspore_job --model phi3 --weights /tmp/w.npz --server HOST:PORT [--bug NAME]

The MindSpore counterpart of paddle_job: it waits for the torch job to write --weights,
converts them to the port's names (refusing any name or shape mismatch), then trains
exactly as the torch job does, PyNative mode, with MindSpore's functional step
(value_and_grad, then the optimizer called with the gradients; twinstep reads them
there: attach(optimizer=...)). --bug injects one realistic porting bug (see BUGS).
This process never imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from . import loop, models
from .paddle_job import (ACT_TARGET, BACKWARD_SCALE, BUGGY_LR, BUGGY_NORM_EPS, NORM_EPS_TARGET, PERMUTED_STEP,
                         UNTRANSPOSED, wait_for_weights)

#: The bugs of the corpus that a MindSpore port can have (the names of paddle_job's --bug).
BUGS: dict[str, str] = {
    "none": "faithful port",
    "norm_eps": "RMSNorm epsilon 1e-5 instead of 1e-6 in model.layers.0.input_layernorm",
    "act_variant": "layers.1.mlp.activation_fn: exact GELU instead of SiLU",
    "untransposed": "layers.0.self_attn.o_proj.weight transposed on load, as for paddle's [in, out] "
                    "(nn.Dense is [out, in], like torch)",
    "lr": "learning rate 1.1e-3 instead of 1e-3",
    "wd_on_norms": "weight decay also applied to norm weights (the baseline exempts them)",
    "custom_backward": "layers.1.mlp.activation_fn in a Cell whose hand-written bprop is 1.01x too large",
    "batch_order": "the batches of steps 3 and 4 fed in swapped order (a sampler/shuffle mismatch)",
}

# Read when mindspore loads. One OpenMP thread keeps two jobs light on a small box; MindSpore's
# warnings print whole tensors (the optimizer's compiled update, every step): errors only.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOG_v", "3")

MODELS = ("phi3",)  # the architectures ported to MindSpore (tests/ports/mindspore_phi3.py)


class MindSporePort:
    """The MindSpore Phi3 port loaded from torch weights, its AdamW and the job's loss."""

    def __init__(self, seed: int, torch_state: dict[str, Any] | None, bug: str = "none") -> None:
        import mindspore

        from . import mindspore_phi3 as phi3

        mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
        mindspore.set_seed(seed)
        self.ms = mindspore
        self.seed = seed
        self.bug = bug
        self.model = phi3.Phi3ForCausalLM()
        self.model.set_train(True)
        if torch_state is not None:  # None: the model keeps its own random weights (--init-from-baseline)
            phi3.load_torch_weights(self.model, torch_state, UNTRANSPOSED if bug == "untransposed" else frozenset())
        if bug == "norm_eps":
            phi3.cell(self.model, NORM_EPS_TARGET).variance_epsilon = BUGGY_NORM_EPS
        if bug == "act_variant":
            _set_cell(self.model, ACT_TARGET_PHI3, mindspore.nn.GELU(approximate=False))  # exact (erf) GELU
        if bug == "custom_backward":
            _set_cell(self.model, ACT_TARGET_PHI3, _scaled_grad_silu(mindspore))

        from mindspore.experimental.optim import AdamW  # torch.optim.AdamW's rule (mint's has no CPU kernel)

        named = dict(self.model.parameters_and_names())
        decayed = [p for n, p in named.items() if bug == "wd_on_norms" or models.decays(n)]
        kept = [p for n, p in named.items() if not (bug == "wd_on_norms" or models.decays(n))]
        groups = [{"params": decayed, "weight_decay": models.WEIGHT_DECAY}]
        if kept:
            groups.append({"params": kept, "weight_decay": 0.0})
        self.opt = AdamW(groups, lr=BUGGY_LR if bug == "lr" else models.LR, betas=models.BETAS, eps=models.EPS)
        self._grad_fn = mindspore.value_and_grad(self._loss, None, self.opt.parameters)

    def attach_options(self) -> dict[str, Any]:
        """MindSpore hands the gradients to the optimizer call: twinstep follows it to capture them."""
        return {"optimizer": self.opt}

    def batch(self, step: int) -> tuple[Any, Any]:
        if self.bug == "batch_order" and step in (PERMUTED_STEP, PERMUTED_STEP + 1):
            step = 2 * PERMUTED_STEP + 1 - step  # as paddle_job: two steps' batches swapped
        ids, tgt = models.batch(step, self.seed)
        return self.ms.Tensor(ids), self.ms.Tensor(tgt)

    def logits(self, ids: Any) -> Any:
        return self.model(input_ids=ids)  # by keyword, as torch_job (both record the ids as the input)

    def _loss(self, ids: Any, tgt: Any) -> Any:
        logits = self.logits(ids)
        return self.ms.ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    def train_step(self, ids: Any, tgt: Any) -> Any:
        """Forward, next-token cross-entropy (mean over all B*S tokens), gradients, AdamW step."""
        loss, grads = self._grad_fn(ids, tgt)
        self.opt(grads)
        return loss

    def zero_grad(self) -> None:
        pass  # gradients are values returned by value_and_grad, never accumulated on the parameters


#: Phi3 names its activation mlp.activation_fn (paddle_job's ACT_TARGET is the paddleformers name).
ACT_TARGET_PHI3 = ACT_TARGET.replace("act_fn", "activation_fn")


def _set_cell(model: Any, name: str, new: Any) -> None:
    from .mindspore_phi3 import cell

    parent, _, leaf = name.rpartition(".")
    setattr(cell(model, parent), leaf, new)


def _scaled_grad_silu(mindspore: Any) -> Any:
    """SiLU as a Cell with a hand-written ``bprop`` that is BACKWARD_SCALE too large: the forward is
    exact, so only the backward pass can reveal it (MindSpore's custom backward, as paddle's PyLayer)."""
    ops = mindspore.ops

    class ScaledGradSiLU(mindspore.nn.Cell):
        def construct(self, x: Any) -> Any:
            return ops.silu(x)

        def bprop(self, x: Any, out: Any, dout: Any) -> tuple:
            s = ops.sigmoid(x)
            return (dout * s * (1 + x * (1 - s)) * BACKWARD_SCALE,)

    return ScaledGradSiLU()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = loop.parser("python -m tests.ports.mindspore_job", __doc__.splitlines()[0], "mindspore")
    p.add_argument("--bug", choices=tuple(BUGS), default="none", help="inject one porting bug: " + "; ".join(
        f"{k}: {v}" for k, v in BUGS.items() if k != "none"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model not in MODELS:
        raise SystemExit(f"mindspore_job: no MindSpore port of {args.model!r}; choose from {', '.join(MODELS)}")
    # --init-from-baseline: no conversion here; twinstep's attach loads the baseline's weights (weight sync),
    # embed_tokens.weight as embed_tokens.embedding_table by itself (twinstep.wire.layouts).
    state = None if args.init_from_baseline else wait_for_weights(args.weights, {"model": args.model, "seed": args.seed})
    trainer = MindSporePort(args.seed, state, args.bug)
    return loop.run(args, trainer, {"framework": "mindspore", "bug": args.bug})


if __name__ == "__main__":
    sys.exit(main())
