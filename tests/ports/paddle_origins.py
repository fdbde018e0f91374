"""Measure, outside twinstep, where each paddle porting bug first shows (models.EXPECTED_ORIGIN).

    python -m tests.ports.paddle_origins --model phi3 --bugs loss_scale,label_shift --steps 12
    python -m tests.ports.paddle_origins --model gemma3 --bugs norm_eps --unit-residual
    python -m tests.ports.paddle_origins --model phi3 --bugs lr_schedule --warmup 10

Each framework runs in its own process (``--dump``) with plain framework hooks, no twinstep:
the full first output tensor of every module (forward), the gradient reaching it (backward),
every parameter's gradient (grad) and value after the update (param), in execution order.
The paddle side is mapped onto torch's names and layouts: fused qkv_proj / up_gate_proj
outputs split into the q/k/v and gate/up outputs (models.split_qkv_output; [gate | up]),
Gemma's q/k norm outputs transposed to torch's [B, H, S, D], parameters and gradients through
models.paddle_to_torch. The faithful port's worst rel_l2 per record over ``--steps`` steps is
the noise floor; a bug's origin is its first record, in the order forward, loss, backward,
grad, param and execution order within a phase, whose rel_l2 exceeds 10x that floor (the
criterion of tests/ports/mindspore_origins.py). One paddle process dumps the faithful port and
every bug in turn (each a fresh model), so the frameworks are imported once per side.
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
from .full_tensors import dump_torch, first_tensor
from .mindspore_origins import _load, _rel_l2, _save, origin


def _paddle_records(spec: models.ModelSpec, name: str, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A paddle module's output (or output gradient) as torch-named records in torch layouts."""
    if spec.fused_qkv and name.endswith(".qkv_proj"):
        base = name[: -len("qkv_proj")]
        return [(base + f"{x}_proj", part) for x, part in zip("qkv", models.split_qkv_output(value))]
    if spec.fused_gate_up and name.endswith(".up_gate_proj"):
        base = name[: -len("up_gate_proj")]
        gate, up = np.split(value, 2, axis=-1)
        return [(base + "gate_proj", gate), (base + "up_proj", up)]
    if spec.name == "gemma3" and name.endswith(("self_attn.q_norm", "self_attn.k_norm")):
        value = np.swapaxes(value, 1, 2)  # paddle [B, S, H, D], torch [B, H, S, D]
    return [(models.torch_module_name(spec, name), value)]


