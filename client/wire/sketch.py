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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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
    q, r = np.divmod(i, spec.block)
    blocks, which = np.unique(q, return_inverse=True)
    shift, negative = block_tables(blocks, spec)
    bucket = (r + shift[which]) % spec.buckets
    return 2 * bucket + (negative[which] ^ pattern_negative(spec)[i % spec.group])


def canonical_flat(values: np.ndarray, transpose: bool = False) -> np.ndarray:
    """Elements in canonical order: a 2-D tensor stored transposed ([in, out]) is read as [out, in]."""
    a = np.asarray(values)
    if transpose:
        if a.ndim != 2:
            raise ValueError(f"transpose needs a 2-D tensor, got shape {a.shape}")
        a = a.T
    return a.reshape(-1)


def sketch_array(values: np.ndarray, spec: SketchSpec = SketchSpec(), transpose: bool = False, offset: int = 0) -> np.ndarray:
    """Reference sketch (float64 [buckets]) of a host array, element by element.

    ``offset`` is the canonical global index of the first element, for a shard
    that is a contiguous range of the canonical flat order; shards' sketches add.
    NaN/Inf poison the one bucket they fall in, as on the device.
    """
    x = canonical_flat(values, transpose).astype(np.float64)
    index = folded_index(np.arange(offset, offset + x.size, dtype=np.int64), spec)
    bins = np.bincount(index, weights=x, minlength=2 * spec.buckets)
    with np.errstate(invalid="ignore"):
        return bins[0::2] - bins[1::2]


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
