"""The heatmap's rows as a module tree: per phase, parents before children, siblings in call order.

A phase's records name modules (``layers.0.mlp.act``) or parameters (``layers.0.mlp.fc1.weight``);
the tree adds a node for every path prefix, so a row can be collapsed into its parent whether or not
the parent produced a record of its own.  Nodes are listed depth first, so a node's subtree is the
contiguous run of nodes up to its ``end``: a page collapses a node by showing the worst cell over
that range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twinstep.wire import phases


@dataclass(frozen=True)
class Node:
    phase: str
    path: str
    """Module or parameter path ("" for the phase itself, whose record, if any, is the whole model's)."""
    label: str
    """What a row shows: its last path component, or the phase's name."""
    depth: int
    row: int
    """Index of its record in the history's rows; -1 for a node that only groups others."""
    end: int
    """Index of the first node after its subtree."""
    type: str


@dataclass
class _Trie:
    row: int = -1
    type: str = ""
    children: dict[str, "_Trie"] = field(default_factory=dict)  # in order of first appearance


def module_tree(rows: tuple[tuple[str, str, str], ...] | list[tuple[str, str, str]]) -> list[Node]:
    """Nodes of every phase present in ``rows`` ((phase, name, type) in the order first recorded)."""
    roots: dict[str, _Trie] = {}
    for k, (phase, name, type_) in enumerate(rows):
        node = roots.setdefault(phase, _Trie())
        for part in path_parts(name):
            node = node.children.setdefault(part, _Trie())
        node.row, node.type = k, type_
    out: list[Node] = []
    order = {name: position for position, name in enumerate(phases.STEP_ORDER)}
    for phase in sorted(roots, key=lambda p: (order.get(p, len(order)), p)):
        _walk(roots[phase], phase, "", phase, 0, out)
    return out


def _walk(trie: _Trie, phase: str, path: str, label: str, depth: int, out: list[Node]) -> None:
    at = len(out)
    out.append(Node(phase, path, label, depth, trie.row, -1, trie.type))
    for part, child in trie.children.items():
        _walk(child, phase, f"{path}.{part}" if path else part, part, depth + 1, out)
    node = out[at]
    out[at] = Node(node.phase, node.path, node.label, node.depth, node.row, len(out), node.type)


def path_parts(name: str) -> list[str]:
    """``a.b.{q,k}.weight`` -> [a, b, {q,k}, weight]: dots inside a fused group's braces do not split."""
    if not name:
        return []
    parts, current, depth = [], [], 0
    for char in name:
        if char == "{":
            depth += 1
        elif char == "}":
            depth = max(0, depth - 1)
        if char == "." and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts
