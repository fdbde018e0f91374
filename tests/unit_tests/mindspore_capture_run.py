"""Run by test_capture_mindspore.py in a fresh process: MindSpore's capture backend on a real model.

A fresh process because MindSpore's CPU kernels fail to load after paddle's
(a oneDNN symbol clash), which a shared pytest process cannot rule out.
The expected values come from torch, fed the same weights and batch: an
independent framework, so a record captured from the wrong tensor, a
gradient matched to the wrong parameter or a missed update cannot agree.
Prints one JSON object of findings; the test asserts on them.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch  # before MindSpore: fine (only paddle before MindSpore clashes)

import mindspore
from mindspore import nn

from twinstep.wire import sketch, stats
from twinstep.runtime import values
from twinstep.runtime.capture.mindspore import GraphModeError, MindSporeBackend
from twinstep.runtime.capture.mindspore.backend import _device_row
from twinstep.runtime.capture.recorder import CaptureConfig, Recorder
from twinstep.v1 import twinstep_pb2 as pb

LR = 0.1
rng = np.random.default_rng(0)
W1, B1 = rng.normal(size=(64, 16)).astype(np.float32), rng.normal(size=64).astype(np.float32)
W2, B2 = rng.normal(size=(3, 64)).astype(np.float32), rng.normal(size=3).astype(np.float32)
X = rng.normal(size=(8, 16)).astype(np.float32)  # fc1's output and weight exceed a sketch's 256 buckets
Y = rng.normal(size=(8, 3)).astype(np.float32)


class Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(16, 64)
        self.act = nn.GELU(approximate=False)
        self.ln = nn.LayerNorm((64,), epsilon=1e-5)
        self.fc2 = nn.Dense(64, 3)

    def construct(self, x):
        return self.fc2(self.ln(self.act(self.fc1(x))))


def ms_model() -> Net:
    net = Net()
    for name, value in {"fc1.weight": W1, "fc1.bias": B1, "fc2.weight": W2, "fc2.bias": B2}.items():
        dict(net.parameters_and_names())[name].set_data(mindspore.Tensor(value))
    return net


def torch_expected() -> dict[tuple[str, str], np.ndarray]:
    """(phase, name) -> the tensor torch computes for the same step."""
    fc1, fc2, ln = torch.nn.Linear(16, 64), torch.nn.Linear(64, 3), torch.nn.LayerNorm(64)
    with torch.no_grad():
        for p, v in ((fc1.weight, W1), (fc1.bias, B1), (fc2.weight, W2), (fc2.bias, B2)):
            p.copy_(torch.from_numpy(v))
    h1 = fc1(torch.from_numpy(X))
    a = torch.nn.functional.gelu(h1)
    n = ln(a)
    out = fc2(n)
    for t in (h1, a, n, out):
        t.retain_grad()
    loss = ((out - torch.from_numpy(Y)) ** 2).mean()
    loss.backward()
    found = {("forward", "fc1"): h1, ("forward", "act"): a, ("forward", "ln"): n, ("forward", "fc2"): out,
             ("forward", ""): out, ("backward", "fc1"): h1.grad, ("backward", "act"): a.grad,
             ("backward", "ln"): n.grad, ("backward", "fc2"): out.grad, ("backward", ""): out.grad,
             ("loss", ""): loss}
    params = {"fc1.weight": fc1.weight, "fc1.bias": fc1.bias, "ln.gamma": ln.weight, "ln.beta": ln.bias,
              "fc2.weight": fc2.weight, "fc2.bias": fc2.bias}
    for name, p in params.items():
        found[("grad", name)] = p.grad
        found[("param", name)] = p.detach() - LR * p.grad  # SGD's update
    return {k: v.detach().numpy().astype(np.float64) for k, v in found.items()}


def one_step(capture: str = "stats", sketch_on: bool = False, stats_workers: int = 1):
    net = ms_model()
    opt = nn.SGD(net.trainable_params(), learning_rate=LR)
    backend = MindSporeBackend()
    recorder = Recorder(net, backend, CaptureConfig(capture=capture, sketch=sketch_on, stats_workers=stats_workers))
    watch = backend.watch_optimizer(opt)
    grad_fn = mindspore.value_and_grad(lambda x, y: ((net(x) - y) ** 2).mean(), None, opt.parameters)
    recorder.set_active(True, 0)
    loss, grads = grad_fn(mindspore.Tensor(X), mindspore.Tensor(Y))
    opt(grads)
    batch = recorder.finish_step(0, loss)
    return net, opt, backend, recorder, watch, grad_fn, batch


def names_of(recorder: Recorder, batch) -> list[tuple[str, str]]:
    modules = {info.id: info.name for info in recorder.take_new_modules()}
    params = {info.id: info.name for info in recorder.parameter_infos}
    out = []
    for phase, target in zip(batch.phase, batch.target):
        name = params[int(target)] if phase in (pb.GRAD, pb.PARAM) else "" if phase == pb.LOSS else modules[int(target)]
        out.append((pb.Phase.Name(int(phase)).lower(), name))
    return out


def relative_errors(batch, labels, expected) -> dict[str, float]:
    """Per record: the largest difference of sum, sum of squares, min, max from torch's, relative to its scale."""
    errors = {}
    for row, label in zip(batch.device_stats, labels):
        if label[0] == "input":
            continue
        want = stats.of_array(expected[label])
        got = dict(zip(stats.DEVICE_FIELDS, row))
        scale = max(float(want["abs_max"][0]), 1e-12)  # sums near 0 (a norm's output) are judged against it
        diffs = [abs(got["sum"] - float(want["sum"][0])) / (scale * float(want["count"][0])),
                 abs(got["sum_sq"] - float(want["sum_sq"][0])) / max(float(want["sum_sq"][0]), 1e-24),
                 abs(got["min"] - float(want["min"][0])) / scale, abs(got["max"] - float(want["max"][0])) / scale]
        errors[f"{label[0]}:{label[1]}"] = max(diffs)
    return errors


