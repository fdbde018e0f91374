"""The preflight diff: a candidate's set-up against the baseline's, through the session's module matching.

Three parts, each giving findings grouped by (what, baseline value, candidate
value) with the baseline names they affect:

- run-wide values with the same category and key on both sides (versions and
  seeds of different frameworks are skipped: torch's and paddle's random
  generators differ, so their seeds say nothing about each other; versions of
  one framework, determinism flags and seeds are ``info``; anything else is a
  ``warning``);
- optimizer hyper-parameters per parameter: a candidate parameter maps to its
  baseline name(s) as its module does (a fused ``qkv_proj.weight`` to the
  ``q/k/v_proj.weight`` it stands for), and the values that apply to each are
  compared;
- per-module hyper-parameters of matched modules; a module the mapping does
  not name (``act_fn`` against ``activation_fn``) is paired with the only
  module of its parent that carries the same hyper-parameter on the other side.

A model config key one side lacks is compared with the other side's module
attribute of the same name (transformers' Ernie keeps ``attention_dropout`` on
its attention modules, paddleformers in its config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from twinstep.server.compare.mapping import NameMapping
from twinstep.server.preflight.values import equal, render
from twinstep.v1 import twinstep_pb2 as pb

MAX_AFFECTS = 20
#: Categories whose differences are context, not findings that change the numerics.
INFO_CATEGORIES = frozenset({"version", "determinism", "seed", "tf32"})
#: Categories compared only between runs of one framework (another framework's are another thing).
SAME_FRAMEWORK_CATEGORIES = frozenset({"version", "seed"})
#: What a category is called in a finding's message.
_WORDS = {"lr": "learning rate", "epsilon": "optimizer epsilon", "weight_decay": "weight decay",
          "betas": "Adam betas", "clipping": "gradient clipping", "loss_scaling": "loss scaling",
          "norm_eps": "norm epsilon", "activation": "activation", "rope_base": "rotary base",
          "dropout": "dropout", "config": "model config", "dtype": "default dtype", "autocast": "autocast",
          "precision": "float32 matmul precision", "optimizer": "optimizer", "momentum": "momentum"}


@dataclass
class _Group:
    category: str
    key: str
    baseline: str
    candidate: str
    scope: str  # "parameters", "modules" or "" (run-wide)
    affects: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)

    def add(self, name: str) -> None:
        if name not in self.seen:
            self.seen.add(name)
            self.affects.append(name)


class _Findings:
    def __init__(self) -> None:
        self.groups: dict[tuple[str, str, str, str], _Group] = {}

    def add(self, category: str, key: str, base: pb.SetupValue | None, cand: pb.SetupValue | None,
            scope: str = "", name: str | None = None) -> None:
        b, c = render(base), render(cand)
        group = self.groups.get((category, key, b, c))
        if group is None:
            group = self.groups[(category, key, b, c)] = _Group(category, key, b, c, scope)
        if name is not None:
            group.add(name)


def diff_setups(base: pb.Setup, cand: pb.Setup, mapping: NameMapping, candidate_run: str) -> list[pb.PreflightFinding]:
    """Every difference between the two set-ups, warnings first."""
    found = _Findings()
    _diff_values(base, cand, mapping, found)
    _diff_parameters(base, cand, mapping, found)
    _diff_modules(base, cand, mapping, found)
    findings = [_finding(group, candidate_run) for group in found.groups.values()]
    findings.sort(key=lambda f: (f.severity != "warning", f.category, f.key))
    return findings


def _severity(category: str) -> str:
    return "info" if category in INFO_CATEGORIES else "warning"


def _diff_values(base: pb.Setup, cand: pb.Setup, mapping: NameMapping, found: _Findings) -> None:
    theirs = {(v.category, v.key): v for v in cand.values}
    mine = {(v.category, v.key): v for v in base.values}
    for (category, key), value in mine.items():
        if category in SAME_FRAMEWORK_CATEGORIES and base.framework != cand.framework:
            continue
        other = theirs.get((category, key))
        if other is not None and not equal(value, other):
            found.add(category, key, value, other)
    # A config key one side lacks against the other side's module attribute of that name.
    for side, other, mapped in ((mine, cand, False), (theirs, base, True)):
        for (category, key), value in side.items():
            if category != "config" or (category, key) in (theirs if side is mine else mine):
                continue
            leaf = key.removeprefix("config.")
            for module in other.modules:
                for attribute in module.values:
                    if attribute.key == leaf and not equal(value, attribute):
                        b, c = (attribute, value) if mapped else (value, attribute)
                        name = module.name if mapped else mapping.to_baseline(module.name)
                        found.add(attribute.category, leaf, b, c, "modules", name)


def _parameter_values(setup: pb.Setup) -> dict[str, dict[str, pb.SetupValue]]:
    out: dict[str, dict[str, pb.SetupValue]] = {}
    for group in setup.groups:
        values = {v.key: v for v in group.values}
        for name in group.parameters:
            out[name] = values
    return out


def _baseline_names(name: str, mapping: NameMapping, fused_parts: dict[str, str], known: object) -> list[str]:
    """The baseline parameter (or module) names a candidate one stands for (a name both sides have wins)."""
    direct = mapping.to_baseline(name)
    if direct in known:  # type: ignore[operator]
        return [direct]
    if name in fused_parts:  # a part of a baseline module that the candidate keeps apart
        return [fused_parts[name]]
    module, dot, local = name.rpartition(".")
    for owner, suffix in ((module, dot + local), (name, "")):
        if owner:
            matched = mapping.fused_match("candidate", owner)
            if matched is not None:
                return [part + suffix for part in matched[1]]
    return [direct]


def _fused_parts(base_names: Iterable[str], mapping: NameMapping) -> dict[str, str]:
    """Candidate names that are parts of one fused baseline module -> that baseline name."""
    parts: dict[str, str] = {}
    if not mapping.fused:
        return parts
    for name in base_names:
        module, dot, local = name.rpartition(".")
        for owner, suffix in ((module, dot + local), (name, "")):
            if owner:
                matched = mapping.fused_match("baseline", owner)
                if matched is not None:
                    for part in matched[1]:
                        parts[part + suffix] = name
    return parts


def _diff_parameters(base: pb.Setup, cand: pb.Setup, mapping: NameMapping, found: _Findings) -> None:
    base_values = _parameter_values(base)
    if not base_values or not cand.groups:
        return
    fused = _fused_parts(base_values, mapping)
    for name, values in _parameter_values(cand).items():
        for base_name in _baseline_names(name, mapping, fused, base_values):
            mine = base_values.get(base_name)
            if mine is None:
                continue
            for key, value in mine.items():
                other = values.get(key)
                if other is not None and not equal(value, other):
                    found.add(value.category, key, value, other, "parameters", base_name)


def _diff_modules(base: pb.Setup, cand: pb.Setup, mapping: NameMapping, found: _Findings) -> None:
    base_modules = {m.name: {v.key: v for v in m.values} for m in base.modules}
    by_parent: dict[tuple[str, str], list[str]] = {}
    for name, values in base_modules.items():
        for key in values:
            by_parent.setdefault((_parent(name), key), []).append(name)
    cand_by_parent: dict[tuple[str, str], int] = {}
    for module in cand.modules:
        for value in module.values:
            cand_by_parent[(_parent(module.name), value.key)] = cand_by_parent.get((_parent(module.name), value.key), 0) + 1
    fused = _fused_parts(base_modules, mapping)
    for module in cand.modules:
        targets = [n for n in _baseline_names(module.name, mapping, fused, base_modules) if n in base_modules]
        for value in module.values:
            names = targets
            if not names and cand_by_parent.get((_parent(module.name), value.key)) == 1:
                parent = mapping.to_baseline(_parent(module.name)) if _parent(module.name) else ""
                siblings = by_parent.get((parent, value.key), [])
                names = siblings if len(siblings) == 1 else []
            for base_name in names:
                mine = base_modules[base_name].get(value.key)
                if mine is not None and not equal(mine, value):
                    found.add(mine.category, value.key, mine, value, "modules", base_name)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _finding(group: _Group, candidate_run: str) -> pb.PreflightFinding:
    words = _WORDS.get(group.category, group.category)
    what = words if group.key in (group.category, "") else f"{words} ({group.key})"
    where = ""
    if group.affects:
        count = len(group.affects)
        listed = ", ".join(group.affects[:3]) + (f" and {count - 3} more" if count > 3 else "")
        where = f" for {count} {group.scope if count > 1 else group.scope.rstrip('s')}: {listed}"
    message = (f"{what} differs: baseline {group.baseline}, candidate {candidate_run!r} {group.candidate}{where}")
    return pb.PreflightFinding(
        candidate_run=candidate_run, category=group.category, key=group.key, baseline=group.baseline,
        candidate=group.candidate, affects=group.affects[:MAX_AFFECTS],
        affects_unlisted=max(len(group.affects) - MAX_AFFECTS, 0), message=message, severity=_severity(group.category),
    )
