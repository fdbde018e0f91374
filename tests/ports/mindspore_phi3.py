"""Phi3 causal LM ported to MindSpore (``mindspore.nn.Cell``, PyNative mode), from transformers' torch code.

No MindSpore model library builds a trainable model on this CPU (tried when this port was written):
mindnlp 0.4.x fails at import against every MindSpore on the mirror (2.7.0 .. 2.10.0:
``mindspore.common._stub_tensor`` and ``_c_expression.Tensor`` are gone), and mindnlp
0.5.1 (mindspore <= 2.7.0, transformers run on its ``mindtorch`` layer) builds
LlamaForCausalLM but its backward leaves every parameter without a gradient on CPU;
mindformers 2.x needs mindspore ~= 2.11, absent from the mirror. So this is a port
written by hand, line for line from transformers 5.x ``models/phi3/modeling_phi3.py``
(eager attention), the way a MindSpore user ports a model: ``nn.Dense`` (weight
[out, in], as torch), ``nn.Embedding`` (its parameter is ``embedding_table``), cells
named as in transformers so the module names match one to one.

The forward returns the logits; every cell returns what its torch counterpart returns
(the attention returns its output and its weights), so the two sides record the same
tensors. Only MindSpore and numpy are imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mindspore
import numpy as np
from mindspore import mint, nn, ops

from . import models


@dataclass(frozen=True)
class Phi3Size:
    """The port's sizes: the test bed's by default (tests/ports/models.py); benchmarks/overhead_models.py
    builds it at the overhead benchmark's size."""

    vocab: int = models.VOCAB
    hidden: int = models.HIDDEN
    layers: int = models.LAYERS
    heads: int = models.HEADS
    kv_heads: int = models.KV_HEADS
    intermediate: int = models.INTERMEDIATE
    rms_eps: float = models.RMS_EPS
    rope_theta: float = models.ROPE_THETA
    pad_id: int = models.PAD_ID


class Phi3RMSNorm(nn.Cell):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = mindspore.Parameter(mindspore.Tensor(np.ones(hidden_size, np.float32)), name="weight")
        self.variance_epsilon = eps

    def construct(self, hidden_states: mindspore.Tensor) -> mindspore.Tensor:
        x = hidden_states.astype(mindspore.float32)
        variance = x.pow(2).mean(-1, keep_dims=True)
        return self.weight * (x * mint.rsqrt(variance + self.variance_epsilon))


class Phi3RotaryEmbedding(nn.Cell):
    """(cos, sin) of the default RoPE, [1, S, head_dim] each; no parameters, no gradient (torch: no_grad)."""

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        # As transformers: base ** (arange(0, dim, 2).float() / dim), in float32.
        exponent = mindspore.Tensor(np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
        self.inv_freq = 1.0 / ops.pow(mindspore.Tensor(base, mindspore.float32), exponent)

    def construct(self, x: mindspore.Tensor, position_ids: mindspore.Tensor) -> tuple[mindspore.Tensor, mindspore.Tensor]:
        inv = self.inv_freq[None, :, None].broadcast_to((position_ids.shape[0], -1, 1))
        freqs = mint.matmul(inv, position_ids[:, None, :].astype(mindspore.float32)).swapaxes(1, 2)
        emb = mint.cat((freqs, freqs), dim=-1)
        return ops.stop_gradient(mint.cos(emb)), ops.stop_gradient(mint.sin(emb))


def _rotate_half(x: mindspore.Tensor) -> mindspore.Tensor:
    half = x.shape[-1] // 2
    return mint.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(x: mindspore.Tensor, n_rep: int) -> mindspore.Tensor:
    b, kv, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].broadcast_to((b, kv, n_rep, s, d)).reshape(b, kv * n_rep, s, d)


