"""Hooks on a three-layer toy model, in torch and in paddle: what is recorded, and clean detach."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from twinstep.runtime.capture import CaptureConfig, Recorder, backend_for
from twinstep.runtime.capture.recorder import StepNotCaptured
from twinstep.v1 import twinstep_pb2 as pb

FRAMEWORKS = ["torch", "paddle"]


def toy(framework: str):
    """Linear -> ReLU -> Linear, with the ReLU module called twice per forward."""
    if framework == "torch":
        import torch

        class Toy(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = torch.nn.Linear(4, 8)
                self.act = torch.nn.ReLU()
                self.fc2 = torch.nn.Linear(8, 2)

            def forward(self, x):
                return self.fc2(self.act(self.act(self.fc1(x))))

        torch.manual_seed(0)
        model = Toy()
        x = torch.randn(3, 4)

        def train_step():
            loss = model(x).square().mean()
            loss.backward()
            return loss
        return model, train_step
    import paddle

    class PToy(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc1 = paddle.nn.Linear(4, 8)
            self.act = paddle.nn.ReLU()
            self.fc2 = paddle.nn.Linear(8, 2)

        def forward(self, x):
            return self.fc2(self.act(self.act(self.fc1(x))))

    paddle.seed(0)
    model = PToy()
    x = paddle.randn([3, 4])

    def train_step():
        loss = model(x).square().mean()
        loss.backward()
        return loss
    return model, train_step


def names(recorder: Recorder, batch) -> list[tuple[str, str, int]]:
    modules = {m.id: m.name for m in recorder.take_new_modules()}
    params = {p.id: p.name for p in recorder.parameter_infos}
    out = []
    for phase, target, call in zip(batch.phase, batch.target, batch.call_index):
        label = pb.Phase.Name(int(phase)).lower()
        name = params[int(target)] if phase in (pb.GRAD, pb.PARAM) else "loss" if phase == pb.LOSS else modules[int(target)]
        out.append((label, name, int(call)))
    return out


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_records_every_phase_in_order(framework):
    model, train_step = toy(framework)
    recorder = Recorder(model, backend_for(model), CaptureConfig())
    loss = train_step()
    batch = recorder.finish_step(0, loss)
    recorded = names(recorder, batch)
    forward = [r for r in recorded if r[0] == "forward"]
    # Outputs in the order they were produced; the twice-called ReLU gives two calls.
    assert forward == [("forward", "fc1", 0), ("forward", "act", 0), ("forward", "act", 1), ("forward", "fc2", 0), ("forward", "", 0)]
    inputs = [r for r in recorded if r[0] == "input"]
    assert inputs == [("input", "fc1", 0), ("input", "act", 0), ("input", "act", 1), ("input", "fc2", 0), ("input", "", 0)]
    # An input produced by another hooked module carries that module's statistics, without a new pass.
    rows = {r: i for i, r in enumerate(recorded)}
    np.testing.assert_array_equal(batch.device_stats[rows[("input", "act", 1)]], batch.device_stats[rows[("forward", "act", 0)]])
    np.testing.assert_array_equal(batch.device_stats[rows[("input", "fc2", 0)]], batch.device_stats[rows[("forward", "act", 1)]])
    backward = [r for r in recorded if r[0] == "backward"]
    # Reverse order; the model output is fc2's output tensor, so those two come first together.
    assert {backward[0][1], backward[1][1]} == {"", "fc2"}
    assert [b[1:] for b in backward[2:]] == [("act", 1), ("act", 0), ("fc1", 0)]
    assert ("loss", "loss", 0) in recorded
    grads = [r[1] for r in recorded if r[0] == "grad"]
    params = [r[1] for r in recorded if r[0] == "param"]
    assert params == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert grads == list(reversed(params))
    assert list(batch.phase) == sorted(batch.phase)
    # Statistics are the real ones: the loss record holds the loss value.
    loss_row = [i for i, r in enumerate(recorded) if r[0] == "loss"][0]
    assert batch.device_stats[loss_row, 0] == pytest.approx(float(loss), rel=1e-6)
    assert batch.count[loss_row] == 1


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_include_exclude_and_inactive_steps(framework):
    model, train_step = toy(framework)
    recorder = Recorder(model, backend_for(model), CaptureConfig(include=("fc*",), exclude=("fc2",)))
    batch = recorder.finish_step(0, train_step())
    recorded = names(recorder, batch)
    assert {r[1] for r in recorded if r[0] == "forward"} == {"fc1"}
    assert {r[1] for r in recorded if r[0] == "param"} == {"fc1.weight", "fc1.bias"}
    recorder.set_active(False)
    train_step()
    recorder.set_active(True)
    quiet = recorder.finish_step(1, None)
    assert not (np.isin(quiet.phase, [pb.FORWARD, pb.BACKWARD])).any()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tensor_mode_copies_are_private(framework):
    model, train_step = toy(framework)
    recorder = Recorder(model, backend_for(model), CaptureConfig(capture="tensors", backward=False, parameters=False, inputs=False))
    train_step()
    batch = recorder.finish_step(0, None)
    assert sorted(r for host in batch.tensors for r in host.records) == list(range(len(batch.phase)))
    host = batch.tensors[0]
    record, array = host.records[0], batch.storage_array(host.copy)
    assert host.dtype == "float32" and array.shape == (3, 8)
    assert batch.device_stats[record, 0] == pytest.approx(float(array.astype(np.float64).sum()), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_detach_restores_the_model(framework):
    model, train_step = toy(framework)
    forward = type(model).forward
    signature = inspect.signature(model.forward)
    before = train_step()
    recorder = Recorder(model, backend_for(model), CaptureConfig())
    recorder.remove()
    recorder.remove()  # idempotent
    hooks = [m._forward_hooks for m in model.modules()] if framework == "torch" else [l._forward_post_hooks for l in model.sublayers(include_self=True)]
    assert all(len(h) == 0 for h in hooks)
    assert type(model).forward is forward and inspect.signature(model.forward) == signature
    assert float(train_step()) == pytest.approx(float(before))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_failing_hook_never_breaks_training(framework, caplog):
    model, train_step = toy(framework)
    recorder = Recorder(model, backend_for(model), CaptureConfig())

    def broken(tensor):
        raise RuntimeError("boom")

    recorder.backend.device_stats = broken
    loss = train_step()  # must not raise
    assert np.isfinite(float(loss))
    # Nothing of the step could be read: the step boundary says so (the monitor reports a whole-step gap).
    with pytest.raises(StepNotCaptured, match="RuntimeError: boom"):
        recorder.finish_step(0, loss)
    warned = [r.message for r in caplog.records if "could not capture" in r.message]
    recorder.set_active(True, 1)
    with pytest.raises(StepNotCaptured):
        recorder.finish_step(1, train_step())
    # One warning per kind of failure (phase and error type), however many records and steps fail.
    assert [r.message for r in caplog.records if "could not capture" in r.message] == warned
    assert {w.split(" records")[0].rsplit(" ", 1)[1] for w in warned} == {"input", "forward", "loss", "grad", "param"}
    # Every failed record is counted, per phase and module or parameter, with its first error.
    health = recorder.health.snapshot()
    by_key = {(pb.Phase.Name(f.phase), f.name): f for f in health.failures}
    assert by_key[("FORWARD", "fc1")].count == 2
    assert (by_key[("FORWARD", "fc1")].first_step, by_key[("FORWARD", "fc1")].last_step) == (0, 1)
    assert by_key[("FORWARD", "fc1")].error == "RuntimeError: boom"
    params = [name for name, _ in model.named_parameters()]
    assert {name for phase, name in by_key if phase == "GRAD"} == set(params)
    assert by_key[("LOSS", "")].count == 2
    # A step where only some records fail still goes out, without them.
    readable = type(recorder.backend).device_stats.__get__(recorder.backend)

    def vectors_fail(tensor):
        if len(tensor.shape) == 1:
            raise RuntimeError("1-D")
        return readable(tensor)

    recorder.backend.device_stats = vectors_fail
    recorder.set_active(True, 2)
    batch = recorder.finish_step(2, train_step())
    assert set(batch.phase) == {pb.FORWARD, pb.LOSS, pb.BACKWARD, pb.GRAD, pb.PARAM, pb.INPUT}
    counts = {(f.phase, f.name): f.count for f in recorder.health.snapshot().failures}
    for name in params:  # the biases failed a third time, the weights did not
        assert counts[(pb.GRAD, name)] == (3 if name.endswith("bias") else 2), name


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_unreadable_output_is_counted_and_its_siblings_still_recorded(framework):
    """A complex output (an FFT mixing layer, say) is a named failure, not a silent gap."""
    if framework == "torch":
        import torch

        class TwoOutputs(torch.nn.Module):
            def forward(self, x):
                return torch.fft.fft(x), x * 2

        model = TwoOutputs()
        x = torch.ones(2, 4)
    else:
        import paddle

        class TwoOutputs(paddle.nn.Layer):
            def forward(self, x):
                return paddle.fft.fft(x), x * 2

        model = TwoOutputs()
        x = paddle.ones([2, 4])
    recorder = Recorder(model, backend_for(model), CaptureConfig(parameters=False))
    model(x)
    batch = recorder.finish_step(0, None)
    forward = batch.phase == pb.FORWARD
    assert list(batch.slot[forward]) == [1]  # the real output (slot 1) is recorded; the complex one is not
    (failure,) = recorder.health.snapshot().failures
    assert (failure.phase, failure.name, failure.count) == (pb.FORWARD, "", 1)
    assert failure.error.startswith("UnsupportedTensor: ") and "complex64" in failure.error


def keyword_toy(framework: str, call: str):
    """Linear -> Gate -> Linear plus a tensor-free Ramp, with Gate called as ``call`` says.

    Gate's forward is ``(hidden_states=None, scale=None)``: "keywords" calls it
    ``gate(scale=s, hidden_states=h)`` (the call's order is not the signature's),
    "positional" calls it ``gate(h, s)``, "mixed" calls it ``gate(None, scale=s)`` (a
    positional argument that is no tensor).  Ramp is called with an int only: ``ramp(n=2)``.
    """
    if framework == "torch":
        import torch as fw

        Module, randn, arange = fw.nn.Module, (lambda *shape: fw.randn(*shape)), fw.arange
        fw.manual_seed(0)
    else:
        import paddle as fw

        Module, randn, arange = fw.nn.Layer, (lambda *shape: fw.randn(list(shape))), fw.arange
        fw.seed(0)

    class Gate(Module):
        def forward(self, hidden_states=None, scale=None):
            return hidden_states * scale if hidden_states is not None else scale * 2

    class Ramp(Module):
        def forward(self, n=3):
            return arange(n).astype("float32") if framework == "paddle" else arange(n).float()

    class Toy(Module):
        def __init__(self):
            super().__init__()
            self.fc1 = fw.nn.Linear(4, 8)
            self.gate = Gate()
            self.ramp = Ramp()
            self.fc2 = fw.nn.Linear(8, 2)

        def forward(self, x):
            h, s = self.fc1(x), x.sum() + 2
            if call == "keywords":
                g = self.gate(scale=s, hidden_states=h)
            elif call == "positional":
                g = self.gate(h, s)
            else:
                g = self.gate(None, scale=s) + h
            return self.fc2(g) + self.ramp(n=2).sum()

    model = Toy()
    x = randn(3, 4)
    return model, (lambda: model(x).square().mean())


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_module_called_with_keywords_has_its_input_recorded(framework):
    """The input is the first positional tensor, else the first keyword tensor in forward's order."""
    rows = {}
    for call in ("keywords", "positional", "mixed"):
        model, train_step = keyword_toy(framework, call)
        recorder = Recorder(model, backend_for(model), CaptureConfig(parameters=False, backward=False))
        batch = recorder.finish_step(0, train_step())
        recorded = names(recorder, batch)
        rows[call] = {r: batch.device_stats[i] for i, r in enumerate(recorded)}
        inputs = [r[1] for r in recorded if r[0] == "input"]
        # Ramp, called with an int only, has no input record, and nothing failed.
        assert inputs == ["fc1", "gate", "fc2", ""], call
        assert ("forward", "ramp", 0) in recorded
        assert not recorder.health.snapshot().failures
    keywords, positional, mixed = rows["keywords"], rows["positional"], rows["mixed"]
    # hidden_states (fc1's output, first in forward's signature), not scale (first in the call).
    np.testing.assert_array_equal(keywords[("input", "gate", 0)], keywords[("forward", "fc1", 0)])
    np.testing.assert_array_equal(keywords[("input", "gate", 0)], positional[("input", "gate", 0)])
    assert keywords.keys() == positional.keys()
    # A positional None is no tensor: the keyword tensor after it (scale, whose double is the output) is the input.
    assert mixed[("input", "gate", 0)][0] == pytest.approx(mixed[("forward", "gate", 0)][0] / 2)


