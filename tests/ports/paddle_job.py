"""Candidate job of the real-model test bed: the paddleformers (paddle) port under twinstep.

    python -m tests.ports.paddle_job --model phi3 --weights /tmp/w.npz --server HOST:PORT [--bug NAME]

It waits for the torch job to write --weights, converts them to paddleformers' names
and layouts (refusing any name or shape mismatch), then trains exactly as the torch
job does (the optimizer of models.OPTIMIZER; --warmup as given to the torch job).
--bug injects one realistic porting bug (see BUGS), so that the place of the first
divergence is known in advance. This process never imports torch.
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
    "loss_scale": "loss divided by 2 before backward (a gradient-accumulation divisor left in); the loss reported is "
                  "the undivided one",
    "label_shift": "labels shifted once more although the batch's targets are already the next tokens",
    "adam_betas": "Adam beta2 0.99 instead of 0.999",
    "lr_schedule": "warmup schedule one step ahead (the scheduler stepped once before training); needs --warmup",
    "rotary_interleaved": "layers.0 attention rotates the other pairs of rotary dimensions (interleaved pairs where "
                          "the model rotates halves; halves where it interleaves)",
    "causal_mask": "layers.1 attention called without its causal mask (every token sees the whole sequence)",
    "layer_bf16": "layers.0.mlp.down_proj's output rounded to bfloat16 (one layer left in low precision)",
}

NORM_EPS_TARGET = "model.layers.0.input_layernorm"  # sees the embeddings, the smallest inputs of any norm
BUGGY_NORM_EPS = 1e-5
ACT_TARGET = "model.layers.1.mlp.act_fn"
BUGGY_ROPE_THETA = 10001.0
ATTN_SCALE_TARGET = "model.layers.1.self_attn"
UNTRANSPOSED = frozenset({"model.layers.0.self_attn.o_proj.weight"})
BUGGY_DROPOUT = 0.1
BUGGY_LR = round(1.1 * models.LR, 12)  # 1.1e-3 under the default optimizer
BUGGY_ADAM_EPS = 1e-6
GRAD_CLIP_NORM = 1.0  # the global gradient norm stays within 9.8..24 over 50 steps: it clips every step
BACKWARD_SCALE = 1.01
PERMUTED_STEP = 3
LOSS_DIVISOR = 2.0
BUGGY_BETA2 = 0.99
ROTARY_TARGET = "model.layers.0.self_attn"
MASK_TARGET = "model.layers.1.self_attn"
BF16_TARGET = "model.layers.0.mlp.down_proj"
# Bugs that only an optimizer with the hyper-parameter can carry (models.OPTIMIZER).
OPTIMIZER_BUGS = {"wd_on_norms": ("adamw",), "adam_eps": ("adamw", "adam"), "adam_betas": ("adamw", "adam")}

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
    """A paddleformers causal LM loaded from torch weights, its optimizer and the job's loss."""

    def __init__(self, spec: models.ModelSpec, seed: int, torch_state: dict[str, Any] | None, bug: str = "none",
                 warmup: int = 0) -> None:
        if bug in OPTIMIZER_BUGS and models.OPTIMIZER not in OPTIMIZER_BUGS[bug]:
            raise SystemExit(f"paddle_job: --bug {bug} needs PORTS_OPTIMIZER in {OPTIMIZER_BUGS[bug]}")
        if bug == "lr_schedule" and warmup < 2:
            raise SystemExit("paddle_job: --bug lr_schedule needs --warmup 2 or more (in both jobs)")
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
        if bug == "rotary_interleaved":
            _other_rotary_convention(self._layer(ROTARY_TARGET), importlib.import_module(spec.paddle_module))
        if bug == "causal_mask":
            _without_mask(self._layer(MASK_TARGET))
        if bug == "layer_bf16":
            self._layer(BF16_TARGET).register_forward_post_hook(
                lambda layer, args, out: out.astype("bfloat16").astype(out.dtype))

        named = dict(self.model.named_parameters())
        lr: Any = BUGGY_LR if bug == "lr" else models.LR
        self.schedule = None
        if warmup:
            self.schedule = lr = paddle.optimizer.lr.LambdaDecay(lr, models.warmup_factor(warmup))
            if bug == "lr_schedule":
                self.schedule.step()  # one step ahead: its step k runs at the baseline's rate of step k + 1
        clip = paddle.nn.ClipGradByGlobalNorm(GRAD_CLIP_NORM) if bug == "grad_clip" else None
        beta2 = BUGGY_BETA2 if bug == "adam_betas" else models.BETAS[1]
        epsilon = BUGGY_ADAM_EPS if bug == "adam_eps" else models.EPS
        if models.OPTIMIZER == "adamw":
            no_decay = bug == "wd_on_norms"
            decayed = {p.name for n, p in named.items() if no_decay or models.decays(n)}
            self.opt = paddle.optimizer.AdamW(
                learning_rate=lr,
                parameters=list(named.values()),
                beta1=models.BETAS[0],
                beta2=beta2,
                epsilon=epsilon,
                weight_decay=models.WEIGHT_DECAY,
                # paddle's way to exempt parameters from decay; it is keyed by the framework's
                # unique parameter name (e.g. "linear_3.w_0"), not the structured name.
                apply_decay_param_fun=lambda pname: pname in decayed,
                grad_clip=clip,
            )
        elif models.OPTIMIZER == "adam":
            self.opt = paddle.optimizer.Adam(learning_rate=lr, parameters=list(named.values()), beta1=models.BETAS[0],
                                             beta2=beta2, epsilon=epsilon, grad_clip=clip)
        else:
            self.opt = paddle.optimizer.SGD(learning_rate=lr, parameters=list(named.values()), grad_clip=clip)

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
        """Forward, next-token cross-entropy (mean over all B*S tokens), backward, optimizer step."""
        logits = self.logits(ids)
        if self.bug == "label_shift":
            logits, tgt = logits[:, :-1], tgt[:, 1:]  # the shift a model does for labels=input_ids, done again
        loss = self.paddle.nn.functional.cross_entropy(logits.reshape([-1, logits.shape[-1]]), tgt.reshape([-1]))
        (loss / LOSS_DIVISOR if self.bug == "loss_scale" else loss).backward()
        self.opt.step()
        if self.schedule is not None:
            self.schedule.step()
        return loss

    def zero_grad(self) -> None:
        self.opt.clear_grad()


