"""Operations inside a module, training side: one call captured, canonical names and lines, nothing left behind."""

from __future__ import annotations

import pytest

from twinstep.runtime.capture.ops import OpsCapture, canonical
from twinstep.tools.demo import spec
from twinstep.v1 import twinstep_pb2 as pb

CFG = spec.ModelConfig(seed=0)


def _model(framework: str):
    weights = spec.init_weights(CFG)
    ids = spec.batch(0, 0, CFG)[0]
    if framework == "torch":
        import torch

        from twinstep.runtime.capture.torch import TorchBackend
        from twinstep.tools.demo.model_torch import build_model

        return build_model(CFG, weights), TorchBackend(), torch.tensor(ids)
    import paddle

    from twinstep.runtime.capture.paddle import PaddleBackend
    from twinstep.tools.demo.model_paddle import build_model

    return build_model(CFG, weights), PaddleBackend(), paddle.to_tensor(ids)


def _paddle_state():
    import paddle
    import paddle.nn.functional as F

    return {("paddle", k): v for k, v in vars(paddle).items()} | {("F", k): v for k, v in vars(F).items()} | {
        ("Tensor", k): v for k, v in vars(paddle.Tensor).items()}


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_one_call_of_one_module_is_captured_and_the_model_is_left_as_it_was(framework):
    model, backend, ids = _model(framework)
    attn = dict(backend.named_modules(model))["layers.0.attn"]
    before = _paddle_state() if framework == "paddle" else None
    expected = model(ids)
    capture = OpsCapture(backend, attn, "layers.0.attn", pb.ZoomSpec(id=7, capture="tensors"), step=3)
    capture.arm()
    assert "forward" in attn.__dict__
    out = model(ids)  # calls the attention once per layer: only layers.0's is captured
    model(ids)  # a second call of the step is not
    trace = pb.OpTrace.FromString(capture.finish())
    assert "forward" not in attn.__dict__  # the instance attribute is gone: the class's forward again
    if framework == "paddle":
        assert _paddle_state() == before  # every wrapped API is the very object it was
    else:
        from torch.overrides import _get_current_function_mode_stack

        assert _get_current_function_mode_stack() == []
    assert backend.to_numpy(out).tolist() == backend.to_numpy(expected).tolist()
    ops = [c.op for c in trace.calls]
    # The children are one operation each; what they compute inside is not listed.
    assert ops.count("module") == 4 and "linear" not in ops
    assert [op for op in ops if op not in ("module", "transpose", "reshape")] == [
        "matmul", "divide", "full", "triu", "add", "softmax", "matmul"]
    divide = trace.calls[ops.index("divide")]
    assert divide.file.endswith(f"model_{framework}.py") and "scores =" in divide.code and divide.line > 0
    assert divide.api in ("torch.Tensor.div", "paddle.Tensor.__truediv__")
    assert list(divide.output.shape) == [CFG.batch, CFG.heads, CFG.seq, CFG.seq]
    assert len(divide.output.stats) == 8 and len(divide.output.values) == 4 * CFG.batch * CFG.heads * CFG.seq ** 2
    assert list(divide.inputs) == [ops.index("divide") - 1]  # the matmul just before it
    assert trace.calls[0].inputs[0] < 0 and len(trace.externals) == 1  # the module's input
    assert (trace.zoom_id, trace.module, trace.error, trace.calls_dropped) == (7, "layers.0.attn", "", 0)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_a_capture_is_bounded_and_a_module_never_called_says_so(framework):
    model, backend, ids = _model(framework)
    block = dict(backend.named_modules(model))["layers.1"]
    capture = OpsCapture(backend, block, "layers.1", pb.ZoomSpec(id=1, capture="stats"), step=0)
    capture.builder.max_calls = 3
    capture.arm()
    model(ids)
    trace = pb.OpTrace.FromString(capture.finish())
    assert len(trace.calls) == 3 and trace.calls_dropped == 3 and "past the bound of 3" in trace.error
    assert all(not c.output.values for c in trace.calls)  # statistics only: the zoom asked for "stats"
    idle = OpsCapture(backend, block, "layers.1", pb.ZoomSpec(id=2), step=4)
    idle.arm()
    assert "not called in step 4" in pb.OpTrace.FromString(idle.finish()).error
    assert "forward" not in block.__dict__
    missing = OpsCapture(backend, None, "layers.9", pb.ZoomSpec(id=3), step=4)
    missing.arm()
    assert "no module named 'layers.9'" in pb.OpTrace.FromString(missing.finish()).error


def test_canonical_names_are_shared_by_both_frameworks_spellings():
    assert {canonical(n) for n in ("torch.Tensor.div", "paddle.Tensor.__truediv__", "torch.divide")} == {"divide"}
    assert {canonical(n) for n in ("torch.Tensor.add", "paddle.Tensor.__radd__", "paddle.add")} == {"add"}
    assert {canonical(n) for n in ("torch.Tensor.permute", "paddle.transpose")} == {"transpose"}
    assert canonical("torch.Tensor.masked_fill_") == "masked_fill" and canonical("paddle.nn.functional.silu") == "silu"
