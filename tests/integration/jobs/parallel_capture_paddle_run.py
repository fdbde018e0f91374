"""Run by test_capture_parallel.py: two real paddle processes over gloo on the CPU, captured by twinstep.

``python parallel_capture_paddle_run.py CASE OUTDIR``; each rank writes ``OUTDIR/rank<r>.json``.

- ``dp``: a plain model in ``paddle.DataParallel``, each rank fed its own batch: one captured step.
- ``fleet``: ``fleet.init`` with model parallelism 2 and fleet's ColumnParallelLinear and
  RowParallelLinear.  paddle has no CPU kernel for their forward (``c_identity``), so only what
  needs none is captured: the layout, the layers' splits, and the parameters' records.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import paddle
import paddle.distributed as dist

BATCH, WIDTH, HIDDEN = 4, 16, 64


def placements(recorder, batch) -> list[dict]:
    from twinstep.v1 import twinstep_pb2 as pb

    modules = {m.id: m.name for m in recorder.take_new_modules()}
    params = {p.id: p.name for p in recorder.parameter_infos}
    out = []
    for record, block in batch.placements:
        phase, target = int(batch.phase[record]), int(batch.target[record])
        name = params[target] if phase in (pb.GRAD, pb.PARAM) else "" if phase == pb.LOSS else modules[target]
        out.append({"phase": pb.Phase.Name(phase).lower(), "name": name, "shape": list(batch.dims_of(record)),
                    "kind": int(block.kind), "global_shape": list(block.global_shape), "offset": list(block.offset),
                    "scale": block.scale, "split_by": block.split_by})
    return out


def main(case: str, outdir: str) -> None:
    from twinstep.runtime.capture import CaptureConfig, Recorder, backend_for, placement

    if case == "fleet":
        from paddle.distributed import fleet

        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "pp_degree": 1}
        fleet.init(is_collective=True, strategy=strategy)
        from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear

        class Model(paddle.nn.Layer):
            def __init__(self) -> None:
                super().__init__()
                self.up = ColumnParallelLinear(WIDTH, HIDDEN, gather_output=False, has_bias=True)
                self.down = RowParallelLinear(HIDDEN, WIDTH, input_is_parallel=True, has_bias=True)

        model = wrapper = Model()
    else:
        dist.init_parallel_env()
        paddle.seed(0)
        model = paddle.nn.Sequential(paddle.nn.Linear(WIDTH, 8), paddle.nn.Tanh(), paddle.nn.Linear(8, 3))
        wrapper = paddle.DataParallel(model)
    rank = dist.get_rank()
    backend = backend_for(model)
    layout = placement.find_layout(backend, model, rank=rank, world_size=2)
    recorder = Recorder(model, backend, CaptureConfig(), layout=layout)
    found: dict = {"layout": placement.layout_dict(layout) if layout is not None else None}
    if case == "fleet":
        found["splits"] = {name: [None if s is None else [s.dim, s.size, s.offset] for s in
                                  backend.module_split(getattr(model, name), layout)] for name in ("up", "down")}
        batch = recorder.finish_step(0, None)  # parameters only: no CPU forward for fleet's layers
    else:
        paddle.seed(100 + rank)
        loss = wrapper(paddle.randn([BATCH, WIDTH])).square().mean()
        loss.backward()
        batch = recorder.finish_step(0, loss)
    found["placements"] = placements(recorder, batch)
    found["failures"] = [f"{f.name}: {f.error}" for f in recorder.health.snapshot().failures]
    recorder.remove()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    dist.spawn(main, args=(sys.argv[1], sys.argv[2]), nprocs=2, backend="gloo")
