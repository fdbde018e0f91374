"""torch's parallel layouts as twinstep.runtime.capture.placement sees them.

- DTensors (``torch.distributed.tensor``): read through their local shard; placed by their
  placements on their device mesh (Shard: a block, with ``compute_local_shape_and_global_offset``
  for uneven shards; Partial: a partial sum; Replicate: whole along that mesh dimension).
- torch's tensor-parallel API leaves plain local tensors between layers: the output of a Linear
  whose weight is a DTensor split by rows (``ColwiseParallel``) holds a block of its last
  dimension, as does the input of a Linear whose weight is split by columns (``RowwiseParallel``)
  and the output of an Embedding whose weight is split by columns.
- Megatron-core's ColumnParallelLinear / RowParallelLinear (by their attributes) and parameters
  it marks ``tensor_model_parallel`` with a ``partition_dim``.
- This rank's place: Megatron's parallel state where the training initialised it, else the
  DTensor meshes of the model's parameters (dimension names such as dp/tp/pp/cp/ep, or data and
  tensor, say which is which; an unnamed 1-D mesh is tensor parallel, or data parallel under
  FSDP), and a process group larger than the tensor and pipeline ones is data parallel.

Nothing here imports ``torch.distributed.tensor`` (half a second): a DTensor can exist only once
the training imported it, so its classes are looked up in ``sys.modules``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from twinstep.runtime.capture.placement import BLOCK, PARTIAL, REPLICATED, Block, Layout, Split, wrapped_by


#: Mesh dimension names -> the parallelism they carry (names not listed: by their first letters).
_ROLES = {"dp": "data", "data": "data", "ddp": "data", "fsdp": "data", "hsdp": "data", "dp_shard": "data",
          "dp_replicate": "data", "replicate": "data", "shard": "data", "batch": "data",
          "tp": "tensor", "tensor": "tensor", "mp": "tensor", "model": "tensor", "sp": "tensor",
          "pp": "pipeline", "pipeline": "pipeline", "pipe": "pipeline", "stage": "pipeline",
          "cp": "context", "context": "context", "ep": "expert", "expert": "expert"}
_PREFIXES = (("dp", "data"), ("data", "data"), ("fsdp", "data"), ("tp", "tensor"), ("tensor", "tensor"),
             ("pp", "pipeline"), ("pipe", "pipeline"), ("cp", "context"), ("context", "context"),
             ("ep", "expert"), ("expert", "expert"))
_ORDER = ("tensor", "data", "pipeline", "context", "expert")


def role_of(name: str | None, unnamed: str) -> str:
    """The parallelism a mesh dimension named ``name`` carries ("data", "tensor", ...)."""
    if not name:
        return unnamed
    key = name.lower()
    if key in _ROLES:
        return _ROLES[key]
    for prefix, role in _PREFIXES:
        if key.startswith(prefix):
            return role
    return key


def _dtensor_class() -> type | None:
    # torch >= 2.5 names it torch.distributed.tensor; 2.4 keeps it in torch.distributed._tensor
    for name in ("torch.distributed.tensor._api", "torch.distributed.tensor", "torch.distributed._tensor.api",
                 "torch.distributed._tensor"):
        found = getattr(sys.modules.get(name), "DTensor", None)
        if found is not None:
            return found
    return None


def _local_offsets():
    """compute_local_shape_and_global_offset, wherever this torch keeps it (2.4: torch.distributed._tensor)."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    return compute_local_shape_and_global_offset


def _async_collective_class() -> type | None:
    module = sys.modules.get("torch.distributed._functional_collectives")
    return getattr(module, "AsyncCollectiveTensor", None) if module is not None else None


def local_shard(tensor: Any) -> Any:
    """A DTensor's local shard; an asynchronous collective's result once complete; else the tensor."""
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(tensor, dtensor):
        local = getattr(tensor, "_local_tensor", None)  # the shard itself: to_local() adds an autograd node
        return local if local is not None else tensor.to_local()
    pending = _async_collective_class()
    if pending is not None and isinstance(tensor, pending):
        tensor.trigger_wait()  # torch's own first use would wait here too
        return tensor.elem
    return tensor


