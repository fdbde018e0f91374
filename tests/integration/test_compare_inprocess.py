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


def keyword_pair(fc1_shift: float = 0.0):
    """fc1 -> gate -> fc2 in torch (the baseline) and paddle, gate called by keyword in another order than its
    forward's ``(hidden_states=None, scale=None)``; the paddle port's fc1 bias is off by ``fc1_shift``."""

    class TorchGate(torch.nn.Module):
        def forward(self, hidden_states=None, scale=None):
            return hidden_states * scale

    class TorchModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.gate, self.fc2 = torch.nn.Linear(4, 8), TorchGate(), torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.fc2(self.gate(scale=x.mean() + 2, hidden_states=self.fc1(x)))

    class PaddleGate(paddle.nn.Layer):
        def forward(self, hidden_states=None, scale=None):
            return hidden_states * scale

    class PaddleModel(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc1, self.gate, self.fc2 = paddle.nn.Linear(4, 8), PaddleGate(), paddle.nn.Linear(8, 2)

        def forward(self, x):
            return self.fc2(self.gate(scale=x.mean() + 2, hidden_states=self.fc1(x)))

    torch.manual_seed(0)
    a, b = TorchModel(), PaddleModel()
    for name in ("fc1", "fc2"):  # paddle keeps a Linear's weight as [in, out]
        source, target = getattr(a, name), getattr(b, name)
        target.weight.set_value(source.weight.detach().numpy().T.copy())
        target.bias.set_value(source.bias.detach().numpy() + (fc1_shift if name == "fc1" else 0.0))
    x = torch.randn(3, 4)
    return a, b, x, paddle.to_tensor(x.numpy())


def test_isolation_feeds_a_module_called_by_keyword():
    """gate takes hidden_states by keyword: isolated, it is fed the baseline's fc1 output, so only fc1 differs."""
    a, b, x_a, x_b = keyword_pair()
    assert twinstep.compare(a, b, [x_a], [x_b]).aligned
    a, b, x_a, x_b = keyword_pair(fc1_shift=0.5)
    plain = twinstep.compare(a, b, [x_a], [x_b])
    isolated = twinstep.compare(a, b, [x_a], [x_b], isolate=True)
    assert rows(plain)["fc1"] and rows(plain)["gate"] and rows(plain)["fc2"]
    assert rows(isolated)["fc1"], str(isolated)
    assert not rows(isolated)["gate"] and not rows(isolated)["fc2"], str(isolated)
