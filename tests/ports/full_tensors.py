"""A torch port's every record over some steps, as full tensors (outside twinstep): the reference side of
python -m tests.ports.paddle_origins and python -m tests.ports.mindspore_origins."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import models


def first_tensor(output: Any, kind: type) -> Any:
    """The output itself, or the first ``kind`` tensor in a tuple, list or dict of outputs (None without)."""
    if isinstance(output, kind):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((o for o in values if isinstance(o, kind)), None)


def dump_torch(model: str, steps: int, weights: str, embed_std: float | None = None,
               warmup: int = 0) -> dict[str, np.ndarray]:
    """Train the torch port ``steps`` steps (writing its initial weights to ``weights`` for the other side) and
    keep every module output, output gradient, parameter gradient, parameter and loss, keyed "step|phase|name"."""
    from .torch_job import TorchPort

    port = TorchPort(models.spec(model), 0, embed_std, warmup)
    models.save_weights(weights, port.state(), {"model": model, "seed": 0})
    torch = port.torch
    out: dict[str, np.ndarray] = {}
    step = [0]

    def forward_hook(name: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            t = first_tensor(output, torch.Tensor)
            if t is None:
                return
            out[f"{step[0]}|forward|{name}"] = t.detach().float().numpy().copy()
            if t.requires_grad:
                t.register_hook(lambda g: out.__setitem__(f"{step[0]}|backward|{name}", g.float().numpy().copy()))
        return hook

    for name, module in port.model.named_modules():
        if name:
            module.register_forward_hook(forward_hook(name))
    for s in range(steps):
        step[0] = s
        ids, tgt = port.batch(s)
        loss = port.train_step(ids, tgt)
        out[f"{s}|loss|loss"] = loss.detach().numpy().reshape(1)
        for name, p in port.model.named_parameters():
            out[f"{s}|grad|{name}"] = p.grad.numpy().copy()
            out[f"{s}|param|{name}"] = p.detach().numpy().copy()
        port.zero_grad()
    return out
