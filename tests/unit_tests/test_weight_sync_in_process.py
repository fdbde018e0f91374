"""Weight sync end to end in one process: torch and paddle models, a real server on a loopback port.

The two-process directions on real transformers and paddleformers models are in
tests/integration/test_weight_sync.py and tests/ports/test_weight_sync_port.py.
"""

from __future__ import annotations

import time

import grpc
import jsonschema
import numpy as np
import paddle
import pytest
import torch

import twinstep
from twinstep.server import ServerConfig, serve
from twinstep.server.config import LimitsConfig, SessionsConfig, SyncConfig
from twinstep.server.report.render import render_text, report_schema
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

#: Under one 4 MiB parameter: the upload must come in pieces to get through.
SMALL_MESSAGES = 2 << 20


@pytest.fixture(scope="module")
def server():
    handle = serve(port=0, config=ServerConfig(limits=LimitsConfig(max_message_bytes=SMALL_MESSAGES), sessions=SessionsConfig(reconnect_grace=0.5)))
    yield handle
    handle.stop(grace=0.5)


def torch_model(dtype: torch.dtype = torch.float32, out: int = 4, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, out)).to(dtype)


def paddle_model(dtype: str = "float32") -> paddle.nn.Layer:
    paddle.seed(123)
    model = paddle.nn.Sequential(paddle.nn.Linear(8, 8), paddle.nn.Tanh(), paddle.nn.Linear(8, 4))
    if dtype != "float32":
        model.to(dtype=dtype)
    return model


def attach(model, server, session, run, **kwargs):
    return twinstep.attach(model, session=session, run=run, server=server.address, **kwargs)


