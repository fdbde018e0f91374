"""twinstep.attach in-process: settings, context manager, halt."""

from __future__ import annotations

import pytest
import torch

import twinstep
from tests.conftest import last_step, run_status, wait_for


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def train(net: torch.nn.Module, mon: twinstep.Monitor, steps: int) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    for _ in range(steps):
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        mon.step(loss=loss)
        opt.zero_grad()


def test_attach_needs_a_server(monkeypatch):
    monkeypatch.delenv("TWINSTEP_SERVER", raising=False)
    with pytest.raises(ValueError, match="TWINSTEP_SERVER"):
        twinstep.attach(model(), session="s", run="r")


def test_rank_and_world_size_come_from_the_launcher_environment(monkeypatch, server):
    monkeypatch.setenv("TWINSTEP_SERVER", server.address)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    with twinstep.attach(model(), session="env", run="r") as mon:
        assert (mon.rank, mon.world_size) == (1, 2)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with twinstep.attach(model(), session="env", run="r") as mon:
        assert (mon.rank, mon.world_size) == (3, 4)
    with pytest.raises(ValueError, match="outside world size"):
        twinstep.attach(model(), session="env", run="r", rank=4)


def test_context_manager_sends_every_step_and_detaches(server):
    net = model()
    with twinstep.attach(net, session="ctx", run="torch", baseline=True, server=server.address, every=2) as mon:
        train(net, mon, 6)
    assert all(len(m._forward_hooks) == 0 for m in net.modules())
    run = run_status(server, "ctx", "torch")
    assert run.last_step == 4 and run.state == "finished"  # steps 0, 2, 4 captured
    assert mon.stats.steps_sent == 3


def test_operator_halt_raises_at_the_next_step(server):
    net = model()
    mon = twinstep.attach(net, session="op", run="torch", baseline=True, server=server.address)
    train(net, mon, 2)
    wait_for(lambda: last_step(server, "op", "torch") == 1)
    assert server.halt("op", "operator says stop") == ["torch"]
    with pytest.raises(twinstep.Halted, match="operator says stop") as caught:
        wait_for(lambda: train(net, mon, 1), timeout=10)
    assert caught.value.reason == "operator says stop"
    assert caught.value.step >= 2
    wait_for(lambda: run_status(server, "op", "torch").state == "halted")
    train(net, mon, 1)  # after close, step() is a no-op: training may go on if the user wants
