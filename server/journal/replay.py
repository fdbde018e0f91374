"""Rebuild a session after a restart by replaying the inputs its journal holds.

Each entry goes through the same Session method that took it the first time,
on a stand-in Connection per journaled stream whose outbox is closed (nothing
is sent to clients that are gone).  Halts are re-marked, not re-sent; log lines
of the replay are muted (they were logged the first time).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Iterable

from twinstep.server.connection import Connection
from twinstep.server.errors import InputError, invalid
from twinstep.server.journal.entries import Entry, Kind, leave_silence
from twinstep.server.session import Session
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


def replay(session: Session, entries: Iterable[Entry]) -> Replayed:
    """Apply ``entries`` to a fresh ``session`` (whose journal is not yet attached)."""
    result = Replayed()
    streams: dict[int, Connection] = {}
    left: dict[int, Connection] = {}  # streams that ended (a lost one's GIVE_UP names it later)
    mute = _MuteThread()
    logger.addFilter(mute)
    session.replaying = True
    try:
        for entry in entries:
            result.entries += 1
            try:
                _apply(session, entry, streams, left)
            except InputError as error:
                result.failed += 1
                logger.debug("journal replay of %s: entry %d refused: %s", session.name, entry.seq, error.message)
            except Exception:  # a journal this code cannot apply must not stop the server starting
                result.failed += 1
                logger.debug("journal replay of %s: entry %d failed", session.name, entry.seq, exc_info=True)
    finally:
        session.replaying = False
        logger.removeFilter(mute)
    result.open_streams = list(streams.values())
    return result


def _apply(session: Session, entry: Entry, streams: dict[int, Connection], left: dict[int, Connection]) -> None:
    if entry.kind is Kind.HALT:
        session.halt(entry.header.decode(errors="replace"))
        return
    if entry.kind is Kind.HELLO:
        conn = Connection(f"journal:{entry.stream}", session.config.window_bytes)
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
