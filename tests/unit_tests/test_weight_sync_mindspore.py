"""Weight sync with MindSpore cells: a torch baseline's weights into a MindSpore candidate, and back.

The MindSpore side runs in a fresh process (tests/unit_tests/mindspore_weight_sync_run.py): MindSpore's
CPU kernels fail to load after paddle's in one process.  Skips where MindSpore is not installed, or
runs with numpy 2 (its 2.x wheels are built against numpy 1.x).  The two-process run of the demo
models is tests/integration/test_weight_sync_mindspore_demo.py.
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

_MISSING = importlib.util.find_spec("mindspore") is None
_NUMPY2 = int(np.__version__.split(".")[0]) >= 2
pytestmark = pytest.mark.skipif(_MISSING or _NUMPY2, reason=(
    "MindSpore is not installed" if _MISSING else f"MindSpore's wheels are built against numpy 1.x; numpy {np.__version__} here"))


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> dict:
    script = Path(__file__).with_name("mindspore_weight_sync_run.py")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path_factory.mktemp("ms-weights"),
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_torch_baselines_weights_load_into_a_mindspore_cell_under_mindspores_names(findings):
    assert findings["differed_before"] and findings["equal_after"]  # bit for bit
    # gamma/beta/embedding_table take torch's weight/bias/weight with no mapping rule; Dense is [out, in]
    # like torch's Linear, so the square fc.weight is not transposed.
    assert findings["loaded"] == {
        "embed.embedding_table": [["embed.weight"], [False]], "fc.weight": [["fc.weight"], [False]],
        "fc.bias": [["fc.bias"], [False]], "ln.gamma": [["ln.weight"], [False]], "ln.beta": [["ln.bias"], [False]],
        "head.weight": [["head.weight"], [False]]}
    assert findings["no_counterpart"] == [] and findings["unused"] == []
    assert findings["output_diff"] < 1e-5


def test_a_mindspore_baseline_shares_its_weights_with_a_torch_candidate(findings):
    assert findings["from_ms_equal"]
    assert findings["from_ms_loaded"] == ["embed.weight", "fc.bias", "fc.weight", "head.weight", "ln.bias",
                                          "ln.weight"]


def test_bfloat16_arrives_bit_for_bit_and_a_float32_parameter_takes_it_by_a_cast(findings):
    assert findings["bf16_equal"]
    assert findings["bf16_dtypes"] == ["BFloat16", "Float32"]
    assert findings["bf16_cast"] == ["embed.embedding_table"]
    assert findings["bf16_from_ms_equal"]
    assert findings["bf16_from_ms_exact"] == ["fc.bias", "fc.weight", "head.weight", "ln.beta", "ln.gamma"]


def test_a_shape_no_rule_reconciles_loads_nothing_into_the_cell(findings):
    assert "head.weight [5, 8]: the baseline's head.weight is [3, 8]" in findings["mismatch_error"]
    assert "nothing was loaded" in findings["mismatch_error"]
    assert findings["mismatch_untouched"]


def test_the_loader_checks_every_shape_before_it_sets_any(findings):
    # MindSpore's set_data would take a value of another shape and reshape the parameter.
    assert findings["loader_error"] == "a value of shape [4, 2] for a parameter of shape [3, 8]"
    assert findings["loader_untouched"] and findings["loader_shapes_kept"]
    assert findings["cast"] == ["Float32", 0.25]
