"""What merging found, kept for the report: layout differences, replicas that disagree, provenance.

Bounded: at most MAX_DIFFERENCES names and MAX_REPLICA findings are kept (the
rest counted), so a run that declares nothing useful cannot grow it.
"""

from __future__ import annotations

from dataclasses import dataclass

from twinstep.server.layouts.merge import MergedStep, ReplicaFinding
from twinstep.v1 import twinstep_pb2 as pb

MAX_DIFFERENCES = 200
MAX_REPLICA = 100


@dataclass
class _Difference:
    run: str
    phase: str
    name: str
    reason: str
    first_step: int
    steps: int = 1


class LayoutLedger:
    def __init__(self) -> None:
        self._differences: dict[tuple[str, str, str], _Difference] = {}
        self.differences_unlisted = 0
        self._replicas: list[pb.ReplicaMismatch] = []
        self._replica_seen: set[tuple[str, str, str]] = set()
        self.replicas_unlisted = 0
        self.partial: dict[str, set[str]] = {}
        """run -> names of records that were partial sums (compared after their reduction instead)."""
        self._provenance: dict[str, dict[tuple[str, str], str]] = {}

    def add(self, run: str, step: int, merged: MergedStep) -> list[pb.ReplicaMismatch]:
        """Note what merging one step found; returns the replica mismatches seen for the first time."""
        self._provenance[run] = merged.provenance
        for skipped in merged.skipped:
            if skipped.kind == "partial":
                names = self.partial.setdefault(run, set())
                if len(names) < MAX_DIFFERENCES:
                    names.add(skipped.name)
                continue
            if skipped.kind == "incomplete":
                continue  # the step's coverage says which ranks did not send it
            self.difference(run, step, skipped.phase, skipped.name, skipped.reason)
        news = []
        for finding in merged.replicas:
            found = self._replica(run, step, finding)
            if found is not None:
                news.append(found)
        return news

    def add_replicas(self, run: str, step: int, merged: MergedStep) -> list[pb.ReplicaMismatch]:
        """Only the replica findings of a merge (runs compared rank by rank still check their replicas)."""
        return [found for finding in merged.replicas if (found := self._replica(run, step, finding)) is not None]

    def difference(self, run: str, step: int, phase: str, name: str, reason: str) -> None:
        key = (run, phase, name)
        known = self._differences.get(key)
        if known is not None:
            known.steps += 1
        elif len(self._differences) < MAX_DIFFERENCES:
            self._differences[key] = _Difference(run, phase, name, reason, step)
        else:
            self.differences_unlisted += 1

    def _replica(self, run: str, step: int, finding: ReplicaFinding) -> pb.ReplicaMismatch | None:
        key = (run, finding.phase, finding.name)
        if key in self._replica_seen:
            return None  # its first step is the one that matters; later steps inherit it
        if len(self._replicas) >= MAX_REPLICA:
            self.replicas_unlisted += 1
            return None
        self._replica_seen.add(key)
        odd = ", ".join(map(str, finding.odd))
        agreeing = ", ".join(map(str, finding.agreeing))
        if finding.tie:
            who = (f"replicas on ranks {odd} and {agreeing} disagree, and no majority says which is right "
                   "(more replicas, or the baseline's value, would)")
        else:
            who = f"the replica on rank{'s' if len(finding.odd) > 1 else ''} {odd} differs from ranks {agreeing}"
        text = (f"run {run!r} step {step}: {finding.phase} of {finding.name!r} should be identical on every "
                f"data-parallel replica, but {who} ({finding.statistic} {finding.value:.9g} vs "
                f"{finding.expected:.9g}): a replica computed or received something else")
        mismatch = pb.ReplicaMismatch(run=run, step=step, phase=finding.phase, name=finding.name, ranks=finding.odd,
                                      agreeing=finding.agreeing, statistic=finding.statistic,
                                      value=finding.value, expected=finding.expected, text=text)
        self._replicas.append(mismatch)
        return mismatch

    def partial_words(self) -> str:
        """Which records were partial sums, in words ("" when none): the report says they were left out."""
        if not self.partial:
            return ""
        runs = [f"run {run!r}: {', '.join(sorted(names)[:10])}" + (f" and {len(names) - 10} more" if len(names) > 10
                                                                    else "")
                for run, names in sorted(self.partial.items())]
        return ("partial sums awaiting their reduction were not compared (the records after the reduction were): "
                + "; ".join(runs))

    def provenance(self, run: str, phase: str, name: str) -> str:
        return self._provenance.get(run, {}).get((phase, name), "")

    def differences(self) -> list[pb.LayoutDifference]:
        return [pb.LayoutDifference(run=d.run, phase=d.phase, name=d.name, reason=d.reason, first_step=d.first_step,
                                    steps=d.steps) for d in self._differences.values()]

    def replica_mismatches(self) -> list[pb.ReplicaMismatch]:
        return list(self._replicas)
