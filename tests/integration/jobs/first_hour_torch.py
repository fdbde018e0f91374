"""A new user's own small torch baseline, trained under twinstep with default settings.

    python -m tests.integration.jobs.first_hour_torch --server HOST:PORT --session S --weights W.npz [--steps 30]

Linear(16->32), LayerNorm(32), GELU, Linear(32->8) (fc1, norm, act, fc2), an MSE
loss, Adam at 1e-3.  The job keeps torch's own random initial weights and writes
them to ``--weights`` (an .npz in torch's names and layouts) once attached;
its twin, first_hour_paddle.py, starts from that file.  Both draw each step's
batch from ``batch(step)``.  attach is called as the README shows: a session,
a run name, baseline=True, the server; nothing else.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

IN, HIDDEN, OUT, BATCH = 16, 32, 8, 8
LR = 1e-3
NORM_EPS = 1e-5  # the baseline's LayerNorm epsilon (torch's default)


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s inputs and targets, the same numbers in both jobs."""
    rng = np.random.default_rng([2024, step])
    return (rng.standard_normal((BATCH, IN)).astype(np.float32),
            rng.standard_normal((BATCH, OUT)).astype(np.float32))


def write_weights(path: str, weights: dict[str, np.ndarray]) -> None:
    """Written whole or not at all: the twin polls for ``path`` and reads it once it exists."""
    partial = f"{path}.partial.npz"
    np.savez(partial, **weights)
    os.replace(partial, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True)
    p.add_argument("--session", required=True)
    p.add_argument("--run", default="torch")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--weights", required=True, help="where to write the initial weights (.npz)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch

    import twinstep

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(IN, HIDDEN))
    model.add_module("norm", torch.nn.LayerNorm(HIDDEN, eps=NORM_EPS))
    model.add_module("act", torch.nn.GELU())
    model.add_module("fc2", torch.nn.Linear(HIDDEN, OUT))
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    mon = twinstep.attach(model, session=args.session, run=args.run, baseline=True, server=args.server)
    # Written once attached, so the port (which waits for the file) joins the session after the baseline.
    write_weights(args.weights, {n: t.detach().numpy().copy() for n, t in model.state_dict().items()})
    for step in range(args.steps):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        mon.step(loss=loss)
        opt.zero_grad()
        print(f"[{args.run}] step {step} loss {loss.item():.6f}", flush=True)
    mon.close()


if __name__ == "__main__":
    main()
