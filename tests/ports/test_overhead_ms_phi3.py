"""The overhead benchmark's ms-phi3 trains what its hf-phi3 trains (benchmarks/overhead_models.py).

Its ratios are only comparable with hf-phi3's and pf-phi3's if the MindSpore port, built at
the benchmark's size from the same config, is the same model trained the same way. A real
process builds both trainers at a size other than the test bed's (so the port's sizes must
come from the config, not tests/ports/models.py), gives the port the torch weights, and
compares logits and the losses of two training steps (the second one follows an AdamW
update on each side: another learning rate or betas shows there; weight decay 0.01 of one
step is below the tolerance). Needs transformers and mindspore (numpy 1.x).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.mindspore_env import skip_module_without_mindspore

skip_module_without_mindspore()
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]

# MindSpore first (its CPU kernels must load before anything else's oneDNN), then torch.
SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {benchmarks!r})
    import overhead_models as om
    from tests.ports import mindspore_phi3

    size = om.ModelSize(hidden=32, layers=1, seq=8, batch=2)
    port = om.build("ms-phi3", size, 1)
    hf = om.build("hf-phi3", size, 1)
    state = {{name: p.detach().numpy().copy() for name, p in hf.inner.named_parameters()}}
    mindspore_phi3.load_torch_weights(port.inner, state)
    ids, tgt = om.batch(0, size)
    torch_logits = hf.inner(input_ids=hf.torch.from_numpy(ids)).logits.detach().numpy()
    port_logits = port.inner(input_ids=port.ms.Tensor(ids)).asnumpy()
    losses = []
    for step in range(2):
        ids, tgt = om.batch(step, size)
        losses.append([float(hf.train_step(ids, tgt).item()), float(port.train_step(ids, tgt).item())])
        hf.zero_grad()
    print(json.dumps({{"shapes": [list(torch_logits.shape), list(port_logits.shape)],
                      "logits_gap": float(abs(torch_logits - port_logits).max()), "losses": losses}}))
""")


def test_ms_phi3_is_hf_phi3_at_the_benchmark_size():
    script = SCRIPT.format(repo=str(REPO), benchmarks=str(REPO / "benchmarks"))
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "GLOG_v": "3"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["shapes"] == [[2, 8, 1024], [2, 8, 1024]]
    assert result["logits_gap"] < 1e-5, result  # measured 1.2e-7; rope theta 5e5 instead of 1e4 gives 5.9e-5
    for torch_loss, port_loss in result["losses"]:
        assert abs(torch_loss - port_loss) < 2e-5, result["losses"]
