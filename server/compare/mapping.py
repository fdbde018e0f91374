"""Candidate-to-baseline module name mapping (YAML rules).

Names match when identical.  A mapping file renames candidate modules:

    exact:  {decoder.final_layernorm: norm}        # a module and everything under it
    prefix: [{candidate: "model.", baseline: ""}]  # strip or swap a prefix
    regex:  [{pattern: '^decoder\\.layers\\.(\\d+)', replace: 'layers.\\1'}]
    fused:                                         # one module on one side, several on the other
      - candidate: 'layers\\.(\\d+)\\.self_attn\\.qkv_proj'
        baseline: ['layers.\\1.self_attn.q_proj', 'layers.\\1.self_attn.k_proj', 'layers.\\1.self_attn.v_proj']
        groups: 2                                  # optional: chunks per part, interleaved (KV heads)
        axis: -1                                   # optional: the outputs' feature axis

The single side of a fused rule is a regular expression over that side's
module names (full match); the list side holds templates (``\\1`` refers to
its groups).  Their parameters follow (``qkv_proj.weight`` is compared with
``q_proj.weight``, ``k_proj.weight`` and ``v_proj.weight`` together).  Merged
statistics are exact for a concatenation in any order or interleaving; full
tensors need the order: each part is cut into ``groups`` equal chunks along
``axis`` and the fused tensor holds [p1_0, p2_0, p3_0, p1_1, p2_1, ...]
(``groups: 1``, the default, is a plain concatenation in the listed order).
``axis`` applies to outputs and output gradients; parameters are combined
along their own out axis (see comparator).

msprobe's class-keyed ``layer_mapping`` files are read too (config key
``layer_mapping_file``, or any mapping file with a ``TopLayer`` key): a key
under a class name maps a sub-path of every candidate module of that class,
and ``TopLayer`` applies to the root.

An exact rule on the longest matching module path of the candidate name wins;
otherwise every prefix rule, then every regex rule applies, and exact rules
are tried once more on the result (so exact names may be written either way).  Parameter names map
through their module path, so ``exact: {mlp.linear_fc1: mlp.up_proj}`` also maps
``mlp.linear_fc1.weight``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class NameMapping:
    exact: dict[str, str] = field(default_factory=dict)
    """Candidate module path -> baseline module path."""
    prefix: list[tuple[str, str]] = field(default_factory=list)
    """(candidate prefix, baseline prefix) pairs."""
    regex: list[tuple[re.Pattern[str], str]] = field(default_factory=list)
    """(pattern over the candidate name, replacement) pairs, applied with re.sub."""
    fused: list["FusedRule"] = field(default_factory=list)
    """One module on one side compared with several on the other."""
    layer_mapping: dict[str, dict[str, str]] = field(default_factory=dict)
    """msprobe format: class name -> {candidate sub-path: baseline sub-path}."""
    candidate_types: dict[str, str] = field(default_factory=dict)
    """Candidate module name -> class name, which layer_mapping needs (see bind)."""
    permuted: list[re.Pattern[str]] = field(default_factory=list)
    """Baseline modules whose outputs hold the same elements in another axis order
    (e.g. [B,S,H,D] vs [B,H,S,D]): statistics compare, full tensors are skipped."""

    def is_permuted(self, baseline_name: str) -> bool:
        return any(p.fullmatch(baseline_name) for p in self.permuted)

    def __post_init__(self) -> None:
        self._cache: dict[str, str] = {}

    @property
    def empty(self) -> bool:
        return not (self.exact or self.prefix or self.regex or self.fused or self.layer_mapping)

    def bind(self, candidate_types: dict[str, str]) -> "NameMapping":
        """A copy that knows the candidate's module classes (for layer_mapping rules)."""
        if not self.layer_mapping:
            return self
        return dataclasses.replace(self, candidate_types=dict(candidate_types))  # every other rule as it is

    def fused_match(self, side: str, module_name: str) -> tuple["FusedRule", list[str]] | None:
        """The fused rule for ``module_name`` of ``side`` and its parts' names: the rule says how to combine them."""
        for rule in self.fused:
            if rule.single_side == side:
                match = rule.pattern.fullmatch(module_name)
                if match:
                    return rule, [match.expand(template) for template in rule.parts]
        return None

    def to_baseline(self, candidate_name: str) -> str:
        cached = self._cache.get(candidate_name)
        if cached is not None:
            return cached
        name = self._apply(candidate_name)
        if len(self._cache) < 1_000_000:
            self._cache[candidate_name] = name
        return name

    def _apply(self, name: str) -> str:
        if self.layer_mapping:
            name = self._layer_mapping(name)
        exact = self._exact(name)
        if exact is not None:
            return exact
        for cand_prefix, base_prefix in self.prefix:
            if name.startswith(cand_prefix):
                name = base_prefix + name[len(cand_prefix):]
        for pattern, replacement in self.regex:
            name = pattern.sub(replacement, name)
        exact = self._exact(name)
        return name if exact is None else exact

    def _exact(self, name: str) -> str | None:
        """Apply the exact rule of the longest matching module path, if any."""
        if not self.exact:
            return None
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            mapped = self.exact.get(".".join(parts[:cut]))
            if mapped is not None:
                return ".".join(([mapped] if mapped else []) + parts[cut:])
        return None

    def _layer_mapping(self, name: str) -> str:
        """Translate along the candidate's module tree with msprobe's class-keyed rules."""
        parts = name.split(".") if name else []
        out: list[str] = []
        pos = 0
        while pos < len(parts):
            current = ".".join(parts[:pos])
            rules: dict[str, str] = {}
            if pos == 0:
                rules.update(self.layer_mapping.get("TopLayer", {}))
            rules.update(self.layer_mapping.get(self.candidate_types.get(current, ""), {}))
            step = None
            for end in range(len(parts), pos, -1):  # the longest sub-path wins
                target = rules.get(".".join(parts[pos:end]))
                if target is not None:
                    step = (end, target)
                    break
            if step is None:
                out.append(parts[pos])
                pos += 1
            else:
                pos, target = step
                if target:
                    out.append(target)
        return ".".join(out)

    @classmethod
    def from_dict(cls, data: Any, where: str = "mapping") -> "NameMapping":
        """Build from parsed YAML; raises ValueError naming the offending option."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be a mapping with keys exact, prefix, regex, fused")
        if "TopLayer" in data:
            return cls(layer_mapping=layer_mapping_from_dict(data, where))
        unknown = set(data) - {"exact", "prefix", "regex", "fused", "permuted"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} (expected exact, prefix, regex, fused, permuted; "
                             "msprobe layer_mapping files go in layer_mapping_file)")
        exact = data.get("exact") or {}
        if not isinstance(exact, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in exact.items()):
            raise ValueError(f"{where}.exact must map candidate names to baseline names (strings)")
        prefix = []
        for i, rule in enumerate(data.get("prefix") or []):
            if not isinstance(rule, dict) or set(rule) != {"candidate", "baseline"}:
                raise ValueError(f"{where}.prefix[{i}] needs exactly the keys candidate and baseline")
            prefix.append((str(rule["candidate"] or ""), str(rule["baseline"] or "")))
        regex = []
        for i, rule in enumerate(data.get("regex") or []):
            if not isinstance(rule, dict) or set(rule) != {"pattern", "replace"}:
                raise ValueError(f"{where}.regex[{i}] needs exactly the keys pattern and replace")
            try:
                regex.append((re.compile(str(rule["pattern"])), str(rule["replace"])))
            except re.error as exc:
                raise ValueError(f"{where}.regex[{i}].pattern is not a valid regex: {exc}") from None
        fused = [FusedRule.from_dict(rule, f"{where}.fused[{i}]") for i, rule in enumerate(data.get("fused") or [])]
        permuted = []
        for i, pattern in enumerate(data.get("permuted") or []):
            try:
                permuted.append(re.compile(str(pattern)))
            except re.error as exc:
                raise ValueError(f"{where}.permuted[{i}] is not a valid regex: {exc}") from None
        return cls(exact=dict(exact), prefix=prefix, regex=regex, fused=fused, permuted=permuted)


_FUSED_KEYS = frozenset({"candidate", "baseline", "axis", "groups"})


@dataclass
class FusedRule:
    single_side: str  # "candidate" or "baseline": the side holding one fused module
    pattern: re.Pattern[str]
    parts: list[str]
    axis: int = -1
    """Axis of outputs and output gradients along which the parts make up the fused tensor."""
    groups: int = 1
    """Chunks per part, interleaved: [p1_0, p2_0, ..., p1_1, p2_1, ...] (KV heads for a grouped qkv)."""

    @classmethod
    def from_dict(cls, rule: Any, where: str) -> "FusedRule":
        if not isinstance(rule, dict) or not {"candidate", "baseline"} <= set(rule) or set(rule) - _FUSED_KEYS:
            raise ValueError(f"{where} needs the keys candidate and baseline (optional: axis, groups)")
        cand, base = rule["candidate"], rule["baseline"]
        if isinstance(cand, str) and isinstance(base, list):
            side, single, parts = "candidate", cand, base
        elif isinstance(base, str) and isinstance(cand, list):
            side, single, parts = "baseline", base, cand
        else:
            raise ValueError(f"{where}: one of candidate/baseline must be a pattern, the other a list of names")
        if len(parts) < 2 or not all(isinstance(p, str) for p in parts):
            raise ValueError(f"{where}: the list side needs at least two names")
        axis, groups = rule.get("axis", -1), rule.get("groups", 1)
        # bool is an int subclass: `groups: true` is a typo, not 1.
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise ValueError(f"{where}.axis must be an integer (negative counts from the last axis), got {axis!r}")
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"{where}.groups must be a positive integer, got {groups!r}")
        try:
            pattern = re.compile(single)
        except re.error as exc:
            raise ValueError(f"{where}: {single!r} is not a valid regex: {exc}") from None
        return cls(side, pattern, list(parts), axis=axis, groups=groups)


def layer_mapping_from_dict(data: Any, where: str) -> dict[str, dict[str, str]]:
    """Validate an msprobe layer_mapping: class name -> {candidate sub-path: baseline sub-path}."""
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"{where}: an msprobe layer_mapping maps class names to {{sub-path: sub-path}}")
    return {str(cls): {str(a): "" if b is None else str(b) for a, b in rules.items()} for cls, rules in data.items()}
