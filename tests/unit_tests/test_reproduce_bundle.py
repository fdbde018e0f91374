"""Reproducer bundles: captured from real torch and paddle modules, read back, replayed in one process."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from twinstep.cli.main import main as cli
from twinstep.tools.reproduce.bundle import VERSION, BundleError, read_bundle
from twinstep.tools.reproduce.capture import BundleCapture
from twinstep.tools.reproduce.replay import reproduce
from twinstep.v1 import twinstep_pb2 as pb

SPEC = pb.ZoomSpec(id=3, modules=["act"], capture="tensors", first_step=4, last_step=4, bundle_module="act",
                   divergent_step=2, reason="test")


def capture(framework: str, module, call, directory, baseline: bool) -> str:
    about = {"session": "s", "run": framework, "baseline": baseline, "reference": False, "rank": 0, "world_size": 1}
    bundle = BundleCapture(framework, module, SPEC, 4, about, directory)
    bundle.arm()
    call()
    bundle.finish()
    bundle.writer.join(30)
    assert bundle.path is not None
    return str(bundle.path)


def torch_gelu(directory, x: np.ndarray) -> str:
    import torch

    module = torch.nn.GELU()
    return capture("torch", module, lambda: module(torch.from_numpy(x)), directory, baseline=True)


def paddle_gelu(directory, x: np.ndarray, approximate: bool) -> str:
    import paddle

    module = paddle.nn.GELU(approximate=approximate)
    return capture("paddle", module, lambda: module(paddle.to_tensor(x)), directory, baseline=False)


@pytest.fixture(scope="module")
def inputs() -> np.ndarray:
    return np.random.default_rng(0).normal(0, 1, size=(4, 64)).astype(np.float32)


def test_a_tanh_gelu_port_is_found_in_its_bundles_and_a_fixed_factory_passes(tmp_path, inputs, monkeypatch):
    base = torch_gelu(tmp_path, inputs)
    cand = paddle_gelu(tmp_path, inputs, approximate=True)
    meta = read_bundle(cand).meta
    assert (meta["step"], meta["divergent_step"], meta["module_class"]) == (4, 2, "paddle.nn.layer.activation.GELU")
    assert any("step 2 itself" in text for text in meta["missing"])
    result = reproduce([base, cand])
    by = {c.label: c for c in result.comparisons}
    assert result.module_diverges and by["same inputs"].values["rel_l2"] > 1e-4
    assert by["inputs"].values["max_abs"] == 0 and by["candidate replay"].values["max_abs"] == 0
    # The fix, checked in seconds: a factory building the port's module as it should be.
    (tmp_path / "fixed_port.py").write_text("import paddle\n\ndef build():\n    return paddle.nn.GELU()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fixed = reproduce([cand, base], candidate_factory="fixed_port:build")
    assert not fixed.module_diverges, fixed.verdict
    assert {c.label: c for c in fixed.comparisons}["same inputs"].values["rel_l2"] < 1e-6


def test_parameters_and_bfloat16_travel_exactly(tmp_path):
    import torch

    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 8).to(torch.bfloat16)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    path = capture("torch", linear, lambda: linear(x), tmp_path, baseline=True)
    bundle = read_bundle(path)
    assert set(bundle.meta["parameters"]) == {"weight", "bias"}
    assert bundle.dtypes[bundle.meta["parameters"]["weight"]] == "bfloat16"
    with torch.no_grad():
        linear.weight.zero_()  # the live module moved on; the bundle keeps the values of its call
    result = reproduce([path])
    [check] = result.comparisons
    assert check.values["max_abs"] == 0, result.verdict


def _corrupt(tmp_path, good: str, name: str, edit) -> str:
    out = tmp_path / name
    with zipfile.ZipFile(good) as source, zipfile.ZipFile(out, "w") as target:
        for item in source.namelist():
            data = source.read(item)
            result = edit(item, data)
            if result is not None:
                target.writestr(item, result)
    return str(out)


def test_a_bad_bundle_is_refused_with_what_is_wrong(tmp_path, inputs, capsys):
    good = torch_gelu(tmp_path / "good", inputs)
    not_zip = tmp_path / "a.twinstep-bundle.zip"
    not_zip.write_bytes(b"PK\x03\x04 truncated")

    def meta_with(**changes):
        def edit(item, data):
            if item != "bundle.json":
                return data
            return json.dumps({**json.loads(data), **changes})
        return edit

    def without_inputs(item, data):
        if item != "bundle.json":
            return data
        return json.dumps({k: v for k, v in json.loads(data).items() if k != "inputs"})

    cases = {
        str(not_zip): "not a twinstep bundle (not a readable zip file",
        str(tmp_path / "absent.zip"): "no such file",
        _corrupt(tmp_path, good, "b.zip", lambda item, data: None if item == "bundle.json" else data): "no bundle.json",
        _corrupt(tmp_path, good, "c.zip", meta_with(format="other")): "does not describe a twinstep-bundle",
        _corrupt(tmp_path, good, "d.zip", meta_with(version=VERSION + 1)): f"format version {VERSION + 1}",
        _corrupt(tmp_path, good, "e.zip", lambda item, data: None if item.startswith("arrays/") else data):
            "is listed but not stored",
        _corrupt(tmp_path, good, "f.zip", without_inputs): "lacks inputs",
    }
    for path, message in cases.items():
        with pytest.raises(BundleError, match="bundle") as error:
            read_bundle(path)
        assert message in str(error.value), (path, str(error.value))
    # The command line says it in one line and exits 2.
    assert cli(["reproduce", str(not_zip)]) == 2
    err = capsys.readouterr().err
    assert "twinstep reproduce: bundle" in err and "Traceback" not in err


def test_the_baselines_parameters_carry_over_in_the_candidates_layout(tmp_path):
    """A paddle Linear whose weight drifted: on the baseline's parameters (transposed to paddle's [in, out])
    it computes what torch's does, so the verdict points at the parameters, not the code."""
    import pickle

    import paddle
    import torch

    try:
        pickle.dumps(paddle.nn.Linear(2, 2))
    except TypeError as error:  # paddle 3.0: parameters are not picklable (docs/zoom-and-reproduce.md, Limits)
        pytest.skip(f"paddle {paddle.__version__} cannot pickle a layer with parameters ({error}): its bundles "
                    "hold no module object and reproduce needs a factory, which the tanh-GELU test covers")
    torch.manual_seed(0)
    base_linear = torch.nn.Linear(16, 8)
    cand_linear = paddle.nn.Linear(16, 8)
    drift = np.random.default_rng(1).normal(0, 1e-2, size=(16, 8)).astype(np.float32)
    cand_linear.weight.set_value(base_linear.weight.detach().numpy().T + drift)
    cand_linear.bias.set_value(base_linear.bias.detach().numpy())
    x = np.random.default_rng(2).normal(0, 1, size=(4, 16)).astype(np.float32)
    base = capture("torch", base_linear, lambda: base_linear(torch.from_numpy(x)), tmp_path, baseline=True)
    cand = capture("paddle", cand_linear, lambda: cand_linear(paddle.to_tensor(x)), tmp_path, baseline=False)
    assert read_bundle(cand).meta["parameter_types"] == {"weight": "Linear", "bias": "Linear"}
    result = reproduce([base, cand])
    by = {c.label: c for c in result.comparisons}
    assert by["same inputs"].exceeded  # its own, drifted weight
    assert not by["same parameters"].note and by["same parameters"].values["rel_l2"] < 1e-6
    assert not result.module_diverges and "parameters have drifted" in result.verdict
