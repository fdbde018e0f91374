"""Statistics off the training thread: same numbers as in the hook, in-place writes caught, bytes read once, idle hooks gone.

Real torch and paddle models, the real offload pool and the real kernels (or
numpy's passes, whichever this process has): nothing here is mocked.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from twinstep.runtime.capture import CaptureConfig, Recorder, backend_for
from twinstep.runtime.capture.offload import StatsOffload
from twinstep.v1 import twinstep_pb2 as pb

FRAMEWORKS = ["torch", "paddle"]
WIDTH = 256  # outputs of 128 x 256 = 32768 elements: above the hand-off threshold


def model_and_step(framework: str, *, inplace_from: int | None = None):
    """Linear -> (ReLU written in place from step ``inplace_from`` on) -> Linear, with a Sequential container.

    ``inplace_from=0``: the first Linear's output is overwritten in place by the
    activation in every step; ``inplace_from=k``: from step k only (after the
    recorder has learnt the record is safe to read late).
    """
    if framework == "torch":
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = torch.nn.Linear(WIDTH, WIDTH)
                self.body = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH))
                self.step = 0

            def forward(self, x):
                h = self.fc1(x)
                h = torch.relu_(h) if inplace_from is not None and self.step >= inplace_from else torch.relu(h)
                return self.body(h)

        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(128, WIDTH)

        def train_step(step: int):
            model.step = step
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            return loss

        def zero():
            opt.zero_grad()
        return model, train_step, zero
    import paddle

    class PNet(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc1 = paddle.nn.Linear(WIDTH, WIDTH)
            self.body = paddle.nn.Sequential(paddle.nn.Linear(WIDTH, WIDTH))
            self.step = 0

        def forward(self, x):
            h = self.fc1(x)
            h = paddle.nn.functional.relu_(h) if inplace_from is not None and self.step >= inplace_from \
                else paddle.nn.functional.relu(h)
            return self.body(h)

    paddle.seed(0)
    model = PNet()
    opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
    x = paddle.randn([128, WIDTH])

    def train_step(step: int):
        model.step = step
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    def zero():
        opt.clear_grad()
    return model, train_step, zero


@pytest.fixture(autouse=True, scope="module")
def compiled_kernels():
    """Both paths use the compiled kernel: before it loads, torch's inline path sums large tensors with torch."""
    from twinstep.runtime import kernels

    kernels.wait(120)


def run_steps(framework: str, steps: int, workers: int, inplace_from: int | None = None):
    model, train_step, zero = model_and_step(framework, inplace_from=inplace_from)
    recorder = Recorder(model, backend_for(model), CaptureConfig(stats_workers=workers))
    batches = []
    for step in range(steps):
        recorder.set_active(True, step)
        loss = train_step(step)
        batches.append(recorder.finish_step(step, loss))
        zero()
    return recorder, batches


