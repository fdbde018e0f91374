"""What a session does once it declares a candidate's first divergence.

Every divergence is told (the log, watchers, every stream).  Then one of:

- ``halt_on_divergence`` off: nothing stops; ``auto_zoom`` looks closer at the
  divergent module and ``auto_ops`` captures its operations;
- a divergence after uncompared steps with ``halt_after_gap`` off: the
  operator is told, and decides;
- ``bundle_on_halt``: every run writes a reproducer bundle, then halts;
- several candidates, another still within tolerance and needing the
  baseline: this candidate halts alone;
- otherwise the whole session halts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from twinstep.server.detect.first_divergence import Candidate
from twinstep.server.detect.gaps import describe as describe_gaps
from twinstep.server.ops.target import ops_target
from twinstep.server.runs.membership import ENDED
from twinstep.server.session.actions import Actions, AutoOps, AutoZoom, HaltRun, HaltTarget, HaltWithBundle, Log, \
    Publish
from twinstep.v1 import twinstep_pb2 as pb

if TYPE_CHECKING:
    from twinstep.server.session.core import SessionCore


class DivergencePolicy:
    """The decisions above, for one session (it remembers only whether a bundle halt has begun)."""

    def __init__(self) -> None:
        self.bundle_started = False

    def announce(self, core: "SessionCore", declared: list[Candidate], out: Actions) -> None:
        config = core.config
        for found in declared:
            row, comparison = found.row, found.comparison
            out.add(Log(logging.WARNING, (
                f"session {core.name}: first divergence of run {comparison.candidate_run!r} at step "
                f"{comparison.step} rank {comparison.rank}, {row.phase} of {row.name or '(model)'!r}: "
                f"{row.metric} {row.value:.3g} > {row.tolerance:.3g}")))
            divergence = found.to_proto()
            divergence.merged_from = core.pipeline.merged_from(comparison.candidate_run, row)
            out.add(Publish(pb.Event(divergence=divergence), keep=True, streams=tuple(core.members.connections())))
            where = (f"divergence at step {comparison.step}, {row.phase} of {row.name or '(model)'!r} "
                     f"({row.metric} {row.value:.3g} > {row.tolerance:.3g})")
            gap = ""
            if found.after_gap:
                gaps = describe_gaps(found.gaps_before, found.gaps_unlisted)
                gap = f"; it comes after a gap (the earliest among compared steps; it may have begun in {gaps})"
                out.alert("warning", f"run {comparison.candidate_run!r}: first divergence at step "
                          f"{comparison.step} comes after steps that were not compared: {gaps}")
            if not config.halt.on_divergence:
                if config.diagnosis.auto_zoom:
                    out.add(AutoZoom(found, config.diagnosis.auto_zoom_steps))
                target = ops_target(found) if config.diagnosis.auto_ops else None
                if target is not None:
                    out.add(AutoOps(found, *target))
                continue
            if found.after_gap and not config.halt.after_gap:
                out.alert("warning", f"not halting on the {where}{gap}: halt_after_gap is off, so the "
                          f"decision is yours (twinstep halt {core.name})")
                continue
            if config.halt.bundle and not self.bundle_started:
                self.bundle_started = True
                out.add(HaltWithBundle(found, where + gap))
                continue  # it halts once every run is told where to write its bundle
            if self._halt_alone(core, comparison.candidate_run, where + gap, out):
                continue  # other candidates are within tolerance: the baseline goes on for them
            core.halt_into(where + gap, None, out)

    def _halt_alone(self, core: "SessionCore", candidate: str, reason: str, out: Actions) -> bool:
        """Halt only ``candidate`` while another candidate still needs the baseline; False: halt all.

        Another candidate needs the baseline while it has not diverged and either streams or is
        ahead of the baseline (its comparison is not over).  With one candidate this is never
        the case, so a session halts whole at its first divergence, as it always did.  With
        several, each candidate stops at its own first divergence, and the baseline (and
        references) at the last one's, or at their end.
        """
        runs = core.runs
        base = runs.get(core.baseline or "")
        healthy = [name for name in core.candidates if name != candidate and name not in core.pipeline.tracker.declared
                   and (runs[name].state not in ENDED
                        or (base is not None and base.last_step < runs[name].last_step))]
        if not healthy:
            return False
        run = runs[candidate]
        text = f"run {candidate!r}: {reason}"
        if core.halts.halt_one(candidate, text):
            streams = tuple(s.connection for s in run.ranks.values() if s.connection is not None)
            out.add(HaltRun(HaltTarget(candidate, run.world_size, streams), text))
        return True
