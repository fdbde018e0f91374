"""What comparing two runs' steps needs that does not change from step to step.

A training records the same modules in the same order every step, so the
join of the two runs' records, the names, the layouts, the shape checks and
the configured tolerances depend only on the pair of record layouts (names,
phases, calls, slots, dtypes, shapes) and the session's mapping and
tolerances.  They are computed once per layout pair and reused: what is left
per step is numpy over the step's statistics plus the records that carry full
tensors or sketches.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from twinstep.wire import phases
from twinstep.server.compare import layout
from twinstep.server.compare.join import Pair, RecordLabel, group_name, join
from twinstep.server.compare.mapping import FusedRule, NameMapping
from twinstep.server.compare.tolerance import METRICS, PRECISION_ORDER, ToleranceConfig, effective_dtype
from twinstep.server.ingest.step import StepData

#: Plans kept (most recently used); a session needs one per candidate run and rank.
MAX_PLANS = 256

Key = tuple[str, str, int, int]


@dataclass
class JoinPlan:
    """The static part of comparing one baseline layout with one candidate layout."""

    pairs: list[Pair]
    fused_rules: dict[int, FusedRule]
    unmatched_baseline: list[RecordLabel]
    unmatched_candidate: list[RecordLabel]
    """Each listed once, in order."""
    base_index: np.ndarray
    """First baseline record of each pair."""
    gather_base: tuple[np.ndarray | slice, np.ndarray | None]
    gather_cand: tuple[np.ndarray | slice, np.ndarray | None]
    """(flat record indices, reduceat starts or None when every group has one record); the indices are
    ``slice(None)`` when every record pairs, one to one and in order (a view, no copy)."""
    names: list[str]
    keys: list[Key]
    static_rows: list[tuple[Any, ...]]
    """Per pair: (phase, name, candidate name, type, call index, slot, ndim, dtype judged as)."""
    fused_pairs: list[int]
    """Pairs with a fused rule (statistics merged; full tensors combined per step)."""
    shape_mismatch: np.ndarray
    """1.0 where a 1:1 pair's shapes cannot match (and the mapping does not declare a permutation)."""
    tensor_pairs: list[tuple[int, int, int, bool]]
    """(pair, base record, candidate record, transpose) of 1:1 pairs whose full tensors can be compared."""
    sketch_pairs: list[tuple[int, int, int]]
    """(pair, base record, candidate record) whose sketches are keyed alike."""
    limits: np.ndarray
    """Configured tolerance [len(METRICS), pairs], before noise bands."""
    bandable: np.ndarray
    """[len(METRICS), pairs]: where a noise band may replace the configured tolerance."""
    phases: list[str]
    """Phase name of each pair (the baseline record's)."""
    judged: np.ndarray
    """Pairs that can be a divergence of their own (module inputs are evidence only)."""
    width: int = 0
    """The model's width as its parameters show it: the largest of each baseline matrix's smaller side
    (a transformer's hidden size); 0 without matrices.  Faithful noise grows with it (server/detect/origin.py)."""
    layout_mismatches: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    """(phase, name, baseline shape, candidate shape) of pairs left out as layout differences."""
    derived: dict[str, Any] = field(default_factory=dict)
    """What consumers of comparisons compute once per plan (per-phase index groups, masks), by consumer."""


