"""Run by test_capture_parallel.py: real torch processes over gloo on the CPU, captured by twinstep.

``python parallel_capture_run.py CASE OUTDIR [SERVER]`` starts two processes (torch.multiprocessing,
a file rendezvous in OUTDIR: no port to race for) and each writes ``OUTDIR/rank<r>.json``: the
records of two captured steps (phase, name, call, slot, shape, placement), what could not be
captured, and the layout twinstep found.  Cases:

- ``tp``: a tiny attention-like block split by torch's tensor-parallel API (``parallelize_module``
  with ``ColwiseParallel`` q/k/v and a ``RowwiseParallel`` output projection, an activation between
  them) on a 1-D CPU device mesh; with SERVER, each rank then attaches to it for two steps.
- ``ddp``: a plain model wrapped in ``DistributedDataParallel``, each rank fed its own batch.
- ``tp_dp``: four processes on a 2-D mesh named ("dp", "tp"): the ``tp`` model split over "tp", each
  "dp" replica fed its own batch.
- ``local``: the ``tp`` model, captured with the layout settings of the environment (the test turns
  detection off: DTensors read as local shards, no placements).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

WORLD = 2
BATCH = 4
STEPS = 2
WIDTH, HIDDEN = 16, 64  # weights above a sketch's 256 buckets: they are sketched, by the logical tensor's index


class Block(torch.nn.Module):
    """q, k, v (split by columns), an activation of q, and o (split by rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(WIDTH, HIDDEN)
        self.k = torch.nn.Linear(WIDTH, HIDDEN)
        self.v = torch.nn.Linear(WIDTH, HIDDEN)
        self.act = torch.nn.GELU()
        self.o = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.act(self.q(x)) * self.k(x) + self.v(x))


class Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, 8)
        self.act = torch.nn.Tanh()
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def placement_of(p) -> dict | None:
    if p is None:
        return None
    return {"kind": {0: "block", 1: "partial", 2: "mean"}[int(p.kind)], "global_shape": list(p.global_shape),
            "offset": list(p.offset), "scale": p.scale, "split_by": p.split_by}


def records(recorder, batch, modules: dict[int, str]) -> list[dict]:
    from twinstep.v1 import twinstep_pb2 as pb

    modules.update({m.id: m.name for m in recorder.take_new_modules()})
    params = {p.id: p.name for p in recorder.parameter_infos}
    placed = {record: block for record, block in batch.placements}
    sketched = {} if batch.sketch_records is None else dict(zip(batch.sketch_records.tolist(), batch.sketches.tolist()))
    out = []
    for i, (phase, target, call, slot) in enumerate(zip(batch.phase, batch.target, batch.call_index, batch.slot)):
        phase = int(phase)
        name = (params[int(target)] if phase in (pb.GRAD, pb.PARAM) else "" if phase == pb.LOSS
                else modules[int(target)])
        block = placed.get(i)
        out.append({"phase": pb.Phase.Name(phase).lower(), "name": name, "call": int(call), "slot": int(slot),
                    "shape": list(batch.dims_of(i)),
                    "placement": None if block is None else placement_of(block.to_proto(i)),
                    "sketch": sketched.get(i)})
    return out


def run_rank(rank: int, case: str, outdir: str, server: str) -> None:
    world = 4 if case == "tp_dp" else WORLD
    dist.init_process_group("gloo", init_method=f"file://{outdir}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from twinstep.runtime.capture import CaptureConfig, Recorder, backend_for
    from twinstep.runtime.capture import placement

    torch.manual_seed(0)
    if case in ("tp", "local", "tp_dp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = Block()
        if case == "tp_dp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
        else:
            mesh = init_device_mesh("cpu", (WORLD,))
        parallelize_module(model, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                         "o": RowwiseParallel()})
        wrapper = model
    else:
        model = Plain()
        wrapper = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(wrapper.parameters(), lr=0.1)
    backend = backend_for(model)
    from twinstep.runtime import settings

    chosen = settings.resolve(environ=os.environ).settings  # the TWINSTEP_* variables the test sets (layout_detect)
    layout = placement.find_layout(backend, model, rank=rank, world_size=world, settings=chosen.layout)
    recorder = Recorder(model, backend, CaptureConfig(sketch=True), layout=layout)
    generator = torch.Generator().manual_seed({"ddp": rank, "tp_dp": rank // 2}.get(case, 0))
    found: dict = {"layout": None if layout is None else placement.layout_dict(layout), "steps": []}
    modules: dict[int, str] = {}
    for step in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=generator)
        loss = wrapper(x).square().mean()
        loss.backward()
        opt.step()
        batch = recorder.finish_step(step, loss)
        found["steps"].append(records(recorder, batch, modules))
        opt.zero_grad()
        recorder.set_active(True, step + 1)
    recorder.remove()
    if case == "tp":  # the sketches of the whole weights, for the test to add the ranks' sketches up to
        from twinstep.runtime.capture.torch.sketch import TorchSketcher
        from twinstep.wire.sketch import SketchSpec

        sketcher = TorchSketcher(SketchSpec())
        found["whole_sketches"] = {name: sketcher.sketch(getattr(model, name).weight.full_tensor()).tolist()
                                   for name in ("q", "o")}
    found["failures"] = [f"{f.name or '(model)'}: {f.error}" for f in recorder.health.snapshot().failures]
    if server:
        import twinstep

        with twinstep.attach(model, session=f"parallel-{case}", run="candidate", server=server, rank=rank,
                             world_size=WORLD) as mon:
            for step in range(STEPS):
                loss = wrapper(torch.randn(BATCH, WIDTH, generator=generator)).square().mean()
                loss.backward()
                opt.step()
                mon.step(loss=loss)
                opt.zero_grad()
            found["hello_layout"] = None if mon.layout is None else placement.layout_dict(mon.layout)
        found["steps_sent"] = mon.stats.steps_sent  # closed: every step went out
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    case, outdir = sys.argv[1], sys.argv[2]
    server = sys.argv[3] if len(sys.argv) > 3 else ""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(run_rank, args=(case, outdir, server), nprocs=4 if case == "tp_dp" else WORLD)
