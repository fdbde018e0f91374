"""The demo LM in PyTorch: the reference side of the torch -> paddle port."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from .spec import K_PROJ_BIAS, ModelConfig


class Attention(nn.Module):
    """Causal multi-head self-attention written out by hand, so every op has a paddle twin."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.k_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=K_PROJ_BIAS)
        self.v_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.reshape(b, s, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self._split(self.q_proj(x)), self._split(self.k_proj(x)), self._split(self.v_proj(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        mask = torch.triu(torch.full((s, s), -1e9, dtype=scores.dtype), diagonal=1)
        probs = torch.softmax(scores + mask, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h)
        return self.o_proj(out)


class MLP(nn.Module):
    """Feed-forward block; act is a module (not F.gelu) so twinstep can hook and compare it."""

    def __init__(self, cfg: ModelConfig, tanh_gelu: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.mlp_hidden)
        self.act = nn.GELU(approximate="tanh" if tanh_gelu else "none")
        self.fc2 = nn.Linear(cfg.mlp_hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block with residual connections."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg, tanh_gelu=index in cfg.tanh_gelu_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Decoder-only LM: forward(input_ids [B,S]) -> logits [B,S,vocab]; the loss lives in the job."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_model(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> TinyLM:
    """TinyLM holding exactly the given torch-layout weights (strict: names and shapes must match)."""
    model = TinyLM(cfg)
    model.load_state_dict({name: torch.from_numpy(value.copy()) for name, value in weights.items()}, strict=True)
    return model
