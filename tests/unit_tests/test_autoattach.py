"""Zero-code attach in-process: each framework's probe finds the model and the step, and leaves no trace.

Real torch and paddle, a real server on port 0; the probes are installed
directly (twinstep run's bootstrap does the same at import; tests/integration/
test_zero_code.py runs it through real processes).
"""

from __future__ import annotations

import logging
import sys
import time

import pytest
import torch

import twinstep
from twinstep.runtime.autoattach import installer as installer_module
from twinstep.runtime.autoattach import postimport
from tests.conftest import last_step, run_status, wait_for

# torch's own, taken before any test installs a probe (a wrapper copies their names).
TORCH_OPTIMIZER_INIT = torch.optim.Optimizer.__init__
TORCH_BACKWARD = torch.autograd.backward


@pytest.fixture
def session_env(monkeypatch, server):
    """TWINSTEP_* variables naming a fresh session on the in-process server: what `twinstep run` sets."""
    for name in ("RANK", "WORLD_SIZE", "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "TWINSTEP_CONFIG"):
        monkeypatch.delenv(name, raising=False)

    def configure(session: str, run: str = "auto") -> None:
        monkeypatch.setenv("TWINSTEP_SESSION", session)
        monkeypatch.setenv("TWINSTEP_RUN", run)
        monkeypatch.setenv("TWINSTEP_SERVER", server.address)
        monkeypatch.setenv("TWINSTEP_STATS_WORKERS", "0")

    return configure


@pytest.fixture
def torch_probe():
    from twinstep.runtime.autoattach.torch import TorchProbe

    probe = TorchProbe()
    yield probe
    probe.installer.remove()


def spy_losses(installer) -> list[float]:
    """Record the loss each monitor.step() receives (calling through to the real one)."""
    seen: list[float] = []
    step = installer.monitor.step

    def recording_step(loss=None):
        seen.append(float(loss))
        return step(loss=loss)

    installer.monitor.step = recording_step
    return seen


def test_torch_attaches_to_the_trained_model_before_its_first_forward(session_env, server, torch_probe, capsys):
    from torch.nn.modules import module as torch_module
    from torch.optim import optimizer as torch_optimizer

    session_env("auto-torch")
    torch.manual_seed(0)
    teacher = torch.nn.Linear(4, 4)  # runs with autograd on, but no optimizer updates it
    student = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    temperature = torch.nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    other = torch.optim.SGD([temperature], lr=0.1)  # a second optimizer steps too: steps end at the model's
    x = torch.randn(8, 4)
    with torch.no_grad():
        student(x)  # an evaluation before training is not the training forward
    assert torch_probe.installer.monitor is None
    expected: list[float] = []
    for step in range(3):
        total = 0.0
        for micro in range(2):  # gradient accumulation: two backward calls per optimizer step
            if step == 0 and micro == 0:
                assert torch_probe.installer.monitor is None
            loss = (student(teacher(x)).square().mean() * temperature) / 2
            if step == 0 and micro == 0:
                seen = spy_losses(torch_probe.installer)
                assert len(torch_module._global_forward_pre_hooks) == 0  # discovery hook gone once found
            loss.backward()
            total += float(loss.detach())
        opt.step()
        other.step()
        expected.append(total)
        opt.zero_grad()
        other.zero_grad()
    assert seen == pytest.approx(expected, rel=1e-6)  # the step's loss: the sum of what backward ran on
    mon = torch_probe.installer.monitor
    assert mon.current_step == 3
    line = capsys.readouterr().err
    assert "run 'auto' (session 'auto-torch'" in line and "attached to Sequential: 25 parameters in 4 tensors" in line
    assert "steps end at SGD.step()" in line
    torch_probe.installer.remove()
    status = run_status(server, "auto-torch", "auto")
    assert status.last_step == 2 and status.state == "finished"
    # Nothing left behind: torch's globals and the model as they were.
    assert torch.optim.Optimizer.__init__ is TORCH_OPTIMIZER_INIT and torch.autograd.backward is TORCH_BACKWARD
    assert not torch_optimizer._global_optimizer_post_hooks
    assert all(not m._forward_hooks for m in student.modules())


def test_torch_optimizer_made_after_the_first_forward_attaches_one_step_late(session_env, server, torch_probe, caplog):
    session_env("auto-late")
    model = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3)
    model(x).sum().backward()  # a forward before any optimizer exists (a lazy-shape probe, say)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="twinstep"):
        opt.step()  # step 0: no model known yet
        opt.zero_grad()
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert sum("no model was found" in r.message for r in caplog.records) == 1
    torch_probe.installer.remove()
    status = run_status(server, "auto-late", "auto")
    assert status.last_step == 2  # steps 1 and 2, numbered as the training counts them


def test_torch_with_no_model_gives_up_once_and_training_goes_on(session_env, torch_probe, caplog):
    session_env("auto-none")
    weights = torch.randn(3, requires_grad=True)  # trained without any nn.Module
    opt = torch.optim.SGD([weights], lr=0.1)
    with caplog.at_level(logging.WARNING, logger="twinstep"):
        for _ in range(installer_module.MAX_STEPS_UNATTACHED + 5):
            (weights * 2).sum().backward()
            opt.step()
            opt.zero_grad()
    messages = [r.message for r in caplog.records if r.name == "twinstep"]
    assert sum("no model was found" in m for m in messages) == 1
    assert sum("training continues without twinstep" in m for m in messages) == 1
    assert torch_probe.installer.given_up and torch.autograd.backward is TORCH_BACKWARD


