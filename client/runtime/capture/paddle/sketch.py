"""Count-sketches of paddle tensors on their device (see :mod:`twinstep.wire.sketch`).

Chunk by chunk (~1M elements), the blocks are multiplied by the sign pattern
and added row-wise into their bags by one accumulating ``paddle.scatter``
along axis 0 (vectorised over a block; 1.3-2x faster on CPU than
``index_add``, 10x faster than ``send_u_recv`` or ``put_along_axis``); the
bags add up in float64 and fold into ``2 * buckets`` sign-folded bins, where
the few leftover elements land through a 1-D scatter-add (``_scatter_add``).
Tables come from ``twinstep.wire.sketch`` in numpy and are uploaded once per
(place, element count, offset).

A shard (``block=(global_shape, offsets)``) is keyed by its elements' indices
in the logical tensor.  One that is a contiguous range of the canonical order
(a dim-0 shard, leading dims of one element) is the ``offset`` path above.
Any other block (a last-dim shard, a transposed [in, out] shard split on
``in``) goes element by element: each element is added into float32 cells
(~64 per cell, like the bags) by one scatter-add, then the cells add up in
float64.  The element-to-cell table (int32: 4 bytes of device memory per
element, 16 MiB for a 4096x1024 shard, built on the host once, ~0.2-0.8 s per
4M elements) is cached per (place, geometry) within ``max_table_bytes`` (LRU,
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
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
import paddle

from twinstep.wire import sketch as _sketch
from twinstep.wire.sketch import Block, SketchSpec

_WIDEN = ("float16", "bfloat16")
_FLOATS = ("float32", "float64")


class _Tables(NamedTuple):
    """Device side of a :class:`twinstep.wire.sketch.Plan` (its host arrays are dropped)."""

    head: int
    tail: int
    blocks: int
    chunks: int
    direct: paddle.Tensor  # int32 folded bins of the element-by-element part
    bag_of_block: paddle.Tensor  # int32 chunk-local bag (row of the bag array) of every block
    owned: int  # device bytes this entry holds (a slice of the shared direct table: 0)


class _Elements(NamedTuple):
    """Device side of ``twinstep.wire.sketch.block_cells``: a block that is not one contiguous range."""

    cells: paddle.Tensor  # int32 cell of every element, canonical local order
    owned: int  # device bytes: 4 per element


#: Small int64 constants of the hashed path kept per place (uploaded once; cleared beyond this many).
_MAX_CONSTANTS = 4096


class PaddleSketcher:
    """Sketches paddle tensors with device tables cached per (place, numel, offset) or (place, block).

    ``max_plans`` and ``max_table_bytes`` bound the cache (least recently used
    first), so dynamic shapes (a growing sequence length, shards at many
    offsets) cannot grow it without limit; an evicted table is rebuilt on the
    host.  Blocks above ``max_table_elements`` (or a quarter of
    ``max_table_bytes``) are hashed on the device at every call, uncached.
    """

    framework = "paddle"

    def __init__(self, spec: SketchSpec = SketchSpec(), max_plans: int = 256, max_table_bytes: int = 512 << 20,
                 max_table_elements: int = _sketch.ELEMENT_TABLE_MAX) -> None:
        self.spec = spec
        self._max_plans = max_plans
        self._max_bytes = max_table_bytes
        self._max_elements = min(max_table_elements, max_table_bytes // 4)
        self._plans: OrderedDict[tuple, _Tables | _Elements] = OrderedDict()
        self._owned = 0
        self._constants: dict[tuple[str, int], paddle.Tensor] = {}
        self._pattern_ints: dict[str, paddle.Tensor] = {}
        self._shared: dict[str, tuple[paddle.Tensor, paddle.Tensor]] = {}
        self._patterns: dict[tuple[str, str], paddle.Tensor] = {}
        self._sign_vectors: dict[str, paddle.Tensor] = {}

    def sketch(self, tensor: paddle.Tensor, transpose: bool = False, offset: int = 0,
               block: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> paddle.Tensor:
        """float64 [buckets] sketch on ``tensor``'s place (hot: no host sync).

        ``transpose``: the tensor is a 2-D matrix stored as the transpose of the
        canonical layout (paddle's [in, out] Linear weight and its gradient); it
        is copied to canonical [out, in] order first.  ``offset``: canonical
        global index of the first element, for a contiguous shard.  ``block`` =
        (global_shape, offsets): the tensor is the block [offsets, offsets + its
        shape) of a logical tensor of global_shape, both in the stored layout
        (``twinstep.wire.sketch.block_indices``); exclusive with ``offset``.
        Shards' sketches add up to the logical tensor's.
        """
        with paddle.no_grad():
            x = tensor.detach()
            if transpose:
                if x.ndim != 2:
                    raise ValueError(f"transpose needs a 2-D tensor, got shape {list(x.shape)}")
                x = paddle.transpose(x, [1, 0])
            offset, geometry = _sketch.shard_geometry(tuple(tensor.shape), transpose, offset, block)
            name = str(x.dtype).rsplit(".", 1)[-1]
            if name in _WIDEN:
                x = x.astype("float32")
            elif name not in _FLOATS:
                x = x.astype("float64")
            flat = x.reshape([-1])
            if geometry is not None:
                return self._sketch_elements(flat, geometry)
            n = int(flat.shape[0])
            place = flat.place
            plan = self._tables(place, n, offset)
            if plan.head == n:
                pieces = flat
            elif plan.head and plan.tail:
                pieces = paddle.concat([flat[: plan.head], flat[n - plan.tail:]])
            else:
                pieces = flat[: plan.head] if plan.head else flat[n - plan.tail:]
            bins = None
            if pieces.shape[0]:
                bins = _scatter_add(bins, plan.direct, pieces.astype("float64"), 2 * self.spec.buckets)
            if plan.blocks:
                bins = _scatter_add(bins, self._shared_for(place)[1], self._bags(flat, plan), 2 * self.spec.buckets)
            if bins is None:
                return _zeros(flat, [self.spec.buckets], "float64")
            return paddle.matmul(bins.reshape([-1, 2]), self._signs(place))

    def _sketch_elements(self, flat: paddle.Tensor, block: Block) -> paddle.Tensor:
        """float64 [buckets]: a block that is not one contiguous range, element by element into cells."""
        spec, place = self.spec, flat.place
        width = 2 * spec.buckets
        size = -(-block.numel // spec.cell_elements) * width
        table = self._element_table(place, block)
        if table is not None:
            cells = _scatter_add(None, table.cells, flat, size)
        else:
            cells = None
            const = functools.partial(self._constant, place)
            negative = self._pattern_int(place)
            band = _sketch.CHUNK_ELEMENTS
            for start in range(0, block.numel, band):
                stop = min(block.numel, start + band)
                local = _arange(start, stop, flat)
                index = _sketch.hashed_folded_index(_sketch.block_global_index(local, block, const), spec, const,
                                                    functools.partial(paddle.gather, negative))
                index = index + (local // const(spec.cell_elements)) * const(width)
                cells = _scatter_add(cells, index, flat[start:stop], size)
        bins = cells.reshape([-1, width]).astype("float64").sum(axis=0)
        return paddle.matmul(bins.reshape([-1, 2]), self._signs(place))

    def _element_table(self, place: Any, block: Block) -> _Elements | None:
        """The block's cached cell table; None above the size limit (hash on the device)."""
        if block.numel > self._max_elements:
            return None
        key = (str(place), block)
        found = self._plans.get(key)
        if found is not None:
            self._plans.move_to_end(key)
            return found
        cells = _upload(_sketch.block_cells(block, self.spec), place)
        return self._store(key, _Elements(cells, 4 * block.numel))

    def _store(self, key: tuple, entry: _Tables | _Elements) -> _Tables | _Elements:
        """Cache an entry; evict the least recently used ones beyond ``max_plans`` or ``max_table_bytes``."""
        self._plans[key] = entry
        self._owned += entry.owned
        while len(self._plans) > self._max_plans or (self._owned > self._max_bytes and len(self._plans) > 1):
            _, evicted = self._plans.popitem(last=False)
            self._owned -= evicted.owned
        return entry

    def _constant(self, place: Any, value: int) -> paddle.Tensor:
        """An int64 [1] tensor on ``place``, uploaded once: paddle's bitwise operators take no Python
        ints, and its arithmetic with a Python scalar may round an int64 beyond 2**53."""
        key = (str(place), value)
        found = self._constants.get(key)
        if found is None:
            if len(self._constants) >= _MAX_CONSTANTS:
                self._constants.clear()
            found = self._constants[key] = _upload(np.array([value], dtype=np.int64), place)
        return found

    def _pattern_int(self, place: Any) -> paddle.Tensor:
        """w < 0 as int64 0/1 on ``place``: the in-block sign of the hashed path."""
        key = str(place)
        found = self._pattern_ints.get(key)
        if found is None:
            found = self._pattern_ints[key] = _upload(_sketch.pattern_negative(self.spec).astype(np.int64), place)
        return found

    def _bags(self, flat: paddle.Tensor, plan: _Tables) -> paddle.Tensor:
        """float64 [2*buckets*L]: the bag sums of all chunks of the blocked part."""
        L, K, per = self.spec.block, _sketch.PATTERN_BLOCKS, self.spec.chunk_blocks
        pattern = self._pattern(flat.place, flat.dtype)
        total = None
        whole = plan.chunks == 1 and plan.blocks * L == int(flat.shape[0])
        for c in range(plan.chunks):
            first, last = c * per, min(plan.blocks, (c + 1) * per)
            body = flat if whole else flat[plan.head + first * L: plan.head + last * L]
            rows = paddle.multiply(body.reshape([-1, K, L]), pattern).reshape([-1, L])
            bags = _zeros(rows, [2 * self.spec.buckets, L], rows.dtype)
            # Accumulating scatter: zeroes the target rows (already zero), then adds.
            index = plan.bag_of_block if plan.chunks == 1 else plan.bag_of_block[first:last]
            bags = paddle.scatter(bags, index, rows, overwrite=False)
            bags = bags.reshape([-1]).astype("float64")
            total = bags if total is None else total + bags
        return total

    def to_host(self, handles: list[paddle.Tensor]) -> np.ndarray:
        """Stack device sketches into one float64 array [n, buckets] with one copy."""
        if not handles:
            return np.zeros((0, self.spec.buckets), dtype=np.float64)
        return paddle.stack(handles).numpy().astype(np.float64, copy=False)

    def cached_bytes(self) -> int:
        """Device bytes held by the cached tables (shared and per plan)."""
        shared = sum(4 * (int(a.shape[0]) + int(b.shape[0])) for a, b in self._shared.values())
        shared += sum(w.size * w.element_size() for w in self._patterns.values())
        shared += sum(8 * c.size for c in [*self._constants.values(), *self._pattern_ints.values()])
        return shared + sum(t.owned for t in self._plans.values())

    def _tables(self, place: Any, numel: int, offset: int) -> _Tables:
        key = (str(place), numel, offset)
        found = self._plans.get(key)
        if found is not None:
            self._plans.move_to_end(key)
            return found
        plan = _sketch.plan(numel, self.spec, offset)
        direct = self._shared_for(place)[0][:numel] if plan.direct_is_prefix else _upload(plan.direct, place)
        owned = 4 * (plan.bag_of_block.size + (0 if plan.direct_is_prefix else plan.direct.size))
        tables = _Tables(plan.head, plan.tail, plan.blocks, plan.chunks, direct,
                         _upload(plan.bag_of_block, place), owned)
        return self._store(key, tables)

    def _signs(self, place: Any) -> paddle.Tensor:
        """[1, -1]: folded bins [buckets, 2] times this are the sketch."""
        key = str(place)
        found = self._sign_vectors.get(key)
        if found is None:
            found = self._sign_vectors[key] = _upload(np.array([1.0, -1.0]), place)
        return found

    def _pattern(self, place: Any, dtype: Any) -> paddle.Tensor:
        key = (str(place), str(dtype))
        found = self._patterns.get(key)
        if found is None:
            found = _upload(_sketch.pattern(self.spec), place).astype(dtype)
            self._patterns[key] = found
        return found

    def _shared_for(self, place: Any) -> tuple[paddle.Tensor, paddle.Tensor]:
        """(direct table, fold table) on ``place``: shared by every tensor size."""
        key = str(place)
        found = self._shared.get(key)
        if found is None:
            found = (_upload(_sketch.direct_table(self.spec), place), _upload(_sketch.fold_table(self.spec), place))
            self._shared[key] = found
        return found


def _scatter_add(bins: paddle.Tensor | None, index: paddle.Tensor, values: paddle.Tensor, size: int) -> paddle.Tensor:
    """bins[index[i]] += values[i] (bins None: zeros of ``size``).

    A 1-D ``paddle.index_add`` costs ~150 ns per element on CPU; ``bincount``
    is 50-80x faster there, but on GPU it copies the input's max to the host (a
    sync), so other places use ``put_along_axis``.
    """
    if values.place.is_cpu_place():
        counted = paddle.bincount(index, weights=values, minlength=size)
        return counted if bins is None else bins + counted
    if bins is None:
        bins = _zeros(values, [size], values.dtype)
    return paddle.put_along_axis(bins, index, values, 0, reduce="add")


def _zeros(like: paddle.Tensor, shape: list[int], dtype: Any) -> paddle.Tensor:
    """Zeros on ``like``'s device.  ``Tensor.new_zeros`` exists from paddle 3.2; 3.0 and 3.1 build them and move them."""
    new_zeros = getattr(like, "new_zeros", None)
    if new_zeros is not None:
        return new_zeros(shape, dtype=dtype)
    zeros = paddle.zeros(shape, dtype=dtype)
    return zeros if str(zeros.place) == str(like.place) else zeros._copy_to(like.place, False)


def _arange(start: int, stop: int, like: paddle.Tensor) -> paddle.Tensor:
    """int64 [start, stop) on ``like``'s place."""
    out = paddle.arange(start, stop, dtype="int64")
    return out if str(out.place) == str(like.place) else out._copy_to(like.place, False)


def _upload(array: np.ndarray, place: Any) -> paddle.Tensor:
    return paddle.to_tensor(np.array(array), place=place)