def test_paddle_before_3_2_reads_keywords_through_a_pre_hook(monkeypatch):
    """paddle 3.0 and 3.1 pass keywords to pre-hooks only (with_kwargs); the post-hook gets them from it."""
    from twinstep.runtime.capture.paddle import backend as paddle_backend

    monkeypatch.setattr(paddle_backend, "_POST_HOOK_KWARGS", False)
    test_a_module_called_with_keywords_has_its_input_recorded("paddle")
    test_keyword_capture_detaches_cleanly("paddle")
    test_nested_keyword_calls_of_one_module_each_record_their_own_input("paddle")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_keyword_capture_detaches_cleanly(framework):
    model, train_step = keyword_toy(framework, "keywords")
    before = float(train_step())
    recorder = Recorder(model, backend_for(model), CaptureConfig())
    train_step()
    recorder.finish_step(0, None)
    recorder.remove()
    if framework == "torch":
        hooks = [(m._forward_hooks, m._forward_hooks_with_kwargs, m._forward_pre_hooks) for m in model.modules()]
    else:
        hooks = [(l._forward_post_hooks, l._forward_pre_hooks, l._forward_pre_hooks_with_kwargs_flag)
                 for l in model.sublayers(include_self=True)]
    assert all(len(h) == 0 for group in hooks for h in group)
    assert float(train_step()) == pytest.approx(before)