def torch_bits(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's storage as numpy (bfloat16 as its bit pattern)."""
    t = t.detach().contiguous()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize(("torch_dtype", "paddle_dtype"), [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_sixteen_bit_weights_reach_paddle_bit_for_bit_with_square_transposes(server, torch_dtype, paddle_dtype):
    session = f"bits-{paddle_dtype}"
    base_model, cand_model = torch_model(torch_dtype), paddle_model(paddle_dtype)
    base = attach(base_model, server, session, "torch", baseline=True, share_weights=True)
    cand = attach(cand_model, server, session, "paddle", init_from_baseline=True, init_timeout=60)
    try:
        for (name, b), (_, c) in zip(base_model.named_parameters(), cand_model.named_parameters()):
            want = torch_bits(b)
            got = c.numpy()
            assert got.dtype == want.dtype, name
            # Linear weights: torch [out, in], paddle [in, out]; the first is square (8 x 8).
            assert np.array_equal(got, want.T if name.endswith("weight") else want), name
        assert {w.name: list(w.transposed) for w in cand.weight_sync.loaded} == {
            "0.weight": [True], "0.bias": [False], "2.weight": [True], "2.bias": [False]}
    finally:
        base.close(), cand.close()


def test_a_float32_baseline_is_cast_into_a_bfloat16_candidate_and_the_report_says_so(server):
    base_model, cand_model = torch_model(), torch_model(torch.bfloat16, seed=1)
    base = attach(base_model, server, "cast", "fp32", baseline=True, share_weights=True)
    cand = attach(cand_model, server, "cast", "bf16", init_from_baseline=True, init_timeout=60)
    base.close(), cand.close()
    for b, c in zip(base_model.parameters(), cand_model.parameters()):
        assert torch.equal(c, b.detach().to(torch.bfloat16))
    report = server.report("cast")
    jsonschema.validate(report, report_schema())
    sync = next(r for r in report["runs"] if r["name"] == "bf16")["weight_sync"]
    assert sync["baseline_run"] == "fp32" and len(sync["loaded"]) == 4
    assert {(w["dtype"], w["candidate_dtype"]) for w in sync["loaded"]} == {("float32", "bfloat16")}
    assert "4 cast" in render_text(server.report_proto("cast"))


def test_a_shape_no_rule_reconciles_loads_nothing_and_names_it(server):
    base_model, cand_model = torch_model(), torch_model(out=5, seed=2)
    before = [p.detach().clone() for p in cand_model.parameters()]
    base = attach(base_model, server, "mismatch", "torch", baseline=True, share_weights=True)
    with pytest.raises(twinstep.WeightSyncError, match=r"2\.weight \[5, 8\].*2\.weight is \[4, 8\].*nothing was loaded"):
        attach(cand_model, server, "mismatch", "cand", init_from_baseline=True, init_timeout=60)
    base.close()
    # 0.weight and 0.bias matched, yet they were not loaded either: all or nothing.
    assert all(torch.equal(p, q) for p, q in zip(cand_model.parameters(), before))


def test_a_baseline_that_does_not_share_its_weights_is_told_at_once(server):
    base = attach(torch_model(), server, "declined", "torch", baseline=True)
    started = time.monotonic()
    with pytest.raises(twinstep.WeightSyncError, match="without share_weights=True"):
        attach(torch_model(seed=3), server, "declined", "cand", init_from_baseline=True, init_timeout=60)
    assert time.monotonic() - started < 10  # not the 60 s timeout
    base.close()


def test_no_baseline_within_init_timeout_is_a_clear_error(server):
    started = time.monotonic()
    with pytest.raises(twinstep.WeightSyncError, match=r"within 0\.5 s \(init_timeout\).*share_weights=True"):
        attach(torch_model(), server, "nobody", "cand", init_from_baseline=True, init_timeout=0.5)
    assert time.monotonic() - started < 5


def test_parameters_larger_than_a_message_travel_in_pieces(server):
    """A 4 MiB square weight against a server that takes messages of at most 2 MiB, torch to paddle and back."""
    torch.manual_seed(4)
    paddle.seed(4)
    big_torch, big_paddle, back = torch.nn.Linear(1024, 1024), paddle.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)
    base = attach(big_torch, server, "big", "torch", baseline=True, share_weights=True)
    cand = attach(big_paddle, server, "big", "paddle", init_from_baseline=True, init_timeout=60)
    assert np.array_equal(big_paddle.weight.numpy(), big_torch.weight.detach().numpy().T)
    base.close(), cand.close()
    assert cand.weight_sync.bytes == (1024 * 1024 + 1024) * 4
    # paddle as the baseline: its [in, out] weight goes back into torch's [out, in].
    base = attach(big_paddle, server, "big-back", "paddle", baseline=True, share_weights=True)
    cand = attach(back, server, "big-back", "torch", init_from_baseline=True, init_timeout=60)
    base.close(), cand.close()
    assert torch.equal(back.weight, big_torch.weight) and torch.equal(back.bias, big_torch.bias)


def test_weights_beyond_the_servers_budget_are_refused_and_the_candidate_is_told():
    small = serve(port=0, config=ServerConfig(sync=SyncConfig(weights_budget_bytes=256), sessions=SessionsConfig(reconnect_grace=0.5)))  # the model: 432 bytes
    try:
        base = attach(torch_model(), small, "budget", "torch", baseline=True, share_weights=True)
        with pytest.raises(twinstep.WeightSyncError, match="weights_budget_bytes"):
            attach(torch_model(seed=5), small, "budget", "cand", init_from_baseline=True, init_timeout=30)
        base.close()
    finally:
        small.stop(grace=0.5)


def test_roles_are_checked_at_attach(server):
    with pytest.raises(ValueError, match="share_weights is the baseline's"):
        attach(torch_model(), server, "roles", "cand", share_weights=True)
    with pytest.raises(ValueError, match="init_from_baseline is for candidates"):
        attach(torch_model(), server, "roles", "base", baseline=True, init_from_baseline=True)


def test_a_malformed_upload_is_refused_the_waiting_candidate_told_and_the_server_serves_on(server):
    header = pb.WeightsHeader(session="malformed", run="torch", framework="torch",
                              parameters=[pb.ParameterInfo(id=0, name="w", module="", module_type="M", shape=[4],
                                                           dtype=pb.FLOAT32)])
    bad = pb.WeightPiece(parameter=0, offset=1, numel=3, codec=pb.RAW, raw_nbytes=12, data=bytes(12))  # not at 0
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.TwinstepStub(channel).PublishWeights(
                iter([pb.WeightsUpload(header=header), pb.WeightsUpload(piece=bad)]), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "starts at element 1, expected 0" in refused.value.details()
    with pytest.raises(twinstep.WeightSyncError, match="upload was malformed"):
        attach(torch_model(), server, "malformed", "cand", init_from_baseline=True, init_timeout=30)
    base = attach(torch_model(), server, "after-malformed", "torch", baseline=True, share_weights=True)
    cand = attach(torch_model(seed=6), server, "after-malformed", "cand", init_from_baseline=True, init_timeout=30)
    base.close(), cand.close()
    assert len(cand.weight_sync.loaded) == 4
