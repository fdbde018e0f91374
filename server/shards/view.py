"""The coordinator's view of one session over every shard: the global first divergence, and when it is final.

Each shard declares divergences among its own ranks once its own frontier has
passed them.  The session's first divergence is the earliest any shard has
found (by the order of twinstep.server.detect.first_divergence: step, phase,
record, rank), and it is final once every shard that compares a rank of that
candidate has passed its step: the rule a single server applies across ranks
(ComparePipeline.declare), applied across shards.  Pure state over digests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twinstep.server.shards.ownership import shard_of


@dataclass(frozen=True)
class GlobalFirst:
    candidate: str
    shard: int
    """The shard whose ranks hold it (its report has the stage, culprit and tree)."""
    divergence: dict[str, Any]
    """The digest's form (twinstep.server.shards.digest.divergence_of)."""
    final: bool
    """Every shard comparing this candidate has passed its step: nothing earlier can appear."""
    waiting_for: tuple[int, ...] = ()
    """Shards whose frontier has not passed it yet (empty once final)."""


@dataclass
class SessionView:
    """One session as the shards' digests show it."""

    name: str
    shards: int
    key: str
    digests: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per shard index: its latest digest of this session (absent: the shard has not seen it)."""
    progress: dict[int, bytes] = field(default_factory=dict)
    """Per shard index: its latest Progress of this session (serialized), merged for watchers."""

    def update(self, shard: int, digest: dict[str, Any]) -> None:
        self.digests[shard] = digest

    def forget(self, shard: int) -> None:
        self.digests.pop(shard, None)

    # -- who is in it, over every shard ----------------------------------------------------------

    def runs(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for digest in self.digests.values():
            for name, run in digest["runs"].items():
                seen = out.setdefault(name, dict(run, joined=[]))
                seen["joined"] = sorted(set(seen["joined"]) | set(run["joined"]))
                seen["ended"] = seen.get("ended", True) and run["ended"]
        return out

    def baseline(self) -> str | None:
        return next((d["baseline"] for d in self.digests.values() if d.get("baseline")), None)

    def candidates(self) -> list[str]:
        names: dict[str, None] = {}
        for digest in self.digests.values():
            names.update(dict.fromkeys(digest["candidates"]))
        return list(names)

    def compared_world(self, candidate: str) -> int:
        runs = self.runs()
        base = runs.get(self.baseline() or "")
        cand = runs.get(candidate)
        if base is None or cand is None:
            return 0
        return min(base["world_size"], cand["world_size"])

    def participants(self, candidate: str) -> set[int]:
        """The shards that compare some rank of ``candidate`` against the baseline."""
        return {shard_of(self.name, rank, self.shards, self.key) for rank in range(self.compared_world(candidate))}

    def home(self) -> int:
        """The shard of rank 0: its report gives what only rank 0 has (set-ups, weights, named records)."""
        return shard_of(self.name, 0, self.shards, self.key)

    # -- the first divergence ---------------------------------------------------------------------

    def first(self, candidate: str) -> GlobalFirst | None:
        found = [(tuple(d["best"][candidate]["key"]), shard, d["best"][candidate])
                 for shard, d in self.digests.items() if candidate in d.get("best", {})]
        if not found:
            return None
        _, shard, divergence = min(found, key=lambda item: (item[0], item[1]))
        waiting = tuple(sorted(p for p in self.participants(candidate)
                               if p not in self.digests
                               or self.digests[p]["frontier"].get(candidate, -1) < divergence["step"]))
        return GlobalFirst(candidate, shard, divergence, final=not waiting, waiting_for=waiting)

    def firsts(self) -> dict[str, GlobalFirst]:
        out = {}
        for candidate in self.candidates():
            found = self.first(candidate)
            if found is not None:
                out[candidate] = found
        return out

    def steps_compared(self, candidate: str | None = None) -> int:
        """Steps compared on every rank: the fewest any comparing shard has (each counts its own ranks)."""
        names = [candidate] if candidate else self.candidates()
        shards = set().union(*(self.participants(name) for name in names)) if names else set()
        counts = [self.digests[s]["steps_compared"] for s in shards if s in self.digests]
        return min(counts) if counts and len(counts) == len(shards) else 0

    # -- what the shards cannot say alone ------------------------------------------------------------

    def layout_problem(self) -> str:
        """Why this session cannot be compared on shards keyed by rank ("" when it can)."""
        if self.key != "rank" or self.shards <= 1:
            return ""
        runs = self.runs()
        shapes = {name: tuple(run["shape"]) for name, run in runs.items()}
        if len(set(shapes.values())) <= 1:
            return ""
        described = ", ".join(f"{name!r} ({runs[name]['layout_text'] or str(runs[name]['world_size']) + ' ranks'})"
                              for name in shapes)
        return (f"the runs' parallel layouts differ ({described}): merging a run's ranks per logical tensor needs "
                f"all of them in one shard, and this server shards by rank, so records whose shapes differ are "
                f"named as layout differences, not compared; start the server with --shard-by session")
