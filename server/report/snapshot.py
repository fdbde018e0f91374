"""A session as a report sees it: copied under the session's lock, read without it."""

from __future__ import annotations

from dataclasses import dataclass

from twinstep.server.compare.comparator import StepComparison
from twinstep.server.detect.first_divergence import Candidate
from twinstep.v1 import twinstep_pb2 as pb


@dataclass(frozen=True)
class CandidateSnapshot:
    """One candidate's comparison against the baseline, for its own section of the report."""

    run: str
    framework: str
    status: str
    """running | aligned | diverged | incomplete, for this candidate alone (detect.coverage.candidate_verdict)."""
    status_reasons: tuple[str, ...]
    halted: bool
    steps_compared: int
    """On every rank."""
    first: Candidate | None
    last_comparison: StepComparison | None
    coverage: str
    """Its Coverage.summary."""


@dataclass(frozen=True)
class SessionSnapshot:
    """Everything a Report says about one session at one moment.

    The comparisons it refers to (first divergence, last step compared) are
    never changed once made, so holding them is safe without the lock.
    """

    name: str
    status: str
    status_reasons: tuple[str, ...]
    halted: bool
    runs: tuple[pb.RunStatus, ...]
    steps_compared: int
    first: Candidate | None
    last_comparison: StepComparison | None
    unmatched_baseline: tuple[str, ...]
    unmatched_candidate: tuple[str, ...]
    errors: tuple[str, ...]
    proposed_mapping: dict[str, str] | None
    """The automatic matches of the first candidate that needed them."""
    coverage: tuple[pb.Coverage, ...]
    long_run: tuple[pb.LongRun, ...]
    headroom: tuple[pb.Headroom, ...]
    records: tuple[pb.NamedRecord, ...] = ()
    """Per candidate and name: the values the runs named (twinstep.server.detect.records)."""
    batch_sync: pb.BatchSync | None = None
    """What the baseline published for candidates (None: batch sync unused)."""
    zooms: tuple[pb.ZoomWindow, ...] = ()
    """Live capture changes asked of the runs (twinstep.server.control)."""
    tensor_steps: tuple[pb.TensorSteps, ...] = ()
    """Per candidate rank: steps compared with full tensors."""
    preflight: tuple[pb.PreflightFinding, ...] = ()
    operations: tuple[pb.OperationFinding, ...] = ()
    """Per capture of a module's operations and candidate rank: the first that differs (twinstep.server.ops)."""
    """Differences between the baseline's training set-up and each candidate's (twinstep.server.preflight)."""
    candidates: tuple[CandidateSnapshot, ...] = ()
    """Per candidate run, in the order they joined: its own verdict and first divergence."""
    layout_mode: str = ""
    layout_summary: str = ""
    layout_differences: tuple[pb.LayoutDifference, ...] = ()
    replica_mismatches: tuple[pb.ReplicaMismatch, ...] = ()
    merged_from: dict[str, str] | None = None
    """candidate run -> what its first divergence's records were merged from, in words (logical layouts)."""
