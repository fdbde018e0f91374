"""Run by test_capture_megatron.py: two real torch processes over gloo on the CPU, with Megatron-core's
tensor parallelism, captured by twinstep.

``python megatron_capture_run.py OUTDIR [SERVER]`` starts two processes (torch.multiprocessing, a
file rendezvous in OUTDIR: no port to race for).  Each initialises Megatron's parallel state with a
tensor-parallel size of 2 and builds a ``ColumnParallelLinear`` (``gather_output=False``), an
activation and a ``RowParallelLinear`` (``input_is_parallel=True``) on the CPU (Megatron's own
``use_cpu_initialization``), and a strided ``ColumnParallelLinear`` beside them (``stride=2``: each rank
holds two interleaved chunks of the logical outputs, not one block), then writes
``OUTDIR/rank<r>.json``: the records of two captured steps (phase, name, call, slot, shape,
placement, sketch), what could not be captured, the layout twinstep found, the sketches of the whole
weights (gathered from both ranks) and, with SERVER, the layout its Hello declared when attached to
it for two more steps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from parallel_capture_run import records  # the same record rows as the torch tensor-parallel cases

WORLD = 2
BATCH = 4
STEPS = 2
WIDTH, HIDDEN = 16, 64  # weights above a sketch's 256 buckets: they are sketched, by the logical tensor's index


def build_model():
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = ModelParallelConfig(tensor_model_parallel_size=WORLD, use_cpu_initialization=True)

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            init = torch.nn.init.xavier_normal_
            self.up = ColumnParallelLinear(WIDTH, HIDDEN, config=config, init_method=init, bias=True,
                                           gather_output=False)
            self.act = torch.nn.GELU()
            self.down = RowParallelLinear(HIDDEN, WIDTH, config=config, init_method=init, bias=True,
                                          input_is_parallel=True, skip_bias_add=False)
            self.fused = ColumnParallelLinear(WIDTH, HIDDEN, config=config, init_method=init, bias=True,
                                              gather_output=False, stride=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fused(x)  # recorded, then left unused: no gradient
            hidden, _ = self.up(x)
            out, _ = self.down(self.act(hidden))
            return out

    return Mlp()


def gathered(weight: torch.Tensor, dim: int) -> torch.Tensor:
    """The whole weight from every rank's block along ``dim``."""
    shards = [torch.empty_like(weight) for _ in range(WORLD)]
    dist.all_gather(shards, weight.detach().contiguous())
    return torch.cat(shards, dim=dim)


def run_rank(rank: int, outdir: str, server: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{outdir}/rendezvous", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from twinstep.runtime.capture import CaptureConfig, Recorder, backend_for, placement

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backend = backend_for(model)
    layout = placement.find_layout(backend, model, rank=rank, world_size=WORLD)
    recorder = Recorder(model, backend, CaptureConfig(sketch=True), layout=layout)
    generator = torch.Generator().manual_seed(0)  # tensor parallel: every rank sees the same batch
    found: dict = {"layout": None if layout is None else placement.layout_dict(layout), "steps": []}
    modules: dict[int, str] = {}
    for step in range(STEPS):
        loss = model(torch.randn(BATCH, WIDTH, generator=generator)).square().mean()
        loss.backward()
        opt.step()
        batch = recorder.finish_step(step, loss)
        found["steps"].append(records(recorder, batch, modules))
        opt.zero_grad()
        recorder.set_active(True, step + 1)
    recorder.remove()
    from twinstep.runtime.capture.torch.sketch import TorchSketcher
    from twinstep.wire.sketch import SketchSpec

    sketcher = TorchSketcher(SketchSpec())
    found["whole_sketches"] = {"up": sketcher.sketch(gathered(model.up.weight, 0)).tolist(),
                               "down": sketcher.sketch(gathered(model.down.weight, 1)).tolist()}
    found["failures"] = [f"{f.name or '(model)'}: {f.error}" for f in recorder.health.snapshot().failures]
    if server:
        import twinstep

        with twinstep.attach(model, session="megatron-tp", run="candidate", server=server, rank=rank,
                             world_size=WORLD) as mon:
            for step in range(STEPS):
                loss = model(torch.randn(BATCH, WIDTH, generator=generator)).square().mean()
                loss.backward()
                opt.step()
                mon.step(loss=loss)
                opt.zero_grad()
            found["hello_layout"] = None if mon.layout is None else placement.layout_dict(mon.layout)
        found["steps_sent"] = mon.stats.steps_sent
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    outdir = sys.argv[1]
    server = sys.argv[2] if len(sys.argv) > 2 else ""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(run_rank, args=(outdir, server), nprocs=WORLD)
