"""The MindSpore set-up collector (twinstep.runtime.setup.mindspore) on real cells and optimizers, diffed against torch twins.

The MindSpore side runs in a fresh process (tests/unit_tests/mindspore_setup_run.py): MindSpore's CPU
kernels fail to load after paddle's in one process.  The torch twins are built here, and the server's
own diff (twinstep.server.preflight.diff) says whether a faithful MindSpore set-up reads as torch's.
Skips where MindSpore is not installed, or runs with numpy 2 (its 2.x wheels are built against numpy 1.x).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.setup_views import groups as _groups, modules as _modules, run_wide as _run_wide

from twinstep.server.compare.mapping import NameMapping
from twinstep.server.preflight.diff import diff_setups
from twinstep.runtime.setup import SetupCollector
from twinstep.v1 import twinstep_pb2 as pb

_HERE = Path(__file__).parent
_MISSING = importlib.util.find_spec("mindspore") is None
_NUMPY2 = int(np.__version__.split(".")[0]) >= 2
pytestmark = pytest.mark.skipif(_MISSING or _NUMPY2, reason=(
    "MindSpore is not installed" if _MISSING else f"MindSpore's wheels are built against numpy 1.x; numpy {np.__version__} here"))


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    out = subprocess.run([sys.executable, str(_HERE / "mindspore_setup_run.py")], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path_factory.mktemp("ms"), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    found = json.loads(out.stdout)
    for name, raw in list(found["setups"].items()):
        setup = pb.Setup()
        setup.ParseFromString(base64.b64decode(raw))
        found["setups"][name] = setup
    return found




def _torch_net():
    """mindspore_setup_run.Net in torch: the same names, torch's modules."""
    import torch

    class RMSNorm(torch.nn.Module):
        def __init__(self, size: int, eps: float) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(size))
            self.variance_epsilon = eps

    class Rotary(torch.nn.Module):
        def __init__(self, base: float, dim: int = 16) -> None:
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(32, 8)
            self.fc = torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8, eps=1e-5)
            self.rms = RMSNorm(8, 1e-6)
            self.act = torch.nn.GELU()
            self.silu = torch.nn.SiLU()
            self.drop = torch.nn.Dropout(0.1)
            self.rotary_emb = Rotary(10000.0)

    return Net()


def _torch_setup(optimizer_for) -> pb.Setup:
    import torch

    torch.manual_seed(7)
    net = _torch_net()
    collector = SetupCollector(net, "torch", torch.__version__, "highest", 0, optimizer=optimizer_for(torch, net))
    try:
        return collector.collect()
    finally:
        collector.close()


def _torch_adamw(torch, net):
    decay = [net.emb.weight, net.fc.weight]
    rest = [p for n, p in net.named_parameters() if n not in ("emb.weight", "fc.weight")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=3e-4, betas=(0.9, 0.95), eps=1e-7)


def _torch_sgd(torch, net):
    fc = [net.fc.weight, net.fc.bias]
    rest = [p for n, p in net.named_parameters() if not n.startswith("fc.")]
    return torch.optim.SGD([{"params": fc, "weight_decay": 0.01, "lr": 0.05}, {"params": rest}], lr=0.1, momentum=0.9)


def _warnings(base: pb.Setup, cand: pb.Setup) -> list[pb.PreflightFinding]:
    return [f for f in diff_setups(base, cand, NameMapping(), "mindspore") if f.severity == "warning"]


def test_experimental_adamw_groups_in_torchs_names(found):
    setup = found["setups"]["adamw"]
    groups = _groups(setup)
    # nn.Embedding's embedding_table and nn.LayerNorm's gamma/beta under torch's names.
    assert set(groups) == {"emb.weight", "fc.weight", "fc.bias", "norm.weight", "norm.bias", "rms.weight"}
    assert [groups[n]["weight_decay"] for n in ("emb.weight", "fc.weight")] == pytest.approx([0.1, 0.1])
    assert {groups[n]["weight_decay"] for n in ("fc.bias", "norm.weight", "norm.bias", "rms.weight")} == {0.0}
    assert groups["fc.bias"]["lr"] == pytest.approx(3e-4, rel=1e-6)  # the group's 0-d Parameter
    assert groups["fc.bias"]["beta2"] == pytest.approx(0.95) and groups["fc.bias"]["epsilon"] == pytest.approx(1e-7)
    wide = _run_wide(setup)
    assert wide["optimizer.class"] == "AdamW" and wide["seed"] == 7 and wide["default_dtype"] == "float32"
    assert wide["mindspore.mode"] == "pynative" and wide["mindspore.device_target"] == "CPU"
    assert wide["mindspore.deterministic"] is False
    assert not setup.warnings


