"""The journal on disk: one SQLite database (WAL mode) per server journal directory.

Tables:

- ``sessions``: one row per session generation (a name reused after its
  session was archived starts a new generation): its times, verdict, runs,
  latest report, and whether it is archived (finished, out of memory, its
  inputs deleted, its report kept).
- ``entries``: the inputs each live session accepted, in order (see entries.py).

Every method takes the store's lock: the sessions of a server share one
connection, and SQLite takes one writer at a time anyway.
"""

from __future__ import annotations

import json
import logging
import pathlib
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from twinstep.server.journal.entries import Entry, Kind

logger = logging.getLogger("twinstep.server")

FORMAT_VERSION = 1
FILE_NAME = "journal.sqlite3"
SYNC_MODES = {"normal": "NORMAL", "full": "FULL"}
_READ_BATCH = 256

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    created REAL NOT NULL,
    last_active REAL NOT NULL,
    ended REAL NOT NULL DEFAULT 0,
    archived INTEGER NOT NULL DEFAULT 0,
    status TEXT NOT NULL DEFAULT 'running',
    runs TEXT NOT NULL DEFAULT '[]',
    steps_compared INTEGER NOT NULL DEFAULT 0,
    first_divergence TEXT NOT NULL DEFAULT '',
    report BLOB
);
CREATE INDEX IF NOT EXISTS sessions_by_name ON sessions (name, id);
CREATE TABLE IF NOT EXISTS entries (
    session INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    stream INTEGER NOT NULL,
    header BLOB NOT NULL,
    payload BLOB,
    PRIMARY KEY (session, seq)
) WITHOUT ROWID;
"""


class JournalError(ValueError):
    """The journal cannot be opened or used (the message says what to do)."""


class JournalClosed(Exception):
    """The server is stopping: inputs are no longer journaled, so they must not be accepted (nor acknowledged)."""


@dataclass(frozen=True)
class StoredSession:
    """A session's row: what ``twinstep sessions`` lists without loading it."""

    id: int
    name: str
    created: float
    last_active: float
    ended: float
    archived: bool
    status: str
    runs: tuple[str, ...]
    steps_compared: int
    first_divergence: str


