"""MindSpore's capture backend on a real model, checked against torch on the same weights and batch.

The MindSpore side runs in a fresh process (tests/unit_tests/mindspore_capture_run.py): MindSpore's CPU
kernels fail to load after paddle's in one process.  Skips where MindSpore is not installed, or runs
with numpy 2 (its 2.x wheels are built against numpy 1.x: client/runtime/environment.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from twinstep.runtime.environment import mindspore_numpy_conflict
from twinstep.wire.layouts import canonical_parameter_name

_HERE = Path(__file__).parent
_MISSING = importlib.util.find_spec("mindspore") is None
_NUMPY2 = int(np.__version__.split(".")[0]) >= 2
needs_mindspore = pytest.mark.skipif(_MISSING or _NUMPY2, reason=(
    "MindSpore is not installed" if _MISSING else f"MindSpore's wheels are built against numpy 1.x; numpy {np.__version__} here"))


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> dict:
    out = subprocess.run([sys.executable, str(_HERE / "mindspore_capture_run.py")], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path_factory.mktemp("ms"), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


@needs_mindspore
def test_every_phase_recorded_with_torchs_numbers(findings):
    modules = ("", "fc1", "act", "ln", "fc2")
    params = ("fc1.weight", "fc1.bias", "ln.gamma", "ln.beta", "fc2.weight", "fc2.bias")
    expected = {f"{phase}:{m}" for phase in ("forward", "backward", "input") for m in modules} - {"input:"} | {
        "input:", "loss:"} | {f"{phase}:{p}" for phase in ("grad", "param") for p in params}
    assert set(findings["labels"]) == expected
    # Statistics of outputs, output gradients, parameter gradients (from the optimizer's call) and parameters
    # after SGD's update agree with torch's to float32 rounding.
    assert max(findings["errors"].values()) < 1e-5, findings["errors"]
    assert findings["transposed"] == []  # nn.Dense stores [out, in], as torch does


@needs_mindspore
def test_detached_model_trains_untouched(findings):
    assert findings["after_remove"] == {"records": 0, "grads_kept": 0, "trained": True}


@needs_mindspore
def test_full_tensors_and_sketches_carry_torchs_values(findings):
    assert findings["tensors"] >= 20
    assert findings["tensor_worst"] < 1e-5
    assert findings["sketched"] >= 4 and findings["sketch_worst"] < 1e-6


@needs_mindspore
def test_device_statistics_agree_with_the_host_path(findings):
    assert findings["device_row_diff"] < 1e-5


@needs_mindspore
def test_named_mindspore_values_keep_dtype_and_numbers(findings):
    assert findings["named"] == ["int64", [[0, 1, 2], [3, 4, 5]]]


@needs_mindspore
def test_jit_compiled_cell_captured_as_one_module_and_graph_mode_refused(findings):
    assert findings["compiled_labels"] == ["forward:", "input:", "loss:"]
    assert "failures" not in findings["compiled_health"]
    assert "PyNative mode only" in findings["graph_mode"] and "set_context(mode=mindspore.PYNATIVE_MODE)" in findings[
        "graph_mode"]


@needs_mindspore
def test_a_cell_called_with_keywords_has_its_input_recorded(findings):
    """As torch and paddle (test_recorder.py): the first keyword tensor in construct's order, hidden_states."""
    found = findings["keyword_inputs"]
    for call in ("keywords", "positional"):
        assert found[call]["inputs"] == ["fc1", "gate", ""] and found[call]["failures"] == 0, found[call]
    assert found["keywords"]["gate_input"] == found["keywords"]["fc1_output"]
    assert found["keywords"]["gate_input"] == found["positional"]["gate_input"]


def test_mindspore_parameter_names_join_torchs():
    assert canonical_parameter_name("LayerNorm", "layers.0.ln1.gamma") == "layers.0.ln1.weight"
    assert canonical_parameter_name("LayerNorm", "norm.beta") == "norm.bias"
    assert canonical_parameter_name("Embedding", "embed.embedding_table") == "embed.weight"
    assert canonical_parameter_name("BatchNorm2d", "bn.moving_variance") == "bn.running_var"
    assert canonical_parameter_name("Dense", "fc.weight") == "fc.weight"
    assert canonical_parameter_name("Custom", "x.gamma") == "x.gamma"  # only the modules that name it so


def test_numpy_2_with_mindspore_is_named_at_attach():
    assert mindspore_numpy_conflict("1.26.4") is None
    assert "install numpy<2" in mindspore_numpy_conflict("2.4.6")
