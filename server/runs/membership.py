"""Who joined a session: its runs, their ranks and streams, and what each said about itself.

Membership validates a Hello (protocol, roles, world size, precision) and keeps
the bookkeeping of joining, reconnecting, closing and losing a stream.  It sends
nothing and compares nothing; the session calls it under its lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import grpc

from twinstep._version import SUPPORTED_PROTOCOL_VERSIONS
from twinstep.server.compare.tolerance import PRECISIONS
from twinstep.server.connection import Connection
from twinstep.server.errors import InputError, invalid
from twinstep.server.ingest.manifest import Manifest
from twinstep.server.layouts.mesh import RunLayout
from twinstep.v1 import twinstep_pb2 as pb

ENDED = ("finished", "halted", "lost")
_INF = float("inf")
#: Bounds on what a Hello may tell about its environment.
MAX_TEXT = 500
MAX_WARNINGS = 16
_MAX_ENVIRONMENT = 32
_MAX_WEIGHT_SYNC_BYTES = 4 << 20


@dataclass
class RankState:
    """One rank (training process) of one run."""

    connection: Connection | None = None
    state: str = "streaming"
    first_step: int = -1
    last_step: int = -1
    accounted_step: int = -1
    """The highest step this rank delivered or said it will not deliver: how far it has got."""
    client_dropped: dict[str, int] = field(default_factory=dict)
    """Steps the client dropped, by reason (cumulative, as the client last said)."""
    manifest: Manifest = field(default_factory=Manifest)
    health: pb.CaptureHealth | None = None
    """What the client could not capture (its latest cumulative snapshot)."""
    warnings: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    last_heard: float = 0.0
    """time.monotonic() of its stream's last message."""
    silent_for: float = -1.0
    """When lost: seconds between its last message and the end of its stream (-1: not lost)."""
    awaiting_return: bool = False
    """Lost, and still within reconnect_grace: it may come back and send what the server does not hold,
    so nothing it could still match is released and the verdict waits."""
    stride: int = 1
    """Steps between its last two deliveries (a run captured every N steps advances N at a time)."""
    records_received: int = 0
    """Records accepted from this rank, each counted once (resent steps are not counted again)."""
    steps_resent: int = 0
    """Steps this rank sent again (after a reconnect or a server restart) that the server already held."""
    capture_cost: pb.CaptureCost = field(default_factory=pb.CaptureCost)
    """What capture read on this rank, summed over the steps received (each once)."""
    weight_sync: pb.WeightSync | None = None
    """What this rank loaded from the baseline's initial parameters (Hello.weight_sync); None: nothing."""

    def add_cost(self, cost: pb.CaptureCost) -> None:
        add_cost(self.capture_cost, cost)

    def merge_dropped(self, counts: Mapping[str, int]) -> None:
        """Cumulative counters from the client: keep the largest seen (messages may come in any order)."""
        for key, count in counts.items():
            if count > self.client_dropped.get(key, 0):
                self.client_dropped[key] = count


@dataclass
class RunState:
    """One run (a training job of one or more ranks)."""

    name: str
    baseline: bool
    framework: str
    framework_version: str
    world_size: int
    capture: str
    max_lead: int
    reference: bool = False
    precision: str = "fp32"
    """Arithmetic of float32 matrix products: "fp32" or "tf32"."""
    share_weights: bool = False
    """The baseline shares its initial parameters (Hello.share_weights, as its latest stream said)."""
    layout: RunLayout | None = None
    """Its parallel layout, as its first rank to join declared it (twinstep.server.layouts.mesh)."""
    ranks: dict[int, RankState] = field(default_factory=dict)

    @property
    def state(self) -> str:
        states = {r.state for r in self.ranks.values()}
        if "streaming" in states or not states:
            return "streaming"
        for final in ("halted", "lost"):
            if final in states:
                return final
        return "finished"

    @property
    def ended(self) -> bool:
        """Every rank's stream ended for good (a lost rank within its reconnect grace has not)."""
        return self.state in ENDED and not any(r.awaiting_return for r in self.ranks.values())

    @property
    def last_step(self) -> int:
        return max((r.last_step for r in self.ranks.values()), default=-1)

    @property
    def first_step(self) -> int:
        return min((r.first_step for r in self.ranks.values() if r.first_step >= 0), default=-1)

    def effective_step(self, rank: int) -> float:
        """Highest step this rank will ever have accounted for by now (inf once its stream ended)."""
        state = self.ranks.get(rank)
        if state is None:
            return -1
        return _INF if state.state in ENDED and not state.awaiting_return else state.accounted_step


