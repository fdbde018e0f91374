"""Operations inside a module, server side: aligning two sequences, naming the operation that creates a difference."""

from __future__ import annotations

import numpy as np
import pytest

from twinstep.server.compare.tolerance import ToleranceConfig
from twinstep.server.errors import InputError
from twinstep.server.ops import OperationsInspector
from twinstep.server.ops.align import align
from twinstep.server.ops.compare import compare_traces
from twinstep.server.ops.trace import decode_trace
from twinstep.wire.stats import DEVICE_FIELDS
from twinstep.v1 import twinstep_pb2 as pb

TOL = ToleranceConfig()


def _tensor(values: np.ndarray, full: bool = True) -> pb.OpTensor:
    x = np.asarray(values, dtype=np.float64)
    mean = x.mean()
    row = {"sum": x.sum(), "sum_sq": (x * x).sum(), "min": x.min(), "max": x.max(), "abs_max": np.abs(x).max(),
           "nan_count": 0, "inf_count": 0, "m2": ((x - mean) ** 2).sum()}
    return pb.OpTensor(dtype=pb.FLOAT32, shape=list(x.shape), stats=[float(row[f]) for f in DEVICE_FIELDS],
                       values=x.astype("<f4").tobytes() if full else b"")


class _Trace:
    """Builds an OpTrace the way the client does: calls in order, each output's statistics and values."""

    def __init__(self, module: str = "layers.0.attn") -> None:
        self.message = pb.OpTrace(zoom_id=1, module=module)

    def external(self, values: np.ndarray) -> int:
        self.message.externals.append(_tensor(values))
        return -len(self.message.externals)

    def call(self, op: str, inputs: list[int], values: np.ndarray, line: int = 1) -> int:
        self.message.calls.append(pb.OpCall(op=op, api=f"api.{op}", file="/src/model.py", line=line,
                                            code=f"{op}(...)", inputs=inputs, output=_tensor(values)))
        return len(self.message.calls) - 1

    def decoded(self, run: str):
        return decode_trace(self.message, run, 0, 5)


def _attention(x: np.ndarray, scale: float, extra_transpose: bool = False, extra_scale: float = 1.0) -> _Trace:
    """q @ k^T / scale, softmax, @ v: torch spells the transpose, paddle folds it into the matmul."""
    t = _Trace()
    xi = t.external(x)
    q = t.call("module", [xi], x * 0.5, line=10)
    k = t.call("module", [xi], x * 0.25, line=10)
    qa = q
    if extra_scale != 1.0:
        qa = t.call("multiply", [q], x * 0.5 * extra_scale, line=11)
    kt = t.call("transpose", [k], (x * 0.25).T, line=12) if extra_transpose else k
    scores = (x * 0.5 * extra_scale) @ (x * 0.25).T
    s = t.call("matmul", [qa, kt], scores, line=12)
    d = t.call("divide", [s], scores / scale, line=12)
    e = np.exp(scores / scale)
    p = t.call("softmax", [d], e / e.sum(-1, keepdims=True), line=13)
    t.call("matmul", [p, xi], (e / e.sum(-1, keepdims=True)) @ x, line=14)
    return t


X = np.random.default_rng(0).standard_normal((8, 8))


def test_alignment_pairs_the_same_operations_and_lets_one_side_do_without_a_view():
    base = _attention(X, 4.0, extra_transpose=True).decoded("torch")
    cand = _attention(X, 4.0).decoded("paddle")
    pairs = align(base.calls, cand.calls)
    assert [(base.calls[i].op, cand.calls[j].op) for i, j in pairs] == [
        ("module", "module"), ("module", "module"), ("matmul", "matmul"), ("divide", "divide"),
        ("softmax", "softmax"), ("matmul", "matmul")]
    assert 2 not in dict(pairs)  # the baseline's transpose has no counterpart, and needs none


def test_alignment_skips_an_operation_only_one_side_has_and_refuses_to_pair_different_names():
    base = _attention(X, 4.0).decoded("torch")
    cand = _attention(X, 4.0, extra_scale=1.1).decoded("paddle")
    pairs = align(base.calls, cand.calls)
    assert all(base.calls[i].op == cand.calls[j].op for i, j in pairs)
    assert len(pairs) == len(base.calls) and 2 not in {j for _, j in pairs}  # the extra multiply stays unpaired
    assert align(base.calls, []) == [] and align([], cand.calls) == []


def test_a_faithful_pair_matches_and_an_inline_scale_is_named_with_its_line():
    base = _attention(X, 4.0, extra_transpose=True).decoded("torch")
    same = compare_traces(base, _attention(X, 4.0).decoded("paddle"), TOL, "paddle")
    assert same.status == "matched", same.message
    found = compare_traces(base, _attention(X, 4.2).decoded("paddle"), TOL, "paddle")
    assert found.status == "found", found.message
    assert (found.candidate.op, found.candidate.line, found.baseline.op, found.baseline.index) == ("divide", 12,
                                                                                                  "divide", 4)
    assert found.value > found.tolerance and found.input_value == 0.0
    assert "divide" in found.message and "model.py:12" in found.message


def test_an_extra_operation_on_one_side_is_named_as_the_origin():
    found = compare_traces(_attention(X, 4.0).decoded("torch"), _attention(X, 4.0, extra_scale=1.1).decoded("paddle"),
                           TOL, "paddle")
    assert found.status == "found" and found.candidate.op == "multiply" and not found.baseline.op, found
    assert "only the candidate has" in found.message


