"""What each run's parallel layout is, in numbers and words, and whether a session merges ranks.

Two runs of one layout are compared rank by rank (rank r with rank r), as
they always were: each rank's records are the same slices on both sides, and
a divergence names its rank.  Runs of different layouts (TP=2 against TP=1,
DP=4 against DP=2, 8 ranks against 1) are compared per logical tensor: each
run's ranks are merged into one logical record set first (merge.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from twinstep.v1 import twinstep_pb2 as pb

RANKS = "ranks"
LOGICAL = "logical"
AUTO = "auto"
MODES = (AUTO, RANKS, LOGICAL)


_SOURCES = {"world": "inferred from the process group, no data-parallel wrapper seen"}


@dataclass(frozen=True)
class RunLayout:
    """One run's layout: its sizes along each kind of parallelism and its rank count."""

    world_size: int
    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    source: str = ""

    @classmethod
    def of(cls, place: pb.MeshPlace | None, world_size: int) -> "RunLayout":
        if place is None or not place.ByteSize():
            return cls(world_size=max(world_size, 1))
        return cls(world_size=max(world_size, 1), data=place.data_size or 1, tensor=place.tensor_size or 1,
                   pipeline=place.pipeline_size or 1, context=place.context_size or 1,
                   expert=place.expert_size or 1, source=place.source)

    @property
    def declared(self) -> bool:
        return bool(self.source) or any(n > 1 for n in (self.data, self.tensor, self.pipeline, self.context,
                                                        self.expert))

    @property
    def shape(self) -> tuple[int, ...]:
        """What two runs must share to be compared rank by rank: the ranks and how the model is split over
        them.  The data-parallel size follows (the ranks that hold one model part), and is left out: a run
        whose data parallelism was declared and one whose was not (each rank its own batch) line up rank by rank."""
        return (self.world_size, self.tensor, self.pipeline, self.context, self.expert)

    @property
    def checks_replicas(self) -> bool:
        """Its replicas are known to synchronise (a wrapper, a mesh, a declaration), so they must agree.

        A layout inferred from the process group alone ("world": no data-parallel wrapper seen) may be
        ranks that each train on their own, whose gradients legitimately differ."""
        return bool(self.source) and self.source != "world" and (self.data > 1 or self.tensor > 1)

    @property
    def unsupported(self) -> str:
        """Why its records cannot be merged ("" when they can)."""
        kinds = [name for name, n in (("context", self.context), ("expert", self.expert)) if n > 1]
        return f"{' and '.join(kinds)} parallelism is declared but not merged yet" if kinds else ""

    def text(self) -> str:
        """"TP=2 x DP=1 x PP=1, 2 ranks (torch-tp)"; "1 rank" for a run of one process with no layout."""
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        if not self.declared:
            return ranks if self.world_size == 1 else f"{ranks}, layout not declared"
        parts = [f"TP={self.tensor}", f"DP={self.data}", f"PP={self.pipeline}"]
        parts += [f"{k}={n}" for k, n in (("CP", self.context), ("EP", self.expert)) if n > 1]
        product = self.data * self.tensor * self.pipeline * self.context
        note = "" if product == self.world_size else f"; the sizes multiply to {product}"
        source = f", {_SOURCES.get(self.source, self.source)}" if self.source else ""
        return f"{' x '.join(parts)}, {ranks}{source}{note}"

    def to_proto(self) -> pb.MeshPlace:
        return pb.MeshPlace(data_size=self.data, tensor_size=self.tensor, pipeline_size=self.pipeline,
                            context_size=self.context, expert_size=self.expert, source=self.source)


def decide(setting: str, layouts: dict[str, RunLayout]) -> tuple[str, str]:
    """(mode, why in words) for runs whose layouts are ``layouts`` (run name -> layout)."""
    described = "; ".join(f"{name}: {layout.text()}" for name, layout in layouts.items())
    if setting == RANKS:
        return RANKS, f"compared rank by rank (comparison.layouts: ranks); {described}"
    unsupported = [f"{name} ({layout.unsupported})" for name, layout in layouts.items() if layout.unsupported]
    if setting == LOGICAL:
        return LOGICAL, f"each run's ranks merged per logical tensor (comparison.layouts: logical); {described}"
    if len({layout.shape for layout in layouts.values()}) <= 1:
        return RANKS, f"same layout on every run, compared rank by rank; {described}"
    if unsupported:
        return RANKS, (f"the layouts differ, but {', '.join(unsupported)}: compared rank by rank, and records "
                       f"whose shapes differ are named as layout differences; {described}")
    return LOGICAL, f"the layouts differ: each run's ranks merged per logical tensor; {described}"
