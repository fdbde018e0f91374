"""A session's operation captures: each run's trace kept until its counterpart arrives, then compared."""

from __future__ import annotations

from collections import OrderedDict

from twinstep.server.compare.tolerance import ToleranceConfig
from twinstep.server.ops.compare import compare_traces
from twinstep.server.ops.trace import OpTrace, decode_trace
from twinstep.v1 import twinstep_pb2 as pb

#: Captures (zoom, rank) one session keeps traces of; older ones are forgotten.
MAX_CAPTURES = 32
#: Findings one session keeps (the newest).
MAX_FINDINGS = 256


class OperationsInspector:
    """Called under the session's lock; compares once both sides of a capture are in."""

    def __init__(self, tolerances: ToleranceConfig) -> None:
        self.tolerances = tolerances
        self._traces: OrderedDict[tuple[int, int], dict[str, OpTrace]] = OrderedDict()
        self._findings: list[pb.OperationFinding] = []

    def add(self, message: pb.OpTrace, run: str, rank: int, step: int, baseline: str | None,
            candidates: list[str]) -> list[pb.OperationFinding]:
        """One run's trace (validated: InputError); the findings it completes."""
        trace = decode_trace(message, run, rank, step)
        key = (trace.zoom_id, rank)
        traces = self._traces.setdefault(key, {})
        self._traces.move_to_end(key)
        while len(self._traces) > MAX_CAPTURES:
            self._traces.popitem(last=False)
        if run in traces:
            return []  # one capture per run and rank (a resent step)
        traces[run] = trace
        base = traces.get(baseline or "")
        if base is None:
            return []
        done = []
        for name in candidates:
            cand = traces.get(name)
            if cand is not None and (name == run or run == baseline):
                done.append(compare_traces(base, cand, self.tolerances, name))
        self._findings.extend(done)
        del self._findings[:-MAX_FINDINGS]
        return done

    def to_proto(self) -> list[pb.OperationFinding]:
        return list(self._findings)
