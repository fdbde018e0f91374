"""twinstep.compare: a torch model and its paddle port in one process."""

from __future__ import annotations

import logging
import re

import numpy as np
import paddle
import torch

import twinstep
from twinstep.server import serve
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


def fresh_port():
    """The faithful paddle port again, built from the same weights (as after editing the port and rebuilding it)."""
    return model_paddle.build_model(spec.ModelConfig(), spec.init_weights(spec.ModelConfig()))


def inputs(ids):
    return [torch.from_numpy(ids)], [paddle.to_tensor(ids)]


def grads(model) -> dict[str, np.ndarray | None]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = None if g is None else (g.detach().numpy() if isinstance(g, torch.Tensor) else g.numpy()).copy()
    return out


def same_grads(before: dict, after: dict) -> bool:
    return before.keys() == after.keys() and all(
        (before[k] is None and after[k] is None) or (before[k] is not None and after[k] is not None
                                                     and np.array_equal(before[k], after[k])) for k in before)


def test_a_reused_model_is_compared_on_this_calls_gradients_only():
    """The same pair compared twice, then the baseline against a rebuilt port, then after the user's own backward on
    both: each report holds this call's gradients only, and every model's gradients are left as found."""
    a, b, ids = models()
    x_a, x_b = inputs(ids)
    rebuilt = fresh_port()
    first = twinstep.compare(a, b, x_a, x_b)
    second = twinstep.compare(a, b, x_a, x_b)
    third = twinstep.compare(a, rebuilt, x_a, x_b)  # the baseline's gradients once counted x0.5 against the port's
    assert "same factor" not in str(third), str(third)
    assert (first.report["status"], first.report["stage"], rows(first)) == (
        second.report["status"], second.report["stage"], rows(second))
    assert all(g is None for m in (a, b, rebuilt) for g in grads(m).values()), "compare left gradients on a model"
    a(x_a[0]).float().pow(2).mean().backward()  # the user's own steps: gradients the comparison must not read
    b(x_b[0]).astype("float32").pow(2).mean().backward()
    before_a, before_b = grads(a), grads(b)
    assert all(g is not None for g in [*before_a.values(), *before_b.values()])
    fourth = twinstep.compare(a, b, x_a, x_b)
    for result in (first, second, third, fourth):
        assert "same factor" not in str(result) and result.aligned, str(result)
        assert {"forward", "loss", "backward", "grad", "param"} <= {row["phase"] for row in result.report["headroom"]}
    assert same_grads(before_a, grads(a)), "compare changed model_a's gradients"
    assert same_grads(before_b, grads(b)), "compare changed model_b's gradients"


def test_isolate_compares_no_leftover_gradients():
    """isolate=True runs no backward: gradients left by an earlier call or by the user are not compared."""
    a, b, ids = models()
    x_a, x_b = inputs(ids)
    twinstep.compare(a, b, x_a, x_b)  # an earlier plain call
    a(x_a[0]).float().mean().backward()  # and the user's own backward on the baseline only
    for candidate in (b, fresh_port(), b):
        isolated = twinstep.compare(a, candidate, x_a, x_b, isolate=True)
        text = str(isolated)
        assert isolated.aligned, text
        assert "same factor" not in text and "grad:" not in text, text
        assert {row["phase"] for row in isolated.report["headroom"]} == {"forward", "loss", "param"}, text
        assert not [r for side in isolated.report["unmatched"].values() for r in side if r.startswith("grad:")], text


#: What the lines about an embedded session's lifetime say (listening, runs joining and ending, how long it is kept).
LIFETIME_WORDS = re.compile(r"\b(listening|joined|every run has ended|session_ttl|time to live|ttl|archived|"
                            r"left memory|INCOMPLETE)\b", re.IGNORECASE)


def test_compare_logs_no_session_lifetime_lines(caplog, capfd):
    """One call says nothing about its embedded server's sessions; a divergence is in the report it returns;
    a server the user starts afterwards still logs as before."""
    caplog.set_level(logging.DEBUG)
    a, b, ids = models()
    x_a, x_b = inputs(ids)
    capfd.readouterr()
    caplog.clear()
    aligned = twinstep.compare(a, b, x_a, x_b)
    a, bad, ids = models(paddle_bug_layers=(1,))
    diverged = twinstep.compare(a, bad, x_a, x_b)
    lines = [f"{r.name} {r.levelname} {r.getMessage()}" for r in caplog.records if r.name.startswith("twinstep")]
    said = [line for line in lines if LIFETIME_WORDS.search(line)]
    assert not said, "\n".join(said)
    server_lines = [line for line in lines if line.startswith("twinstep.server ")]
    assert not [line for line in server_lines if " WARNING " in line or " INFO " in line], "\n".join(server_lines)
    # the divergence still reaches the log, once, from the candidate's side
    told = [line for line in lines if "divergence at step 0, forward of 'layers.1.mlp.act'" in line]
    assert len(told) == 1 and told[0].startswith("twinstep WARNING ") and "(mean 8.8e-05 > 1e-05)" in told[0], lines
    err = capfd.readouterr().err
    assert not LIFETIME_WORDS.search(err), err
    assert aligned.aligned, str(aligned)
    assert not diverged.aligned
    assert diverged.first_divergence["module"] == "layers.1.mlp.act"
    assert "origin: layers.1.mlp.act (GELU) creates the error" in str(diverged)
    # quiet for compare's own server only: the user's server still says where it listens
    caplog.clear()
    handle = serve(port=0)
    try:
        assert any(r.name == "twinstep.server" and f"listening on 127.0.0.1:{handle.port}" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        handle.stop(grace=0.5)
