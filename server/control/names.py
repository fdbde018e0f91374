"""Module names for a capture change: a divergent module's neighbours, and each run's own names.

A zoom is asked in the baseline's names.  The baseline and its references use
them as they are; a candidate gets, besides the patterns themselves, the exact
names of its own modules that its mapping pairs with a matching baseline
module (renamed, prefixed, mapped by layer rules).  Candidate modules its
manifest has not listed yet can only match the patterns directly.
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Iterable

from twinstep.wire import phases

#: Names sent to one run for one change, at most (beyond it the patterns alone are sent).
MAX_NAMES = 512


def parent(name: str) -> str:
    """The enclosing module's name ("" is the whole model, and its own parent)."""
    return name.rsplit(".", 1)[0] if "." in name else ""


def module_of(phase: str, name: str) -> str:
    """The module a record belongs to: itself, or a parameter's owner ("layers.0.fc1.weight" -> "layers.0.fc1")."""
    try:
        number = phases.value(phase)
    except ValueError:
        return name
    return parent(name) if number in phases.PARAM_PHASES else name


def neighbourhood(name: str, names: Iterable[str]) -> list[str]:
    """The module, its parent, its siblings and its children among one run's module names, in their order."""
    up = parent(name)
    keep = []
    for other in names:
        if other == name or (name and other == up) or (other and parent(other) in (up, name) and other != up):
            keep.append(other)
    if name not in keep:
        keep.insert(0, name)
    return keep


def escape(name: str) -> str:
    """A glob pattern matching exactly ``name``."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def for_candidate(patterns: list[str], candidate_names: Iterable[str], to_baseline: Callable[[str], str]) -> list[str]:
    """The patterns, plus the exact names of candidate modules whose baseline counterpart matches one."""
    out = list(patterns)
    for name in candidate_names:
        if len(out) >= MAX_NAMES:
            break
        if not matches(name, patterns) and matches(to_baseline(name), patterns):
            out.append(escape(name))
    return out
