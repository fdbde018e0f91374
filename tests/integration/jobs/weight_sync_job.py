"""A small model with fused projections, in torch (parts apart) or paddle (fused), trained under twinstep.

    python -m tests.integration.jobs.weight_sync_job --framework torch --baseline --server HOST:PORT --session S
    python -m tests.integration.jobs.weight_sync_job --framework paddle --server HOST:PORT --session S

torch keeps q/k/v and gate/up projections apart; paddle fuses them as
paddleformers does (qkv_proj grouped by KV head, up_gate_proj = [gate | up]),
so the two compute the same function from different parameters.  Each job
starts from its own random weights: the baseline shares them
(``share_weights``), the candidate loads them (``init_from_baseline``) and
nothing else makes the two agree.  ``--dump`` writes the parameters right
after attach (a candidate's: as loaded) in the job's own names and layouts.
A 1024 x 1024 weight (4 MiB) is larger than the test server's message limit.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

WIDTH, HEADS, KV_HEADS, HEAD_DIM, INTER, WIDE, CLASSES, BATCH = 32, 4, 2, 4, 64, 1024, 10, 8
LR = 0.05


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([7, step])
    return rng.standard_normal((BATCH, WIDTH)).astype(np.float32), rng.integers(0, CLASSES, BATCH).astype(np.int64)


def torch_job(seed: int):
    import torch

    torch.set_num_threads(1)
    nn = torch.nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(WIDTH, HEADS * HEAD_DIM)
            self.k_proj = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM)
            self.v_proj = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM)
            self.o_proj = nn.Linear(WIDTH, WIDTH)  # square

        def forward(self, x):
            return self.o_proj(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1))

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(WIDTH, INTER, bias=False), nn.Linear(WIDTH, INTER, bias=False)
            self.down_proj = nn.Linear(INTER, WIDTH, bias=False)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.mlp = Attention(), Mlp()
            self.wide = nn.Sequential(nn.Linear(WIDTH, WIDE), nn.Tanh(), nn.Linear(WIDE, WIDE), nn.Tanh(),
                                      nn.Linear(WIDE, WIDTH))
            self.head = nn.Linear(WIDTH, CLASSES)

        def forward(self, x):
            x = x + self.attn(x)
            x = x + self.mlp(x)
            return self.head(x + self.wide(x))

    torch.manual_seed(seed)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def train_step(step: int):
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        return loss

    def state() -> dict[str, np.ndarray]:
        return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}

    return model, train_step, opt.zero_grad, state


def paddle_job(seed: int):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import paddle

    paddle.set_device("cpu")
    nn = paddle.nn
    group = (HEADS // KV_HEADS) * HEAD_DIM

    class Attention(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj = nn.Linear(WIDTH, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
            self.o_proj = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            # Columns grouped by KV head: [q heads of group g, k_g, v_g] per g (paddleformers' layout).
            qkv = self.qkv_proj(x).reshape([-1, KV_HEADS, group + 2 * HEAD_DIM])
            q = qkv[:, :, :group].reshape([-1, HEADS * HEAD_DIM])
            k = qkv[:, :, group:group + HEAD_DIM].reshape([-1, KV_HEADS * HEAD_DIM])
            v = qkv[:, :, group + HEAD_DIM:].reshape([-1, KV_HEADS * HEAD_DIM])
            return self.o_proj(paddle.concat([q, k, v], axis=-1))

    class Mlp(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.up_gate_proj = nn.Linear(WIDTH, 2 * INTER, bias_attr=False)  # [gate | up]
            self.down_proj = nn.Linear(INTER, WIDTH, bias_attr=False)

        def forward(self, x):
            gate, up = paddle.split(self.up_gate_proj(x), 2, axis=-1)
            return self.down_proj(paddle.nn.functional.silu(gate) * up)

    class Model(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.mlp = Attention(), Mlp()
            self.wide = nn.Sequential(nn.Linear(WIDTH, WIDE), nn.Tanh(), nn.Linear(WIDE, WIDE), nn.Tanh(),
                                      nn.Linear(WIDE, WIDTH))
            self.head = nn.Linear(WIDTH, CLASSES)

        def forward(self, x):
            x = x + self.attn(x)
            x = x + self.mlp(x)
            return self.head(x + self.wide(x))

    paddle.seed(seed)
    model = Model()
    opt = paddle.optimizer.SGD(learning_rate=LR, parameters=model.parameters())

    def train_step(step: int):
        x, y = batch(step)
        loss = paddle.nn.functional.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        return loss

    def state() -> dict[str, np.ndarray]:
        return {n: p.numpy().copy() for n, p in model.named_parameters()}

    return model, train_step, opt.clear_grad, state


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("torch", "paddle"), required=True)
    p.add_argument("--baseline", action="store_true", help="the baseline, sharing its weights")
    p.add_argument("--server", required=True)
    p.add_argument("--session", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump", help="write the parameters after attach (.npz)")
    args = p.parse_args()
    model, train_step, zero_grad, state = (torch_job if args.framework == "torch" else paddle_job)(args.seed)
    import twinstep

    role = {"baseline": True, "share_weights": True} if args.baseline else {"init_from_baseline": True,
                                                                           "init_timeout": 120}
    mon = twinstep.attach(model, session=args.session, run=args.framework, server=args.server, **role)
    if args.dump:
        np.savez(args.dump, **state())
    for step in range(args.steps):
        loss = train_step(step)
        print(f"[{args.framework}] step {step} loss {float(loss.item()):.6f}", flush=True)
        mon.step(loss=loss)
        zero_grad()
    mon.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
