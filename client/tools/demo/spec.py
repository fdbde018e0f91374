"""Framework-neutral definition of the demo model: config, initial weights and data.

Both framework implementations take their weights and batches from here, so any
difference between two runs comes from the frameworks (or an injected bug), never
from initialisation or data. Only numpy is imported, so a torch job never loads
paddle and vice versa.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the pre-LayerNorm decoder-only LM and of its data."""

    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 16
    batch: int = 4
    mlp_ratio: int = 4
    seed: int = 0
    # Layer indices whose mlp.act uses the tanh-approximate GELU (the "gelu_tanh" injected bug).
    tanh_gelu_layers: tuple[int, ...] = ()
    # Layer indices whose attention divides its scores by sqrt(head_dim + 1), inline in its forward (the
    # "attn_scale" injected bug: no submodule differs, one functional operation does; docs/operations.md).
    attn_scale_layers: tuple[int, ...] = ()

    @property
    def mlp_hidden(self) -> int:
        return self.hidden * self.mlp_ratio

    @property
    def head_dim(self) -> int:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        return self.hidden // self.heads


# k_proj has no bias: a key bias adds the same q.b to every score of a query row, which
# softmax cancels, so its gradient is exactly zero in theory and pure rounding noise in
# practice. Adam normalises that noise into real, framework-dependent updates, which
# would show up as a spurious divergence between two otherwise identical trainings.
K_PROJ_BIAS = False


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name and torch-layout shape, in a fixed order that init_weights draws in."""
    h, f, v = cfg.hidden, cfg.mlp_hidden, cfg.vocab
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, h)}
    for i in range(cfg.layers):
        p = f"layers.{i}."
        shapes[p + "ln1.weight"] = (h,)
        shapes[p + "ln1.bias"] = (h,)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}attn.{proj}.weight"] = (h, h)
            if proj != "k_proj" or K_PROJ_BIAS:
                shapes[f"{p}attn.{proj}.bias"] = (h,)
        shapes[p + "ln2.weight"] = (h,)
        shapes[p + "ln2.bias"] = (h,)
        shapes[p + "mlp.fc1.weight"] = (f, h)
        shapes[p + "mlp.fc1.bias"] = (f,)
        shapes[p + "mlp.fc2.weight"] = (h, f)
        shapes[p + "mlp.fc2.bias"] = (h,)
    shapes["norm.weight"] = (h,)
    shapes["norm.bias"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


_NORMS = ("ln1", "ln2", "norm")


def _module(name: str) -> str:
    """Last module name in a parameter path, e.g. 'fc1' for 'layers.0.mlp.fc1.weight'."""
    return name.rsplit(".", 2)[-2]


def is_linear_weight(name: str) -> bool:
    """True for Linear weights, whose layout differs between torch ([out,in]) and paddle ([in,out])."""
    return name.endswith(".weight") and _module(name) not in ("embed", *_NORMS)


def init_weights(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Initial parameters as float32 arrays in torch layout, identical on every machine for a seed."""
    rng = np.random.default_rng([cfg.seed, 0x5EED])
    weights: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(cfg).items():
        if _module(name) in _NORMS:
            value = np.ones(shape) if name.endswith(".weight") else np.zeros(shape)
        elif name.endswith(".bias"):
            value = np.zeros(shape)
        elif name == "embed.weight":
            value = rng.normal(0.0, 1.0, size=shape)
        else:
            # 1/sqrt(fan_in) keeps pre-activations near unit scale, as in trained
            # models; at GPT-2's 0.02 the GELU inputs are so small that the exact
            # and tanh forms barely differ, which would make the demo's bug unrealistic.
            value = rng.normal(0.0, shape[-1] ** -0.5, size=shape)
        weights[name] = value.astype(np.float32)
    return weights


def batch(step: int, rank: int = 0, cfg: ModelConfig = ModelConfig()) -> tuple[np.ndarray, np.ndarray]:
    """Next-token batch (input_ids, targets), both int64 [batch, seq], fixed by (seed, step, rank).

    Sequences are arithmetic progressions modulo the vocabulary with a random start
    and stride, so the model can actually learn and the loss curve moves visibly.
    """
    rng = np.random.default_rng([cfg.seed, step, rank])
    start = rng.integers(0, cfg.vocab, size=(cfg.batch, 1))
    stride = rng.integers(1, 4, size=(cfg.batch, 1))
    tokens = (start + stride * np.arange(cfg.seq + 1)) % cfg.vocab
    tokens = tokens.astype(np.int64)
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()
