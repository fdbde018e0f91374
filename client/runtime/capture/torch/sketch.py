"""Count-sketches of torch tensors on their device (see :mod:`twinstep.wire.sketch`).

No host sync.  Chunk by chunk (~1M elements), the blocks are multiplied by the
sign pattern into a reused scratch buffer and summed row-wise into bags by one
``embedding_bag`` (a gather-and-sum vectorised over a block); the bags add up in
float64 and fold into ``2 * buckets`` sign-folded bins, where the few leftover
elements land through ``scatter_add_``.  Tables come from ``twinstep.wire.sketch`` in
numpy and are uploaded once per (device, element count, offset).

A shard (``block=(global_shape, offsets)``) is keyed by its elements' indices
in the logical tensor.  One that is a contiguous range of the canonical order
(a dim-0 shard, leading dims of one element) is the ``offset`` path above.
Any other block (a last-dim shard, a transposed [in, out] shard split on
``in``) goes element by element: each element is added into float32 cells
(~64 per cell, like the bags) by one ``index_add_``, then the cells add up in
float64.  The element-to-cell table (int32: 4 bytes of device memory per
element, 16 MiB for a 4096x1024 shard, built on the host once, ~0.2-0.8 s per
4M elements) is cached per (device, geometry) within ``max_table_bytes`` (LRU,
with the offset plans); a block of more than ``max_table_elements`` (16M) or
whose table would not fit the budget is hashed on the device at every call
instead (~35 int64 operations per element: no table, no host work; slow on a
CPU, ~100 ns per element, 40-100x the table path; on an accelerator ~35
elementwise kernels per 1M elements, not measured here).

Precision: float16/bfloat16 are widened to float32 and integers to float64
first (a copy); a bag sums ~30 float32 blocks before the float64 sum (bucket
error ~1e-7 relative).  A transposed tensor is copied to canonical order
first.  A NaN or Inf makes the one bucket it falls in NaN or Inf; the server
leaves such buckets out (``twinstep.server.compare.sketch``).

Not thread-safe (one scratch buffer per device): call it from one thread, as
the capture hooks do.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from twinstep.wire import sketch as _sketch
from twinstep.wire.sketch import Block, SketchSpec

_WIDEN = (torch.float16, torch.bfloat16)


class _Tables(NamedTuple):
    """Device side of a :class:`twinstep.wire.sketch.Plan` (its host arrays are dropped)."""

    head: int
    tail: int
    blocks: int
    chunks: int
    direct: torch.Tensor  # int64 folded bins of the element-by-element part
    order: torch.Tensor  # int32 chunk-local blocks sorted by bag, chunk after chunk
    bag_offsets: torch.Tensor  # int32 [chunks, 2*buckets] start of each bag in its chunk's order
    owned: int  # device bytes this entry holds (a slice of the shared direct table: 0)


class _Elements(NamedTuple):
    """Device side of ``twinstep.wire.sketch.block_cells``: a block that is not one contiguous range."""

    cells: torch.Tensor  # int32 cell of every element, canonical local order
    owned: int  # device bytes: 4 per element


class TorchSketcher:
    """Sketches torch tensors with device tables cached per (device, numel, offset) or (device, block).

    ``max_plans`` and ``max_table_bytes`` bound the cache (least recently used
    first), so dynamic shapes (a growing sequence length, shards at many
    offsets) cannot grow it without limit; an evicted table is rebuilt on the
    host.  Blocks above ``max_table_elements`` (or a quarter of
    ``max_table_bytes``) are hashed on the device at every call, uncached.
    """

    framework = "torch"

    def __init__(self, spec: SketchSpec = SketchSpec(), max_plans: int = 256, max_table_bytes: int = 512 << 20,
                 max_table_elements: int = _sketch.ELEMENT_TABLE_MAX) -> None:
        self.spec = spec
        self._max_plans = max_plans
        self._max_bytes = max_table_bytes
        self._max_elements = min(max_table_elements, max_table_bytes // 4)
        self._plans: OrderedDict[tuple, _Tables | _Elements] = OrderedDict()
        self._owned = 0
        self._pattern_ints: dict[str, torch.Tensor] = {}
        self._shared: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._patterns: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._scratch: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._sign_vectors: dict[str, torch.Tensor] = {}

    def sketch(self, tensor: torch.Tensor, transpose: bool = False, offset: int = 0,
               block: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> torch.Tensor:
        """float64 [buckets] sketch on ``tensor``'s device (hot: no host sync).

        ``transpose``: the tensor is a 2-D matrix stored as the transpose of the
        canonical layout (e.g. a paddle-style [in, out] Linear weight); it is
        copied to canonical order first.  ``offset``: canonical global index of
        the first element, for a contiguous shard of a larger tensor.
        ``block`` = (global_shape, offsets): the tensor is the block [offsets,
        offsets + its shape) of a logical tensor of global_shape, both in the
        stored layout (``twinstep.wire.sketch.block_indices``); exclusive with
        ``offset``.  Shards' sketches add up to the logical tensor's.
        """
        with torch.no_grad():
            x = tensor.detach()
            if transpose:
                if x.dim() != 2:
                    raise ValueError(f"transpose needs a 2-D tensor, got shape {tuple(x.shape)}")
                x = x.t()
            offset, geometry = _sketch.shard_geometry(tuple(tensor.shape), transpose, offset, block)
            if x.dtype in _WIDEN:
                x = x.float()
            elif not x.is_floating_point():
                x = x.double()
            flat = x.reshape(-1)
            if geometry is not None:
                return self._sketch_elements(flat, geometry)
            n = flat.numel()
            device = flat.device
            plan = self._tables(device, n, offset)
            bins = torch.zeros(2 * self.spec.buckets, dtype=torch.float64, device=device)
            if plan.head == n:
                pieces = flat
            elif plan.head and plan.tail:
                pieces = torch.cat([flat[: plan.head], flat[n - plan.tail:]])
            else:
                pieces = flat[: plan.head] if plan.head else flat[n - plan.tail:]
            if pieces.numel():
                bins.scatter_add_(0, plan.direct, pieces.to(torch.float64))
            if plan.blocks:
                bins.scatter_add_(0, self._shared_for(device)[1], self._bags(flat, plan))
            return bins.view(-1, 2) @ self._signs(device)

    def _sketch_elements(self, flat: torch.Tensor, block: Block) -> torch.Tensor:
        """float64 [buckets]: a block that is not one contiguous range, element by element into cells."""
        spec, device = self.spec, flat.device
        width = 2 * spec.buckets
        cells = torch.zeros(-(-block.numel // spec.cell_elements) * width, dtype=flat.dtype, device=device)
        table = self._element_table(device, block)
        if table is not None:
            cells.index_add_(0, table.cells, flat)
        else:
            negative = self._pattern_int(device)
            band = _sketch.CHUNK_ELEMENTS
            for start in range(0, block.numel, band):
                local = torch.arange(start, min(block.numel, start + band), device=device)
                index = _sketch.hashed_folded_index(_sketch.block_global_index(local, block, int), spec, int,
                                                    negative.__getitem__)
                index += torch.div(local, spec.cell_elements, rounding_mode="floor") * width
                cells.index_add_(0, index, flat[start:start + band])
        bins = cells.view(-1, width).sum(0, dtype=torch.float64)
        return bins.view(-1, 2) @ self._signs(device)

    def _element_table(self, device: torch.device, block: Block) -> _Elements | None:
        """The block's cached cell table; None above the size limit (hash on the device)."""
        if block.numel > self._max_elements:
            return None
        key = (str(device), block)
        found = self._plans.get(key)
        if found is not None:
            self._plans.move_to_end(key)
            return found
        cells = _upload(_sketch.block_cells(block, self.spec), device)
        return self._store(key, _Elements(cells, 4 * block.numel))

    def _store(self, key: tuple, entry: _Tables | _Elements) -> _Tables | _Elements:
        """Cache an entry; evict the least recently used ones beyond ``max_plans`` or ``max_table_bytes``."""
        self._plans[key] = entry
        self._owned += entry.owned
        while len(self._plans) > self._max_plans or (self._owned > self._max_bytes and len(self._plans) > 1):
            _, evicted = self._plans.popitem(last=False)
            self._owned -= evicted.owned
        return entry

    def _pattern_int(self, device: torch.device) -> torch.Tensor:
        """w < 0 as int64 0/1 on ``device``: the in-block sign of the hashed path."""
        key = str(device)
        found = self._pattern_ints.get(key)
        if found is None:
            found = self._pattern_ints[key] = _upload(_sketch.pattern_negative(self.spec).astype(np.int64), device)
        return found

    def _bags(self, flat: torch.Tensor, plan: _Tables) -> torch.Tensor:
        """float64 [2*buckets*L]: the bag sums of all chunks of the blocked part."""
        L, K, per = self.spec.block, _sketch.PATTERN_BLOCKS, self.spec.chunk_blocks
        pattern = self._pattern(flat.device, flat.dtype)
        scratch = self._scratch_for(flat.device, flat.dtype)
        total = None
        whole = plan.chunks == 1 and plan.blocks * L == flat.numel()
        for c in range(plan.chunks):
            first, last = c * per, min(plan.blocks, (c + 1) * per)
            body = (flat if whole else flat[plan.head + first * L: plan.head + last * L]).view(-1, K, L)
            rows = scratch[: (last - first) * L]
            torch.mul(body, pattern, out=rows.view(-1, K, L))
            order = plan.order if plan.chunks == 1 else plan.order[first:last]
            bags = F.embedding_bag(order, rows.view(-1, L), plan.bag_offsets[c], mode="sum")
            total = bags.view(-1).to(torch.float64) if total is None else total.add_(bags.view(-1))
        return total

    def to_host(self, handles: list[torch.Tensor]) -> np.ndarray:
        """Stack device sketches into one float64 array [n, buckets] with one copy."""
        if not handles:
            return np.zeros((0, self.spec.buckets), dtype=np.float64)
        return torch.stack(handles).cpu().numpy()

    def cached_bytes(self) -> int:
        """Device bytes held by the cached tables, patterns and scratch buffers."""
        held = [a for pair in self._shared.values() for a in pair]
        held += list(self._patterns.values()) + list(self._scratch.values()) + list(self._pattern_ints.values())
        return sum(a.numel() * a.element_size() for a in held) + sum(t.owned for t in self._plans.values())

    def _tables(self, device: torch.device, numel: int, offset: int) -> _Tables:
        key = (str(device), numel, offset)
        found = self._plans.get(key)
        if found is not None:
            self._plans.move_to_end(key)
            return found
        plan = _sketch.plan(numel, self.spec, offset)
        direct = self._shared_for(device)[0][:numel] if plan.direct_is_prefix else _upload(plan.direct, device).long()
        order, bag_offsets = _upload(plan.order, device), _upload(plan.bag_offsets, device)
        owned = 4 * (plan.order.size + plan.bag_offsets.size) + (0 if plan.direct_is_prefix else 8 * plan.direct.size)
        tables = _Tables(plan.head, plan.tail, plan.blocks, plan.chunks, direct, order, bag_offsets, owned)
        return self._store(key, tables)

    def _signs(self, device: torch.device) -> torch.Tensor:
        """[1, -1]: folded bins [buckets, 2] times this are the sketch."""
        key = str(device)
        found = self._sign_vectors.get(key)
        if found is None:
            found = self._sign_vectors[key] = torch.tensor([1.0, -1.0], dtype=torch.float64, device=device)
        return found

    def _pattern(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (str(device), dtype)
        found = self._patterns.get(key)
        if found is None:
            found = self._patterns[key] = _upload(_sketch.pattern(self.spec), device).to(dtype)
        return found

    def _scratch_for(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (str(device), dtype)
        found = self._scratch.get(key)
        if found is None:
            size = self.spec.chunk_blocks * self.spec.block
            found = self._scratch[key] = torch.empty(size, dtype=dtype, device=device)
        return found

    def _shared_for(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(direct table, fold table) on ``device``: shared by every tensor size."""
        key = str(device)
        found = self._shared.get(key)
        if found is None:
            # int64: scatter_add_ needs it, and beats index_add_ by ~1.5x on CPU.
            found = (_upload(_sketch.direct_table(self.spec), device).long(),
                     _upload(_sketch.fold_table(self.spec), device).long())
            self._shared[key] = found
        return found


def _upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(array)).to(device)
