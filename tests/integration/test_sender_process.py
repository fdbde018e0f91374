"""sender="process": full tensors leave through a sender process reading shared memory.

Real torch jobs in their own processes, a real server on loopback, a real
sender process; the sender is killed outright in the fail-open test.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import wait_for
from twinstep.runtime.transport.shared_memory import AVAILABLE

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="shared memory files are Linux's")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(c) for c in text]
    return found


def _sender_of(job_pid: int) -> int:
    """The job's sender process: its child running twinstep.runtime.transport.sidecar_main."""
    for child in _children(job_pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"twinstep.runtime.transport.sidecar_main" in cmdline:
            return child
    return 0


def _last_step(server, session: str) -> int:
    try:
        runs = server.report(session)["runs"]
    except KeyError:  # no such session yet
        return -1
    return runs[0]["last_step"] if runs else -1


def test_thread_and_process_senders_deliver_the_same_tensors(server, jobs):
    """Same model, same data: one run sends from a thread, one from a sender process; every tensor compares equal."""
    base = jobs("torch", server=server.address, session="senders", run="thread", baseline=True, steps=4,
                capture="tensors", extra=["--sender", "thread"])
    cand = jobs("torch", server=server.address, session="senders", run="process", steps=4,
                capture="tensors", extra=["--sender", "process"])
    base_result, cand_result = base.wait(), cand.wait()
    assert base_result.returncode == 0 and cand_result.returncode == 0, base_result.output + cand_result.output
    for result in (base_result, cand_result):
        assert result.result["steps_sent"] == 4 and not any(result.result["dropped"].values()), result.result
        assert result.result["tensor_bytes"] > 0
    # Both sent the same full tensors byte for byte.
    assert base_result.result["tensor_bytes"] == cand_result.result["tensor_bytes"]
    report = server.report_proto("senders")
    assert report.status == "aligned" and report.steps_compared == 4 and not report.errors, report
    # Element-wise metrics ran on every recorded tensor of the last step, and found them identical.
    rel_l2 = server.last_comparison("senders").values["rel_l2"]
    measured = rel_l2[np.isfinite(rel_l2)]
    assert measured.size >= 20 and (measured == 0.0).all(), rel_l2


def test_a_bug_is_found_through_the_sender_process(server, jobs):
    base = jobs("torch", server=server.address, session="sender-bug", run="base", baseline=True, steps=3,
                capture="tensors", extra=["--sender", "process"])
    cand = jobs("torch", server=server.address, session="sender-bug", run="cand", steps=3, bug="gelu_tanh",
                capture="tensors", extra=["--sender", "process"])
    base_result, cand_result = base.wait(), cand.wait()
    assert base_result.returncode == 0 and cand_result.returncode == 0
    assert cand_result.result["tensor_bytes"] > 0
    first = server.report("sender-bug")["first_divergence"]
    assert (first["step"], first["phase"], first["module"]) == (0, "forward", "layers.1.mlp.act")


def test_training_goes_on_when_the_sender_process_dies(server, jobs):
    job = jobs("torch", server=server.address, session="sender-dies", run="torch", baseline=True, steps=40,
               capture="tensors", extra=["--sender", "process", "--step-delay", "0.05"])
    sender = wait_for(lambda: _sender_of(job.process.pid), timeout=60)
    wait_for(lambda: _last_step(server, "sender-dies") >= 2)  # three steps went through the sender process
    os.kill(sender, signal.SIGKILL)
    start = time.monotonic()
    result = job.wait()
    assert result.returncode == 0, result.output
    assert result.result["steps_completed"] == 40  # every step trained
    assert "training continues without sending its steps" in result.output  # one clear warning
    dropped = result.result["dropped"]
    assert dropped.get("sender_lost", 0) > 0, result.result
    run = server.report_proto("sender-dies").runs[0]  # what got through before is kept; then the run is lost
    assert run.last_step >= 2 and run.state == "lost", run
    assert time.monotonic() - start < 60  # and close did not hang on the dead sender


def test_no_server_means_drops_not_a_stuck_training(jobs, tmp_path, refused_address):
    job = jobs("torch", server=refused_address, session="nobody", steps=5, capture="tensors",
               extra=["--sender", "process"])
    result = job.wait(timeout=120)
    assert result.returncode == 0 and result.result["steps_completed"] == 5, result.output
    assert result.result["steps_sent"] == 0 and sum(result.result["dropped"].values()) == 5, result.result


def test_shared_buffers_are_reused_step_after_step(server):
    """Buffers come back from the sender process once encoded: memory stops growing after the first steps."""
    import torch

    import twinstep

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = twinstep.attach(model, session="reuse", run="torch", baseline=True, server=server.address,
                          capture="tensors", sender="process")
    client = mon._client
    sizes = []
    try:
        for step in range(8):
            loss = model(torch.randn(32, 64)).square().mean()
            loss.backward()
            opt.step()
            mon.step(loss=loss)
            opt.zero_grad()
            wait_for(lambda: client.pending_steps == 0, timeout=30)
            sizes.append(client.buffers.total_bytes)
    finally:
        mon.close()
    assert sizes[0] > 0
    assert sizes[-1] == sizes[1], sizes  # steps 2..8 reused the buffers of the first ones
    # Allocations happen in the first two steps at most (a step's buffers may not be back before the next);
    # the six steps after them take every buffer from the pool.
    pool = mon._recorder.pool.stats
    assert pool.reused >= 6 * (pool.allocated // 2)
    assert mon.stats.steps_sent == 8 and not any(mon.stats.dropped.values())
    assert server.report("reuse")["runs"][0]["last_step"] == 7


def test_auto_picks_a_sender_process_for_tensors_of_a_cpu_model_only(server):
    import torch

    import twinstep
    from twinstep.runtime.transport import StreamClient
    from twinstep.runtime.transport.sidecar import SidecarClient

    model = torch.nn.Linear(4, 4)
    chosen = {}
    for capture in ("stats", "tensors", "lossy"):
        mon = twinstep.attach(model, session=f"auto-{capture}", run="torch", server=server.address, capture=capture)
        chosen[capture] = type(mon._client)
        mon.close()
    assert chosen == {"stats": StreamClient, "tensors": SidecarClient, "lossy": SidecarClient}
    with pytest.raises(ValueError, match="sender must be"):
        twinstep.attach(model, session="bad", run="torch", server=server.address, sender="fork")


@pytest.mark.parametrize("server", [{"halt_on_divergence": True}], indirect=True)
def test_lockstep_holds_from_the_first_step_while_the_sender_process_starts(server, jobs):
    """The sender process connects a second after attach; lockstep must not let a fast run go ahead meanwhile."""
    extra = ["--sender", "process", "--lockstep", "1"]
    base = jobs("torch", server=server.address, session="sender-lockstep", baseline=True, steps=200,
                capture="tensors", extra=extra)
    cand = jobs("paddle", server=server.address, session="sender-lockstep", bug="gelu_tanh", steps=200,
                capture="tensors", extra=extra)
    base_result, cand_result = base.wait(), cand.wait()
    assert base_result.halted and cand_result.halted, base_result.output + cand_result.output
    # The divergence is at step 0: with lockstep 1 neither job got further than a few steps.
    assert base_result.result["steps_completed"] <= 3 and cand_result.result["steps_completed"] <= 3


def test_a_halt_is_prepared_with_the_training_s_live_step(server):
    """HALT_PREPARE (sent to multi-rank runs) is answered with the step training is at now, asked of the training process."""
    import torch

    import twinstep

    model = torch.nn.Linear(8, 8)
    mon = twinstep.attach(model, session="live-step", run="torch", baseline=True, server=server.address,
                          capture="tensors", sender="process", rank=0, world_size=2)
    try:
        for _ in range(5):
            model(torch.randn(2, 8)).sum().backward()
            mon.step()
        wait_for(lambda: mon._client.pending_steps == 0, timeout=30)
        assert mon.current_step == 5
        server.halt("live-step", reason="operator")
        at_step, _ = wait_for(lambda: mon._halt, timeout=30)
        # The last batch was sent during step 4; the live answer is step 5, so the halt lands on step 6.
        assert at_step == 6
    finally:
        mon.close()