class PlanCache:
    """Bounded LRU of join plans, held by whoever compares (a session: one per candidate run and rank).

    A plan is for one pair of record layouts, frameworks and arithmetic, and
    for the very mapping and tolerance objects it was planned with: those are
    compared by identity (they are not hashable, and a new mapping is a new
    object, never an old one changed), and held by the entry, so a plan is
    never reused for other rules.  Used under its owner's lock.
    """

    def __init__(self, size: int = MAX_PLANS) -> None:
        self._size = size
        self._plans: OrderedDict[_Hashed, list[tuple[NameMapping, ToleranceConfig, JoinPlan]]] = OrderedDict()
        # alias -> (anchors, key): a key found by the identity of its large parts, not hashed in full each step.
        self._aliases: dict[tuple, tuple[tuple, _Hashed]] = {}
        self._keys: dict[_Hashed, _Hashed] = {}  # each key of _plans to itself: aliases share it (identity is fast)
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._plans.values())

    def get(self, key: tuple, mapping: NameMapping, tolerances: ToleranceConfig,
            build: Callable[[], JoinPlan], alias: tuple[tuple, tuple] | None = None) -> JoinPlan:
        """The plan for ``key`` under ``mapping`` and ``tolerances``, built on a miss.

        ``alias``: (cheap key, anchors), where the cheap key is ``key`` with its large parts (the
        anchors, objects that stay the same from step to step) replaced by their ``id``.  A key met
        before under the same anchors is then found without hashing it again; the anchors are held
        and compared by identity, so an alias never stands for another key.
        """
        hashed = None
        if alias is not None:
            cheap, anchors = alias
            known = self._aliases.get(cheap)
            if known is not None and len(known[0]) == len(anchors) and all(
                    a is b for a, b in zip(known[0], anchors)):
                hashed = known[1]
        if hashed is None:
            hashed = _Hashed(key)
            hashed = self._keys.get(hashed, hashed)
            if alias is not None:
                if len(self._aliases) >= 4 * self._size:
                    self._aliases.clear()
                self._aliases[alias[0]] = (alias[1], hashed)
        entries = self._plans.get(hashed)
        if entries is not None:
            self._plans.move_to_end(hashed)
            for known_mapping, known_tolerances, plan in entries:
                if known_mapping is mapping and known_tolerances is tolerances:
                    self.hits += 1
                    return plan
        plan = build()
        self.misses += 1
        self._plans.setdefault(hashed, []).append((mapping, tolerances, plan))
        self._keys.setdefault(hashed, hashed)
        while len(self) > self._size:
            oldest_key, oldest = next(iter(self._plans.items()))
            oldest.pop(0)
            if not oldest:
                self._plans.popitem(last=False)
                self._keys.pop(oldest_key, None)
        return plan


class _Hashed:
    """A plan key with its hash computed once (a layout key is a large tuple); equal as the key is."""

    __slots__ = ("_hash", "key")

    def __init__(self, key: tuple) -> None:
        self.key = key
        self._hash = hash(key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Hashed) and (self is other or (self._hash == other._hash and self.key == other.key))