class Phi3Attention(nn.Cell):
    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.heads, self.kv_heads = heads, kv_heads
        self.scaling = self.head_dim**-0.5
        op_size = heads * self.head_dim + 2 * kv_heads * self.head_dim
        self.o_proj = nn.Dense(heads * self.head_dim, hidden, has_bias=False)
        self.qkv_proj = nn.Dense(hidden, op_size, has_bias=False)

    def construct(self, hidden_states: mindspore.Tensor, position_embeddings: tuple, mask: mindspore.Tensor) -> tuple:
        b, s = hidden_states.shape[0], hidden_states.shape[1]
        qkv = self.qkv_proj(hidden_states)
        qp, kp = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = qkv[..., :qp].reshape(b, s, -1, self.head_dim).swapaxes(1, 2)
        k = qkv[..., qp:qp + kp].reshape(b, s, -1, self.head_dim).swapaxes(1, 2)
        v = qkv[..., qp + kp:].reshape(b, s, -1, self.head_dim).swapaxes(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = _repeat_kv(k, self.heads // self.kv_heads)
        v = _repeat_kv(v, self.heads // self.kv_heads)
        weights = mint.matmul(q, k.swapaxes(2, 3)) * self.scaling + mask
        weights = mint.nn.functional.softmax(weights.astype(mindspore.float32), dim=-1)
        out = mint.matmul(weights, v).swapaxes(1, 2).reshape(b, s, -1)
        return self.o_proj(out), weights


class Phi3MLP(nn.Cell):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Dense(hidden, 2 * intermediate, has_bias=False)
        self.down_proj = nn.Dense(intermediate, hidden, has_bias=False)
        self.activation_fn: nn.Cell = nn.SiLU()

    def construct(self, hidden_states: mindspore.Tensor) -> mindspore.Tensor:
        gate, up = mint.chunk(self.gate_up_proj(hidden_states), 2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class Phi3DecoderLayer(nn.Cell):
    def __init__(self, size: Phi3Size | None = None) -> None:
        super().__init__()
        size = size or Phi3Size()
        self.self_attn = Phi3Attention(size.hidden, size.heads, size.kv_heads)
        self.mlp = Phi3MLP(size.hidden, size.intermediate)
        self.input_layernorm = Phi3RMSNorm(size.hidden, size.rms_eps)
        self.post_attention_layernorm = Phi3RMSNorm(size.hidden, size.rms_eps)
        self.resid_attn_dropout = nn.Dropout(p=0.0)  # resid_pdrop 0, as the torch config
        self.resid_mlp_dropout = nn.Dropout(p=0.0)

    def construct(self, hidden_states: mindspore.Tensor, mask: mindspore.Tensor, position_embeddings: tuple) -> mindspore.Tensor:
        # By keyword, as transformers calls it: both sides' attention inputs are recorded all the same
        # (twinstep.wire.inputs.call_inputs).
        attn, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                 position_embeddings=position_embeddings, mask=mask)
        hidden_states = hidden_states + self.resid_attn_dropout(attn)
        mlp = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + self.resid_mlp_dropout(mlp)


class Phi3Model(nn.Cell):
    def __init__(self, size: Phi3Size | None = None) -> None:
        super().__init__()
        size = size or Phi3Size()
        self.embed_tokens = nn.Embedding(size.vocab, size.hidden, padding_idx=size.pad_id)
        self.layers = nn.CellList([Phi3DecoderLayer(size) for _ in range(size.layers)])
        self.norm = Phi3RMSNorm(size.hidden, size.rms_eps)
        self.rotary_emb = Phi3RotaryEmbedding(size.hidden // size.heads, size.rope_theta)

    def construct(self, input_ids: mindspore.Tensor) -> mindspore.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        seq = input_ids.shape[1]
        position_ids = mindspore.Tensor(np.arange(seq, dtype=np.int64)[None])
        # transformers' eager causal mask: the float32 minimum above the diagonal, added to the scores.
        mask = mindspore.Tensor(np.triu(np.full((seq, seq), np.finfo(np.float32).min, np.float32), 1)[None, None])
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_embeddings)
        return self.norm(hidden_states)


class Phi3ForCausalLM(nn.Cell):
    def __init__(self, size: Phi3Size | None = None) -> None:
        super().__init__()
        size = size or Phi3Size()
        self.model = Phi3Model(size)
        self.lm_head = nn.Dense(size.hidden, size.vocab, has_bias=False)

    def construct(self, input_ids: mindspore.Tensor) -> mindspore.Tensor:
        return self.lm_head(self.model(input_ids=input_ids))  # by keyword, as transformers


# ------------------------------------------------------------ weights from torch

#: torch parameter name -> this port's, where they differ (nn.Embedding's table).
RENAMED = {"model.embed_tokens.weight": "model.embed_tokens.embedding_table"}


def torch_to_mindspore(state: dict[str, np.ndarray], *, transposed: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """torch names and layouts -> this port's. nn.Dense keeps torch's [out, in], so only names change;
    ``transposed`` names are (wrongly) transposed, as a converter written for paddle's [in, out] would."""
    return {RENAMED.get(name, name): np.ascontiguousarray(value.T if name in transposed else value)
            for name, value in state.items()}


def load_torch_weights(model: nn.Cell, state: dict[str, np.ndarray], transposed: frozenset[str] = frozenset()) -> None:
    """Copy converted torch weights into ``model``; any missing, extra or misshapen name is an error."""
    want = torch_to_mindspore(state, transposed=transposed)
    have = {name: p for name, p in model.parameters_and_names()}
    missing, extra = sorted(set(have) - set(want)), sorted(set(want) - set(have))
    bad = sorted(n for n in set(have) & set(want) if tuple(have[n].shape) != tuple(want[n].shape))
    if missing or extra or bad:
        lines = ["mindspore_job: weights do not match the phi3 port:"]
        lines += [f"  not in the file: {n}" for n in missing]
        lines += [f"  not in the model: {n}" for n in extra]
        lines += [f"  shape: {n} model {tuple(have[n].shape)} file {tuple(want[n].shape)}" for n in bad]
        raise SystemExit("\n".join(lines))
    for name, p in have.items():
        p.set_data(mindspore.Tensor(np.asarray(want[name], dtype=np.float32)))


def cell(model: nn.Cell, name: str) -> Any:
    """The sub-cell of a dotted name (``model.layers.0.input_layernorm``)."""
    found = model
    for part in name.split("."):
        found = found[int(part)] if part.isdigit() else getattr(found, part)
    return found