def recursive_keyword_toy(framework: str):
    """A Block that calls its Scale child, then itself once more, all by keyword: two calls of Block nest.

    Block's forward is ``(hidden_states=None, bias=None, depth=0)``, called as
    ``block(bias=b, hidden_states=h, depth=1)`` (the call's order is not the signature's);
    Scale's is ``(hidden_states=None, factor=1.0)``, called as ``scale(factor=3.0, hidden_states=h)``.
    With x all ones (3 x 4) and b all 0.5: the outer Block's input sums to 12, its Scale's to 12,
    the inner Block's (3x + b) to 42, the inner Scale's to 42.
    """
    if framework == "torch":
        import torch as fw

        Module, full = fw.nn.Module, (lambda value: fw.full((3, 4), value))
    else:
        import paddle as fw

        Module, full = fw.nn.Layer, (lambda value: fw.full([3, 4], value))

    class Scale(Module):
        def forward(self, hidden_states=None, factor=1.0):
            return hidden_states * factor

    class Block(Module):
        def __init__(self):
            super().__init__()
            self.scale = Scale()

        def forward(self, hidden_states=None, bias=None, depth=0):
            out = self.scale(factor=3.0, hidden_states=hidden_states) + bias
            if depth:
                out = self(bias=bias, hidden_states=out, depth=depth - 1)
            return out

    class Toy(Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x, b):
            return self.block(bias=b, hidden_states=x, depth=1)

    model = Toy()
    x, b = full(1.0), full(0.5)
    return model, (lambda: model(x, b))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_nested_keyword_calls_of_one_module_each_record_their_own_input(framework):
    """A module whose forward calls itself by keyword: each call's input is its own, not the other call's."""
    model, forward = recursive_keyword_toy(framework)
    recorder = Recorder(model, backend_for(model), CaptureConfig(parameters=False, backward=False))
    forward()
    batch = recorder.finish_step(0, None)
    recorded = names(recorder, batch)
    sums = {r: float(batch.device_stats[i][0]) for i, r in enumerate(recorded)}
    assert not recorder.health.snapshot().failures
    # Calls are numbered as they end: the inner Block call (0) ends before the outer one (1).
    assert sums[("input", "block", 0)] == pytest.approx(42.0)
    assert sums[("input", "block", 1)] == pytest.approx(12.0)
    assert sums[("input", "block.scale", 0)] == pytest.approx(12.0)
    assert sums[("input", "block.scale", 1)] == pytest.approx(42.0)
    assert sums[("input", "", 0)] == pytest.approx(12.0)  # the root, called positionally
    assert sums[("forward", "block", 1)] == pytest.approx(3 * 42.0 + 6.0)