class TorchLayouts:
    """One backend's layout readers, with their caches (training thread only)."""

    def __init__(self) -> None:
        self.unnamed = "tensor"
        """The parallelism of an unnamed 1-D mesh: tensor (torch's TP API), or data under FSDP."""
        self._specs: dict[tuple, Block] = {}

    # -- DTensor placements ----------------------------------------------------------------------

    def tensor_placement(self, tensor: Any) -> Block | None:
        dtensor = _dtensor_class()
        if dtensor is None or not isinstance(tensor, dtensor):
            return None
        spec = tensor._spec
        key = (spec.mesh, tuple(spec.placements), tuple(spec.shape))
        found = self._specs.get(key)
        if found is None:
            found = self._specs[key] = self._placement(*key)
        return found

    def _placement(self, mesh: Any, placements: tuple, shape: tuple[int, ...]) -> Block:
        names = mesh.mesh_dim_names or (None,) * len(placements)
        roles = [role_of(names[d], self.unnamed) for d in range(len(placements))]
        partial = [roles[d] for d, p in enumerate(placements) if p.is_partial()]
        if partial:
            return Block(PARTIAL, shape, (0,) * len(shape), split_by=_joined(partial))
        sharded = [d for d, p in enumerate(placements) if not p.is_replicate()]
        if not sharded:
            return REPLICATED
        if any(type(placements[d]).__name__ == "_StridedShard" for d in sharded):
            # FSDP over a tensor-parallel shard: this rank's elements are not one block of the logical tensor.
            raise NotImplementedError("a DTensor sharded with strides (FSDP over tensor parallelism) is not one "
                                      "block of its logical tensor; its records are not captured")
        _, offset = _local_offsets()(shape, mesh, placements)
        return Block(BLOCK, shape, tuple(int(o) for o in offset), split_by=_joined(roles[d] for d in sharded))

    # -- tensor-parallel layers -------------------------------------------------------------------

    def module_split(self, module: torch.nn.Module, layout: Layout) -> tuple[Split | None, Split | None] | None:
        megatron = _megatron_split(module, layout)
        if megatron is not None:
            return megatron
        weight = module._parameters.get("weight") if isinstance(module, torch.nn.Module) else None
        dtensor = _dtensor_class()
        if weight is None or dtensor is None or not isinstance(weight, dtensor):
            return None
        if isinstance(module, torch.nn.Linear):
            shard = self._tensor_shard(weight)
            if shard is None:
                return None
            dim, size, offset = shard
            if dim == 0:  # split by output features: each rank computes a block of the outputs
                return Split(-1, size, offset), None
            return None, Split(-1, size, offset)  # split by input features: the input is a block, the sum whole
        if isinstance(module, torch.nn.Embedding):
            shard = self._tensor_shard(weight)
            if shard is not None and shard[0] == 1:
                return Split(-1, shard[1], shard[2]), None
        return None

    def _tensor_shard(self, weight: Any) -> tuple[int, int, int] | None:
        """(tensor dim, global size, this rank's offset) of a 2-D DTensor weight along the tensor-parallel mesh
        dimensions (the data-parallel ones, FSDP's, are gathered before the layer computes)."""
        compute_local_shape_and_global_offset = _local_offsets()
        try:
            from torch.distributed.tensor import Replicate
        except ImportError:  # torch 2.4
            from torch.distributed._tensor import Replicate

        spec = weight._spec
        mesh, placements, shape = spec.mesh, tuple(spec.placements), tuple(spec.shape)
        names = mesh.mesh_dim_names or (None,) * len(placements)
        kept = tuple(p if role_of(names[d], self.unnamed) == "tensor" else Replicate()
                     for d, p in enumerate(placements))
        dims = {p.dim for p in kept if p.is_shard()}
        if len(dims) != 1 or len(shape) != 2:
            return None
        dim = dims.pop() % 2
        _, offset = compute_local_shape_and_global_offset(shape, mesh, kept)
        return dim, shape[dim], int(offset[dim])

    def parameter_split(self, parameter: Any, layout: Layout) -> Split | None:
        """Megatron's marks: ``tensor_model_parallel`` and ``partition_dim`` (with a ``partition_stride`` above 1, the
        rank holds interleaved chunks of the logical tensor, not one block: left whole)."""
        if (getattr(parameter, "tensor_model_parallel", False) and layout.tensor_size > 1
                and getattr(parameter, "partition_stride", 1) == 1):
            dim = getattr(parameter, "partition_dim", None)
            if isinstance(dim, int) and dim >= 0:
                return Split(dim)
        return None

    # -- this rank's place ------------------------------------------------------------------------

    def detect(self, model: torch.nn.Module) -> Layout | None:
        dist = torch.distributed
        if not dist.is_available() or not dist.is_initialized():
            return None
        world, rank = dist.get_world_size(), dist.get_rank()
        megatron = _megatron_layout()
        if megatron is not None:
            return megatron
        types = {type(m).__name__ for m in model.modules()}
        fsdp = any(t.startswith("FSDP") or t == "FullyShardedDataParallel" for t in types)
        wrapped = "DistributedDataParallel" in types
        sizes: dict[str, tuple[int, int]] = {}  # role -> (size, rank)
        source = ""
        mesh = self._model_mesh(model)
        if mesh is not None:
            coordinate = mesh.get_coordinate()
            names = mesh.mesh_dim_names
            if fsdp and not names and mesh.ndim == 1:
                self.unnamed = "data"
            if coordinate is not None:
                for d in range(mesh.ndim):
                    role = role_of(names[d] if names else None, self.unnamed)
                    size, at = sizes.get(role, (1, 0))
                    sizes[role] = (size * mesh.size(d), at * mesh.size(d) + coordinate[d])
                source = "dtensor" if names or fsdp else "torch-tp"
        tensor = sizes.get("tensor", (1, 0))
        pipeline = sizes.get("pipeline", (1, 0))
        context = sizes.get("context", (1, 0))
        expert = sizes.get("expert", (1, 0))
        data = sizes.get("data")
        others = tensor[0] * pipeline[0] * context[0]
        if data is None and world > others and world % others == 0:
            # The ranks that hold the same model part see different data: Megatron's order, tensor fastest.
            size = world // others
            data = (size, (rank // (tensor[0] * context[0])) % size)
            if not source:
                wrapped = wrapped or wrapped_by(model, ("DistributedDataParallel",))
                source = "ddp" if wrapped else "world"
        elif data is None:
            data = (1, 0)
        if wrapped and not source:
            source = "ddp"
        return Layout(data_rank=data[1], data_size=data[0], tensor_rank=tensor[1], tensor_size=tensor[0],
                      pipeline_rank=pipeline[1], pipeline_size=pipeline[0], context_rank=context[1],
                      context_size=context[0], expert_rank=expert[1], expert_size=expert[0], source=source)

    @staticmethod
    def _model_mesh(model: torch.nn.Module) -> Any:
        """The device mesh of the model's DTensor parameters (the root mesh of a sub-mesh where torch keeps it)."""
        dtensor = _dtensor_class()
        if dtensor is None:
            return None
        found = None
        for parameter in model.parameters():
            if isinstance(parameter, dtensor):
                mesh = parameter._spec.mesh
                if found is None or mesh.ndim > found.ndim:
                    found = mesh
        if found is None:
            return None
        try:
            own = getattr(found, "_get_root_mesh", None)  # torch >= 2.9; earlier, the mesh resources' helper
            if own is not None:
                root = own()
            else:
                from torch.distributed.device_mesh import _mesh_resources

                root = _mesh_resources.get_root_mesh(found)
            if root is not None and root.ndim > found.ndim and root.mesh_dim_names:
                return root
        except Exception:  # a torch without either helper: the parameters' own mesh
            pass
        return found


def _joined(roles: Any) -> str:
    unique = sorted(set(roles), key=lambda r: _ORDER.index(r) if r in _ORDER else len(_ORDER))
    return "+".join(unique)


# -- Megatron-core (where the training imported and initialised it) -------------------------------------


def _megatron_state() -> Any:
    state = sys.modules.get("megatron.core.parallel_state")
    try:
        if state is None or not state.model_parallel_is_initialized():
            return None
    except Exception:
        return None
    return state


def _megatron_layout() -> Layout | None:
    state = _megatron_state()
    if state is None:
        return None

    def ask(name: str, default: int) -> int:
        getter = getattr(state, name, None)
        try:
            return int(getter()) if getter is not None else default
        except Exception:
            return default

    return Layout(tensor_rank=ask("get_tensor_model_parallel_rank", 0),
                  tensor_size=ask("get_tensor_model_parallel_world_size", 1),
                  pipeline_rank=ask("get_pipeline_model_parallel_rank", 0),
                  pipeline_size=ask("get_pipeline_model_parallel_world_size", 1),
                  data_rank=ask("get_data_parallel_rank", 0), data_size=ask("get_data_parallel_world_size", 1),
                  context_rank=ask("get_context_parallel_rank", 0),
                  context_size=ask("get_context_parallel_world_size", 1),
                  expert_rank=ask("get_expert_model_parallel_rank", 0),
                  expert_size=ask("get_expert_model_parallel_world_size", 1), source="megatron")


def _megatron_split(module: Any, layout: Layout) -> tuple[Split | None, Split | None] | None:
    """Megatron-core's column- and row-parallel linear layers (and Transformer Engine's), by their attributes."""
    kind = type(module).__name__
    if layout.tensor_size <= 1 or not kind.endswith(("ColumnParallelLinear", "RowParallelLinear")):
        return None
    if getattr(getattr(module, "weight", None), "partition_stride", 1) != 1:
        return None, None  # a strided layer: each rank holds interleaved chunks of the features, not one block
    if kind.endswith("ColumnParallelLinear"):
        if getattr(module, "gather_output", False):
            return None, None
        part = getattr(module, "output_size_per_partition", None)
        size = getattr(module, "output_size", None)
        if isinstance(part, int) and isinstance(size, int):
            return Split(-1, size, part * layout.tensor_rank), None
        return Split(-1), None
    if not getattr(module, "input_is_parallel", True):
        return None, None
    part = getattr(module, "input_size_per_partition", None)
    size = getattr(module, "input_size", None)
    if isinstance(part, int) and isinstance(size, int):
        return None, Split(-1, size, part * layout.tensor_rank)
    return None, Split(-1)
