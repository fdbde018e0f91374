"""Weight sync between real jobs: torch to paddle and paddle to torch, in separate processes.

Each job starts from its own random weights (tests/integration/jobs/weight_sync_job.py):
torch keeps q/k/v and gate/up apart, paddle fuses them (qkv grouped by 2 KV heads,
[gate | up]); a 4 MiB square weight is twice the server's message limit.  The
candidate's parameters after attach must be exactly the baseline's, converted by
a rule written here, and the pair must stay aligned.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.integration.jobs.weight_sync_job import HEAD_DIM, HEADS, KV_HEADS
from twinstep.server import serve
from twinstep.server.config import config_from_dict

STEPS = 3
#: Both directions' fused rules in one server: each applies where its single side exists.
MAPPING = {"fused": [
    {"candidate": r"attn\.qkv_proj", "baseline": ["attn.q_proj", "attn.k_proj", "attn.v_proj"], "groups": KV_HEADS},
    {"candidate": r"mlp\.up_gate_proj", "baseline": ["mlp.gate_proj", "mlp.up_proj"]},
    {"baseline": r"attn\.qkv_proj", "candidate": ["attn.q_proj", "attn.k_proj", "attn.v_proj"], "groups": KV_HEADS},
    {"baseline": r"mlp\.up_gate_proj", "candidate": ["mlp.gate_proj", "mlp.up_proj"]},
]}


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    """Both directions at once, each in its own session: (server, dump folder)."""
    tmp = tmp_path_factory.mktemp("weights")
    server = serve(port=0, config=config_from_dict({"mapping": MAPPING, "limits": {"max_message_bytes": 2 << 20}, "sessions": {"reconnect_grace": 0.5}}))
    jobs = []
    for session, base, cand in (("to-paddle", "torch", "paddle"), ("to-torch", "paddle", "torch")):
        for framework, role in ((base, ["--baseline"]), (cand, [])):
            command = [sys.executable, "-m", "tests.integration.jobs.weight_sync_job", "--framework", framework,
                       "--server", server.address, "--session", session, "--steps", str(STEPS),
                       "--seed", str(len(jobs)), "--dump", str(tmp / f"{session}-{framework}.npz"), *role]
            jobs.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"}))
    try:
        outputs = [job.communicate(timeout=240)[0] for job in jobs]
        for job, output in zip(jobs, outputs):
            assert job.returncode == 0, output[-3000:]
        yield server, tmp
    finally:
        for job in jobs:
            job.kill()
        server.stop(grace=0.5)


def fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """torch [out] rows q, k, v as paddle's grouped qkv columns: per KV head g, [its query heads, k_g, v_g]."""
    per_kv = HEADS // KV_HEADS * HEAD_DIM
    rows = []
    for g in range(KV_HEADS):
        rows += [q[g * per_kv:(g + 1) * per_kv], k[g * HEAD_DIM:(g + 1) * HEAD_DIM], v[g * HEAD_DIM:(g + 1) * HEAD_DIM]]
    return np.concatenate(rows, axis=0)


def as_paddle(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The torch job's parameters in the paddle job's names and layouts (Linear weights [in, out])."""
    out = {n: (v.T if n.endswith("weight") and v.ndim == 2 else v) for n, v in t.items()
           if not any(f".{p}_proj." in n for p in ("q", "k", "v", "gate", "up"))}
    out["attn.qkv_proj.weight"] = fuse_qkv(*(t[f"attn.{p}_proj.weight"] for p in "qkv")).T
    out["attn.qkv_proj.bias"] = fuse_qkv(*(t[f"attn.{p}_proj.bias"] for p in "qkv"))
    out["mlp.up_gate_proj.weight"] = np.concatenate([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]]).T
    return out


@pytest.mark.parametrize(("session", "base", "cand"), [("to-paddle", "torch", "paddle"), ("to-torch", "paddle", "torch")])
def test_the_candidate_starts_from_the_baselines_weights_and_stays_aligned(synced, session, base, cand):
    server, tmp = synced
    with np.load(tmp / f"{session}-{base}.npz") as b, np.load(tmp / f"{session}-{cand}.npz") as c:
        base_state, cand_state = dict(b), dict(c)
    torch_state, paddle_state = (base_state, cand_state) if base == "torch" else (cand_state, base_state)
    expected = as_paddle(torch_state)
    assert set(expected) == set(paddle_state)
    for name, value in expected.items():  # bit for bit
        assert np.array_equal(paddle_state[name], value), name
    report = server.report_proto(session)
    assert report.status == "aligned" and report.steps_compared == STEPS, report.first_divergence
    sync = next(r for r in report.runs if r.name == cand).weight_sync
    assert sync.baseline_run == base and not sync.no_counterpart and not sync.unused
    loaded = {w.name: w for w in sync.loaded}
    assert len(loaded) == len(cand_state) and sync.bytes > 4 << 20
    if cand == "paddle":
        qkv = loaded["attn.qkv_proj.weight"]
        assert list(qkv.sources) == ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"]
        assert (qkv.groups, list(qkv.transposed)) == (KV_HEADS, [True, True, True])
    else:
        k = loaded["attn.k_proj.weight"]
        assert (list(k.sources), k.part, k.groups) == (["attn.qkv_proj.weight"], 1, KV_HEADS)
    assert list(loaded["wide.2.weight"].transposed) == [True]  # 1024 x 1024: square
