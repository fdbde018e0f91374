"""paddle's parallel layouts as twinstep.runtime.capture.placement sees them.

- fleet's model-parallel layers (``paddle.distributed.fleet.meta_parallel``): a ColumnParallelLinear
  that does not gather its output holds a block of its outputs' last dimension; a RowParallelLinear
  whose input is parallel holds a block of its input's; parameters fleet marks ``is_distributed``
  hold a block along their ``split_axis`` (in paddle's stored layout: a Linear weight stays
  [in, out]).
- This rank's place: fleet's hybrid communicate group where ``fleet.init`` made one (model, data
  and sharding, pipeline and sequence-parallel degrees and ranks), else a process group of more
  than one rank (paddle.DataParallel) is data parallel.

paddle's auto-parallel distributed tensors (``shard_tensor``) are not read here: their records are
the local values paddle hands the hooks, sent as whole tensors.
"""

from __future__ import annotations

import sys
from typing import Any

import paddle

from twinstep.runtime.capture.placement import Layout, Split, wrapped_by


def module_split(module: Any, layout: Layout) -> tuple[Split | None, Split | None] | None:
    """fleet's column- and row-parallel linear layers, by their attributes."""
    kind = type(module).__name__
    if not getattr(module, "is_mp", False) or not kind.endswith(("ColumnParallelLinear", "RowParallelLinear")):
        return None
    # A ColumnParallelLinear keeps no rank of its own: the model-parallel group's is this rank's.
    world, rank = getattr(module, "world_size", None), getattr(module, "rank", layout.tensor_rank)
    if not isinstance(world, int) or not isinstance(rank, int):
        return None
    if kind.endswith("ColumnParallelLinear"):
        part = getattr(module, "output_size_per_partition", None)
        if getattr(module, "gather_output", False) or not isinstance(part, int):
            return None, None
        return Split(-1, part * world, part * rank), None
    part, size = getattr(module, "input_size_per_partition", None), getattr(module, "in_features", None)
    if not getattr(module, "input_is_parallel", False) or not isinstance(part, int) or not isinstance(size, int):
        return None, None
    return None, Split(-1, size, part * rank)


def parameter_split(parameter: Any, layout: Layout) -> Split | None:
    """A parameter fleet marks as one rank's part: ``is_distributed`` with its ``split_axis``."""
    axis = getattr(parameter, "split_axis", None)
    if getattr(parameter, "is_distributed", False) and isinstance(axis, int) and axis >= 0 and layout.tensor_size > 1:
        return Split(axis)
    return None


def detect(model: Any) -> Layout | None:
    dist = paddle.distributed
    if not dist.is_initialized():
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    fleet = sys.modules.get("paddle.distributed.fleet")
    hcg = getattr(getattr(fleet, "fleet", None), "_hcg", None) if fleet is not None else None
    if hcg is not None:
        def ask(name: str, default: int) -> int:
            getter = getattr(hcg, name, None)
            try:
                return int(getter()) if getter is not None else default
            except Exception:
                return default

        dp, sharding = ask("get_data_parallel_world_size", 1), ask("get_sharding_parallel_world_size", 1)
        # Sharded data parallelism (ZeRO) splits the batch as data parallelism does; fleet's data axis is outer.
        data_rank = ask("get_data_parallel_rank", 0) * sharding + ask("get_sharding_parallel_rank", 0)
        return Layout(data_rank=data_rank, data_size=dp * sharding,
                      tensor_rank=ask("get_model_parallel_rank", 0),
                      tensor_size=ask("get_model_parallel_world_size", 1),
                      pipeline_rank=ask("get_stage_id", 0), pipeline_size=ask("get_pipe_parallel_world_size", 1),
                      context_rank=ask("get_sep_parallel_rank", 0), context_size=ask("get_sep_parallel_world_size", 1),
                      source="paddle-fleet")
    if world > 1:  # no model parallelism: the ranks hold the same model and see different data
        wrapped = type(model).__name__ == "DataParallel" or wrapped_by(model, ("DataParallel",))
        return Layout(data_rank=rank, data_size=world, source="ddp" if wrapped else "world")
    return None
