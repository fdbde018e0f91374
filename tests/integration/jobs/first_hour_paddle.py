"""A new user's paddle port of first_hour_torch.py, trained under twinstep with default settings.

    python -m tests.integration.jobs.first_hour_paddle --server HOST:PORT --session S --weights W.npz \
        [--steps 30] [--norm-eps 1e-6]

The same model (fc1, norm, act, fc2), loss, optimizer and batches as the torch
baseline, started from the weights the baseline writes to ``--weights``
(waited for, up to ``--wait`` seconds; Linear weights transposed: paddle
stores them [in, out]).  ``--norm-eps`` is the port's LayerNorm epsilon: the
baseline's 1e-5 by default (a faithful port); 1e-6 is the bug a port makes
when it copies another framework's default.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import numpy as np

from tests.integration.jobs.first_hour_torch import HIDDEN, IN, LR, NORM_EPS, OUT, batch

os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when paddle loads


def pair_commands(server: str, session: str, steps: int, weights: str,
                  norm_eps: float | None = None) -> list[list[str]]:
    """The torch baseline's and this port's command lines (run from the repository root)."""
    common = ["--server", server, "--session", session, "--steps", str(steps), "--weights", weights]
    port = [sys.executable, "-m", "tests.integration.jobs.first_hour_paddle", *common]
    if norm_eps is not None:
        port += ["--norm-eps", repr(norm_eps)]
    return [[sys.executable, "-m", "tests.integration.jobs.first_hour_torch", *common], port]


def read_weights(path: str, wait: float) -> dict[str, np.ndarray]:
    deadline = time.monotonic() + wait
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"no initial weights at {path} after {wait:.0f} s (is the torch baseline running?)")
        time.sleep(0.1)
    with np.load(path) as saved:
        return {name: saved[name] for name in saved.files}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True)
    p.add_argument("--session", required=True)
    p.add_argument("--run", default="paddle")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--weights", required=True, help="the baseline's initial weights (.npz), waited for")
    p.add_argument("--wait", type=float, default=180.0, help="seconds to wait for --weights")
    p.add_argument("--norm-eps", type=float, default=NORM_EPS, help="the LayerNorm epsilon (the baseline's: 1e-5)")
    args = p.parse_args()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No ccache found")
        import paddle

    import twinstep

    paddle.set_device("cpu")
    model = paddle.nn.Sequential(
        ("fc1", paddle.nn.Linear(IN, HIDDEN)),
        ("norm", paddle.nn.LayerNorm(HIDDEN, epsilon=args.norm_eps)),
        ("act", paddle.nn.GELU()),
        ("fc2", paddle.nn.Linear(HIDDEN, OUT)),
    )
    weights = read_weights(args.weights, args.wait)
    state = {}
    for name, value in weights.items():
        linear = name.startswith("fc") and name.endswith(".weight")
        state[name] = paddle.to_tensor(np.ascontiguousarray(value.T) if linear else value)
    missing, unexpected = model.set_state_dict(state)
    if missing or unexpected:
        raise SystemExit(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    opt = paddle.optimizer.Adam(learning_rate=LR, parameters=model.parameters())

    mon = twinstep.attach(model, session=args.session, run=args.run, baseline=False, server=args.server)
    for step in range(args.steps):
        x, y = batch(step)
        loss = paddle.nn.functional.mse_loss(model(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        mon.step(loss=loss)
        opt.clear_grad()
        print(f"[{args.run}] step {step} loss {float(loss.item()):.6f}", flush=True)
    mon.close()


if __name__ == "__main__":
    main()
