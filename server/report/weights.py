"""The weight-sync part of a report: what a run loaded from the baseline's initial parameters.

From ``RunStatus.weight_sync`` (the run's Hello said it): the JSON form (schema:
``report.schema.json``, a run's ``weight_sync``) and the text lines under the run.
"""

from __future__ import annotations

from typing import Any

from twinstep.wire.codec import WIRE_TO_DTYPE
from twinstep.v1 import twinstep_pb2 as pb

_SHOWN = 10


def weight_sync_to_dict(run: pb.RunStatus) -> dict[str, Any] | None:
    """A run's ``weight_sync`` key: null when it loaded nothing from the baseline."""
    if not run.HasField("weight_sync"):
        return None
    w = run.weight_sync
    return {
        "baseline_run": w.baseline_run,
        "baseline_framework": w.baseline_framework,
        "loaded": [
            {"name": x.name, "sources": list(x.sources), "transposed": list(x.transposed), "groups": x.groups,
             "part": x.part if x.part >= 0 else None, "dtype": WIRE_TO_DTYPE.get(x.dtype, "unknown"),
             "candidate_dtype": WIRE_TO_DTYPE.get(x.candidate_dtype, "unknown")}
            for x in w.loaded
        ],
        "no_counterpart": list(w.no_counterpart),
        "unused": list(w.unused),
        "unlisted": w.unlisted,
        "bytes": w.bytes,
        "seconds": w.seconds,
    }


def weight_sync_lines(run: pb.RunStatus) -> list[str]:
    """Text lines under a run that loaded the baseline's weights (none otherwise)."""
    if not run.HasField("weight_sync"):
        return []
    w = run.weight_sync
    transposed = sum(1 for x in w.loaded if any(x.transposed))
    fused = sum(1 for x in w.loaded if len(x.sources) > 1)
    split = sum(1 for x in w.loaded if x.part >= 0)
    cast = sum(1 for x in w.loaded if x.dtype != x.candidate_dtype)
    lines = [f"    weights: loaded {len(w.loaded)} parameters ({w.bytes / 1e6:.1f} MB) from baseline run "
             f"{w.baseline_run!r} ({w.baseline_framework}) in {w.seconds:.2f} s: {transposed} transposed, "
             f"{fused} fused from parts, {split} split from a fused one, {cast} cast"
             + (f" ({w.unlisted} entries not listed)" if w.unlisted else "")]
    for label, names in (("without a counterpart (kept their own values)", w.no_counterpart),
                         ("baseline parameters unused", w.unused)):
        if names:
            more = f" ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
            lines.append(f"      {label}: " + ", ".join(names[:_SHOWN]) + more)
    return lines
