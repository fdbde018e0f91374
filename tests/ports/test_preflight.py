"""Preflight on the real ports: each corpus bug that changes the set-up gets its finding, faithful ports none.

Two processes in all (tests/ports/preflight_job.py): one torch process attaches every
baseline, one paddle process every port, each to a session of its own; nothing trains.
Where MindSpore runs (installed, numpy 1.x), a third process attaches the MindSpore Phi3
port as a second candidate of the phi3 sessions its corpus has (run ``mindspore``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.ports import models
from tests.ports.corpus import FUSED_MAPPING, ROOT
from tests.ports.preflight_job import session_name
from twinstep.server import serve
from twinstep.server.config import config_from_dict

#: Corpus bug -> (finding category, the baseline name it must name, or None for a run-wide value, per model).
SETUP_BUGS = {
    "lr": ("lr", {m: "model.embed_tokens.weight" for m in models.MODEL_NAMES}),
    "adam_eps": ("epsilon", {m: "model.embed_tokens.weight" for m in models.MODEL_NAMES}),
    "wd_on_norms": ("weight_decay", {m: "model.layers.0.input_layernorm.weight" for m in models.MODEL_NAMES}),
    "grad_clip": ("clipping", {m: None for m in models.MODEL_NAMES}),
    # phi3's torch module is activation_fn, paddleformers' act_fn: paired as the only activation of their parent.
    "act_variant": ("activation", {"phi3": "model.layers.1.mlp.activation_fn", "ernie4_5": "model.layers.1.mlp.act_fn",
                                   "gemma3": "model.layers.1.mlp.act_fn"}),
    "norm_eps": ("norm_eps", {m: "model.layers.0.input_layernorm" for m in models.MODEL_NAMES}),
    "rope_base": ("rope_base", {m: "model.rotary_emb" for m in models.MODEL_NAMES}),
    "dropout_on": ("dropout", {m: "model.layers.0.self_attn" for m in models.MODEL_NAMES}),
}
CASES = [(m, b) for m in models.MODEL_NAMES for b in ("none", *SETUP_BUGS)]

#: The MindSpore corpus bugs that change the set-up (tests/ports/mindspore_job.py), on its one port.
MINDSPORE_MODEL = "phi3"
MINDSPORE_BUGS = ("lr", "wd_on_norms", "act_variant", "norm_eps")
MINDSPORE_CASES = [(MINDSPORE_MODEL, b) for b in ("none", *MINDSPORE_BUGS)]
_MINDSPORE_RUNS = importlib.util.find_spec("mindspore") is not None and int(np.__version__.split(".")[0]) < 2
needs_mindspore = pytest.mark.skipif(not _MINDSPORE_RUNS, reason="MindSpore is not installed, or numpy is 2.x "
                                     "(MindSpore's wheels are built against numpy 1.x)")


@pytest.fixture(scope="module")
def preflight_server():
    """Every case's session, filled by two job processes running side by side."""
    handle = serve(port=0, config=config_from_dict({"mapping": FUSED_MAPPING}))
    # The torch side attaches its (bug-free) baseline to every session.
    cases = {framework: [a for m, b in CASES for a in ("--case", f"{m}:{b}")] for framework in ("torch", "paddle")}
    if _MINDSPORE_RUNS:
        cases["mindspore"] = [a for m, b in MINDSPORE_CASES for a in ("--case", f"{m}:{b}")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    jobs = [subprocess.Popen([sys.executable, "-m", "tests.ports.preflight_job", "--framework", framework,
                              "--server", handle.address, *framework_cases], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for framework, framework_cases in cases.items()]
    outputs = [job.communicate(timeout=600)[0] for job in jobs]
    for job, out in zip(jobs, outputs):
        assert job.returncode == 0, out[-3000:]
    yield handle
    handle.stop(grace=0.5)


def _findings(handle, model: str, bug: str, candidate: str = "paddle") -> list[dict]:
    """The findings of one candidate run of a case's session."""
    runs = 3 if _MINDSPORE_RUNS and (model, bug) in MINDSPORE_CASES else 2
    deadline = time.monotonic() + 30
    while True:  # every run has closed; their set-ups were taken before their goodbyes
        report = handle.report(session_name(model, bug))
        if len(report["runs"]) == runs or time.monotonic() > deadline:
            return [f for f in report["preflight"] if f["candidate_run"] == candidate]
        time.sleep(0.05)


@pytest.mark.parametrize("model", models.MODEL_NAMES)
def test_a_faithful_port_has_no_preflight_warning(preflight_server, model):
    findings = _findings(preflight_server, model, "none")
    assert [f for f in findings if f["severity"] == "warning"] == [], findings


@pytest.mark.parametrize("model", models.MODEL_NAMES)
@pytest.mark.parametrize("bug", tuple(SETUP_BUGS))
def test_each_setup_bug_has_its_preflight_finding(preflight_server, model, bug):
    category, affected = SETUP_BUGS[bug]
    findings = _findings(preflight_server, model, bug)
    mine = [f for f in findings if f["category"] == category and f["severity"] == "warning"]
    assert mine, findings
    assert mine[0]["baseline"] != mine[0]["candidate"], mine
    if affected[model] is not None:
        assert any(affected[model] in f["affects"] for f in mine), mine
    else:
        assert mine[0]["affects"] == [], mine
    # Nothing else is blamed: every warning is about this bug's category (or the config key that set it).
    others = [f for f in findings if f["severity"] == "warning" and f["category"] not in (category, "config")]
    assert others == [], others


@needs_mindspore
def test_a_faithful_mindspore_port_has_no_preflight_warning(preflight_server):
    findings = _findings(preflight_server, MINDSPORE_MODEL, "none", "mindspore")
    assert [f for f in findings if f["severity"] == "warning"] == [], findings


@needs_mindspore
@pytest.mark.parametrize("bug", MINDSPORE_BUGS)
def test_each_mindspore_setup_bug_has_its_preflight_finding(preflight_server, bug):
    category, affected = SETUP_BUGS[bug]
    findings = _findings(preflight_server, MINDSPORE_MODEL, bug, "mindspore")
    mine = [f for f in findings if f["category"] == category and f["severity"] == "warning"]
    assert mine, findings
    assert mine[0]["baseline"] != mine[0]["candidate"], mine
    assert any(affected[MINDSPORE_MODEL] in f["affects"] for f in mine), mine  # the port's names are transformers'
    others = [f for f in findings if f["severity"] == "warning" and f["category"] != category]
    assert others == [], others
