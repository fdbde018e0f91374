"""What a session core asks for, as data: the coordinator (or a replay) carries it out.

The core (twinstep.server.session.core) never sends, waits, logs as a side
effect, starts a thread or writes the journal: each input returns a list of
these, in the order they must happen.  Two handlers carry them out: the live
coordinator (coordinator.py: streams, watchers, timers, the journal, halts),
and the journal's replay (twinstep.server.journal.replay), which keeps what
changes the session's own record (kept events) and drops what would reach a
stream that is gone.

Connections appear here as handles: the core reads their identity (run, rank,
stream id) and their pending tensor pieces, and only a handler sends to them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from google.protobuf.message import Message

from twinstep.server.connection import Connection
from twinstep.server.journal.entries import Kind
from twinstep.v1 import twinstep_pb2 as pb

if TYPE_CHECKING:
    from twinstep.server.detect.first_divergence import Candidate

Row = tuple[Kind, int, bytes, object]
"""One journal entry: kind, stream id, header, payload (None, or a tensor piece's data)."""


@dataclass(frozen=True)
class Moment:
    """When an input happened, on both clocks: the core reads no clock of its own."""

    monotonic: float
    """time.monotonic(): silences, activity order."""
    wall: float
    """time.time(): when the session ended (kept in the journal's summary)."""

    @classmethod
    def now(cls) -> "Moment":
        return cls(time.monotonic(), time.time())


# -- to streams --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Queue one message to one stream (a Welcome, a zoom window, a halt on joining)."""

    conn: Connection
    message: pb.ServerMessage


@dataclass(frozen=True)
class SetCredit:
    """How far a stream may run ahead, and the highest step the server holds of it."""

    conn: Connection
    max_step: int
    acked_step: int


@dataclass(frozen=True)
class EndStream:
    """End a stream a newer one of the same rank replaced (the newest wins)."""

    conn: Connection


# -- to watchers and the log ---------------------------------------------------------------------


@dataclass(frozen=True)
class Publish:
    """Tell watchers ``event`` (``keep``: also later ones); then send the same event to ``streams``."""

    event: pb.Event
    keep: bool = True
    streams: tuple[Connection, ...] = ()


@dataclass(frozen=True)
class Alert:
    """A log line of the session, told to every watcher (and kept for watchers who come later)."""

    level: str
    message: str
    kind: str = ""
    run: str = ""
    rank: int = 0

    def event(self) -> pb.Event:
        return pb.Event(alert=pb.AlertNotice(level=self.level, message=self.message, kind=self.kind, run=self.run,
                                             rank=self.rank))


@dataclass(frozen=True)
class Log:
    """A log line only (logging level and text)."""

    level: int
    message: str


@dataclass(frozen=True)
class PublishProgress:
    """Tell watchers where the runs are now (``force``: even within a quarter second of the last time)."""

    force: bool = False


# -- durable and timed -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Commit:
    """One accepted input, for the journal: committed before anything else the input asks for, so no
    credit acknowledges what is not journaled.  The header is serialized only when a journal takes it."""

    kind: Kind
    stream: int
    header: bytes | Message

    def rows(self) -> list[Row]:
        header = self.header if isinstance(self.header, bytes) else self.header.SerializeToString()
        return [(self.kind, self.stream, header, None)]


@dataclass(frozen=True)
class CommitStep:
    """A step's records and the tensor pieces that came before them (skipped once the journal failed)."""

    stream: int
    message: pb.StepRecords
    pieces: tuple[tuple[pb.TensorPiece, object], ...]

    def rows(self) -> list[Row]:
        rows: list[Row] = [(Kind.PIECE, self.stream, header.SerializeToString(), data) for header, data in self.pieces]
        rows.append((Kind.STEP, self.stream, self.message.SerializeToString(), None))
        return rows


@dataclass(frozen=True)
class ArmGiveUp:
    """After ``after`` seconds, feed the core give_up(conn): the lost stream's reconnect grace ran out."""

    conn: Connection
    after: float


@dataclass(frozen=True)
class SessionEnded:
    """Every run has ended: the registry keeps the report and enforces the memory budget."""


# -- halts and live capture control ----------------------------------------------------------------


@dataclass(frozen=True)
class HaltTarget:
    run: str
    world_size: int
    streams: tuple[Connection, ...]


@dataclass(frozen=True)
class HaltRuns:
    """Halt every open stream of every run (ranks of a run at one step; ``at_step``: all there)."""

    targets: tuple[HaltTarget, ...]
    reason: str
    at_step: int | None = None

    @property
    def told(self) -> list[str]:
        return [target.run for target in self.targets if target.streams]


@dataclass(frozen=True)
class HaltRun:
    """Halt one candidate alone: the baseline goes on for the others."""

    target: HaltTarget
    reason: str


@dataclass(frozen=True)
class AutoZoom:
    """auto_zoom: the divergent module and its neighbours in full tensors for ``steps`` steps."""

    found: "Candidate"
    steps: int


@dataclass(frozen=True)
class AutoOps:
    """auto_ops: capture the operations of ``module`` (``candidate_module`` in the candidate's names)."""

    found: "Candidate"
    module: str
    candidate_module: str


@dataclass(frozen=True)
class HaltWithBundle:
    """bundle_on_halt: every run writes a reproducer bundle, then the session halts with ``reason``.

    Its halt comes back as the core's halt input once the runs are told where to stop; a handler
    that cannot ask the runs (a replay) feeds that halt at once.
    """

    found: "Candidate"
    reason: str


Action = Union[Send, SetCredit, EndStream, Publish, Alert, Log, PublishProgress, Commit, CommitStep, ArmGiveUp,
               SessionEnded, HaltRuns, HaltRun, AutoZoom, AutoOps, HaltWithBundle]


@dataclass
class Actions:
    """The actions one input caused, appended in the order they must be carried out."""

    items: list[Action] = field(default_factory=list)

    def add(self, action: Action) -> None:
        self.items.append(action)

    def alert(self, level: str, message: str, kind: str = "", run: str = "", rank: int = 0) -> None:
        self.items.append(Alert(level, message, kind, run, rank))
