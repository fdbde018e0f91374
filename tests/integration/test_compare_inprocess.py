"""twinstep.compare: a torch model and its paddle port in one process."""

from __future__ import annotations

import paddle
import torch

import twinstep
from twinstep.tools.demo import model_paddle, model_torch, spec


def models(paddle_bug_layers=(), torch_bug_layers=()):
    weights = spec.init_weights(spec.ModelConfig())
    a = model_torch.build_model(spec.ModelConfig(tanh_gelu_layers=torch_bug_layers), weights)
    b = model_paddle.build_model(spec.ModelConfig(tanh_gelu_layers=paddle_bug_layers), weights)
    ids, _ = spec.batch(0)
    return a, b, ids


def rows(result) -> dict[str, bool]:
    return {row.name: row.divergent for row in result.proto.tree}


def test_faithful_port_is_aligned_forward_and_backward():
    a, b, ids = models()
    result = twinstep.compare(a, b, [torch.from_numpy(ids)], [paddle.to_tensor(ids)])
    assert result.aligned, str(result)
    assert result.report["steps_compared"] == 1
    assert len(result.proto.tree) == 28 and not any(row.divergent for row in result.proto.tree)


def test_activation_bug_is_found():
    a, b, ids = models(paddle_bug_layers=(1,))
    result = twinstep.compare(a, b, [torch.from_numpy(ids)], [paddle.to_tensor(ids)])
    first = result.first_divergence
    assert (first["phase"], first["module"]) == ("forward", "layers.1.mlp.act")
    assert "origin: layers.1.mlp.act (GELU) creates the error" in str(result)


def test_isolation_separates_own_error_from_inherited_error():
    """Two bad activations: isolated, the module after each one sees clean inputs and matches."""
    weights = spec.init_weights(spec.ModelConfig())
    a = model_torch.build_model(spec.ModelConfig(), weights)
    b = model_torch.build_model(spec.ModelConfig(tanh_gelu_layers=(0, 1)), weights)
    ids = torch.from_numpy(spec.batch(0)[0])
    plain = twinstep.compare(a, b, [ids], [ids])
    isolated = twinstep.compare(a, b, [ids], [ids], isolate=True)
    assert plain.first_divergence["module"] == "layers.0.mlp.act"
    assert rows(plain)["layers.1.mlp.act"] and rows(plain)["layers.0.mlp.fc2"]  # everything downstream inherits
    assert rows(isolated)["layers.0.mlp.act"] and rows(isolated)["layers.1.mlp.act"]
    assert not rows(isolated)["layers.0.mlp.fc2"] and not rows(isolated)["layers.1.attn.q_proj"]