def keyed(batch) -> dict[tuple[int, int, int, int], np.ndarray]:
    return {(int(p), int(t), int(c), int(s)): batch.device_stats[i]
            for i, (p, t, c, s) in enumerate(zip(batch.phase, batch.target, batch.call_index, batch.slot))}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_offloaded_statistics_equal_the_hooks_own(framework):
    _, inline = run_steps(framework, 4, workers=0)
    recorder, offloaded = run_steps(framework, 4, workers=1)
    for a, b in zip(inline, offloaded):
        ka, kb = keyed(a), keyed(b)
        assert ka.keys() == kb.keys()
        for key in ka:
            np.testing.assert_array_equal(ka[key], kb[key], err_msg=f"{framework} step {a.step} record {key}")
    # The first step learns which records are safe to read late; later steps read them off the thread.
    assert offloaded[0].cost.inline > 0
    assert offloaded[-1].cost.offloaded >= 6  # outputs, inputs, gradients and parameters of the large tensors
    assert offloaded[-1].cost.offloaded > offloaded[0].cost.offloaded
    assert all(b.cost.offloaded == 0 for b in inline)
    assert recorder.cost.steps == 4


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_tensor_written_in_place_after_capture_keeps_its_captured_numbers(framework):
    """fc1's output is overwritten by an in-place ReLU after its hook: its record is the pre-ReLU output, every step."""
    _, reference = run_steps(framework, 3, workers=0, inplace_from=0)
    recorder, batches = run_steps(framework, 3, workers=1, inplace_from=0)
    fc1 = recorder._module_ids["fc1"]
    for a, b in zip(reference, batches):
        key = (pb.FORWARD, fc1, 0, 0)
        row = keyed(b)[key]
        np.testing.assert_array_equal(keyed(a)[key], row)
        assert row[2] < 0  # min of the pre-ReLU output: the in-place ReLU did not leak into it
        assert not b.incomplete
    assert (pb.FORWARD, fc1, 0, 0) in recorder._volatile
    assert not recorder.health.snapshot().failures


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_unexpected_in_place_write_drops_the_record_instead_of_sending_a_wrong_one(framework):
    """Safe for two steps, then overwritten in place: that step's record is dropped and counted, the next is right."""
    _, reference = run_steps(framework, 4, workers=0, inplace_from=2)
    recorder, batches = run_steps(framework, 4, workers=1, inplace_from=2)
    fc1 = recorder._module_ids["fc1"]
    key = (pb.FORWARD, fc1, 0, 0)
    assert key in keyed(batches[1])
    assert key not in keyed(batches[2])
    assert pb.FORWARD in batches[2].incomplete
    np.testing.assert_array_equal(keyed(reference[3])[key], keyed(batches[3])[key])
    for a, b in zip(reference, batches):  # every record sent equals the hook's own numbers
        ka = keyed(a)
        for k, row in keyed(b).items():
            np.testing.assert_array_equal(ka[k], row, err_msg=f"step {b.step} record {k}")
    failures = recorder.health.snapshot().failures
    assert [(f.phase, f.name, f.count, f.first_step) for f in failures] == [(pb.FORWARD, "fc1", 1, 2)]
    assert "modified in place" in failures[0].error


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_distinct_tensor_is_read_once(framework):
    """The container's output is its last child's output and the child's input is the activation: read once each."""
    recorder, batches = run_steps(framework, 2, workers=1)
    cost = batches[1].cost
    # Records of 128 x 256 float32 tensors: fc1 in/out, body in/out, body.0 in/out, root in/out,
    # and their output gradients (fc1, body, body.0, root): 12.  Distinct: x (fc1's and root's
    # input), fc1's output, the ReLU's (body's and body.0's input), body.0's output (body's and
    # root's too), and two output gradients (root's, body's and body.0's are one tensor): 6.
    activation = 128 * WIDTH * 4
    params = 2 * (WIDTH * WIDTH + WIDTH) * 4
    assert cost.bytes_captured == 12 * activation + 2 * params + 4  # + the loss
    assert cost.bytes_read == 6 * activation + 2 * params + 4
    assert cost.bytes_read < cost.bytes_captured


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_no_hook_is_attached_while_a_step_is_not_captured(framework):
    model, train_step, zero = model_and_step(framework)
    recorder = Recorder(model, backend_for(model), CaptureConfig())

    def hooked() -> int:
        attr = "_forward_hooks" if framework == "torch" else "_forward_post_hooks"
        return sum(len(getattr(m, attr)) for m in (model, model.fc1, model.body, model.body[0]))

    assert hooked() == 4
    recorder.set_active(False, 1)
    assert hooked() == 0
    train_step(1)
    recorder.discard_step()
    zero()
    recorder.set_active(True, 2)
    assert hooked() == 4
    batch = recorder.finish_step(2, train_step(2))
    assert (batch.phase == pb.FORWARD).sum() == 4
    recorder.remove()
    recorder.set_active(True, 3)
    assert hooked() == 0


def test_a_stuck_statistic_costs_one_bounded_wait_then_the_pool_steps_aside():
    """The worker hangs in a task: the boundary runs the rest itself, waits at most the timeout, then goes inline."""
    started, release = threading.Event(), threading.Event()
    pool = StatsOffload(workers=1, timeout=0.3)

    def hang():
        started.set()
        release.wait(30)

    stuck = pool.submit(hang)
    assert started.wait(10)
    quick = pool.submit(lambda: 7)
    begin = time.perf_counter()
    waited = pool.drain([stuck, quick])
    assert 0.25 < waited < 5 and time.perf_counter() - begin < 5
    assert quick.done and quick.result == 7  # the caller ran it while the worker hung
    assert not stuck.done and stuck.cancelled and pool.broken
    release.set()
    pool.close()