def _rotate_halves(paddle: Any, x: Any) -> Any:
    """rotate_half of Llama-style models (GPT-NeoX convention): dimension i pairs with i + d/2."""
    half = x.shape[-1] // 2
    return paddle.cat([-x[..., half:], x[..., :half]], axis=-1)


def _rotate_pairs(paddle: Any, x: Any) -> Any:
    """rotate_every_two (GPT-J / Meta convention): dimension 2i pairs with 2i + 1."""
    return paddle.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).flatten(-2)


def _other_rotary_convention(attention: Any, modeling: Any) -> None:
    """Make one attention layer rotate by the other convention than the model's own rotate_half.

    paddleformers' attention calls its module's rotate_half (through apply_rotary_pos_emb)
    by global name, so the layer's forward swaps that global for its own call only; the
    model's other layers and the backward pass (recorded by autograd) are untouched.
    """
    import paddle

    probe = modeling.rotate_half(paddle.arange(4, dtype="float32")).tolist()
    halves = probe == [-2.0, -3.0, 0.0, 1.0]
    other = _rotate_pairs if halves else _rotate_halves
    forward = attention.forward

    def swapped(*args: Any, **kwargs: Any) -> Any:
        own, modeling.rotate_half = modeling.rotate_half, lambda x: other(paddle, x)
        try:
            return forward(*args, **kwargs)
        finally:
            modeling.rotate_half = own

    attention.forward = swapped


def _without_mask(attention: Any) -> None:
    """One attention layer called without its mask: a forward pre-hook drops the mask arguments,
    and the layer stops declaring itself causal (the SDPA path that paddleformers' Gemma3 takes
    when no mask is passed reads ``is_causal``)."""
    attention.is_causal = False

    def drop(layer: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return args, {**kwargs, "attention_mask": None, "attn_mask_startend_row_indices": None}

    attention.register_forward_pre_hook(drop, with_kwargs=True)


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
    trainer = PaddlePort(spec, args.seed, state, args.bug, args.warmup)
    return loop.run(args, trainer, {"framework": "paddle", "bug": args.bug})


if __name__ == "__main__":
    sys.exit(main())
