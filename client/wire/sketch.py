"""Count-sketches: linear, mergeable fingerprints of whole tensors (numpy only).

A sketch ``S(x)`` maps a tensor of any size to ``buckets`` numbers such that
``<S(a), S(b)>`` estimates ``<a, b>``; the server turns two sketches into
rel_l2 and cosine estimates at statistics cost (``twinstep.server.compare.sketch``).
Element ``i`` of the tensor -- its index in the *canonical* flat order, the
torch layout -- adds ``sign(i) * x[i]`` to bucket ``bucket(i)``.

Both are fixed by ``i`` and the seed alone, so a torch job and its paddle port
agree on them without talking to each other.  The hash is blocked, so that the
device tables hold one entry per block of ``L`` elements instead of one per
element and the device pass is a row-wise sum: with ``i = q*L + r``,

    bucket(i) = (r + shift(q)) mod buckets,   sign(i) = u(q) * w(i mod K*L)

``shift`` (uniform), ``u`` and ``w`` (+-1) are splitmix64 outputs of (seed, q)
or (seed, i mod K*L).  Two elements of one block never share a bucket; two of
different blocks share one with probability exactly 1/buckets, with signs
whose product is +-1 with equal odds (``u`` differs).  ``w`` varies the sign
pattern inside a block, so two blocks that land on the same shift do not add
coherently (with ``u`` alone a constant or smooth difference had 1.4x the
error); patterns repeat only every ``K`` blocks, which leaves 1/K of that
excess.  Net: the variance of a count-sketch with fully random hashing
(``tests/unit_tests/test_sketch.py`` checks it on spread, sparse, constant,
smooth, periodic and rank-one differences).

The tables are computed here, once, and handed to the framework backends
(``capture/torch/sketch.py``, ``capture/paddle/sketch.py``), which is what makes
the two frameworks' sketches identical.  ``sketch_array`` is the element-by-
element reference they are tested against.

Shards.  A rank that holds a block of a logical tensor (a tensor-parallel
shard, a data-parallel slice of the batch) sketches it with every element
keyed by its index ``i`` in the *logical* tensor, so the shards' sketches add
up to the whole tensor's (``merge``).  ``block_geometry`` describes the block
in canonical order with adjacent dimensions merged; a block that is one
contiguous range of the canonical order (a dim-0 shard, or leading dims of one
element) is the ``offset`` form and takes the blocked device path; any other
block (a last-dim shard, an [in, out] weight split on ``in``) is sketched
element by element, from ``block_cells`` (cached on the device) or from
``hashed_folded_index`` (the hash computed on the device from the indices).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: 256 buckets: the rel_l2 estimate's relative std is 1/sqrt(2*256) = 4.4% (cosine
#: gap: 8.8%), so a 3-sigma verdict resolves a factor 1.14 around a tolerance
#: (benchmarks/sketch_accuracy.py measures it on real tensors); a 1 KiB float32
#: vector per record on the wire, next to ~64 bytes of statistics, and a fixed
#: device cost of one 31k-cell fold per tensor.  4x the buckets halves the error.
DEFAULT_BUCKETS = 256
DEFAULT_SEED = 0x7C0FFEE5EED
#: Upper bound: the per-tensor fixed cost (a fold over 2 x buckets x L cells) and
#: the shared direct table (as many entries: 31k at 256 buckets, 500k at 4096) grow with buckets.
MAX_BUCKETS = 4096
#: Blocks per period of the in-block sign pattern w.
PATTERN_BLOCKS = 64
#: Most blocks summed in float32 into one bag, on average, before the float64
#: sum: bounds the float32 accumulation error of a bucket near 3.4e-8*sqrt(64/2) = 2e-7 relative.
BAG_ROWS = 64
#: Elements a device processes at once (4 MiB of float32): its sign-multiplied
#: copy lives in a reused scratch buffer of this size, never one as large as the tensor.
CHUNK_ELEMENTS = 1 << 20
#: Largest block that is not one contiguous range (elements) whose element table a
#: device sketcher caches: an int32 per element, 64 MiB at this size.  Larger blocks
#: hash their elements' indices on the device at every call instead (no table).
ELEMENT_TABLE_MAX = 1 << 24

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_BLOCK_STREAM = 1
_PATTERN_STREAM = 2


@dataclass(frozen=True, kw_only=True)
class SketchSpec:
    """What both runs must agree on: bucket count and seed (sent with every batch)."""

    buckets: int = DEFAULT_BUCKETS
    """Sketch length; the estimates' relative std falls as 1/sqrt(buckets)."""
    seed: int = DEFAULT_SEED
    """Any uint64; changes every bucket and sign."""

    def __post_init__(self) -> None:
        if not isinstance(self.buckets, (int, np.integer)) or not 16 <= self.buckets <= MAX_BUCKETS:
            raise ValueError(f"sketch.buckets must be an integer in [16, {MAX_BUCKETS}], got {self.buckets!r}")
        if not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2**64:
            raise ValueError(f"sketch.seed must be an integer in [0, 2**64), got {self.seed!r}")

    @property
    def block(self) -> int:
        """Block length L: the largest prime <= min(64, buckets/2).

        Prime, so no power-of-two row length lines up with the blocks; at most
        buckets/2, so that two elements of one pair of blocks can only collide
        together with another pair at the same offsets; at most 64, which keeps
        the per-tensor fold over a [2*buckets, L] array cheap (31k cells at 256
        buckets) while the row-wise sums still stream at memory speed.
        """
        return _largest_prime(min(64, int(self.buckets) // 2))

    @property
    def group(self) -> int:
        """Elements per period of the sign pattern w (K*L); the device multiplies whole groups."""
        return PATTERN_BLOCKS * self.block

    @property
    def chunk_blocks(self) -> int:
        """Blocks per device chunk: whole groups, ~CHUNK_ELEMENTS, at most ~BAG_ROWS per bag."""
        groups = min(CHUNK_ELEMENTS // self.group, BAG_ROWS * 2 * self.buckets // PATTERN_BLOCKS)
        return PATTERN_BLOCKS * max(groups, 1)

    @property
    def cell_elements(self) -> int:
        """Consecutive elements of a block that share one set of ``2*buckets`` float32 cells.

        The element-by-element path sums a block's elements into cells: element
        ``k`` into cell ``(k // cell_elements) * 2*buckets + bin``, ~BAG_ROWS
        elements per cell, before the cells add up in float64 (the precision of
        the blocked path's bags).
        """
        return BAG_ROWS * 2 * self.buckets

    @property
    def direct_max(self) -> int:
        """Tensors with fewer elements are sketched element by element (cheaper below ~2 x buckets x L)."""
        return max(2 * self.buckets * self.block, 2 * self.group)


def _largest_prime(n: int) -> int:
    for p in range(n, 1, -1):
        if all(p % d for d in range(2, int(p**0.5) + 1)):
            return p
    raise ValueError(n)


def _splitmix(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """Output ``index`` of splitmix64 started at a state derived from (seed, stream)."""
    with np.errstate(over="ignore"):
        key = _mix64(np.array([seed], dtype=np.uint64) ^ (np.uint64(stream) * _MIX2))[0]
        state = key + (np.asarray(index, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
        return _mix64(state)


def _mix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def block_tables(blocks: np.ndarray, spec: SketchSpec) -> tuple[np.ndarray, np.ndarray]:
    """(shift int64, u < 0 bool) of the given global block indices."""
    h = _splitmix(spec.seed, _BLOCK_STREAM, np.asarray(blocks, dtype=np.uint64))
    shift = ((h >> np.uint64(32)) % np.uint64(spec.buckets)).astype(np.int64)
    return shift, (h & np.uint64(1)).astype(bool)


@functools.lru_cache(maxsize=16)
def pattern_negative(spec: SketchSpec) -> np.ndarray:
    """w(j) < 0 for j in [0, K*L): the in-block half of every sign (read-only)."""
    h = _splitmix(spec.seed, _PATTERN_STREAM, np.arange(spec.group, dtype=np.uint64))
    out = (h & np.uint64(1)).astype(bool)
    out.setflags(write=False)
    return out


def pattern(spec: SketchSpec, dtype: np.dtype = np.float32) -> np.ndarray:
    """w as +-1 values, shaped [K, L]: the factor a device multiplies each group of K blocks by."""
    return np.where(pattern_negative(spec), -1, 1).astype(dtype).reshape(PATTERN_BLOCKS, spec.block)


def folded_index(positions: np.ndarray, spec: SketchSpec) -> np.ndarray:
    """2*bucket + (sign < 0) of canonical global indices: a sign-folded bin in [0, 2*buckets)."""
    i = np.asarray(positions, dtype=np.int64)
    q = i // spec.block
    r = i - q * spec.block
    low, high = (int(q.min()), int(q.max())) if q.size else (0, -1)
    if high - low < 2 * q.size:
        # Indices of a block or a range: hash every block of their span (no sort).
        blocks, which = np.arange(low, high + 1, dtype=np.int64), q - low
    else:
        blocks, which = np.unique(q, return_inverse=True)
    shift, negative = block_tables(blocks, spec)
    bucket = r + shift[which]
    np.subtract(bucket, spec.buckets, out=bucket, where=bucket >= spec.buckets)  # r < L < buckets
    within = (q & (PATTERN_BLOCKS - 1)) * spec.block + r  # i mod K*L (K is a power of two)
    return 2 * bucket + (negative[which] ^ pattern_negative(spec)[within])


def canonical_flat(values: np.ndarray, transpose: bool = False) -> np.ndarray:
    """Elements in canonical order: a 2-D tensor stored transposed ([in, out]) is read as [out, in]."""
    a = np.asarray(values)
    if transpose:
        if a.ndim != 2:
            raise ValueError(f"transpose needs a 2-D tensor, got shape {a.shape}")
        a = a.T
    return a.reshape(-1)


def sketch_array(values: np.ndarray, spec: SketchSpec = SketchSpec(), transpose: bool = False, offset: int = 0,
                 block: tuple[Sequence[int], Sequence[int]] | None = None) -> np.ndarray:
    """Reference sketch (float64 [buckets]) of a host array, element by element.

    ``offset`` is the canonical global index of the first element, for a shard
    that is a contiguous range of the canonical flat order.  ``block`` =
    (global_shape, offsets): the array is the block [offsets, offsets + its
    shape) of a logical tensor of global_shape, both in the stored layout (see
    ``block_indices``; exclusive with ``offset``).  Either way shards' sketches
    add.  NaN/Inf poison the one bucket they fall in, as on the device.
    """
    x = canonical_flat(values, transpose).astype(np.float64)
    if block is not None:
        _no_offset_with_block(offset)
        global_shape, offsets = block
        positions = block_indices(np.shape(values), global_shape, offsets, transpose)
    else:
        positions = np.arange(offset, offset + x.size, dtype=np.int64)
    index = folded_index(positions, spec)
    bins = np.bincount(index, weights=x, minlength=2 * spec.buckets)
    with np.errstate(invalid="ignore"):
        return bins[0::2] - bins[1::2]


def _no_offset_with_block(offset: int) -> None:
    if offset:
        raise ValueError(f"offset ({offset}) and block are exclusive: "
                         "a block's offsets give its place in the logical tensor")


def shard_geometry(local_shape: Sequence[int], transpose: bool, offset: int,
                   block: tuple[Sequence[int], Sequence[int]] | None) -> tuple[int, Block | None]:
    """What a device sketcher does with its ``offset`` and ``block`` arguments.

    (offset, None): the elements are one contiguous range of the canonical
    order starting at ``offset`` (no block, or a block that is such a range);
    (0, the block): sketch element by element.  Validates as ``block_indices``.
    """
    if block is None:
        return offset, None
    _no_offset_with_block(offset)
    global_shape, offsets = block
    geometry = block_geometry(local_shape, global_shape, offsets, transpose)
    return (geometry.offset, None) if geometry.offset is not None else (0, geometry)


@dataclass(frozen=True)
class Block:
    """A rectangular block of a logical tensor, in canonical order, adjacent dimensions merged.

    Two neighbouring dimensions merge when the inner one is whole (the block
    holds all of it), which keeps the canonical order: a dim-0 shard of a
    [4096, 1024] tensor is ``shape (s*1024,)``, a last-dim shard ``(4096, s)``.
    """

    shape: tuple[int, ...]
    """The block's canonical shape (merged dimensions)."""
    global_shape: tuple[int, ...]
    """The logical tensor's canonical shape, merged alike."""
    offsets: tuple[int, ...]
    """Where the block starts in each merged dimension."""
    numel: int
    offset: int | None
    """Canonical flat index of the first element when the block is one contiguous range (else None)."""

    @property
    def strides(self) -> tuple[int, ...]:
        """Canonical flat strides of the logical tensor's merged dimensions."""
        out, stride = [], 1
        for n in reversed(self.global_shape):
            out.append(stride)
            stride *= n
        return tuple(reversed(out))

    @property
    def first(self) -> int:
        """Canonical flat index of the block's first element."""
        return sum(o * s for o, s in zip(self.offsets, self.strides))

    def indices(self) -> np.ndarray:
        """Canonical global flat index (int64) of every element, in canonical local order."""
        return _indices(self)


@functools.lru_cache(maxsize=4096)
def _block_geometry(local: tuple[int, ...], global_: tuple[int, ...], offsets: tuple[int, ...],
                    transpose: bool) -> Block:
    if not len(local) == len(global_) == len(offsets):
        raise ValueError(f"block: the local shape {list(local)}, global shape {list(global_)} and offsets "
                         f"{list(offsets)} must have the same number of dimensions")
    if any(n < 0 for n in (*local, *global_, *offsets)):
        raise ValueError(f"block: negative size or offset in local shape {list(local)}, global shape "
                         f"{list(global_)}, offsets {list(offsets)}")
    for d, (n, g, o) in enumerate(zip(local, global_, offsets)):
        if o + n > g:
            raise ValueError(f"block: dim {d} spans [{o}, {o + n}), outside the global size {g} "
                             f"(local shape {list(local)}, global shape {list(global_)}, offsets {list(offsets)})")
    if transpose:
        if len(local) != 2:
            raise ValueError(f"transpose needs a 2-D tensor, got shape {list(local)}")
        local, global_, offsets = local[::-1], global_[::-1], offsets[::-1]
    numel = functools.reduce(operator.mul, local, 1)
    if numel == 0:
        return Block((0,), (0,), (0,), 0, 0)
    merged: list[list[int]] = []  # [local, global, offset], innermost first
    for n, g, o in zip(reversed(local), reversed(global_), reversed(offsets)):
        if merged and merged[-1][0] == merged[-1][1]:  # the inner part is whole
            inner = merged[-1]
            merged[-1] = [n * inner[0], g * inner[1], o * inner[1]]
        else:
            merged.append([n, g, o])
    if not merged:
        merged = [[1, 1, 0]]  # a scalar
    merged.reverse()
    shape, glob, offs = (tuple(m[i] for m in merged) for i in range(3))
    block = Block(shape, glob, offs, numel, None)
    if all(n == 1 for n in shape[:-1]):
        block = Block(shape, glob, offs, numel, block.first)
    return block


def block_geometry(local_shape: Sequence[int], global_shape: Sequence[int], offsets: Sequence[int],
                   transpose: bool = False) -> Block:
    """The block [offsets, offsets + local_shape) of a tensor of global_shape (stored layout), canonical and merged.

    Validated (same number of dimensions, inside the global tensor); cached, so
    the capture hooks can call it per record.
    """
    return _block_geometry(tuple(int(n) for n in local_shape), tuple(int(n) for n in global_shape),
                           tuple(int(n) for n in offsets), bool(transpose))


def block_offset(local_shape: Sequence[int], global_shape: Sequence[int], offsets: Sequence[int],
                 transpose: bool = False) -> int | None:
    """Canonical flat index of the block's first element if the block is one contiguous range, else None."""
    return block_geometry(local_shape, global_shape, offsets, transpose).offset


def block_indices(local_shape: tuple[int, ...], global_shape: tuple[int, ...], offsets: tuple[int, ...],
                  transpose: bool = False) -> np.ndarray:
    """Canonical global flat index (int64) of every element of a block, in canonical local order.

    The block is [offsets, offsets + local_shape) of a logical tensor of
    global_shape, both in the tensor's stored layout.  With ``transpose`` (a
    2-D matrix stored as the transpose of the canonical layout, e.g. a paddle
    [in, out] weight) the canonical order of the block is ``local.T`` flattened
    and the indices are into the transposed logical tensor ([out, in]).
    Raises ValueError when the dimensions disagree or the block is not inside.
    """
    return _indices(block_geometry(local_shape, global_shape, offsets, transpose))


def _indices(block: Block) -> np.ndarray:
    if block.offset is not None:
        return np.arange(block.offset, block.offset + block.numel, dtype=np.int64)
    out = np.zeros((), dtype=np.int64)
    for n, o, s in zip(block.shape, block.offsets, block.strides):
        out = out[..., None] + (np.arange(o, o + n, dtype=np.int64) * s)
    return out.reshape(-1)


def block_cells(block: Block, spec: SketchSpec) -> np.ndarray:
    """The cell (int32) of every element of a block, in canonical local order.

    Element k of the block goes to cell ``(k // cell_elements) * 2*buckets +
    folded bin``; the device sums the cells in the tensor's float type, then
    adds them up in float64 as a [-1, 2*buckets] array into the folded bins.
    """
    local = np.arange(block.numel, dtype=np.int64) // spec.cell_elements
    cells = folded_index(_indices(block), spec) + 2 * spec.buckets * local
    return cells.astype(np.int32)


def block_global_index(local: Any, block: Block, const: Callable[[int], Any]) -> Any:
    """Canonical global indices of the block's elements at canonical local flat positions ``local``.

    Framework-neutral: ``local`` is an int64 array or tensor (numpy, torch,
    paddle) and ``const`` turns a Python int into an operand of its framework.
    """
    out = const(block.first)
    rest = local
    for d in range(len(block.shape) - 1, -1, -1):
        n, s = block.shape[d], block.strides[d]
        if d == 0:
            index = rest
        elif n == 1:
            continue
        else:
            index = rest % const(n)
            rest = rest // const(n)
        out = out + index * const(s)
    return out


def _signed(value: int) -> int:
    """A uint64 as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def hashed_folded_index(positions: Any, spec: SketchSpec, const: Callable[[int], Any],
                        pattern_negative_at: Callable[[Any], Any]) -> Any:
    """``folded_index`` with wrapping int64 arithmetic only, for a device's int64 tensor of indices >= 0.

    ``const`` turns a Python int (int64 range) into an operand of the
    framework; ``pattern_negative_at(j)`` is ``pattern_negative(spec)[j]`` as
    int64 0/1 on the device.  About 25 elementwise operations per element
    (with ``block_global_index`` and the cell, ~35);
    splitmix64's logical shifts are arithmetic shifts then a mask.
    """
    L, B = spec.block, spec.buckets
    key = _mix64(np.array([spec.seed], dtype=np.uint64) ^ (np.uint64(_BLOCK_STREAM) * _MIX2))[0]

    def mix(z: Any) -> Any:
        for shift, factor in ((30, _MIX1), (27, _MIX2), (31, None)):
            z = z ^ ((z >> const(shift)) & const((1 << (64 - shift)) - 1))
            if factor is not None:
                z = z * const(_signed(int(factor)))
        return z

    q = positions // const(L)
    r = positions - q * const(L)
    h = mix(const(_signed(int(key))) + (q + const(1)) * const(_signed(int(_GOLDEN))))
    shift = ((h >> const(32)) & const(0xFFFFFFFF)) % const(B)
    negative = (h & const(1)) ^ pattern_negative_at(positions % const(spec.group))
    return const(2) * ((r + shift) % const(B)) + negative


def merge(sketches: list[np.ndarray]) -> np.ndarray:
    """Sketch of a tensor from the sketches of its shards (linearity: they add)."""
    if not sketches:
        raise ValueError("merge needs at least one sketch")
    return np.sum(np.stack([np.asarray(s, dtype=np.float64) for s in sketches]), axis=0)


@dataclass(frozen=True)
class Plan:
    """How a device sketches ``numel`` elements starting at canonical index ``offset``.

    Elements [0, head) and [numel - tail, numel) go element by element through
    ``direct`` (folded bins).  The ``blocks`` blocks between them (whole groups
    of K, starting on a global group boundary) are processed in ``chunks`` of
    ``spec.chunk_blocks`` blocks (the last may be shorter): multiplied by
    ``pattern`` (viewed [-1, K, L]), then summed row-wise into ``2*buckets``
    float32 bags, block j of a chunk into bag ``bag_of_block[j]`` = 2*shift +
    (u < 0).  ``order`` (blocks of each chunk sorted by bag, chunk-local, chunk
    after chunk) and ``bag_offsets`` [chunks, 2*buckets] (each bag's start in
    its chunk's part of ``order``) are the same grouping as embedding-bag input.
    The bags, summed over chunks in float64 as a [2*buckets*L] vector, are folded
    into the bins by ``fold_table``.
    """

    numel: int
    offset: int
    head: int
    tail: int
    blocks: int
    chunks: int
    direct_is_prefix: bool
    """``direct`` is ``direct_table(spec)[:numel]``: backends slice their shared copy."""
    direct: np.ndarray
    bag_of_block: np.ndarray
    order: np.ndarray
    bag_offsets: np.ndarray


@functools.lru_cache(maxsize=4)
def direct_table(spec: SketchSpec) -> np.ndarray:
    """Folded bins of canonical indices [0, direct_max): shared by every small tensor (int32)."""
    out = folded_index(np.arange(spec.direct_max, dtype=np.int64), spec).astype(np.int32)
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=4)
def fold_table(spec: SketchSpec) -> np.ndarray:
    """Folded bin of every cell (k, s, r) of a [buckets, 2, L] bag array, int32.

    Cell (k, s, r) sums the (pattern-multiplied) elements at offset r of the
    blocks of shift k and u-sign s: bucket (k + r) mod buckets, negative if s.
    """
    k, s, r = np.unravel_index(np.arange(2 * spec.buckets * spec.block), (spec.buckets, 2, spec.block))
    out = (2 * ((k + r) % spec.buckets) + s).astype(np.int32)
    out.setflags(write=False)
    return out


def plan(numel: int, spec: SketchSpec = SketchSpec(), offset: int = 0) -> Plan:
    """The plan for a tensor of ``numel`` elements (not cached: backends keep the device copy).

    Building it hashes and sorts one entry per block: ~0.5 s for 1e8 elements.
    """
    if numel < 0 or offset < 0:
        raise ValueError(f"numel and offset must be >= 0, got {numel}, {offset}")
    G, B = spec.group, spec.buckets
    head = min(numel, (-offset) % G)
    groups = (numel - head) // G
    empty = np.zeros(0, dtype=np.int32)
    if numel < spec.direct_max or groups == 0:
        if offset == 0 and numel <= spec.direct_max:
            return Plan(numel, offset, numel, 0, 0, 0, True, direct_table(spec)[:numel], empty, empty, empty)
        direct = folded_index(np.arange(offset, offset + numel), spec).astype(np.int32)
        return Plan(numel, offset, numel, 0, 0, 0, False, direct, empty, empty, empty)
    tail = numel - head - groups * G
    local = np.r_[np.arange(head), np.arange(numel - tail, numel)]
    direct = folded_index(offset + local, spec).astype(np.int32)
    blocks = groups * PATTERN_BLOCKS
    first = (offset + head) // spec.block
    shift, negative = block_tables(np.arange(first, first + blocks), spec)
    bag = 2 * shift + negative
    per = spec.chunk_blocks
    chunks = -(-blocks // per)
    order = np.empty(blocks, dtype=np.int32)
    offsets = np.empty((chunks, 2 * B), dtype=np.int32)
    for c in range(chunks):
        part = bag[c * per:(c + 1) * per]
        order[c * per:(c + 1) * per] = np.argsort(part, kind="stable")
        offsets[c] = np.searchsorted(part[order[c * per:(c + 1) * per]], np.arange(2 * B))
    return Plan(numel, offset, head, tail, blocks, chunks, False, direct, bag.astype(np.int32), order, offsets)