class Gate(nn.Cell):
    def construct(self, hidden_states=None, scale=None):
        return hidden_states * scale


class KeywordNet(nn.Cell):
    """fc1 -> gate, gate called by keyword in an order that is not its signature's (transformers' style)."""

    def __init__(self, keywords: bool) -> None:
        super().__init__()
        self.keywords = keywords
        self.fc1 = nn.Dense(16, 64)
        self.gate = Gate()

    def construct(self, x):
        h, s = self.fc1(x), x.sum() + 2
        return self.gate(scale=s, hidden_states=h) if self.keywords else self.gate(h, s)


def keyword_inputs() -> dict:
    """The gate's input record, called by keyword and positionally: hidden_states (fc1's output) both times."""
    found = {}
    for keywords in (True, False):
        mindspore.set_seed(0)
        net = KeywordNet(keywords)
        recorder = Recorder(net, MindSporeBackend(), CaptureConfig(parameters=False, backward=False))
        net(mindspore.Tensor(X))
        batch = recorder.finish_step(0, None)
        labels = names_of(recorder, batch)
        rows = {label: batch.device_stats[i].tolist() for i, label in enumerate(labels)}
        found["keywords" if keywords else "positional"] = {
            "inputs": [n for p, n in labels if p == "input"], "gate_input": rows[("input", "gate")],
            "fc1_output": rows[("forward", "fc1")], "failures": len(recorder.health.snapshot().failures)}
        recorder.remove()
    return found


def main() -> None:
    findings: dict = {"mindspore": mindspore.__version__}
    findings["keyword_inputs"] = keyword_inputs()
    expected = torch_expected()

    # Statistics mode, statistics off the training thread where allowed.
    net, opt, backend, recorder, watch, grad_fn, batch = one_step()
    labels = names_of(recorder, batch)
    findings["labels"] = sorted(f"{p}:{n}" for p, n in labels)
    findings["errors"] = relative_errors(batch, labels, expected)
    findings["transposed"] = sorted(recorder._transposed)  # Dense is [out, in]: nothing transposed

    # Detached: no record and no gradient is taken any more; the optimizer still trains.
    recorder.remove()
    watch.remove()
    before = net.fc1.weight.asnumpy().copy()
    loss, grads = grad_fn(mindspore.Tensor(X), mindspore.Tensor(Y))
    opt(grads)
    findings["after_remove"] = {"records": len(recorder._buffer.phase), "grads_kept": len(backend._grads),
                                "trained": bool(np.abs(net.fc1.weight.asnumpy() - before).max() > 0)}

    # Tensor mode: the full tensors sent are torch's values; sketches equal the numpy reference.
    net, opt, backend, recorder, watch, grad_fn, batch = one_step(capture="tensors", sketch_on=True)
    labels = names_of(recorder, batch)
    worst = 0.0
    for host in batch.tensors:
        label = labels[host.records[0]]
        if label[0] == "input":
            continue
        got = backend.storage_array(host.copy).astype(np.float64)
        worst = max(worst, float(np.abs(got - expected[label]).max() / (np.abs(expected[label]).max() + 1e-6)))
    findings["tensor_worst"] = worst
    findings["tensors"] = len(batch.tensors)
    sketched = {labels[int(r)]: batch.sketches[i] for i, r in enumerate(batch.sketch_records)}
    findings["sketch_worst"] = max(
        float(np.abs(row - sketch.sketch_array(expected[label])).max() / (np.abs(expected[label]).sum() + 1e-6))
        for label, row in sketched.items() if label[0] != "input")
    findings["sketched"] = len(sketched)

    # The accelerator path (a device vector, no host sync) run on the CPU agrees with the host path.
    t = mindspore.Tensor(np.concatenate([rng.normal(size=999), [np.nan, np.inf]]).astype(np.float32))
    device = _device_row(t).asnumpy()
    host = np.array(stats.host_row(t.asnumpy()))
    findings["device_row_diff"] = float(np.nanmax(np.abs(device - host) / (np.abs(host) + 1e-6)))

    # Named values: a MindSpore tensor keeps its dtype and numbers.
    ids = values.to_host(mindspore.Tensor(np.arange(6, dtype=np.int64).reshape(2, 3)))
    findings["named"] = [ids.dtype, ids.storage.tolist()]

    # A cell whose construct is compiled with jit: hooked as one module, its inside left alone (MindSpore
    # would compile the inner cells' hooks into its graph, and fail), and the training runs.
    class Compiled(Net):
        @mindspore.jit
        def construct(self, x):
            return self.fc2(self.ln(self.act(self.fc1(x))))

    net = Compiled()
    backend = MindSporeBackend()
    recorder = Recorder(net, backend, CaptureConfig(stats_workers=0))
    recorder.set_active(True, 0)
    loss = ((net(mindspore.Tensor(X)) - mindspore.Tensor(Y)) ** 2).mean()
    batch = recorder.finish_step(0, loss)
    findings["compiled_labels"] = sorted(f"{p}:{n}" for p, n in names_of(recorder, batch) if p != "param")
    findings["compiled_health"] = str(recorder.health.snapshot())

    # GRAPH_MODE: refused at attach with the reason and what to do.
    mindspore.set_context(mode=mindspore.GRAPH_MODE)
    try:
        MindSporeBackend()
        findings["graph_mode"] = "accepted"
    except GraphModeError as error:
        findings["graph_mode"] = str(error)
    json.dump(findings, sys.stdout)


if __name__ == "__main__":
    main()
