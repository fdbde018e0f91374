"""Candidate job of the real-model test bed: the paddleformers (paddle) port under twinstep.

    python -m tests.ports.paddle_job --model phi3 --weights /tmp/w.npz --server HOST:PORT [--bug NAME]

It waits for the torch job to write --weights, converts them to paddleformers' names
and layouts (refusing any name or shape mismatch), then trains exactly as the torch
job does. --bug injects one realistic porting bug (see BUGS), so that the place of
the first divergence is known in advance. This process never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import warnings
from typing import Any

from . import loop, models

BUGS: dict[str, str] = {
    "none": "faithful port",
    "norm_eps": "RMSNorm epsilon 1e-5 instead of 1e-6 in model.layers.0.input_layernorm",
    "act_variant": "layers.1.mlp.act_fn: exact GELU instead of SiLU (phi3, ernie4_5) or of tanh GELU (gemma3)",
    "rope_base": "rotary base 10001 instead of 10000 (an error below the default tolerances)",
    "attn_scale": "layers.1 attention scores scaled by 1/sqrt(hidden_size) instead of 1/sqrt(head_dim)",
    "untransposed": "layers.0.self_attn.o_proj.weight loaded without the Linear transpose",
    "dropout_on": "attention dropout 0.1 left on",
    "wd_on_norms": "weight decay also applied to norm weights (the baseline exempts them)",
    "lr": "learning rate 1.1e-3 instead of 1e-3",
    "adam_eps": "AdamW epsilon 1e-6 instead of 1e-8",
    "grad_clip": "gradients clipped to global norm 1.0 (the baseline does not clip)",
    "custom_backward": "layers.1.mlp.act_fn in a PyLayer whose hand-written backward is 1.01x too large",
    "batch_order": "the batches of steps 3 and 4 fed in swapped order (a sampler/shuffle mismatch)",
}

NORM_EPS_TARGET = "model.layers.0.input_layernorm"  # sees the embeddings, the smallest inputs of any norm
BUGGY_NORM_EPS = 1e-5
ACT_TARGET = "model.layers.1.mlp.act_fn"
BUGGY_ROPE_THETA = 10001.0
ATTN_SCALE_TARGET = "model.layers.1.self_attn"
UNTRANSPOSED = frozenset({"model.layers.0.self_attn.o_proj.weight"})
BUGGY_DROPOUT = 0.1
BUGGY_LR = 1.1e-3
BUGGY_ADAM_EPS = 1e-6
GRAD_CLIP_NORM = 1.0  # the global gradient norm stays within 9.8..24 over 50 steps: it clips every step
BACKWARD_SCALE = 1.01
PERMUTED_STEP = 3

WEIGHTS_TIMEOUT = 300.0  # seconds to wait for the torch job's weights file
_POLL = 0.1


def wait_for_weights(path: str, meta: dict[str, Any], timeout: float = WEIGHTS_TIMEOUT) -> dict[str, Any]:
    """Poll until `path` holds weights written for this model and seed, then return them.

    A file left by another run (other model or seed) is waited out rather than loaded:
    the torch job of this run replaces it atomically.
    """
    deadline = time.monotonic() + timeout
    seen: dict[str, Any] | None = None
    while True:
        if os.path.exists(path):
            state, seen = models.load_weights(path)
            if seen == meta:
                return state
        if time.monotonic() > deadline:
            found = f"found {seen}" if seen is not None else "no file"
            raise SystemExit(f"paddle_job: no weights for {meta} at {path} after {timeout:.0f}s ({found})")
        time.sleep(_POLL)


class PaddlePort:
    """A paddleformers causal LM loaded from torch weights, its AdamW and the job's loss."""

    def __init__(self, spec: models.ModelSpec, seed: int, torch_state: dict[str, Any] | None, bug: str = "none") -> None:
        # OpenMP reads this at import time; one thread keeps two jobs light on a small box.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="No ccache found")
            import paddle
        paddle.set_device("cpu")
        paddle.seed(seed)
        self.paddle = paddle
        self.spec = spec
        self.seed = seed
        self.bug = bug
        mod = importlib.import_module(spec.paddle_module)

        cfg = dict(spec.paddle_config)
        if bug == "rope_base":
            cfg["rope_theta"] = BUGGY_ROPE_THETA
            if "rope_local_base_freq" in cfg:
                cfg["rope_local_base_freq"] = BUGGY_ROPE_THETA
        if bug == "dropout_on":
            cfg[spec.attention_dropout_key] = BUGGY_DROPOUT
        config = getattr(mod, spec.paddle_config_class)(**cfg)
        self.model = getattr(mod, spec.paddle_class)(config)
        self.model.train()
        if torch_state is not None:  # None: the model keeps its own random weights (--init-from-baseline)
            self._load(torch_state, UNTRANSPOSED if bug == "untransposed" else frozenset())

        if bug == "norm_eps":
            norm = self._layer(NORM_EPS_TARGET)
            attr = "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps"
            setattr(norm, attr, BUGGY_NORM_EPS)
        if bug == "attn_scale":
            self._layer(ATTN_SCALE_TARGET).scaling = models.HIDDEN**-0.5
        if bug == "act_variant":
            self._set_layer(ACT_TARGET, paddle.nn.GELU())  # exact (erf) GELU
        if bug == "custom_backward":
            self._set_layer(ACT_TARGET, _scaled_grad_activation(paddle, spec))

        named = dict(self.model.named_parameters())
        no_decay = bug == "wd_on_norms"
        decayed = {p.name for n, p in named.items() if no_decay or models.decays(n)}
        self.opt = paddle.optimizer.AdamW(
            learning_rate=BUGGY_LR if bug == "lr" else models.LR,
            parameters=list(named.values()),
            beta1=models.BETAS[0],
            beta2=models.BETAS[1],
            epsilon=BUGGY_ADAM_EPS if bug == "adam_eps" else models.EPS,
            weight_decay=models.WEIGHT_DECAY,
            # paddle's way to exempt parameters from decay; it is keyed by the framework's
            # unique parameter name (e.g. "linear_3.w_0"), not the structured name.
            apply_decay_param_fun=lambda pname: pname in decayed,
            grad_clip=paddle.nn.ClipGradByGlobalNorm(GRAD_CLIP_NORM) if bug == "grad_clip" else None,
        )

    def _layer(self, name: str) -> Any:
        layer = self.model
        for part in name.split("."):
            layer = layer[int(part)] if part.isdigit() else getattr(layer, part)
        return layer

    def _set_layer(self, name: str, new: Any) -> None:
        parent, _, leaf = name.rpartition(".")
        setattr(self._layer(parent), leaf, new)

    def _load(self, torch_state: dict[str, Any], untransposed: frozenset[str]) -> None:
        """Copy converted torch weights into the model; any missing, extra or misshapen name is an error."""
        import numpy as np

        want = models.torch_to_paddle(self.spec, torch_state, untransposed=untransposed)
        have = dict(self.model.named_parameters())
        missing, extra = sorted(set(have) - set(want)), sorted(set(want) - set(have))
        bad = sorted(n for n in set(have) & set(want) if tuple(have[n].shape) != tuple(want[n].shape))
        if missing or extra or bad:
            lines = [f"paddle_job: weights do not match the {self.spec.name} port:"]
            lines += [f"  not in the file: {n}" for n in missing]
            lines += [f"  not in the model: {n}" for n in extra]
            lines += [f"  shape: {n} model {tuple(have[n].shape)} file {tuple(want[n].shape)}" for n in bad]
            raise SystemExit("\n".join(lines))
        for name, p in have.items():
            p.set_value(np.asarray(want[name], dtype=np.float32))

    def batch(self, step: int) -> tuple[Any, Any]:
        if self.bug == "batch_order" and step in (PERMUTED_STEP, PERMUTED_STEP + 1):
            # Reversing rows would be invisible and harmless (a batch mean does not care); real
            # data bugs feed other samples, as swapping two steps' batches does.
            step = 2 * PERMUTED_STEP + 1 - step
        ids, tgt = models.batch(step, self.seed)
        return self.paddle.to_tensor(ids), self.paddle.to_tensor(tgt)

    def logits(self, ids: Any) -> Any:
        return self.model(input_ids=ids, return_dict=True).logits

    def train_step(self, ids: Any, tgt: Any) -> Any:
        """Forward, next-token cross-entropy (mean over all B*S tokens), backward, AdamW step."""
        logits = self.logits(ids)
        loss = self.paddle.nn.functional.cross_entropy(logits.reshape([-1, logits.shape[-1]]), tgt.reshape([-1]))
        loss.backward()
        self.opt.step()
        return loss

    def zero_grad(self) -> None:
        self.opt.clear_grad()


