"""Rebuild a session after a restart by replaying the inputs its journal holds.

Each entry goes to the session's core (twinstep.server.session.core) as the
same input it was the first time, on a stand-in Connection per journaled
stream.  The actions it returns are carried out by a handler that sends
nothing: what changes the session's own record is kept (alerts and
divergences its watchers will be shown), what would reach a stream, arm a
timer, start a zoom or journal again is dropped (the clients are gone, the
entries are in the journal).  A halt decided with reproducer bundles becomes a
plain halt: there is no run to ask where it is.  Log lines of the replay are
muted (they were logged the first time).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Iterable

from typing import Protocol

from twinstep.server.config import ServerConfig
from twinstep.server.connection import Connection
from twinstep.server.errors import InputError, invalid
from twinstep.server.journal.entries import Entry, Kind, leave_silence
from twinstep.server.session import Session
from twinstep.server.session.actions import Action, Alert, HaltWithBundle, Moment, Publish
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")


@dataclass
class Replayed:
    entries: int = 0
    failed: int = 0
    """Entries the session refused on replay (the journal and this server's code disagree)."""
    open_streams: list[Connection] = field(default_factory=list)
    """Streams that had not ended when the old server stopped: their clients are expected back."""


class _MuteThread(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


class Inputs(Protocol):
    """What a journal entry is applied to: a live Session, or its core during a replay."""

    config: ServerConfig

    def join(self, conn: Connection, hello: pb.Hello) -> object: ...
    def leave(self, conn: Connection, silent_for: float | None = None, grace: float | None = None) -> object: ...
    def give_up(self, conn: Connection) -> object: ...
    def close_stream(self, conn: Connection, message: pb.Close) -> object: ...
    def add_manifest(self, conn: Connection, message: pb.Manifest) -> object: ...
    def add_health(self, conn: Connection, health: pb.CaptureHealth) -> object: ...
    def add_setup(self, conn: Connection, setup: pb.Setup) -> object: ...
    def add_step(self, conn: Connection, message: pb.StepRecords) -> object: ...
    def halt(self, reason: str) -> object: ...


class _Replaying:
    """The session's core fed from its journal, its actions carried out by a handler that sends nothing.

    Only for a session being restored: it is not in the registry yet, so no other thread reaches it.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        self.config = session.config
        self.core = session.core

    def join(self, conn: Connection, hello: pb.Hello) -> None:
        self._carry_out(self.core.join(conn, hello, Moment.now()))

    def leave(self, conn: Connection, silent_for: float | None = None, grace: float | None = None) -> None:
        self._carry_out(self.core.leave(conn, Moment.now(), silent_for, grace))

    def give_up(self, conn: Connection) -> None:
        self._carry_out(self.core.give_up(conn, Moment.now()))

    def close_stream(self, conn: Connection, message: pb.Close) -> None:
        self._carry_out(self.core.close_stream(conn, message))

    def add_manifest(self, conn: Connection, message: pb.Manifest) -> None:
        self._carry_out(self.core.add_manifest(conn, message))

    def add_health(self, conn: Connection, health: pb.CaptureHealth) -> None:
        self._carry_out(self.core.add_health(conn, health))

    def add_setup(self, conn: Connection, setup: pb.Setup) -> None:
        self._carry_out(self.core.add_setup(conn, setup))

    def add_step(self, conn: Connection, message: pb.StepRecords) -> None:
        self._carry_out(self.core.add_step(conn, message, Moment.now()))

    def halt(self, reason: str) -> None:
        self._carry_out(self.core.halt(reason))

    def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Alert):
                self.session.events.publish(action.event(), keep=True)
            elif isinstance(action, Publish) and action.keep:
                self.session.events.publish(action.event, keep=True)
            elif isinstance(action, HaltWithBundle):
                self.halt(action.reason)
            # Anything else reaches streams, timers, zooms, the journal or the log: dropped.


def replay(session: Session, entries: Iterable[Entry]) -> Replayed:
    """Apply ``entries`` to a fresh ``session`` (whose journal is not yet attached)."""
    result = Replayed()
    streams: dict[int, Connection] = {}
    left: dict[int, Connection] = {}  # streams that ended (a lost one's GIVE_UP names it later)
    target = _Replaying(session)
    mute = _MuteThread()
    logger.addFilter(mute)
    try:
        for entry in entries:
            result.entries += 1
            try:
                _apply(target, entry, streams, left)
            except InputError as error:
                result.failed += 1
                logger.debug("journal replay of %s: entry %d refused: %s", session.name, entry.seq, error.message)
            except Exception:  # a journal this code cannot apply must not stop the server starting
                result.failed += 1
                logger.debug("journal replay of %s: entry %d failed", session.name, entry.seq, exc_info=True)
    finally:
        logger.removeFilter(mute)
    result.open_streams = list(streams.values())
    return result


def _apply(session: Inputs, entry: Entry, streams: dict[int, Connection], left: dict[int, Connection]) -> None:
    if entry.kind is Kind.HALT:
        session.halt(entry.header.decode(errors="replace"))
        return
    if entry.kind is Kind.HELLO:
        conn = Connection(f"journal:{entry.stream}", session.config.window.bytes)
        conn.finish()  # a closed outbox: the replay's credits and events go nowhere
        conn.stream_id = entry.stream
        streams[entry.stream] = conn
        session.join(conn, pb.Hello.FromString(entry.header))
        return
    conn = streams.get(entry.stream) or left.get(entry.stream)
    if conn is None:
        raise invalid(f"entry {entry.seq} names stream {entry.stream}, which never joined")
    if entry.kind is Kind.MANIFEST:
        session.add_manifest(conn, pb.Manifest.FromString(entry.header))
    elif entry.kind is Kind.HEALTH:
        session.add_health(conn, pb.CaptureHealth.FromString(entry.header))
    elif entry.kind is Kind.SETUP:
        session.add_setup(conn, pb.Setup.FromString(entry.header))
    elif entry.kind is Kind.PIECE:
        header = pb.TensorPiece.FromString(entry.header)
        conn.pieces.add(header, None if entry.payload is None else memoryview(entry.payload))
    elif entry.kind is Kind.STEP:
        session.add_step(conn, pb.StepRecords.FromString(entry.header))
    elif entry.kind is Kind.CLOSE:
        session.close_stream(conn, pb.Close.FromString(entry.header))
    elif entry.kind is Kind.LEAVE:
        del streams[entry.stream]
        conn.pieces.discard()
        session.leave(conn, silent_for=leave_silence(entry.header))
        left[entry.stream] = conn
    elif entry.kind is Kind.GIVE_UP:
        session.give_up(conn)


def apply_entry(session: Session, entry: Entry, conn: Connection) -> None:
    """Apply one entry of a stream that ``conn`` already joined, as a replay does (not HELLO or LEAVE).

    For other players of journaled inputs (twinstep.server.record.player): entry kinds
    added here later are applied there too.
    """
    _apply(session, entry, {entry.stream: conn}, {})