class JournalStore:
    """A journal directory, opened by one server process at a time."""

    def __init__(self, directory: str | pathlib.Path, sync: str = "normal") -> None:
        if sync not in SYNC_MODES:
            raise JournalError(f"journal sync must be one of {sorted(SYNC_MODES)}, not {sync!r}")
        self.directory = pathlib.Path(directory).expanduser().resolve()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise JournalError(f"cannot create the journal directory {self.directory}: {exc}") from None
        self.path = self.directory / FILE_NAME
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
            # Another server on the same journal would interleave two histories: refuse it.
            self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise JournalError(f"the journal {self.path} cannot use SQLite's WAL mode (got {mode!r})")
            # NORMAL: a commit survives the server process dying (the tests' and most users' fault);
            # FULL also survives the machine losing power, at an fsync per commit.
            self._db.execute(f"PRAGMA synchronous={SYNC_MODES[sync]}")
            self._db.executescript(_SCHEMA)
            self._check_format()
        except sqlite3.OperationalError as exc:
            raise JournalError(f"cannot open the journal {self.path}: {exc} (is another twinstep server using it?)") from None
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"{self.path} is not a twinstep journal: {exc}") from None

    def _check_format(self) -> None:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('format', ?)", (str(FORMAT_VERSION),))
        elif int(row[0]) > FORMAT_VERSION:
            raise JournalError(f"the journal {self.path} has format {row[0]}, written by a newer twinstep; this one "
                               f"reads format {FORMAT_VERSION} (upgrade twinstep or use another --journal directory)")

    # -- sessions ----------------------------------------------------------------------------

    def open_session(self, name: str) -> "SessionJournal":
        """A new generation of session ``name``, journaled from its first input."""
        now = time.time()
        with self._lock:
            cursor = self._db.execute("INSERT INTO sessions (name, created, last_active) VALUES (?, ?, ?)",
                                      (name, now, now))
            return SessionJournal(self, int(cursor.lastrowid), next_seq=1)

    def resume(self, stored: StoredSession) -> "SessionJournal":
        """Keep journaling a session read back after a restart."""
        with self._lock:
            row = self._db.execute("SELECT MAX(seq) FROM entries WHERE session = ?", (stored.id,)).fetchone()
        return SessionJournal(self, stored.id, next_seq=(row[0] or 0) + 1)

    def live_sessions(self) -> list[StoredSession]:
        """Sessions that were in memory when the last server stopped, oldest first."""
        return [s for s in self.sessions() if not s.archived]

    def sessions(self) -> list[StoredSession]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, name, created, last_active, ended, archived, status, runs, steps_compared, "
                "first_divergence FROM sessions ORDER BY id").fetchall()
        return [StoredSession(row[0], row[1], row[2], row[3], row[4], bool(row[5]), row[6], tuple(json.loads(row[7])),
                              row[8], row[9]) for row in rows]

    def entries(self, session_id: int) -> Iterator[Entry]:
        """The inputs of a session in order, read in batches (a session's entries may not fit in memory)."""
        after = 0
        while True:
            with self._lock:
                rows = self._db.execute(
                    "SELECT seq, kind, stream, header, payload FROM entries WHERE session = ? AND seq > ? "
                    "ORDER BY seq LIMIT ?", (session_id, after, _READ_BATCH)).fetchall()
            if not rows:
                return
            for seq, kind, stream, header, payload in rows:
                yield Entry(seq, Kind(kind), stream, header, payload)
            after = rows[-1][0]

    def entry_bytes(self, session_id: int) -> int:
        with self._lock:
            row = self._db.execute("SELECT SUM(LENGTH(header) + IFNULL(LENGTH(payload), 0)) FROM entries "
                                   "WHERE session = ?", (session_id,)).fetchone()
        return int(row[0] or 0)

    def save_summary(self, session_id: int, *, status: str, runs: Sequence[str], steps_compared: int,
                     first_divergence: str, last_active: float, ended: float, report: bytes | None) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE sessions SET status = ?, runs = ?, steps_compared = ?, first_divergence = ?, last_active = ?, "
                "ended = ?, report = IFNULL(?, report) WHERE id = ?",
                (status, json.dumps(list(runs)), steps_compared, first_divergence, last_active, ended, report,
                 session_id))

    def archive(self, session_id: int) -> None:
        """The session left memory: keep its row and report, delete its inputs."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("UPDATE sessions SET archived = 1 WHERE id = ?", (session_id,))
                self._db.execute("DELETE FROM entries WHERE session = ?", (session_id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def report(self, name: str) -> bytes | None:
        """The stored report of the newest archived generation of ``name``."""
        with self._lock:
            row = self._db.execute("SELECT report FROM sessions WHERE name = ? AND archived = 1 AND report IS NOT NULL "
                                   "ORDER BY id DESC LIMIT 1", (name,)).fetchone()
        return None if row is None else bytes(row[0])

    # -- entries ------------------------------------------------------------------------------

    def append(self, session_id: int, first_seq: int, rows: Sequence[tuple[Kind, int, bytes, object]]) -> None:
        """Commit ``rows`` (kind, stream, header, payload) as consecutive entries, atomically."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "INSERT INTO entries (session, seq, kind, stream, header, payload) VALUES (?, ?, ?, ?, ?, ?)",
                    [(session_id, first_seq + i, int(kind), stream, header, payload)
                     for i, (kind, stream, header, payload) in enumerate(rows)])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass
            self._db.close()


class SessionJournal:
    """The entries of one session.  Appends happen under the session's lock, so their order is its order.

    A failed write (disk full, file removed) must not stop the trainings: the
    session goes on in memory, no longer durable, and says so once.
    """

    def __init__(self, store: JournalStore, session_id: int, next_seq: int) -> None:
        self.store = store
        self.session_id = session_id
        self._next = next_seq
        self.failure = ""
        """Why the journal stopped taking this session's entries ("" while it works)."""
        self.closed = False

    @property
    def last_seq(self) -> int:
        """The seq of the newest entry committed (0: none yet); a recorder copies a restored session up to it."""
        return self._next - 1

    def close(self) -> None:
        """From now on appends raise JournalClosed (caller holds the session's lock: no append is half done)."""
        self.closed = True

    def append(self, kind: Kind, stream: int, header: bytes, payload: object = None) -> bool:
        return self.append_many([(kind, stream, header, payload)])

    def append_many(self, rows: Sequence[tuple[Kind, int, bytes, object]]) -> bool:
        """Commit the rows; False (and no exception) once the journal has failed; JournalClosed once closed."""
        if self.closed:
            raise JournalClosed()
        if self.failure or not rows:
            return not self.failure
        try:
            self.store.append(self.session_id, self._next, rows)
        except (sqlite3.Error, OSError, ValueError) as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.error("journal %s: cannot write session %d any more (%s); it goes on in memory only and will not "
                         "survive a restart", self.store.path, self.session_id, self.failure)
            return False
        self._next += len(rows)
        return True


class NoJournal:
    """A server without a journal: every append is a no-op."""

    failure = ""
    session_id = 0
    closed = False

    def close(self) -> None:
        pass

    def append(self, kind: Kind, stream: int, header: bytes, payload: object = None) -> bool:
        return True

    def append_many(self, rows: Sequence[tuple[Kind, int, bytes, object]]) -> bool:
        return True