def test_a_task_that_raises_reports_its_error():
    pool = StatsOffload(workers=1)
    task = pool.submit(lambda: 1 / 0)
    pool.drain([task])
    assert isinstance(task.error, ZeroDivisionError) and not pool.broken
    pool.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_runs_its_own_workers():
    pool = StatsOffload(workers=1)
    pool.drain([pool.submit(lambda: 1)])  # the parent's worker is running
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's exit code is the assertion
        code = 1
        try:
            task = pool.submit(lambda: 42)
            deadline = time.monotonic() + 30
            while not task.finished and time.monotonic() < deadline:  # a worker of the child runs it
                time.sleep(0.01)
            code = 0 if task.done and task.result == 42 else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    pool.close()


def run_tensor_steps(framework: str, steps: int, workers: int, inplace_from: int | None = None):
    """Tensor mode: per step, the statistics by record and the full tensors by record."""
    model, train_step, zero = model_and_step(framework, inplace_from=inplace_from)
    backend = backend_for(model)
    recorder = Recorder(model, backend, CaptureConfig(capture="tensors", stats_workers=workers))
    out = []
    for step in range(steps):
        recorder.set_active(True, step)
        loss = train_step(step)
        batch = recorder.finish_step(step, loss)
        keys = list(zip(batch.phase.tolist(), batch.target.tolist(), batch.call_index.tolist(), batch.slot.tolist()))
        tensors = {}
        for host in batch.tensors:
            array = np.array(backend.storage_array(host.copy))  # a copy: the buffer goes back to the pool
            for record in host.records:
                tensors[keys[record]] = array
            recorder._release(host)
        out.append((batch, keyed(batch), tensors))
        zero()
    return recorder, out


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("inplace_from", [None, 0])
def test_tensor_mode_copies_off_the_thread_hold_the_hooks_numbers(framework, inplace_from):
    """Copies made by the worker equal copies made in the hook, bit for bit, in-place writes included."""
    _, reference = run_tensor_steps(framework, 4, workers=0, inplace_from=inplace_from)
    recorder, offloaded = run_tensor_steps(framework, 4, workers=1, inplace_from=inplace_from)
    for (_, stats_a, tensors_a), (batch, stats_b, tensors_b) in zip(reference, offloaded):
        assert stats_a.keys() == stats_b.keys() and tensors_a.keys() == tensors_b.keys()
        for key in stats_a:
            np.testing.assert_array_equal(stats_a[key], stats_b[key], err_msg=f"step {batch.step} {key}")
        for key in tensors_a:
            np.testing.assert_array_equal(tensors_a[key], tensors_b[key], err_msg=f"step {batch.step} {key}")
        assert not batch.incomplete
    assert offloaded[-1][0].cost.offloaded > offloaded[0][0].cost.offloaded
    fc1 = (pb.FORWARD, recorder._module_ids["fc1"], 0, 0)
    assert (fc1 in recorder._volatile) == (inplace_from == 0)
    if inplace_from == 0:
        assert offloaded[-1][2][fc1].min() < 0  # the copy is the pre-ReLU output


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tensor_mode_drops_a_copy_written_in_place_after_it_was_learnt_safe(framework):
    _, reference = run_tensor_steps(framework, 4, workers=0, inplace_from=2)
    recorder, offloaded = run_tensor_steps(framework, 4, workers=1, inplace_from=2)
    fc1 = (pb.FORWARD, recorder._module_ids["fc1"], 0, 0)
    batch, stats, tensors = offloaded[2]
    assert fc1 not in stats and fc1 not in tensors and pb.FORWARD in batch.incomplete
    for (_, stats_a, tensors_a), (_, stats_b, tensors_b) in zip(reference, offloaded):
        for key, array in tensors_b.items():  # every tensor sent equals the hook's copy
            np.testing.assert_array_equal(tensors_a[key], array)
        for key, row in stats_b.items():
            np.testing.assert_array_equal(stats_a[key], row)
    np.testing.assert_array_equal(reference[3][2][fc1], offloaded[3][2][fc1])
