"""A small Llama-like model trained at a chosen parallel layout (torch only, CPU, gloo).

    python tests/integration/jobs/parallel_llama.py                          # one process: TP=1, DP=1
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/integration/jobs/parallel_llama.py --tp 2                      # tensor parallel
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/integration/jobs/parallel_llama.py --dp 2                      # data parallel (DDP)

(``--master_port PORT`` instead of ``--standalone`` works as well.)  twinstep is
attached when a session is named (``--session`` or ``TWINSTEP_SESSION``); the
run, the server and the baseline flag come from the options or their
``TWINSTEP_*`` variables, as ``twinstep.attach`` reads them.  Without a session
the job trains alone.

Every layout computes the same training: the weights come from one seeded
initialisation of the whole model, made before it is split; each step's global
batch comes from a generator seeded by the step.  Tensor parallelism splits
each layer with torch's own API (``parallelize_module``: q, k, v, gate and up
projections column-parallel, o and down projections row-parallel; embedding,
norms and lm_head replicated) and every tensor-parallel rank sees the whole
global batch.  Data parallelism (DistributedDataParallel) gives rank r the
rows [r*B/N, (r+1)*B/N) of the same global batch.

Bugs a port to another layout could carry (``--bug``):
  tp_heads_order   on tensor-parallel rank 1 only, the heads of q_proj's output are put in reverse order
                   before attention (a wrong head split)
  rowwise_bias     o_proj's bias added on every shard before the all-reduce: its output carries tp-1
                   extra copies of the bias (needs --o-bias)
  dp_group_size    gradients averaged over twice the data-parallel group (a DDP communication hook
                   dividing by 2*world)
  corrupt_replica  after backward, on the last data-parallel rank only, one element of one parameter's
                   gradient is changed (a replica silently corrupted)

Each rank writes a JSON summary to ``--result-dir`` (``RUN-rankR.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

BUGS = ("none", "tp_heads_order", "rowwise_bias", "dp_group_size", "corrupt_replica")
#: The parameter whose gradient --bug corrupt_replica changes, and how.
CORRUPTED = "model.layers.1.mlp.down_proj.weight"
CORRUPTION = 1.0


# -- the model ------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, o_bias: bool, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.theta = theta
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=o_bias)
        self.reverse_q_heads = False
        """--bug tp_heads_order: set on tensor-parallel rank 1 only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # The heads this rank holds: all of them at TP=1, its share on a tensor-parallel shard.
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(batch, seq, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.reverse_q_heads:
            q = q.flip(1)
        # Rotary position embedding and the causal mask, computed here as Llama's attention does.
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        mask = torch.full((seq, seq), float("-inf")).triu(1)
        probs = torch.softmax(scores + mask, dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(batch, seq, heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, width, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, width: int, heads: int, inner: int, o_bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(width)
        self.self_attn = Attention(width, heads, o_bias)
        self.post_attention_layernorm = RMSNorm(width)
        self.mlp = MLP(width, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, inner: int, layers: int, o_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(DecoderLayer(width, heads, inner, o_bias) for _ in range(layers))
        self.norm = RMSNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaLike(nn.Module):
    def __init__(self, vocab: int = 128, width: int = 64, heads: int = 4, inner: int = 128, layers: int = 2,
                 o_bias: bool = False) -> None:
        super().__init__()
        self.model = Decoder(vocab, width, heads, inner, layers, o_bias)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


# -- layouts --------------------------------------------------------------------------------------


def tensor_parallel(model: LlamaLike, tp: int) -> None:
    """Split every decoder layer over a tensor-parallel mesh of ``tp`` ranks, with torch's own API."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (tp,))
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def add_bias_on_every_shard(model: LlamaLike, tp: int) -> None:
    """--bug rowwise_bias: each o_proj's output gets tp-1 more copies of its bias, as if every shard had added it
    before the all-reduce (a forward hook after the row-parallel one, so it sees the reduced output)."""

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + (tp - 1) * _local(module.bias)

    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(hook)


def wrong_group_size_hook(state, bucket):  # no annotations: DDP checks them against its own classes
    """--bug dp_group_size: DDP's all-reduce of a gradient bucket, averaged over twice the group's size."""
    world = torch.distributed.get_world_size()
    buffer = bucket.buffer().div_(2 * world)
    future = torch.distributed.all_reduce(buffer, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


# -- data -----------------------------------------------------------------------------------------


def global_batch(step: int, batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch (input ids, next-token targets), the same at every layout."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


# -- training -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the number of processes)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (the number of processes)")
    p.add_argument("--bug", choices=BUGS, default="none")
    p.add_argument("--o-bias", action="store_true", help="o_proj with a bias (--bug rowwise_bias needs it)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--session", default=os.environ.get("TWINSTEP_SESSION"),
                   help="twinstep session (default $TWINSTEP_SESSION); none: train without twinstep")
    # Not --run: torch.distributed.run would take it for its own --run-path.
    p.add_argument("--run-name", default=None, help="twinstep run name (default $TWINSTEP_RUN)")
    p.add_argument("--server", default=None, help="comparison server host:port (default $TWINSTEP_SERVER)")
    p.add_argument("--baseline", action="store_true", default=None, help="this run is the baseline "
                   "(default $TWINSTEP_BASELINE)")
    p.add_argument("--capture", choices=("stats", "tensors", "lossy"), default=None)
    p.add_argument("--result-dir", default=None, help="each rank writes RUN-rankR.json here")
    p.add_argument("--quiet", action="store_true", help="no line per step")
    args = p.parse_args(argv)
    if args.tp > 1 and args.dp > 1:
        p.error("--tp and --dp together are not supported by this job: one of them must be 1")
    if args.bug == "rowwise_bias" and not args.o_bias:
        p.error("--bug rowwise_bias needs --o-bias (the bias it adds on every shard)")
    if args.bug in ("tp_heads_order", "rowwise_bias") and args.tp < 2:
        p.error(f"--bug {args.bug} is a tensor-parallel bug: it needs --tp 2 or more")
    if args.bug in ("dp_group_size", "corrupt_replica") and args.dp < 2:
        p.error(f"--bug {args.bug} is a data-parallel bug: it needs --dp 2 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp * args.dp:
        raise SystemExit(f"parallel_llama: --tp {args.tp} --dp {args.dp} needs {args.tp * args.dp} processes, "
                         f"launched with {world}")
    if world > 1:
        torch.distributed.init_process_group("gloo")

    torch.manual_seed(args.seed)  # the whole model, initialised before it is split: the same at every layout
    model = LlamaLike(o_bias=args.o_bias)
    trained: nn.Module = model
    if args.tp > 1:
        tensor_parallel(model, args.tp)
        if args.bug == "tp_heads_order" and rank == 1:
            for layer in model.model.layers:
                layer.self_attn.reverse_q_heads = True
        if args.bug == "rowwise_bias":
            add_bias_on_every_shard(model, args.tp)
    if args.dp > 1:
        trained = nn.parallel.DistributedDataParallel(model)
        if args.bug == "dp_group_size":
            trained.register_comm_hook(None, wrong_group_size_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    run = args.run_name or os.environ.get("TWINSTEP_RUN") or f"tp{args.tp}-dp{args.dp}"
    prefix = f"[{run}]" if world == 1 else f"[{run}:{rank}]"
    mon = None
    halted_type: object = ()  # catches nothing until twinstep is attached
    if args.session:
        import twinstep

        # After the layout is in place (parallelize_module, DDP), on the model itself: its names are the same at
        # every layout (DDP's wrapper would put "module." before them).
        mon = twinstep.attach(model, session=args.session, run=run, server=args.server, baseline=args.baseline,
                              capture=args.capture, optimizer=opt)
        halted_type = twinstep.Halted

    dp_rank = rank if args.dp > 1 else 0
    rows = slice(dp_rank * args.batch // args.dp, (dp_rank + 1) * args.batch // args.dp)
    corrupted = dict(model.named_parameters())[CORRUPTED]
    losses: list[float] = []
    halted, halt_step = False, None
    started = time.perf_counter()
    try:
        for step in range(args.steps):
            ids, targets = global_batch(step, args.batch, args.seq, 128, args.seed)
            ids, targets = ids[rows], targets[rows]
            logits = trained(ids)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            loss.backward()
            if args.bug == "corrupt_replica" and dp_rank == args.dp - 1:
                with torch.no_grad():
                    _local(corrupted.grad).view(-1)[0] += CORRUPTION
            opt.step()
            losses.append(float(loss.detach()))
            if not args.quiet:
                print(f"{prefix} step {step} loss {losses[-1]:.6f}", flush=True)
            if mon is not None:
                mon.step(loss=loss)
            opt.zero_grad()
    except halted_type as halt:  # type: ignore[misc]
        halted, halt_step = True, halt.step
        print(f"{prefix} halted at step {halt.step}: {halt.reason}", flush=True)
    finally:
        seconds = time.perf_counter() - started
        if mon is not None:
            mon.close()
        if world > 1:
            torch.distributed.destroy_process_group()
    print(f"{prefix} {len(losses)} steps in {seconds:.2f} s", flush=True)
    if args.result_dir:
        Path(args.result_dir).mkdir(parents=True, exist_ok=True)
        result = {"run": run, "rank": rank, "world": world, "tp": args.tp, "dp": args.dp, "bug": args.bug,
                  "losses": losses, "steps_completed": len(losses), "halted": halted, "halt_step": halt_step,
                  "seconds": seconds}
        (Path(args.result_dir) / f"{run}-rank{rank}.json").write_text(json.dumps(result))
    return 0



if __name__ == "__main__":
    sys.exit(main())