def _scaled_grad_activation(paddle: Any, spec: models.ModelSpec) -> Any:
    """The model's activation as a PyLayer with a hand-written backward that is BACKWARD_SCALE
    too large: the forward is exact, so only the backward pass can reveal it."""
    kind = spec.paddle_config.get(spec.activation_key)
    F = paddle.nn.functional
    c = (2.0 / 3.141592653589793) ** 0.5

    def derivative(x: Any) -> Any:
        if kind == "silu":
            s = F.sigmoid(x)
            return s * (1 + x * (1 - s))
        if kind in ("gelu_pytorch_tanh", "gelu_tanh"):
            t = paddle.tanh(c * (x + 0.044715 * x**3))
            return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
        raise ValueError(f"no hand-written derivative for activation {kind!r}")

    def forward_fn(x: Any) -> Any:
        return F.silu(x) if kind == "silu" else F.gelu(x, approximate=True)

    class ScaledGrad(paddle.autograd.PyLayer):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.save_for_backward(x)
            return forward_fn(x)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            (x,) = ctx.saved_tensor()
            return dy * derivative(x) * BACKWARD_SCALE

    class ScaledGradAct(paddle.nn.Layer):
        def forward(self, x: Any) -> Any:
            return ScaledGrad.apply(x)

    return ScaledGradAct()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = loop.parser("python -m tests.ports.paddle_job", __doc__.splitlines()[0], "paddle")
    p.add_argument("--bug", choices=tuple(BUGS), default="none", help="inject one porting bug: " + "; ".join(
        f"{k}: {v}" for k, v in BUGS.items() if k != "none"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = models.spec(args.model)
    # --init-from-baseline: no conversion here; twinstep's attach loads the baseline's weights (weight sync).
    state = None if args.init_from_baseline else wait_for_weights(args.weights, {"model": spec.name, "seed": args.seed})
    trainer = PaddlePort(spec, args.seed, state, args.bug)
    return loop.run(args, trainer, {"framework": "paddle", "bug": args.bug})


if __name__ == "__main__":
    sys.exit(main())