def build_plan(
    base: StepData,
    cand: StepData,
    *,
    mapping: NameMapping,
    tolerances: ToleranceConfig,
    base_framework: str,
    cand_framework: str,
    tf32: bool,
    shapes_are_layout: bool = False,
) -> JoinPlan:
    """``shapes_are_layout``: the runs' parallel layouts differ, so a 1:1 pair whose shapes cannot match is a
    layout difference (``layout_mismatches``), not compared and never a divergence."""
    pairs, fused_rules, unmatched_baseline, unmatched_candidate = join(base, cand, mapping)
    layout_mismatches: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = []
    if shapes_are_layout:
        kept = []
        for base_group, cand_group in pairs:
            i, j = base_group[0], cand_group[0]
            if base_group[0] not in fused_rules:
                transpose = int(base.phase[i]) in phases.PARAM_PHASES and layout.needs_transpose(
                    (base_framework, base.types[i], base.names[i]), (cand_framework, cand.types[j], cand.names[j]))
                if not layout.shapes_compatible(base.shapes[i], cand.shapes[j], transpose):
                    layout_mismatches.append((phases.name(int(base.phase[i])), base.names[i], base.shapes[i],
                                              cand.shapes[j]))
                    continue
            kept.append((base_group, cand_group))
        pairs = kept
    n = len(pairs)
    base_index = np.fromiter((group[0] for group, _ in pairs), dtype=np.int64, count=n)
    names = [group_name([base.names[x] for x in group]) for group, _ in pairs]
    keys = [(phases.name(int(base.phase[i])), names[k], int(base.call_index[i]), int(base.slot[i]))
            for k, i in enumerate(base_index.tolist())]
    shape_mismatch = np.zeros(n)
    tensor_pairs: list[tuple[int, int, int, bool]] = []
    sketch_pairs: list[tuple[int, int, int]] = []
    for k, (base_group, cand_group) in enumerate(pairs):
        if base_group[0] in fused_rules:
            continue
        i, j = base_group[0], cand_group[0]
        transpose = int(base.phase[i]) in phases.PARAM_PHASES and layout.needs_transpose(
            (base_framework, base.types[i], base.names[i]), (cand_framework, cand.types[j], cand.names[j])
        )
        if not layout.shapes_compatible(base.shapes[i], cand.shapes[j], transpose):
            permuted = sorted(base.shapes[i]) == sorted(cand.shapes[j]) and mapping.is_permuted(base.names[i])
            if not permuted:
                shape_mismatch[k] = 1.0
            continue
        tensor_pairs.append((k, i, j, transpose))
        # Sketches are keyed by the canonical index (a transposed layout was sketched as its transpose).
        canonical = tuple(reversed(cand.shapes[j])) if transpose else cand.shapes[j]
        if canonical == base.shapes[i]:
            sketch_pairs.append((k, i, j))

    # The runs' arithmetic: a float32 record computed from bfloat16 products carries their rounding.
    arithmetic = effective_dtype(*set(base.dtypes), *set(cand.dtypes), "tf32" if tf32 else "float32")
    limits = np.empty((len(METRICS), n))
    static_rows = []
    for k, (base_group, cand_group) in enumerate(pairs):
        i = base_group[0]
        dtype = base.dtypes[i]
        if dtype in PRECISION_ORDER:
            dtype = effective_dtype(dtype, cand.dtypes[cand_group[0]], arithmetic)
        limits[:, k] = [tolerances.for_record(keys[k][0], base.names[i], dtype)[m] for m in METRICS]
        static_rows.append((keys[k][0], names[k], group_name([cand.names[x] for x in cand_group]), base.types[i],
                            keys[k][2], keys[k][3], len(base.shapes[i]), dtype))
    exact = np.array([m in ("shape", "nonfinite") for m in METRICS])[:, None]
    return JoinPlan(
        pairs=pairs,
        fused_rules=fused_rules,
        unmatched_baseline=list(dict.fromkeys(unmatched_baseline)),
        unmatched_candidate=list(dict.fromkeys(unmatched_candidate)),
        base_index=base_index,
        gather_base=_gather_index([g for g, _ in pairs], len(base)),
        gather_cand=_gather_index([g for _, g in pairs], len(cand)),
        names=names,
        keys=keys,
        static_rows=static_rows,
        fused_pairs=[k for k, (group, _) in enumerate(pairs) if group[0] in fused_rules],
        shape_mismatch=shape_mismatch,
        tensor_pairs=tensor_pairs,
        sketch_pairs=sketch_pairs,
        limits=limits,
        bandable=~exact & np.isfinite(limits),
        phases=[key[0] for key in keys],
        judged=np.array([key[0] != "input" for key in keys], dtype=bool),
        width=max((min(base.shapes[g[0]]) for g, _ in pairs
                   if int(base.phase[g[0]]) in phases.PARAM_PHASES and len(base.shapes[g[0]]) == 2), default=0),
        layout_mismatches=layout_mismatches,
    )


def _gather_index(groups: list[list[int]], records: int) -> tuple[np.ndarray | slice, np.ndarray | None]:
    flat = np.fromiter((i for g in groups for i in g), dtype=np.int64)
    if len(flat) == len(groups):
        if len(flat) == records and np.array_equal(flat, np.arange(records)):
            return slice(None), None
        return flat, None
    return flat, np.cumsum([0] + [len(g) for g in groups[:-1]]).astype(np.int64)


def gather(table: dict[str, np.ndarray], index: tuple[np.ndarray, np.ndarray | None]) -> dict[str, np.ndarray]:
    """Rows of ``table`` per pair, parts of a fused group merged (exact for concatenations)."""
    flat, starts = index
    if starts is None:
        return {k: v[flat] for k, v in table.items()}
    out = {}
    for name, values in table.items():
        reduce = np.minimum if name == "min" else np.maximum if name in ("max", "abs_max") else np.add
        out[name] = reduce.reduceat(values[flat], starts)
    return out