def test_a_call_reader_follows_the_forward_signature():
    """CallInputs: the recorder's inputs and the first input's place, for positional, keyword and mixed calls."""
    import torch

    from twinstep.runtime.capture.base import CallInputs

    class Attention(torch.nn.Module):
        def forward(self, hidden_states=None, position_embeddings=None, attention_mask=None, **extra):
            return hidden_states

    module, reader = Attention(), CallInputs(torch.Tensor)
    h, pe, m = torch.ones(2), torch.zeros(2), torch.full((2,), 2.0)
    assert reader(module, (h, pe), {"attention_mask": m}) == (h, pe)  # a positional tensor first: no keyword read
    assert reader(module, (), {"attention_mask": m, "later": 1, "hidden_states": h}) == (h, m, 1)
    assert reader.first(module, (h,), {"attention_mask": m}) == 0
    assert reader.first(module, (None, pe), {"hidden_states": h}) == 1
    assert reader.first(module, (), {"attention_mask": m, "hidden_states": h}) == "hidden_states"
    assert reader.first(module, (), {"extra": h}) == "extra"  # a keyword the signature does not name
    assert reader.first(module, (None,), {"scale": 2.0}) is None


def test_attach_refuses_other_objects():
    with pytest.raises(TypeError, match="expected a torch.nn.Module, a paddle.nn.Layer or a mindspore.nn.Cell"):
        backend_for(object())


