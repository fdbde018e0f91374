"""twinstep.integrations.base: what both trainer callbacks share, driven as a trainer drives it (torch, in-process server).

The callbacks under real Trainers are in tests/ports/test_trainers.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import run_status, wait_for
from twinstep.integrations.base import TrainerAttachment, output_loss, unwrap_model


class TinyLM(torch.nn.Module):
    """Returns a dict with a loss, as transformers' models do when given labels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.fc(x)
        return {"loss": out.square().mean(), "logits": out}


def forward_hook(attachment: TrainerAttachment, weight: float | None):
    def install(model: torch.nn.Module):
        return model.register_forward_hook(lambda m, a, out: attachment.add_loss(out, weight, m.training)).remove
    return install


def micro_batches(step: int) -> list[torch.Tensor]:
    return [torch.full((2, 4), float(step + k + 1)) for k in range(2)]


def test_the_step_loss_weights_micro_batches_as_the_trainer_does(server):
    for weight, expected in ((None, "mean"), (0.5, "mean"), (1.0, "sum")):
        model = TinyLM()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        attachment = TrainerAttachment("test", {"session": f"loss-{expected}-{weight}", "run": "a",
                                                "server": server.address})
        attachment.begin(model, 0, forward_hook(attachment, weight))
        for step in range(2):
            losses = []
            for x in micro_batches(step):
                loss = model(x)["loss"]
                losses.append(float(loss.detach()))
                loss.backward()
            opt.step()
            assert attachment.end_step() is False
            opt.zero_grad()
            want = sum(losses) / len(losses) if expected == "mean" else sum(losses)
            assert float(attachment.last_loss) == pytest.approx(want, rel=1e-6)
        attachment.end()
        assert attachment.monitor is None


def test_eval_forwards_are_not_counted(server):
    model = TinyLM()
    attachment = TrainerAttachment("test", {"session": "eval", "run": "a", "server": server.address})
    attachment.begin(model, 0, forward_hook(attachment, None))
    train = model(torch.ones(2, 4))["loss"]
    model.eval()
    model(torch.full((2, 4), 9.0))  # an evaluation inside training
    model.train()
    train.backward()
    attachment.end_step()
    assert float(attachment.last_loss) == pytest.approx(float(train.detach()))
    attachment.end()


def test_a_halt_from_the_server_is_reported_not_raised(server):
    model = TinyLM()
    attachment = TrainerAttachment("test", {"session": "halted", "run": "a", "server": server.address})
    attachment.begin(model, 0, forward_hook(attachment, None))
    model(torch.ones(2, 4))["loss"].backward()
    attachment.end_step()
    wait_for(lambda: run_status(server, "halted", "a"))
    server.halt("halted", "stop here")
    stopped = wait_for(lambda: _step(model, attachment), timeout=30)
    assert stopped and attachment.halted is not None and attachment.halted.reason == "stop here"
    assert attachment.monitor is None  # closed by the halt; the callback stops the trainer
    attachment.end()


def _step(model: TinyLM, attachment: TrainerAttachment) -> bool:
    model(torch.ones(2, 4))["loss"].backward()
    return attachment.end_step()


def test_a_training_starts_numbered_from_the_trainers_step(server):
    model = TinyLM()
    attachment = TrainerAttachment("test", {"session": "resumed", "run": "a", "server": server.address})
    attachment.begin(model, 7, forward_hook(attachment, None))  # resumed from a checkpoint at step 7
    assert attachment.monitor.current_step == 7
    attachment.end()


def test_an_attach_failure_leaves_the_training_running(caplog):
    attachment = TrainerAttachment("test", {"session": "s", "run": "a", "server": "http://no-port"})
    with caplog.at_level(logging.ERROR, logger="twinstep"):
        attachment.begin(TinyLM(), 0, lambda model: pytest.fail("no hook without a monitor"))
    assert attachment.monitor is None
    assert "could not attach" in caplog.text and "training goes on without capture" in caplog.text
    assert attachment.end_step() is False
    attachment.end()


def test_an_option_attach_does_not_take_is_refused_before_training():
    with pytest.raises(TypeError, match="twinstep callback: .*sesion"):
        TrainerAttachment("test", {"sesion": "typo", "run": "a"})
    with pytest.raises(TypeError, match="do not pass model="):
        TrainerAttachment("test", {"model": object()})


def test_loss_is_read_as_the_trainers_read_it():
    loss = torch.tensor(2.0)
    assert output_loss({"loss": loss, "logits": torch.ones(3)}) is loss
    assert output_loss((loss, torch.ones(3))) is loss
    assert output_loss(loss) is loss
    assert output_loss({"logits": torch.ones(3)}) is None  # no labels: no loss
    assert output_loss((torch.ones(3),)) is None  # a tuple without a loss first
    assert output_loss(torch.tensor(2)) is None  # not floating


def test_wrappers_are_taken_off():
    model = TinyLM()
    assert unwrap_model(torch.nn.DataParallel(model)) is model
    assert unwrap_model(model) is model


def test_the_package_imports_no_trainer_library():
    """Only importing a callback's module imports its library (and its framework)."""
    import subprocess
    import sys

    script = ("import sys, twinstep.integrations\n"
              "loaded = {'transformers', 'paddleformers', 'torch', 'paddle'} & set(sys.modules)\n"
              "assert not loaded, loaded\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
