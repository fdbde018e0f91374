"""The demo LM ported to PaddlePaddle, module-for-module and name-for-name with model_torch."""

from __future__ import annotations

import math

import numpy as np
import paddle
from paddle import nn

from .spec import K_PROJ_BIAS, ModelConfig, is_linear_weight


class Attention(nn.Layer):
    """Causal multi-head self-attention, op-for-op the same as the torch version."""

    def __init__(self, cfg: ModelConfig, scale_bug: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.scale = math.sqrt(self.head_dim + 1 if scale_bug else self.head_dim)
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.k_proj = nn.Linear(cfg.hidden, cfg.hidden, bias_attr=K_PROJ_BIAS)
        self.v_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden)

    def _split(self, x: paddle.Tensor) -> paddle.Tensor:
        b, s, _ = x.shape
        return x.reshape([b, s, self.heads, self.head_dim]).transpose([0, 2, 1, 3])

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        b, s, h = x.shape
        q, k, v = self._split(self.q_proj(x)), self._split(self.k_proj(x)), self._split(self.v_proj(x))
        scores = paddle.matmul(q, k, transpose_y=True) / self.scale
        mask = paddle.triu(paddle.full([s, s], -1e9, dtype=scores.dtype), diagonal=1)
        probs = nn.functional.softmax(scores + mask, axis=-1)
        out = paddle.matmul(probs, v).transpose([0, 2, 1, 3]).reshape([b, s, h])
        return self.o_proj(out)


class MLP(nn.Layer):
    """Feed-forward block; paddle spells the tanh GELU as approximate=True (torch: 'tanh')."""

    def __init__(self, cfg: ModelConfig, tanh_gelu: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.mlp_hidden)
        self.act = nn.GELU(approximate=tanh_gelu)
        self.fc2 = nn.Linear(cfg.mlp_hidden, cfg.hidden)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Layer):
    """Pre-LayerNorm transformer block with residual connections."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg, scale_bug=index in cfg.attn_scale_layers)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg, tanh_gelu=index in cfg.tanh_gelu_layers)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Layer):
    """Decoder-only LM: forward(input_ids [B,S]) -> logits [B,S,vocab]; the loss lives in the job."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.LayerList([Block(cfg, i) for i in range(cfg.layers)])
        self.norm = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias_attr=False)

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_model(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> TinyLM:
    """TinyLM holding the given torch-layout weights; Linear weights are transposed to paddle's [in,out]."""
    model = TinyLM(cfg)
    params = dict(model.named_parameters())
    if params.keys() != weights.keys():
        raise ValueError(f"parameter names differ from spec: {sorted(params.keys() ^ weights.keys())}")
    for name, param in params.items():
        value = weights[name].T if is_linear_weight(name) else weights[name]
        if tuple(param.shape) != value.shape:
            raise ValueError(f"{name}: paddle shape {tuple(param.shape)} != spec shape {value.shape}")
        param.set_value(np.ascontiguousarray(value))
    return model