def _dump_paddle(model: str, steps: int, weights: str, bug: str, warmup: int) -> dict[str, np.ndarray]:
    from .paddle_job import PaddlePort, wait_for_weights

    spec = models.spec(model)
    port = PaddlePort(spec, 0, wait_for_weights(weights, {"model": model, "seed": 0}), bug, warmup)
    paddle = port.paddle
    out: dict[str, np.ndarray] = {}
    step = [0]

    def put(phase: str, name: str, value: np.ndarray) -> None:
        for torch_name, part in _paddle_records(spec, name, value):
            out[f"{step[0]}|{phase}|{torch_name}"] = np.array(part, dtype=np.float32)

    def forward_hook(name: str) -> Any:
        def hook(layer: Any, args: Any, output: Any) -> None:
            t = first_tensor(output, paddle.Tensor)
            if t is None:
                return
            put("forward", name, t.detach().astype("float32").numpy())
            if not t.stop_gradient:
                t.register_hook(lambda g: put("backward", name, g.astype("float32").numpy()))
        return hook

    for name, layer in port.model.named_sublayers():
        layer.register_forward_post_hook(forward_hook(name))
    for s in range(steps):
        step[0] = s
        ids, tgt = port.batch(s)
        loss = port.train_step(ids, tgt)
        out[f"{s}|loss|loss"] = np.asarray(loss.numpy(), np.float32).reshape(1)
        named = dict(port.model.named_parameters())
        grads = models.paddle_to_torch(spec, {n: p.grad.numpy() for n, p in named.items() if p.grad is not None})
        params = models.paddle_to_torch(spec, {n: p.numpy() for n, p in named.items()})
        for n, g in grads.items():
            out[f"{s}|grad|{n}"] = np.ascontiguousarray(g)
        for n, v in params.items():
            out[f"{s}|param|{n}"] = np.ascontiguousarray(v)
        port.zero_grad()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.ports.paddle_origins", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=models.MODEL_NAMES, required=True)
    p.add_argument("--bugs", required=True, help="comma-separated paddle_job --bug names")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=0, help="--warmup of both jobs")
    p.add_argument("--unit-residual", action="store_true", help="embeddings at models.unit_embed_std (--embed-std)")
    p.add_argument("--dump", choices=("torch", "paddle"), help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)  # a path prefix: OUT.npz (torch), OUT-BUG.npz (paddle)
    args = p.parse_args(argv)
    embed_std = models.unit_embed_std(args.model) if args.unit_residual else None
    if args.dump == "torch":
        _save(f"{args.out}.npz", dump_torch(args.model, args.steps, args.weights, embed_std, args.warmup))
        return 0
    if args.dump == "paddle":
        for bug in ["none", *args.bugs.split(",")]:
            _save(f"{args.out}-{bug}.npz", _dump_paddle(args.model, args.steps, args.weights, bug, args.warmup))
        return 0

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bugs = args.bugs.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "w.npz")
        common = ["--model", args.model, "--bugs", args.bugs, "--steps", str(args.steps), "--warmup", str(args.warmup),
                  "--weights", weights] + (["--unit-residual"] if args.unit_residual else [])

        def dump(framework: str) -> None:
            done = subprocess.run([sys.executable, "-m", "tests.ports.paddle_origins", *common, "--dump", framework,
                                   "--out", os.path.join(tmp, framework)], cwd=root, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{framework} dump failed ({done.returncode}):\n{done.stderr[-3000:]}")

        dump("torch")
        dump("paddle")
        base = _load(os.path.join(tmp, "torch.npz"))
        faithful = _load(os.path.join(tmp, "paddle-none.npz"))
        floor: dict[str, float] = {}
        for key in faithful:
            if key in base:
                _, phase, name = key.split("|")
                floor[f"{phase}|{name}"] = max(floor.get(f"{phase}|{name}", 0.0), _rel_l2(base[key], faithful[key]))
        by_step: dict[int, float] = {}
        for key in faithful:
            if key in base:
                rel = _rel_l2(base[key], faithful[key])
                if rel < 1e-1:  # not a record the two libraries define differently (Gemma's scaled embeddings)
                    by_step[int(key.split("|")[0])] = max(by_step.get(int(key.split("|")[0]), 0.0), rel)
        missing = sorted({k.split("|", 1)[1] for k in base} - {k.split("|", 1)[1] for k in faithful})
        worst = max(floor.items(), key=lambda kv: kv[1] if kv[1] < 1e-2 else 0.0)
        print(f"{args.model} hidden {models.HIDDEN} {models.OPTIMIZER} embed_std {embed_std} warmup {args.warmup}: "
              f"faithful worst rel_l2 {worst[1]:.1e} ({worst[0]}) over {args.steps} steps; "
              f"records only in torch: {missing}")
        print("faithful worst rel_l2 per step: " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(by_step.items())))
        print(f"{'bug':20} {'step':>4} {'phase':9} {'record':45} {'rel_l2':>8} {'floor':>8}")
        for bug in bugs:
            found = origin(base, _load(os.path.join(tmp, f"paddle-{bug}.npz")), floor)
            print(f"{bug:20} " + ("not found" if found is None else
                                  f"{found[0]:>4} {found[1]:9} {found[2]:45} {found[3]:8.1e} "
                                  f"{floor.get(f'{found[1]}|{found[2]}', 0.0):8.1e}"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