def test_torch_halt_passes_through_optimizer_step(session_env, server, torch_probe):
    session_env("auto-halt")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 2)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    wait_for(lambda: last_step(server, "auto-halt", "auto") >= 0)  # the run has joined: there is one to halt
    assert server.halt("auto-halt", "enough") == ["auto"]
    deadline = time.monotonic() + 20
    with pytest.raises(twinstep.Halted, match="enough"):
        while time.monotonic() < deadline:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert torch_probe.installer.monitor is None and torch_probe.installer.given_up
    model(x).sum().backward()
    opt.step()  # training may go on after a halt it caught: nothing of twinstep is left


def test_paddle_attaches_inside_its_own_optimizers_and_restores_everything(session_env, server, capsys):
    paddle = pytest.importorskip("paddle")
    from twinstep.runtime.autoattach.paddle import PaddleProbe

    session_env("auto-paddle")
    paddle.seed(0)
    originals = {"call": paddle.nn.Layer.__call__, "backward": paddle.Tensor.backward,
                 "adamw": paddle.optimizer.AdamW.__init__}
    probe = PaddleProbe()
    try:
        def scaled_init(self, **kwargs):
            super(Scaled, self).__init__(**kwargs)

        class Scaled(paddle.optimizer.SGD):  # an optimizer defined after the probe, as a library's would be
            __init__ = scaled_init

        assert Scaled.__dict__["__init__"] is not scaled_init  # wrapped as it was defined
        teacher = paddle.nn.Linear(4, 4)  # runs with autograd on, but no optimizer updates it
        student = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.Tanh(), paddle.nn.Linear(4, 1))
        unused = paddle.nn.Linear(2, 2)
        opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=student.parameters())  # not via Optimizer.__init__
        Scaled(learning_rate=0.1, parameters=unused.parameters())  # made first by its own __init__, never stepped
        x = paddle.randn([8, 4])
        for step in range(3):
            for micro in range(2):
                loss = student(teacher(x)).square().mean() / 2
                if step == 0 and micro == 0:
                    seen = spy_losses(probe.installer)
                    assert paddle.nn.Layer.__call__ is originals["call"]  # discovery gone once found
                loss.backward()
            opt.step()
            opt.clear_grad()
        assert len(seen) == 3
        err = capsys.readouterr().err
        assert "attached to Sequential: 25 parameters in 4 tensors; steps end at AdamW.step()" in err
    finally:
        probe.installer.remove()
    assert run_status(server, "auto-paddle", "auto").last_step == 2
    assert paddle.nn.Layer.__call__ is originals["call"] and paddle.Tensor.backward is originals["backward"]
    assert paddle.optimizer.AdamW.__init__ is originals["adamw"]
    assert "__init_subclass__" not in paddle.optimizer.Optimizer.__dict__
    assert Scaled.__dict__["__init__"] is scaled_init


def test_post_import_callback_runs_once_the_module_has_loaded(tmp_path, monkeypatch):
    (tmp_path / "late_module_for_twinstep.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    postimport.when_imported("late_module_for_twinstep", lambda module: seen.append(module.VALUE))
    assert not seen
    import late_module_for_twinstep

    assert seen == [42]
    assert type(late_module_for_twinstep.__loader__).__name__ == "SourceFileLoader"  # the wrapper never shows
    assert not any(type(f).__name__ == "_PostImportFinder" for f in sys.meta_path)
    postimport.when_imported("late_module_for_twinstep", lambda module: seen.append(0))  # already imported: now
    assert seen == [42, 0]
    monkeypatch.delitem(sys.modules, "late_module_for_twinstep")


def test_each_probe_imports_only_its_framework():
    import ast
    from pathlib import Path

    folder = Path(twinstep.__file__).parent / "runtime" / "autoattach"
    for framework, other in (("torch", "paddle"), ("paddle", "torch")):
        tree = ast.parse((folder / f"{framework}.py").read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert framework in imported and other not in imported, (framework, imported)


def test_the_armed_bootstrap_loads_no_framework_and_no_runtime():
    """Every Python process of a `twinstep run` job pays for the bootstrap: it must stay a few small modules."""
    import os
    import subprocess

    from twinstep.runtime.autoattach import BOOTSTRAP_DIR

    env = {**os.environ, "PYTHONPATH": BOOTSTRAP_DIR, "TWINSTEP_AUTO_ATTACH": "1"}
    script = ("import sys\n"
              "assert 'twinstep.runtime.autoattach' in sys.modules, 'the bootstrap did not run'\n"
              "heavy = {'torch', 'paddle', 'numpy', 'grpc', 'yaml', 'twinstep.runtime.api', 'twinstep.runtime.settings'} & set(sys.modules)\n"
              "assert not heavy, heavy\n"
              f"assert {BOOTSTRAP_DIR!r} not in sys.path\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
