"""The set-up collectors (twinstep.runtime.setup) on real torch and paddle models and optimizers."""

from __future__ import annotations

import pytest

from tests.setup_views import groups as _groups, modules as _modules, run_wide as _run_wide
from twinstep.runtime.setup import SetupCollector


def _torch_model():
    import torch

    class Rotary(torch.nn.Module):
        def __init__(self, base: float, dim: int = 16) -> None:
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8, eps=1e-5)
            self.act = torch.nn.GELU(approximate="tanh")
            self.drop = torch.nn.Dropout(0.1)
            self.rotary_emb = Rotary(10000.0)

    return Block()


def test_torch_groups_name_exactly_the_parameters_each_value_applies_to():
    import torch

    model = _torch_model()
    decay = [model.fc.weight]
    rest = [p for n, p in model.named_parameters() if n != "fc.weight"]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-7)
    collector = SetupCollector(model, "torch", torch.__version__, "fp32", 0, optimizer=opt)
    setup = collector.collect()
    collector.close()
    groups = _groups(setup)
    assert groups["fc.weight"]["weight_decay"] == pytest.approx(0.1)
    assert {groups[n]["weight_decay"] for n in ("fc.bias", "norm.weight", "norm.bias")} == {0.0}
    assert groups["fc.bias"]["epsilon"] == pytest.approx(1e-7) and groups["fc.bias"]["beta2"] == pytest.approx(0.95)
    modules = _modules(setup)
    assert modules["norm"] == {"eps": pytest.approx(1e-5)}
    assert modules["act"] == {"activation": "gelu_tanh"}
    assert modules["drop"] == {"p": pytest.approx(0.1)}
    assert modules["rotary_emb"]["rope_base"] == pytest.approx(10000.0, rel=1e-6)  # from inv_freq
    wide = _run_wide(setup)
    assert wide["optimizer.class"] == "AdamW" and wide["clipping"] == "none" and wide["default_dtype"] == "float32"
    assert setup.digest and not setup.warnings


def test_torch_clipping_is_seen_in_the_loop_and_changes_the_setup_then_the_wrapper_goes():
    import torch

    model = _torch_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    original = torch.nn.utils.clip_grad_norm_
    collector = SetupCollector(model, "torch", torch.__version__, "fp32", 0, optimizer=opt)
    first = collector.collect()
    assert collector.changed() is None  # nothing changed: no resend
    model.fc(torch.ones(2, 8)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    changed = collector.changed()
    assert changed is not None and changed.digest != first.digest
    assert _run_wide(changed)["clipping"] == "global_norm"
    assert _run_wide(changed)["clipping.max_norm"] == pytest.approx(0.5)
    assert _groups(changed)["fc.weight"]["momentum"] == pytest.approx(0.9)
    collector.close()
    assert torch.nn.utils.clip_grad_norm_ is original


def test_paddle_decay_function_is_mapped_back_to_structured_names_and_clipping_read():
    import paddle

    class Block(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.fc = paddle.nn.Linear(8, 8)
            self.norm = paddle.nn.LayerNorm(8, epsilon=1e-6)
            self.act = paddle.nn.Silu()

    model = Block()
    decayed = {model.fc.weight.name}  # paddle's unique name ("linear_0.w_0"), as training scripts key it
    opt = paddle.optimizer.AdamW(learning_rate=paddle.optimizer.lr.CosineAnnealingDecay(1e-3, 10),
                                 parameters=model.parameters(), epsilon=1e-6, weight_decay=0.01,
                                 apply_decay_param_fun=lambda name: name in decayed,
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    setup = SetupCollector(model, "paddle", paddle.__version__, "fp32", 0, optimizer=opt).collect()
    groups = _groups(setup)
    assert groups["fc.weight"]["weight_decay"] == pytest.approx(0.01)
    assert groups["fc.bias"]["weight_decay"] == 0.0 and groups["norm.weight"]["weight_decay"] == 0.0
    assert groups["fc.bias"]["lr"] == pytest.approx(1e-3) and groups["fc.bias"]["epsilon"] == pytest.approx(1e-6)
    wide = _run_wide(setup)
    assert (wide["clipping"], wide["clipping.max_norm"]) == ("global_norm", pytest.approx(1.0))
    assert wide["scheduler"] == "CosineAnnealingDecay"
    assert _modules(setup)["norm"] == {"eps": pytest.approx(1e-6)}
    assert _modules(setup)["act"] == {"activation": "silu"}


def test_a_failing_collector_is_a_setup_warning_not_an_exception():
    import torch

    class Broken(torch.nn.Module):
        @property
        def eps(self):  # an attribute that raises when read
            raise RuntimeError("boom")

    model = torch.nn.Sequential(Broken(), torch.nn.Linear(2, 2))
    setup = SetupCollector(model, "torch", torch.__version__, "fp32", 0, optimizer=object()).collect()
    assert any("boom" in w for w in setup.warnings), setup.warnings
    assert any("optimizer" in w for w in setup.warnings), setup.warnings
    assert _modules(setup) == {}  # what could be read still is: nothing else here has hyper-parameters


def test_without_an_optimizer_the_setup_says_so():
    import torch

    setup = SetupCollector(torch.nn.Linear(2, 2), "torch", torch.__version__, "fp32", 0).collect()
    assert not setup.groups
    assert any("no optimizer was given" in w for w in setup.warnings)
