"""Candidate-to-baseline module name mapping (YAML rules).

Names match when identical.  A mapping file renames candidate modules:

    exact:  {decoder.final_layernorm: norm}        # a module and everything under it
    prefix: [{candidate: "model.", baseline: ""}]  # strip or swap a prefix
    regex:  [{pattern: '^decoder\\.layers\\.(\\d+)', replace: 'layers.\\1'}]

An exact rule on the longest matching module path of the candidate name wins;
otherwise every prefix rule, then every regex rule applies, and exact rules
are tried once more on the result (so exact names may be written either way).  Parameter names map
through their module path, so ``exact: {mlp.linear_fc1: mlp.up_proj}`` also maps
``mlp.linear_fc1.weight``.
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        self._cache: dict[str, str] = {}

    @property
    def empty(self) -> bool:
        return not (self.exact or self.prefix or self.regex)

    def to_baseline(self, candidate_name: str) -> str:
        cached = self._cache.get(candidate_name)
        if cached is not None:
            return cached
        name = self._apply(candidate_name)
        if len(self._cache) < 1_000_000:
            self._cache[candidate_name] = name
        return name

    def _apply(self, name: str) -> str:
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

    @classmethod
    def from_dict(cls, data: Any, where: str = "mapping") -> "NameMapping":
        """Build from parsed YAML; raises ValueError naming the offending option."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be a mapping with keys exact, prefix, regex")
        unknown = set(data) - {"exact", "prefix", "regex"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} (expected exact, prefix, regex)")
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
        return cls(exact=dict(exact), prefix=prefix, regex=regex)
