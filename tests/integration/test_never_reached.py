"""A training whose server is never reached: it ends at once, says so, and counts what was not sent in words.

Each case is a real training process (torch) attached to an address where connections are refused.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    import twinstep

    server, capture, sender, share = sys.argv[1:5]
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = twinstep.attach(model, session="nowhere", run="torch", baseline=True, server=server, optimizer=optimizer,
                          capture=capture, sender=sender, share_weights=share == "share")
    for _ in range(30):
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mon.step(loss)
    time.sleep(1.0)  # the first connection attempt has failed by now
    started = time.monotonic()
    mon.close()
    print(f"close took {time.monotonic() - started:.2f} s", flush=True)
""")


@pytest.mark.parametrize("capture, sender, share", [("stats", "thread", ""), ("tensors", "process", ""),
                                                   ("stats", "thread", "share")])  # and its weights' upload
def test_a_run_that_never_reached_its_server_ends_at_once_and_says_so(refused_address, tmp_path, capture, sender,
                                                                      share):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ran = subprocess.run([sys.executable, str(script), refused_address, capture, sender, share], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output
    took = float(re.search(r"close took ([\d.]+) s", output).group(1))
    assert took < 3.0, output  # not the 10 s a run that was connected may take to flush its queue
    assert "lost contact" not in output and "Traceback" not in output, output  # there was no contact to lose
    assert output.count(f"cannot reach the comparison server at {refused_address}") == 1, output
    assert (f"twinstep: run 'torch' rank 0 never reached the comparison server at {refused_address}: 30 steps "
            "not sent: the training ended before the server was reached") in output, output
    assert "{" not in output.split("never reached", 1)[1].splitlines()[0], output  # counted in words, not a dict
