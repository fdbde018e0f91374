"""server/compare/lossy.py: error budgets that keep every verdict, from the server's tolerances."""

from __future__ import annotations

import math

import numpy as np
import pytest

from twinstep.wire import codec
from twinstep.server.compare import metrics
from twinstep.server.compare.lossy import lossy_bounds
from twinstep.server.compare.tolerance import ToleranceConfig


def test_every_phase_gets_a_budget_from_its_tightest_element_wise_tolerance():
    bounds = lossy_bounds(ToleranceConfig())
    assert set(bounds) == {"forward", "loss", "backward", "grad", "param"}
    # rel_l2 1e-4 (forward) vs 1e-3 (param): ten times the room per element.
    assert bounds["param"].rms_fraction > 5 * bounds["forward"].rms_fraction
    assert bounds["forward"].absolute == float("inf")  # max_abs has no default tolerance


def test_a_tighter_override_tightens_its_phase_only():
    config = ToleranceConfig.from_dict({"overrides": [{"pattern": "layers.0.*", "phase": "forward", "rel_l2": 1e-6},
                                                      {"pattern": "*", "phase": "grad", "max_abs": 1e-3}]})
    default, tight = lossy_bounds(ToleranceConfig()), lossy_bounds(config)
    assert tight["forward"].rms_fraction < default["forward"].rms_fraction / 50
    assert tight["backward"].rms_fraction == default["backward"].rms_fraction
    assert tight["grad"].absolute == codec.error_bound_for_max_abs(1e-3, codec.DEFAULT_MARGIN)


def test_a_zero_tolerance_means_lossless():
    config = ToleranceConfig.from_dict({"forward": {"rel_l2": 0}})
    assert "forward" not in lossy_bounds(config)


def test_the_budget_keeps_a_forward_verdict_on_real_data():
    rng = np.random.default_rng(0)
    a = rng.normal(size=4096).astype(np.float32)
    b = (a + 2e-4 * rng.normal(size=4096)).astype(np.float32)  # rel_l2 ~2e-4: over forward's 1e-4
    fraction = lossy_bounds(ToleranceConfig())["forward"].rms_fraction
    decoded = []
    for x in (a, b):
        bound = fraction * float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
        kind, data, raw, step = codec.encode_quantized(x, bound)
        assert kind == codec.pb.QUANT_ZSTD and len(data) < x.nbytes
        decoded.append(codec.decode(kind, data, raw, "float32", x.shape, quant_step=step, error_bound=bound))
    exact = metrics.from_tensors(a, b)["rel_l2"]
    lossy = metrics.from_tensors(*decoded)["rel_l2"]
    assert exact > 1e-4 and lossy > 1e-4
    assert abs(lossy - exact) <= codec.DEFAULT_MARGIN * 1e-4


def test_a_lossy_client_quantises_each_tensor_within_its_phase_budget():
    import torch

    from twinstep.runtime.capture import CaptureConfig, Recorder, backend_for
    from twinstep.runtime.transport.messages import TensorEncoder, encoded_pieces

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    recorder = Recorder(model, backend_for(model), CaptureConfig(capture="lossy"))
    x = torch.randn(16, 64)
    loss = model(x).square().mean()
    loss.backward()
    batch = recorder.finish_step(0, loss)
    budgets = lossy_bounds(ToleranceConfig())
    del budgets["param"]  # a phase without a budget travels losslessly
    originals = {host.records[0]: batch.storage_array(host.copy).copy() for host in batch.tensors}
    pieces = [codec.pb.ClientMessage.FromString(wire).tensor for wire in encoded_pieces(batch, TensorEncoder(), budgets)]
    kinds = {}
    for payload in pieces:
        phase = codec.pb.Phase.Name(int(batch.phase[payload.record])).lower()
        kinds.setdefault(phase, set()).add(payload.codec)
        if payload.codec != codec.pb.QUANT_ZSTD:
            continue
        shape = tuple(batch.dims_of(payload.record))
        assert payload.offset == 0 and payload.numel == math.prod(shape)  # small tensors: one piece each
        decoded = codec.decode(payload.codec, payload.data, payload.raw_nbytes, "float32", shape,
                               quant_step=payload.quant_step, error_bound=payload.error_bound)
        original = originals[payload.record]
        rms = float(np.sqrt(np.mean(original.astype(np.float64) ** 2)))
        assert payload.error_bound == pytest.approx(budgets[phase].rms_fraction * rms, rel=1e-5)
        assert np.abs(decoded - original).max() <= payload.error_bound
    assert kinds["forward"] == kinds["grad"] == {codec.pb.QUANT_ZSTD}
    assert codec.pb.QUANT_ZSTD not in kinds["param"]
