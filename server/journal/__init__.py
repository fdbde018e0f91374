"""The server's journal: sessions that survive a restart.

A session is journaled as the inputs it accepted, in the order it applied
them (hellos, manifests, capture health, tensor pieces, step records, goodbyes,
stream ends, halts), plus its latest report.  A restarted server replays each
live session's inputs through the same ingest, align, compare and detect code
that took them the first time, so its state, and therefore its report, is the
state of the same runs without the restart.

Why SQLite in WAL mode: it is in Python's standard library (no new
dependency), one file per journal, atomic multi-row commits (a step's tensor
pieces and its records land together or not at all), readers that never block
the writer, and a format users can inspect with the ``sqlite3`` shell.  A step
is acknowledged to its client only after its commit, which is what makes a
resend after any disconnect or restart exactly-once.
"""

from twinstep.server.journal.store import JournalStore, SessionJournal, StoredSession

__all__ = ["JournalStore", "SessionJournal", "StoredSession"]
