"""Run a transformers baseline and its paddleformers port against one server; the bug corpus.

Used by tests/ports/test_ports.py and benchmarks/localization.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from tests.ports import models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: paddleformers fuses q/k/v and gate/up where transformers keeps them apart (Ernie4_5, Gemma3).
#: Layouts as models.fuse_qkv / fuse_gate_up: qkv_proj's columns are grouped by KV head
#: ([q heads of group g, k_g, v_g] per g: groups = KV heads); up_gate_proj is [gate | up].
FUSED_MAPPING: dict[str, Any] = {
    "fused": [
        {"candidate": r"model\.layers\.(\d+)\.self_attn\.qkv_proj",
         "baseline": [r"model.layers.\1.self_attn.q_proj", r"model.layers.\1.self_attn.k_proj", r"model.layers.\1.self_attn.v_proj"],
         "groups": models.KV_HEADS},
        {"candidate": r"model\.layers\.(\d+)\.mlp\.up_gate_proj",
         "baseline": [r"model.layers.\1.mlp.gate_proj", r"model.layers.\1.mlp.up_proj"]},
    ],
    # Gemma3's q/k norms: paddle [B,S,H,D], torch [B,H,S,D] (transposed before the norm in torch).
    "permuted": [r"model\.layers\.\d+\.self_attn\.[qk]_norm"],
}


def job_commands(model: str, server: str, session: str, steps: int, tmp: str, bug: str | None = None,
                 capture: str = "stats", reference: bool = False, embed_std: float | None = None,
                 warmup: int = 0) -> list[list[str]]:
    """Baseline (torch), candidate (paddle) and, with ``reference``, a second torch run measuring noise.

    ``embed_std`` goes to the torch jobs, which make the weights (the paddle job reads them from the
    file); ``warmup`` to every job alike.
    """
    weights = os.path.join(tmp, f"{session}.npz")
    common = ["--model", model, "--server", server, "--session", session, "--steps", str(steps), "--capture", capture]
    common += ["--warmup", str(warmup)] if warmup else []
    made = ["--embed-std", repr(embed_std)] if embed_std is not None else []
    base = [sys.executable, "-m", "tests.ports.torch_job", "--baseline", *common, *made, "--weights", weights]
    cand = [sys.executable, "-m", "tests.ports.paddle_job", *common, "--weights", weights] + (["--bug", bug] if bug else [])
    commands = [base, cand]
    if reference:
        rerun = os.path.join(tmp, f"{session}-rerun.npz")
        commands.append([sys.executable, "-m", "tests.ports.torch_job", "--reference", "--run", "rerun", *common,
                         *made, "--weights", rerun])
    return commands


def run_pair(server: str, session: str, model: str, steps: int, bug: str | None = None, capture: str = "stats",
             reference: bool = False, embed_std: float | None = None, warmup: int = 0) -> list[str]:
    """Train the jobs to the end; returns their outputs (raises if one fails)."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for cmd in job_commands(model, server, session, steps, tmp, bug, capture, reference, embed_std,
                                         warmup)]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
        for p, out in zip(procs, outputs):
            if p.returncode != 0:
                raise RuntimeError(f"job failed ({p.returncode}):\n{out[-3000:]}")
        return outputs


@dataclass
class PortCase:
    model: str
    bug: str | None
    expected: tuple[int, str, str] | None  # (step, phase, torch module) or None for a faithful port
    reference: bool = False  # add a reference rerun of the baseline (noise bands)
    embed_std: float | None = None  # initial embedding std (--embed-std); None: the default 0.02
    warmup: int = 0  # linear learning-rate warmup of both jobs (--warmup); 0: none

    @property
    def name(self) -> str:
        extra = "" if self.embed_std is None else f" embed-std={self.embed_std:.3g}"
        extra += f" warmup={self.warmup}" if self.warmup else ""
        return f"{self.model} {self.bug or 'faithful'}{extra}" + (" +reference" if self.reference else "")

    #: Server config the ports need (fused projections, permuted norms).
    config = {"mapping": FUSED_MAPPING}

    def commands(self, server: str, session: str, steps: int, tmp: str) -> list[list[str]]:
        return job_commands(self.model, server, session, steps, tmp, self.bug, reference=self.reference,
                            embed_std=self.embed_std, warmup=self.warmup)


def _expected(bug: str, model: str) -> tuple[int, str, str]:
    """The origin; outside forward only step and phase are asserted (the first record may be another parameter)."""
    step, phase, module, _ = models.EXPECTED_ORIGIN[bug][model]
    return step, phase, module if phase == "forward" else "*"


#: Bugs whose origin crosses a default statistics tolerance at the origin itself.
DETECTABLE = ("norm_eps", "act_variant", "attn_scale", "untransposed", "dropout_on", "lr", "grad_clip")

