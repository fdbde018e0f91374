"""Measure, outside twinstep, where each MindSpore porting bug first shows (models.EXPECTED_ORIGIN_MINDSPORE).

    python -m tests.ports.mindspore_origins --steps 12      # prints the table

Each framework runs in its own process (``--dump``) with plain framework hooks, no
twinstep: the full first output tensor of every module (forward), the gradient
reaching it (backward), every parameter's gradient (grad) and value after the update
(param), in execution order. The faithful port's worst rel_l2 per record over
``--steps`` steps is the noise floor; a bug's origin is its first record, in the
order forward, loss, backward, grad, param and execution order within a phase,
whose rel_l2 exceeds 10x that floor.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from . import models
from .full_tensors import dump_torch
from .mindspore_job import BUGS

PHASES = ("forward", "loss", "backward", "grad", "param")


def _dump_mindspore(steps: int, weights: str, bug: str) -> dict[str, np.ndarray]:
    from .mindspore_job import MindSporePort
    from .mindspore_phi3 import RENAMED
    from .paddle_job import wait_for_weights

    port = MindSporePort(0, wait_for_weights(weights, {"model": "phi3", "seed": 0}), bug)
    ms = port.ms
    torch_name = {v: k for k, v in RENAMED.items()}
    out: dict[str, np.ndarray] = {}
    step = [0]

    def forward_hook(name: str) -> Any:
        def hook(cell: Any, inputs: Any, output: Any) -> None:
            t = output if isinstance(output, ms.Tensor) else next((o for o in output if isinstance(o, ms.Tensor)), None)
            if t is None:
                return
            out[f"{step[0]}|forward|{name}"] = t.asnumpy().astype(np.float32).copy()
            if getattr(t, "_requires_grad", False):
                t.register_hook(lambda g: out.__setitem__(f"{step[0]}|backward|{name}", g.asnumpy().copy()))
        return hook

    for name, cell in port.model.cells_and_names():
        if name:
            cell.register_forward_hook(forward_hook(name))
    captured: dict[str, Any] = {}
    port.opt.register_forward_pre_hook(lambda cell, inputs: captured.__setitem__("grads", inputs[0]))
    params = list(port.opt.parameters)
    for s in range(steps):
        step[0] = s
        ids, tgt = port.batch(s)
        loss = port.train_step(ids, tgt)
        out[f"{s}|loss|loss"] = np.asarray(loss.asnumpy(), np.float32).reshape(1)
        for p, g in zip(params, captured["grads"]):
            out[f"{s}|grad|{torch_name.get(p.name, p.name)}"] = g.asnumpy().copy()
        for p in params:
            out[f"{s}|param|{torch_name.get(p.name, p.name)}"] = p.asnumpy().copy()
    return out


def _save(path: str, dump: dict[str, np.ndarray]) -> None:
    """An .npz whose keys keep execution order (np.savez keeps insertion order; the order is stored too)."""
    np.savez(path, __order__=np.array(list(dump)), **{f"a{i}": v for i, v in enumerate(dump.values())})


def _load(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[f"a{i}"] for i, k in enumerate(z["__order__"].tolist())}


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(a64), 1e-30))


def origin(base: dict[str, np.ndarray], cand: dict[str, np.ndarray], floor: dict[str, float]) -> tuple | None:
    """(step, phase, name, rel_l2) of the first record over 10x its floor, or None."""
    by_step: dict[int, list[str]] = {}
    for key in cand:  # the candidate's execution order within a step
        s, phase, name = key.split("|")
        by_step.setdefault(int(s), []).append(key)
    for s in sorted(by_step):
        keys = sorted(by_step[s], key=lambda k: PHASES.index(k.split("|")[1]))  # stable: execution order kept
        for key in keys:
            if key not in base:
                continue
            _, phase, name = key.split("|")
            rel = _rel_l2(base[key], cand[key])
            if rel > 10 * floor.get(f"{phase}|{name}", 0.0) and rel > 1e-7:
                return s, phase, name, rel
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.ports.mindspore_origins", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dump", choices=("torch", "mindspore"), help=argparse.SUPPRESS)
    p.add_argument("--bug", default="none", help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dump == "torch":
        _save(args.out, dump_torch("phi3", args.steps, args.weights))
        return 0
    if args.dump == "mindspore":
        _save(args.out, _dump_mindspore(args.steps, args.weights, args.bug))
        return 0

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "w.npz")

        def dump(framework: str, bug: str = "none") -> dict[str, np.ndarray]:
            out = os.path.join(tmp, f"{framework}-{bug}.npz")
            subprocess.run([sys.executable, "-m", "tests.ports.mindspore_origins", "--dump", framework, "--bug", bug,
                            "--steps", str(args.steps), "--weights", weights, "--out", out], cwd=root, check=True,
                           stdout=subprocess.DEVNULL)
            return _load(out)

        base = dump("torch")
        faithful = dump("mindspore")
        floor: dict[str, float] = {}
        for key in faithful:
            if key in base:
                _, phase, name = key.split("|")
                floor[f"{phase}|{name}"] = max(floor.get(f"{phase}|{name}", 0.0), _rel_l2(base[key], faithful[key]))
        missing = sorted({k.split("|", 1)[1] for k in base} - {k.split("|", 1)[1] for k in faithful})
        print(f"faithful: worst rel_l2 {max(floor.values()):.1e} over {args.steps} steps; records only in torch: {missing}")
        print(f"{'bug':16} {'step':>4} {'phase':9} {'record':45} rel_l2")
        for bug in BUGS:
            if bug == "none":
                continue
            found = origin(base, dump("mindspore", bug), floor)
            print(f"{bug:16} " + ("not found" if found is None else
                                  f"{found[0]:>4} {found[1]:9} {found[2]:45} {found[3]:.1e}"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
