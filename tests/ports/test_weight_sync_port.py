"""Weight sync on a real port: transformers' Ernie4_5 (torch) to paddleformers' (fused qkv and up_gate projections).

The paddle job starts from paddleformers' own random initialisation and reads no
weights file: the only way it can match the torch baseline is that attach loaded
the baseline's weights through the server (fused by the corpus mapping, Linear
weights transposed, square ones included).  Needs transformers and paddleformers.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

from tests.ports import models
from tests.ports.corpus import FUSED_MAPPING, ROOT, job_commands
from twinstep.server import serve
from twinstep.server.config import config_from_dict

STEPS = 20


@pytest.fixture
def ports_server():
    handle = serve(port=0, config=config_from_dict({"mapping": FUSED_MAPPING}))
    yield handle
    handle.stop(grace=0.5)


def test_a_paddle_candidate_from_its_own_init_loads_the_torch_baselines_weights_and_stays_aligned(ports_server):
    with tempfile.TemporaryDirectory() as tmp:
        base, cand = job_commands("ernie4_5", ports_server.address, "weights", STEPS, tmp)
        base.append("--share-weights")
        # A file nobody writes: a candidate that waited for the conversion script's weights would time out.
        cand[cand.index("--weights") + 1] = os.path.join(tmp, "never-written.npz")
        cand.append("--init-from-baseline")
        procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for cmd in (base, cand)]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    report = ports_server.report_proto("weights")
    assert report.status == "aligned", f"{report.first_divergence}"
    assert report.steps_compared == STEPS
    sync = next(r for r in report.runs if r.name == "paddle").weight_sync
    assert sync.baseline_run == "torch" and sync.baseline_framework == "torch"
    assert list(sync.no_counterpart) == [] and list(sync.unused) == []
    loaded = {w.name: w for w in sync.loaded}
    for layer in range(models.LAYERS):
        qkv = loaded[f"model.layers.{layer}.self_attn.qkv_proj.weight"]
        assert [s.rsplit(".", 2)[-2] for s in qkv.sources] == ["q_proj", "k_proj", "v_proj"]
        assert qkv.groups == models.KV_HEADS and all(qkv.transposed)
        up_gate = loaded[f"model.layers.{layer}.mlp.up_gate_proj.weight"]
        assert [s.rsplit(".", 2)[-2] for s in up_gate.sources] == ["gate_proj", "up_proj"]
        assert list(loaded[f"model.layers.{layer}.self_attn.o_proj.weight"].transposed) == [True]  # 64 x 64
    assert list(loaded["lm_head.weight"].transposed) == [False]  # paddleformers' LMHead keeps [vocab, hidden]