#: Bugs under every flat tolerance at their origin, found against a reference rerun's noise band.
NEED_REFERENCE = ("wd_on_norms", "rope_base", "adam_eps")

#: Bugs that porting guides list, on the baseline's default set-up: a loss divided before backward,
#: labels shifted twice, Adam's beta2, the other rotary convention in one layer, one layer without its
#: causal mask, one layer's output in bfloat16. All but adam_betas cross a default tolerance at their origin.
GUIDE = ("loss_scale", "label_shift", "adam_betas", "rotary_interleaved", "causal_mask", "layer_bf16")

#: A warmup schedule one step ahead: both jobs train under a linear warmup (--warmup).
SCHEDULED = ("lr_schedule",)

#: Bugs run with the embeddings at models.unit_embed_std (a residual stream of order 1, --embed-std),
#: where their origin lies under every flat tolerance (models.EXPECTED_ORIGIN_UNIT_RESIDUAL).
UNIT_RESIDUAL = ("norm_eps",)


def _expected_unit_residual(bug: str, model: str) -> tuple[int, str, str]:
    step, phase, module, _ = models.EXPECTED_ORIGIN_UNIT_RESIDUAL[bug][model]
    return step, phase, module if phase == "forward" else "*"


CASES = (
    [PortCase(m, None, None) for m in models.MODEL_NAMES]
    + [PortCase(m, None, None, reference=True) for m in models.MODEL_NAMES]
    + [PortCase(m, bug, _expected(bug, m)) for bug in (*DETECTABLE, "custom_backward", "batch_order") for m in models.MODEL_NAMES]
    + [PortCase(m, bug, _expected(bug, m), reference=True) for bug in NEED_REFERENCE for m in models.MODEL_NAMES]
    + [PortCase(m, bug, _expected(bug, m)) for bug in GUIDE for m in models.MODEL_NAMES]
    + [PortCase(m, bug, _expected(bug, m), warmup=models.SCHEDULE_WARMUP)
       for bug in SCHEDULED for m in models.MODEL_NAMES]
    + [PortCase(m, None, None, embed_std=models.unit_embed_std(m)) for m in models.MODEL_NAMES]
    + [PortCase(m, bug, _expected_unit_residual(bug, m), embed_std=models.unit_embed_std(m))
       for bug in UNIT_RESIDUAL for m in models.MODEL_NAMES]
)


# ------------------------------------------------------------------ MindSpore candidate
# transformers' Phi3 (torch, the baseline) against the MindSpore port of tests/ports/mindspore_phi3.py.
# The port names its modules as transformers does, so no mapping is needed.

def mindspore_job_commands(model: str, server: str, session: str, steps: int, tmp: str, bug: str | None = None,
                           capture: str = "stats", reference: bool = False) -> list[list[str]]:
    """job_commands with the MindSpore port (tests.ports.mindspore_job) as the candidate."""
    commands = job_commands(model, server, session, steps, tmp, None, capture, reference)
    cand = [sys.executable, "-m", "tests.ports.mindspore_job", *commands[1][3:]] + (["--bug", bug] if bug else [])
    return [commands[0], cand, *commands[2:]]


def run_mindspore_pair(server: str, session: str, model: str, steps: int, bug: str | None = None,
                       capture: str = "stats", reference: bool = False) -> list[str]:
    """run_pair with the MindSpore port as the candidate."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for cmd in mindspore_job_commands(model, server, session, steps, tmp, bug, capture, reference)]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
        for p, out in zip(procs, outputs):
            if p.returncode != 0:
                raise RuntimeError(f"job failed ({p.returncode}):\n{out[-3000:]}")
        return outputs


@dataclass
class MindSporePortCase(PortCase):
    @property
    def name(self) -> str:
        return "mindspore " + super().name

    def commands(self, server: str, session: str, steps: int, tmp: str) -> list[list[str]]:
        return mindspore_job_commands(self.model, server, session, steps, tmp, self.bug, reference=self.reference)


def _expected_mindspore(bug: str) -> tuple[int, str, str]:
    step, phase, module, _ = models.EXPECTED_ORIGIN_MINDSPORE[bug]
    return step, phase, module if phase == "forward" else "*"


#: The corpus of the MindSpore port: bugs found at their origin on default tolerances, then the
#: one that needs the baseline's own noise band (a reference rerun), as for paddle.
MINDSPORE_DETECTABLE = ("norm_eps", "act_variant", "untransposed", "lr", "custom_backward", "batch_order")
MINDSPORE_CASES = (
    [MindSporePortCase("phi3", None, None)]
    + [MindSporePortCase("phi3", bug, _expected_mindspore(bug)) for bug in MINDSPORE_DETECTABLE]
    + [MindSporePortCase("phi3", "wd_on_norms", _expected_mindspore("wd_on_norms"), reference=True)]
)