def test_an_operation_that_passes_on_a_difference_is_not_blamed_one_that_grows_it_is():
    # Inputs already 1e-4 apart (a few steps after the divergence): the matmuls pass that on,
    # the wrong scale multiplies it by hundreds.
    drift = X * (1 + 1e-4)
    base = _attention(X, 4.0).decoded("torch")
    inherited = compare_traces(base, _attention(drift, 4.0).decoded("paddle"), TOL, "paddle")
    assert inherited.status == "inherited", inherited.message
    found = compare_traces(base, _attention(drift, 4.2).decoded("paddle"), TOL, "paddle")
    assert found.status == "found" and found.candidate.op == "divide", found.message


def test_sequences_that_share_too_little_are_unaligned_and_a_failed_capture_is_incomplete():
    other = _Trace()
    xi = other.external(X)
    for _ in range(6):
        xi = other.call("gelu", [xi], X)
    unaligned = compare_traces(_attention(X, 4.0).decoded("torch"), other.decoded("paddle"), TOL, "paddle")
    assert unaligned.status == "unaligned" and "do not line up" in unaligned.message
    broken = _attention(X, 4.0)
    broken.message.error = "call 3 (paddle.matmul) could not be recorded"
    incomplete = compare_traces(_attention(X, 4.0).decoded("torch"), broken.decoded("paddle"), TOL, "paddle")
    assert incomplete.status == "incomplete" and "could not be recorded" in incomplete.message


@pytest.mark.parametrize(("mutate", "says"), [
    (lambda m: m.calls[1].inputs.append(5), "names neither an earlier call"),
    (lambda m: m.calls[0].output.stats.pop(), "7 statistics, expected 8"),
    (lambda m: setattr(m.calls[0].output, "values", b"\0" * 12), "bytes of values"),
    (lambda m: setattr(m.calls[0], "op", ""), "needs an op name"),
    (lambda m: m.calls[0].output.shape.append(-2), "is not a tensor's"),
])
def test_a_malformed_trace_is_refused_saying_where(mutate, says):
    trace = _attention(X, 4.0)
    mutate(trace.message)
    with pytest.raises(InputError, match=says):
        trace.decoded("paddle")


def test_the_inspector_compares_once_both_sides_are_in_in_either_order():
    inspector = OperationsInspector(TOL)
    assert inspector.add(_attention(X, 4.2).message, "paddle", 0, 5, "torch", ["paddle"]) == []
    [finding] = inspector.add(_attention(X, 4.0).message, "torch", 0, 5, "torch", ["paddle"])
    assert finding.status == "found" and finding.candidate_run == "paddle"
    assert inspector.add(_attention(X, 4.0).message, "torch", 0, 5, "torch", ["paddle"]) == []  # sent again
    assert [f.status for f in inspector.to_proto()] == ["found"]


def test_an_input_within_tolerance_that_carries_the_error_is_no_match():
    """The culprit's inputs must match on one scale of error, not merely be within their tolerance: an input
    off by 4e-5 (under the forward extrema tolerance, 1e-4) passes on an output off by as much."""
    x = np.linspace(-1.0, 1.0, 64).reshape(8, 8)

    def trace(offset: float) -> _Trace:
        t = _Trace("norm")
        xi = t.external(x * (1 + offset))
        t.call("gelu", [xi], np.tanh(x * (1 + offset)) * 1.0001 ** (offset > 0), line=5)
        return t

    finding = compare_traces(trace(0.0).decoded("base"), trace(4e-5).decoded("cand"), TOL, "cand")
    assert finding.status == "inherited", finding.message
    assert "already gets inputs off by" in finding.message and "none grows it 10 times" in finding.message
    created = compare_traces(trace(0.0).decoded("base"), trace(0.0).decoded("cand"), TOL, "cand")
    assert created.status == "matched"


def test_an_operation_that_creates_its_error_says_how_far_its_inputs_are():
    x = np.linspace(-1.0, 1.0, 64).reshape(8, 8)

    def trace(scale: float) -> _Trace:
        t = _Trace("norm")
        xi = t.external(x)
        t.call("gelu", [xi], np.tanh(x) * scale, line=5)
        return t

    finding = compare_traces(trace(1.0).decoded("base"), trace(1.001).decoded("cand"), TOL, "cand")
    assert finding.status == "found" and "while its inputs match exactly" in finding.message, finding.message


def test_a_child_modules_call_is_not_the_culprit():
    """A hooked child (q_proj) captured after its weights drifted differs with matching inputs; the inline
    divide after it is the module's own code that creates the difference."""
    x = np.linspace(-1.0, 1.0, 64).reshape(8, 8)

    def trace(drift: float, scale: float) -> _Trace:
        t = _Trace()
        xi = t.external(x)
        q = t.call("module", [xi], x * 0.5 * (1 + drift), line=10)
        t.call("divide", [q], x * 0.5 * (1 + drift) / scale, line=12)
        return t

    finding = compare_traces(trace(0.0, 4.0).decoded("base"), trace(1e-3, 4.2).decoded("cand"), TOL, "cand")
    assert finding.status == "found" and finding.candidate.op == "divide", finding.message
