"""The demo LM ported to MindSpore (PyNative), module-for-module with model_torch, in MindSpore's own idiom.

Idiomatic MindSpore names some parameters otherwise than torch: nn.LayerNorm
holds ``gamma``/``beta``, nn.Embedding ``embedding_table``; twinstep joins
them with torch's ``weight``/``bias`` by itself (twinstep.wire.layouts).  nn.Dense
stores its weight [out, in] as torch does.  Two MindSpore defaults differ from
torch's and are set explicitly: LayerNorm's epsilon (1e-7; torch 1e-5) and
GELU's form (``approximate=True``, the tanh form; torch: exact), which is the
demo's ``gelu_tanh`` bug when left in.
"""

from __future__ import annotations

import math

import mindspore
import numpy as np
from mindspore import nn, ops

from .spec import K_PROJ_BIAS, ModelConfig

#: torch's LayerNorm epsilon (MindSpore's default is 1e-7).
LAYER_NORM_EPS = 1e-5

# spec/torch name -> MindSpore name, where MindSpore's modules name a parameter otherwise.
_MS_LOCAL = {"embed.weight": "embed.embedding_table"}


class Attention(nn.Cell):
    """Causal multi-head self-attention, op-for-op the same as the torch version."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.q_proj = nn.Dense(cfg.hidden, cfg.hidden)
        self.k_proj = nn.Dense(cfg.hidden, cfg.hidden, has_bias=K_PROJ_BIAS)
        self.v_proj = nn.Dense(cfg.hidden, cfg.hidden)
        self.o_proj = nn.Dense(cfg.hidden, cfg.hidden)
        self.mask = mindspore.Tensor(np.triu(np.full((cfg.seq, cfg.seq), -1e9, dtype=np.float32), 1))

    def _split(self, x: mindspore.Tensor) -> mindspore.Tensor:
        b, s, _ = x.shape
        return x.reshape(b, s, self.heads, self.head_dim).transpose(0, 2, 1, 3)

    def construct(self, x: mindspore.Tensor) -> mindspore.Tensor:
        b, s, h = x.shape
        q, k, v = self._split(self.q_proj(x)), self._split(self.k_proj(x)), self._split(self.v_proj(x))
        scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(self.head_dim)
        probs = ops.softmax(scores + self.mask[:s, :s], axis=-1)
        out = ops.matmul(probs, v).transpose(0, 2, 1, 3).reshape(b, s, h)
        return self.o_proj(out)


class MLP(nn.Cell):
    """Feed-forward block; MindSpore spells the tanh GELU approximate=True (and defaults to it)."""

    def __init__(self, cfg: ModelConfig, tanh_gelu: bool) -> None:
        super().__init__()
        self.fc1 = nn.Dense(cfg.hidden, cfg.mlp_hidden)
        self.act = nn.GELU(approximate=tanh_gelu)
        self.fc2 = nn.Dense(cfg.mlp_hidden, cfg.hidden)

    def construct(self, x: mindspore.Tensor) -> mindspore.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Cell):
    """Pre-LayerNorm transformer block with residual connections."""

    def __init__(self, cfg: ModelConfig, index: int, eps: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm((cfg.hidden,), epsilon=eps)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm((cfg.hidden,), epsilon=eps)
        self.mlp = MLP(cfg, tanh_gelu=index in cfg.tanh_gelu_layers)

    def construct(self, x: mindspore.Tensor) -> mindspore.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Cell):
    """Decoder-only LM: construct(input_ids [B,S]) -> logits [B,S,vocab]; the loss lives in the job."""

    def __init__(self, cfg: ModelConfig, eps: float = LAYER_NORM_EPS) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.CellList([Block(cfg, i, eps) for i in range(cfg.layers)])
        self.norm = nn.LayerNorm((cfg.hidden,), epsilon=eps)
        self.lm_head = nn.Dense(cfg.hidden, cfg.vocab, has_bias=False)

    def construct(self, input_ids: mindspore.Tensor) -> mindspore.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def mindspore_name(name: str) -> str:
    """The MindSpore parameter name of a spec (torch) name: LayerNorm gamma/beta, Embedding embedding_table."""
    if name in _MS_LOCAL:
        return _MS_LOCAL[name]
    module, local = name.rsplit(".", 1)
    if module.rsplit(".", 1)[-1] in ("ln1", "ln2", "norm"):
        return f"{module}.{'gamma' if local == 'weight' else 'beta'}"
    return name


def build_model(cfg: ModelConfig, weights: dict[str, np.ndarray], eps: float = LAYER_NORM_EPS) -> TinyLM:
    """TinyLM holding the given torch-layout weights (Dense is [out, in] as in torch: no transpose)."""
    model = TinyLM(cfg, eps)
    params = {name: p for name, p in model.parameters_and_names()}
    wanted = {mindspore_name(name): value for name, value in weights.items()}
    if params.keys() != wanted.keys():
        raise ValueError(f"parameter names differ from spec: {sorted(params.keys() ^ wanted.keys())}")
    for name, param in params.items():
        value = wanted[name]
        if tuple(param.shape) != value.shape:
            raise ValueError(f"{name}: MindSpore shape {tuple(param.shape)} != spec shape {value.shape}")
        param.set_data(mindspore.Tensor(np.ascontiguousarray(value)))
    return model
