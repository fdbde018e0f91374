"""Which record of the baseline goes with which of the candidate, and what a joined record is called.

Records are joined on (phase, baseline name, call index, slot): fused groups
first (one module on one side, its parts on the other), then by name after
the mapping (parameters under torch's local names: twinstep.wire.layouts).  Named records (phase record) join by their own names: no
mapping or fused rule applies to them.  Used once per pair of layouts by the planner; the comparator
names fused groups the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from twinstep.wire import phases
from twinstep.wire.layouts import canonical_parameter_name
from twinstep.server.compare.mapping import FusedRule, NameMapping
from twinstep.server.ingest.step import StepData

#: (baseline records, candidate records) compared as one: one of each, or a fused group against one.
Pair = tuple[list[int], list[int]]


@dataclass(frozen=True)
class RecordLabel:
    """A record listed as unmatched: its phase and module or parameter name ("" is the model's root).

    Code reads the two fields; ``str()`` renders it for a report ("forward:fc1", "forward:(model)").
    """

    phase: str
    name: str

    def __str__(self) -> str:
        return f"{self.phase}:{self.name or '(model)'}"


def join(base: StepData, cand: StepData, mapping: NameMapping
         ) -> tuple[list[Pair], dict[int, FusedRule], list[RecordLabel], list[RecordLabel]]:
    """Match records: fused groups first, then names (after mapping); in the baseline's order.

    Returns (pairs, fused rules keyed by the pair's first baseline record (each
    is in one pair only), unmatched baseline records, unmatched candidate records).
    """
    def key(data: StepData, i: int, name: str) -> tuple[int, str, int, int]:
        phase = int(data.phase[i])
        if phase in phases.PARAM_PHASES:  # MindSpore's gamma/beta/embedding_table join torch's weight/bias
            name = canonical_parameter_name(data.types[i], name)
        return (phase, name, int(data.call_index[i]), int(data.slot[i]))

    base_index = {key(base, i, name): i for i, name in enumerate(base.names)}
    pairs: list[Pair] = []
    fused_rules: dict[int, FusedRule] = {}
    used_base: set[int] = set()
    used_cand: set[int] = set()
    if mapping.fused:
        cand_index = {key(cand, j, name): j for j, name in enumerate(cand.names)}
        for side, data, index, used_single, used_parts in (
            ("candidate", cand, base_index, used_cand, used_base),
            ("baseline", base, cand_index, used_base, used_cand),
        ):
            for x, name in enumerate(data.names):
                if int(data.phase[x]) == phases.RECORD:
                    continue
                module, local = _split(int(data.phase[x]), name)
                matched = mapping.fused_match(side, module)
                if not matched:
                    continue
                rule, parts = matched
                found = [index.get(key(data, x, part + local)) for part in parts]
                if any(f is None or f in used_parts for f in found):
                    continue
                used_single.add(x)
                used_parts.update(found)  # type: ignore[arg-type]
                group = [f for f in found if f is not None]
                pair = (group, [x]) if side == "candidate" else ([x], group)
                pairs.append(pair)
                fused_rules[pair[0][0]] = rule
    unmatched_candidate: list[RecordLabel] = []
    for j, name in enumerate(cand.names):
        if j in used_cand:
            continue
        named = int(cand.phase[j]) == phases.RECORD
        i = base_index.get(key(cand, j, name if named else mapping.to_baseline(name)))
        if i is None or i in used_base:
            unmatched_candidate.append(RecordLabel(phases.name(int(cand.phase[j])), name))
            continue
        used_base.add(i)
        pairs.append(([i], [j]))
    pairs.sort(key=lambda pair: pair[0][0])
    unmatched_baseline = [RecordLabel(phases.name(int(base.phase[i])), base.names[i])
                          for i in range(len(base)) if i not in used_base]
    return pairs, fused_rules, unmatched_baseline, unmatched_candidate


def _split(phase: int, name: str) -> tuple[str, str]:
    """(module path, suffix): parameters follow their module through fused rules."""
    if phase in phases.PARAM_PHASES and "." in name:
        module, local = name.rsplit(".", 1)
        return module, "." + local
    return name, ""


def group_name(names: list[str]) -> str:
    """"a.b.{q,k,v}.weight" for parts that differ in one path component."""
    if len(names) == 1:
        return names[0]
    split = [n.split(".") for n in names]
    if len({len(s) for s in split}) == 1:
        differing = [i for i in range(len(split[0])) if len({s[i] for s in split}) > 1]
        if len(differing) == 1:
            d = differing[0]
            parts = split[0][:d] + ["{" + ",".join(s[d] for s in split) + "}"] + split[0][d + 1 :]
            return ".".join(parts)
    return "+".join(names)