def test_modules_read_in_torchs_words(found):
    modules = _modules(found["setups"]["adamw"])
    assert modules["norm"] == {"eps": pytest.approx(1e-5)}
    assert modules["rms"] == {"eps": pytest.approx(1e-6)}
    assert modules["act"] == {"activation": "gelu"}  # nn.GELU(approximate=False): erf
    assert modules["silu"] == {"activation": "silu"}
    assert modules["drop"] == {"p": pytest.approx(0.1)}
    assert modules["rotary_emb"]["rope_base"] == pytest.approx(10000.0, rel=1e-6)  # from inv_freq


def test_primitives_and_keep_prob_are_read(found):
    modules = _modules(found["setups"]["primitives"])
    assert modules["act"] == {"activation": "gelu_tanh"}  # ops.GeLU is the tanh form
    assert modules["fast"] == {"activation": "quick_gelu"}  # x * sigmoid(1.702 x)
    assert modules["gelu_default"] == {"activation": "gelu_tanh"}  # nn.GELU()'s default approximate=True
    assert modules["drop"] == {"p": pytest.approx(0.1)}  # nn.Dropout(keep_prob=0.9)
    assert modules["raw_drop"] == {"p": pytest.approx(0.2)}  # ops.Dropout(keep_prob=0.8)
    assert "fc" not in modules  # nn.Dense's own primitives (MatMul, BiasAdd) are not modules


def test_a_faithful_setup_has_no_warning_against_its_torch_twin(found):
    assert _warnings(_torch_setup(_torch_adamw), found["setups"]["adamw"]) == []
    # nn.Momentum is torch's SGD with momentum (the same update): named so, with dampening 0.
    assert _warnings(_torch_setup(_torch_sgd), found["setups"]["nn_momentum"]) == []


def test_nn_layernorms_default_epsilon_is_found(found):
    (finding,) = _warnings(_torch_setup(_torch_adamw), found["setups"]["norm_eps_default"])
    assert (finding.category, list(finding.affects)) == ("norm_eps", ["norm"])
    assert (finding.baseline, finding.candidate) == ("1e-05", "1e-07")


def test_nn_adam_schedule_loss_scale_and_decay_filter(found):
    setup = found["setups"]["nn_adam"]
    groups = _groups(setup)
    # One weight decay for all, withheld by nn.Optimizer's decay_filter from names holding gamma or beta,
    # and stored times loss_scale: the user's 0.01 comes back.
    assert {groups[n]["weight_decay"] for n in ("norm.weight", "norm.bias")} == {0.0}
    assert [groups[n]["weight_decay"] for n in ("emb.weight", "fc.weight", "fc.bias", "rms.weight")] == pytest.approx(
        [0.01] * 4, rel=1e-6)
    assert groups["fc.weight"]["lr"] == pytest.approx(1e-3)  # CosineDecayLR's max_lr
    assert groups["fc.weight"]["beta2"] == pytest.approx(0.98, rel=1e-6)
    wide = _run_wide(setup)
    assert wide["scheduler"] == "CosineDecayLR" and wide["optimizer.class"] == "Adam"
    assert wide["loss_scaling"] == "static" and wide["loss_scaling.init_scale"] == 2.0


def test_nn_momentum_groups_and_adamweightdecay_keeps_its_name(found):
    groups = _groups(found["setups"]["nn_momentum"])
    assert groups["fc.weight"]["lr"] == pytest.approx(0.05, rel=1e-6) and groups["fc.weight"]["weight_decay"] == 0.01
    assert groups["emb.weight"]["lr"] == pytest.approx(0.1, rel=1e-6) and groups["emb.weight"]["weight_decay"] == 0.0
    assert groups["emb.weight"]["momentum"] == pytest.approx(0.9, rel=1e-6) and groups["emb.weight"]["dampening"] == 0
    # No bias correction: not torch's AdamW, so a port using it is told.
    assert _run_wide(found["setups"]["nn_adamweightdecay"])["optimizer.class"] == "AdamWeightDecay"


def test_changes_between_steps_are_seen_cheaply(found):
    assert found["unchanged"] is True
    assert found["changed_epsilon"] == [pytest.approx(1e-7), pytest.approx(1e-6)]
    assert found["changed_us"] < 200, found["changed_us"]  # measured ~3 µs


def test_unreadable_parts_are_warnings_never_exceptions(found):
    assert "raised" not in found, found.get("raised")
    broken = found["setups"]["broken"]
    assert any("could not read the optimizer" in w and "groups are gone" in w for w in broken.warnings)
    assert _modules(broken)["norm"] == {"eps": pytest.approx(1e-5)}  # the rest is still read
    assert any("1 optimized parameter(s) are not parameters of the attached model" in w
               for w in found["setups"]["stranger"].warnings)