def test_capture_config_is_validated():
    with pytest.raises(ValueError, match="capture must be"):
        CaptureConfig(capture="all")
    with pytest.raises(ValueError, match="every must be a positive integer"):
        CaptureConfig(every=0)
    with pytest.raises(ValueError, match="not a string"):
        CaptureConfig(include="fc*")


def _linear_pair():
    """A torch and a paddle Linear(64, 48) holding the same weights, and one input batch."""
    import paddle
    import torch

    rng = np.random.default_rng(0)
    w, b, x = rng.normal(size=(48, 64)), rng.normal(size=48), rng.normal(size=(8, 64))
    t = torch.nn.Linear(64, 48)
    p = paddle.nn.Linear(64, 48)
    with torch.no_grad():
        t.weight.copy_(torch.from_numpy(w))
        t.bias.copy_(torch.from_numpy(b))
    p.weight.set_value(w.T.astype("float32"))  # paddle stores [in, out]
    p.bias.set_value(b.astype("float32"))
    return (t, torch.from_numpy(x).float()), (p, paddle.to_tensor(x.astype("float32")))


def test_sketches_of_the_same_numbers_agree_across_frameworks_and_layouts():
    batches = []
    for model, x in _linear_pair():
        recorder = Recorder(model, backend_for(model), CaptureConfig(sketch=True))
        loss = model(x).sum()
        loss.backward()
        batches.append(recorder.finish_step(0, loss))
        recorder.remove()
    (tb, pb_) = batches
    assert tb.sketch_spec == pb_.sketch_spec and tb.sketch_spec[0] == 256
    for batch in batches:
        # Ascending records; only tensors larger than the sketch (the 48-element bias is not).
        assert list(batch.sketch_records) == sorted(batch.sketch_records)
        assert all(int(np.prod(batch.dims_of(r))) > 256 for r in batch.sketch_records)
    def by_phase(batch):
        return {int(batch.phase[r]): batch.sketches[k] for k, r in enumerate(batch.sketch_records)}
    t_rows, p_rows = by_phase(tb), by_phase(pb_)
    assert set(t_rows) == set(p_rows) == {pb.FORWARD, pb.BACKWARD, pb.GRAD, pb.PARAM}
    for phase in t_rows:
        # The weight (and its gradient) is stored transposed in paddle, sketched by torch's index.
        np.testing.assert_allclose(p_rows[phase], t_rows[phase], rtol=1e-4, atol=1e-4 * np.abs(t_rows[phase]).max())