def check_hello(hello: pb.Hello) -> str:
    """Refuse a Hello no session could accept; returns its precision ("fp32" when unset)."""
    if hello.protocol_version not in SUPPORTED_PROTOCOL_VERSIONS:
        raise InputError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"unsupported protocol version {hello.protocol_version}; this server speaks "
            f"{', '.join(map(str, SUPPORTED_PROTOCOL_VERSIONS))} (upgrade the older side)",
        )
    if not hello.run:
        raise invalid("hello needs a run name")
    if hello.world_size < 1 or hello.rank >= hello.world_size:
        raise invalid(f"rank {hello.rank} is outside world size {hello.world_size}")
    if hello.baseline and hello.reference:
        raise invalid("a run is either the baseline or a reference rerun of it, not both")
    precision = hello.precision or "fp32"
    if precision not in PRECISIONS:
        raise invalid(f"unknown precision {hello.precision!r}; expected one of {', '.join(PRECISIONS)}")
    return precision


class Membership:
    """The runs of one session."""

    def __init__(self, session: str, max_runs: int = 16) -> None:
        self.session = session
        self.max_runs = max_runs
        self.runs: dict[str, RunState] = {}
        self.baseline: str | None = None

    @property
    def candidates(self) -> list[str]:
        """Runs judged against the baseline."""
        return [name for name, run in self.runs.items() if not run.baseline and not run.reference]

    @property
    def references(self) -> list[str]:
        """Reruns of the baseline that measure its own noise."""
        return [name for name, run in self.runs.items() if run.reference]

    @property
    def compared_runs(self) -> list[str]:
        """Every run but the baseline: candidates and references."""
        return [name for name, run in self.runs.items() if not run.baseline]

    def all_ended(self) -> bool:
        return bool(self.runs) and all(run.ended for run in self.runs.values())

    def join(self, conn: Connection, hello: pb.Hello, precision: str,
             now: float | None = None) -> tuple[RankState, Connection | None]:
        """Admit a stream as one rank of a run (a new run, or a rank joining or reconnecting).

        Returns the rank's state and the stream this one replaced, still open: the caller ends it
        (a reconnect whose old stream is not yet known dead: the newest wins).
        """
        run = self.runs.get(hello.run)
        if hello.baseline and self.baseline not in (None, hello.run):
            raise InputError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"session {self.session!r} already has baseline run {self.baseline!r}; "
                f"join {hello.run!r} as a candidate (baseline=False) or use another session",
            )
        if run is None:
            if len(self.runs) >= self.max_runs:
                raise InputError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"session {self.session!r} already holds {len(self.runs)} runs (max_runs_per_session); "
                                 f"run {hello.run!r} is refused")
            run = RunState(name=hello.run, baseline=hello.baseline, framework=hello.framework,
                           framework_version=hello.framework_version, world_size=hello.world_size,
                           capture=hello.capture, max_lead=hello.max_lead, reference=hello.reference,
                           precision=precision)
            self.runs[hello.run] = run
            if hello.baseline:
                self.baseline = hello.run
        elif (run.baseline, run.reference, run.world_size, run.framework) != (
            hello.baseline, hello.reference, hello.world_size, hello.framework
        ):
            raise InputError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run {hello.run!r} joined as baseline={run.baseline}, world_size={run.world_size}, "
                f"framework={run.framework!r}; this process says baseline={hello.baseline}, "
                f"world_size={hello.world_size}, framework={hello.framework!r}",
            )
        if hello.rank == 0:
            run.share_weights = hello.share_weights
        if run.layout is None or (hello.rank == 0 and hello.HasField("layout")):
            run.layout = RunLayout.of(hello.layout if hello.HasField("layout") else None, hello.world_size)
        rank_state = run.ranks.get(hello.rank)
        replaced = None
        if rank_state is None:
            rank_state = run.ranks[hello.rank] = RankState()
        elif rank_state.connection is not None and rank_state.connection is not conn:
            replaced = rank_state.connection
        rank_state.connection = conn
        rank_state.state = "streaming"
        rank_state.last_heard = time.monotonic() if now is None else now
        rank_state.silent_for = -1.0
        rank_state.awaiting_return = False
        rank_state.manifest = Manifest()  # a reconnecting client resends its manifest in full
        rank_state.warnings = [w[:MAX_TEXT] for w in hello.warnings[:MAX_WARNINGS]]
        rank_state.environment = {k[:64]: v[:MAX_TEXT] for k, v in list(hello.environment.items())[:_MAX_ENVIRONMENT]}
        rank_state.weight_sync = _bounded_weight_sync(hello)
        conn.session, conn.run, conn.rank = self.session, hello.run, hello.rank
        return rank_state, replaced

    def rank_of(self, conn: Connection) -> RankState:
        """The rank a joined stream speaks for (refused when the stream never joined or was replaced)."""
        run = self.runs.get(conn.run or "")
        state = run.ranks.get(conn.rank) if run else None
        if state is None or state.connection is not conn:
            raise InputError(grpc.StatusCode.FAILED_PRECONDITION, "stream is not joined (send Hello first)")
        return state

    def leave(self, conn: Connection, now: float | None = None) -> RunState | None:
        """The stream ended; returns its run when this stream was the rank's current one."""
        run = self.runs.get(conn.run or "")
        if run is None:
            return None
        rank_state = run.ranks.get(conn.rank)
        if rank_state is None or rank_state.connection is not conn:
            return None  # replaced by a newer stream
        rank_state.connection = None
        if not conn.closed_cleanly:
            rank_state.state = "lost"
            rank_state.silent_for = (time.monotonic() if now is None else now) - rank_state.last_heard
        return run

    def close(self, conn: Connection, message: pb.Close) -> None:
        rank_state = self.rank_of(conn)
        conn.closed_cleanly = True
        conn.close_reason = message.reason
        rank_state.state = "halted" if message.reason == "halted" else "finished"
        rank_state.merge_dropped(message.dropped)

    def connections(self, rank: int | None = None) -> list[Connection]:
        """Open streams, of every rank or of one."""
        return [state.connection for run in self.runs.values() for r, state in run.ranks.items()
                if state.connection is not None and (rank is None or r == rank)]

    def ordered(self) -> Iterator[RunState]:
        """The baseline first, then reference reruns, then candidates, each in the order they joined."""
        return iter(sorted(self.runs.values(), key=lambda r: (not r.baseline, not r.reference)))

    def status_rows(self, dropped_by_reason: Callable[[RunState], dict[str, int]]) -> list[pb.RunStatus]:
        out = []
        for run in self.ordered():
            by_reason = dropped_by_reason(run)
            status = pb.RunStatus(
                name=run.name, baseline=run.baseline, reference=run.reference, framework=run.framework,
                ranks=run.world_size, last_step=run.last_step, state=run.state, dropped=sum(by_reason.values()),
                dropped_by_reason=by_reason, first_step=run.first_step,
                records_received=sum(state.records_received for state in run.ranks.values()),
                steps_resent=sum(state.steps_resent for state in run.ranks.values()),
            )
            if run.layout is not None:
                status.layout.CopyFrom(run.layout.to_proto())
                status.layout_text = run.layout.text()
            for state in run.ranks.values():
                add_cost(status.capture_cost, state.capture_cost)
            for rank, state in sorted(run.ranks.items()):
                if state.health is not None:
                    status.health.append(pb.RankHealth(rank=rank, capture=state.health))
                for warning in state.warnings:
                    if warning not in status.warnings:
                        status.warnings.append(warning)
            first_rank = run.ranks.get(0) or next(iter(run.ranks.values()), None)
            if first_rank is not None:
                status.environment.update(first_rank.environment)
                if first_rank.weight_sync is not None:
                    status.weight_sync.CopyFrom(first_rank.weight_sync)
            out.append(status)
        return out


def _bounded_weight_sync(hello: pb.Hello) -> pb.WeightSync | None:
    """What a run loaded from the baseline, as kept for its report: lists beyond reason are counted, not kept."""
    if not hello.HasField("weight_sync"):
        return None
    sync = pb.WeightSync()
    sync.CopyFrom(hello.weight_sync)
    if sync.ByteSize() > _MAX_WEIGHT_SYNC_BYTES:
        sync.unlisted += len(sync.loaded) + len(sync.no_counterpart) + len(sync.unused)
        del sync.loaded[:], sync.no_counterpart[:], sync.unused[:]
    return sync


def add_cost(total: pb.CaptureCost, cost: pb.CaptureCost) -> None:
    """Add one capture cost to a running sum (fields are counters)."""
    total.bytes_captured += cost.bytes_captured
    total.bytes_read += cost.bytes_read
    total.stats_offloaded += cost.stats_offloaded
    total.stats_inline += cost.stats_inline
    total.boundary_us += cost.boundary_us
    total.steps += cost.steps
