"""``twinstep serve --record DIR``: every session's accepted inputs copied into a recording file of its own.

The copy is taken where the journal takes it (a session commits each input it
accepts, under its lock): each session's journal is wrapped by
:class:`RecordingJournal`, which hands the same rows to a bounded queue.  One
background thread compresses and writes them, so recording never holds a
session's lock for more than an append to a deque, and never blocks a stream.

Bounds, each told once in the log and counted (:meth:`Recorder.counts`):

- ``budget``: bytes the directory's recordings may take.  Past it the oldest
  finished recordings are deleted, oldest first; when only recordings still
  being written are left, a recording takes no more data (steps and tensor
  pieces): it stays a clean prefix of the session, ends with a note naming
  the first step refused, and the session's watchers are told.
- ``queue_bytes``: data waiting for the writer.  A step that does not fit is
  refused the same way (the disk or the core is slower than the streams).

Hellos, manifests, goodbyes and halts (kilobytes) are always written, so a
recording cut short still says how each run ended.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from twinstep.server.journal.entries import Entry, Kind
from twinstep.server.journal.store import NoJournal, SessionJournal
from twinstep.server.record.format import SUFFIX, RecordingWriter, entry_step, recordings_in
from twinstep.server.session import Session
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")

DEFAULT_BUDGET = 10 << 30
_QUEUE_BYTES = 256 << 20
"""Data waiting for the writer thread.  zstd level 3 compresses float32 tensors at ~500 MB/s on one core
(measured here), so the queue fills only when tensor streams outpace the disk or that core for seconds."""
_IDLE_SECONDS = 0.5
_DATA_KINDS = (Kind.PIECE, Kind.STEP)
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")

Row = tuple[Kind, int, bytes, object]


@dataclass
class Recording:
    """One session generation's recording (its file is created by the writer thread at the first entry)."""

    session: Session
    writer: RecordingWriter | None = None
    failure: str = ""
    """Why the file could not be written ("" while it can)."""
    refused: str = ""
    """Why data is no longer taken ("" while it is): the recording is a prefix of the session."""
    refused_from_step: int = -1
    steps: int = 0
    steps_refused: int = 0
    entries: int = 0
    dirty: bool = False
    closed: bool = False
    """Ended (END written, file closed): later appends of its session are ignored."""
    told: set[str] = field(default_factory=set)


class RecordingJournal:
    """A session's journal that also copies every accepted input into its recording.

    It is the journal to the session and the registry (``failure``, ``closed``
    and ``session_id`` are the journal's): appends go to the journal first (a
    server that is stopping refuses them there, before anything is recorded),
    then to the recorder's queue, which never raises and never blocks.
    """

    def __init__(self, inner: SessionJournal | NoJournal, recorder: "Recorder", recording: Recording) -> None:
        self.inner = inner
        self.recorder = recorder
        self.recording = recording

    @property
    def failure(self) -> str:
        return self.inner.failure

    @property
    def session_id(self) -> int:
        return self.inner.session_id

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def close(self) -> None:
        self.inner.close()

    def append(self, kind: Kind, stream: int, header: bytes, payload: object = None) -> bool:
        return self.append_many([(kind, stream, header, payload)])

    def append_many(self, rows: Sequence[Row]) -> bool:
        ok = self.inner.append_many(rows)
        self.recorder.add(self.recording, rows)
        return ok


class Recorder:
    """The recordings of one server: a directory, a byte budget, one writer thread."""

    def __init__(self, directory: str | pathlib.Path, budget: int = DEFAULT_BUDGET,
                 queue_bytes: int = _QUEUE_BYTES) -> None:
        self.directory = pathlib.Path(directory).expanduser().resolve()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create the recording directory {self.directory}: {exc.strerror or exc}") from None
        if not os.access(self.directory, os.W_OK):
            raise ValueError(f"the recording directory {self.directory} is not writable")
        self.budget = budget
        self.queue_bytes = queue_bytes
        self._cond = threading.Condition()
        self._queue: deque[tuple[Recording, object, int]] = deque()
        self._queued = 0
        self._open: list[Recording] = []
        self._finished: list[tuple[float, pathlib.Path, int]] = []  # (mtime, path, size): what may be evicted
        for path in recordings_in(self.directory):
            try:
                stat = path.stat()
            except OSError:
                continue
            self._finished.append((stat.st_mtime, path, stat.st_size))
        self._finished.sort()
        self.total_bytes = sum(size for _, _, size in self._finished)
        """Bytes of every recording in the directory, finished or being written."""
        self.protected: set[pathlib.Path] = set()
        """Recordings never evicted: those this server plays (--replay)."""
        self.evicted_recordings = 0
        self.evicted_bytes = 0
        self.refused_steps: dict[str, int] = {}
        """Steps not recorded, by reason ("budget", "writer_behind", "write_failed")."""
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="twinstep-recorder", daemon=True)
        self._thread.start()

    # -- the sessions' side (under their locks: O(1), never raises) ------------------------------

    def attach(self, session: Session, history: Iterable[Entry] | None = None) -> Recording:
        """Record ``session`` from now on; ``history``: the inputs it took before (a session restored
        from the journal), recorded first."""
        recording = Recording(session)
        with self._cond:
            self._open.append(recording)
            if history is not None:
                self._queue.append((recording, history, 0))
                self._cond.notify()
        session.journal = RecordingJournal(session.journal, self, recording)
        return recording

    def add(self, recording: Recording, rows: Sequence[Row]) -> None:
        """Queue the rows one append committed (a step: its pieces, then its records)."""
        try:
            data = any(kind in _DATA_KINDS for kind, *_ in rows)
            nbytes = sum(len(header) + _nbytes(payload) for _, _, header, payload in rows)
            with self._cond:
                if recording.closed:
                    return
                if data and (recording.refused or recording.failure):
                    self._count_refused(recording, rows, recording.failure and "write_failed" or recording.refused)
                    return
                if data and self._queued + nbytes > self.queue_bytes:
                    self._refuse(recording, rows, "writer_behind")
                    return
                self._queue.append((recording, list(rows), nbytes))
                self._queued += nbytes
                self._cond.notify()
        except Exception:  # the training comes first: a recording fault is logged, never raised into a stream
            logger.exception("recording of session %s: an entry could not be queued", recording.session.name)

    def counts(self) -> dict[str, object]:
        """What the recorder did: bytes held, recordings evicted, steps refused by reason."""
        with self._cond:
            return {"bytes": self.total_bytes, "budget": self.budget, "evicted_recordings": self.evicted_recordings,
                    "evicted_bytes": self.evicted_bytes, "refused_steps": dict(self.refused_steps),
                    "recordings": [str(r.writer.path) for r in self._open if r.writer is not None]}

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is queued (within ``timeout``), end every recording with its END frame, close the files."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("recorder: %d queued bytes were not written within %.1f s of the stop; the recordings "
                           "end before them", self._queued, timeout)

    # -- the writer thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._stopping:
                    self._cond.wait(_IDLE_SECONDS)
                item = self._queue.popleft() if self._queue else None
                if item is not None:
                    self._queued -= item[2]
                stopping = self._stopping and not self._queue
            if item is not None:
                self._safely(self._write, *item)
            if item is None or not self._queue:
                self._safely(self._flush_and_finish, stopping)
            if stopping:
                return

    def _safely(self, function, *args) -> None:
        try:
            function(*args)
        except Exception:  # the writer must not die: every later session would go unrecorded
            logger.exception("recorder: writing failed; going on with the next entry")

    def _write(self, recording: Recording, rows: object, nbytes: int) -> None:
        if isinstance(rows, list):
            self._write_rows(recording, rows)
            return
        group: list[Row] = []  # history from the journal: one group per step, as it was committed
        for entry in rows:  # type: ignore[attr-defined]
            group.append((entry.kind, entry.stream, entry.header, entry.payload))
            if entry.kind is not Kind.PIECE:
                self._write_rows(recording, group)
                group = []

    def _write_rows(self, recording: Recording, rows: list[Row]) -> None:
        if recording.closed:
            return
        data = any(kind in _DATA_KINDS for kind, *_ in rows)
        if data and (recording.refused or recording.failure):
            with self._cond:
                self._count_refused(recording, rows, recording.failure and "write_failed" or recording.refused)
            return
        writer = self._writer(recording)
        if writer is None:
            return
        frames = [writer.encode_entry(kind, stream, header, payload) for kind, stream, header, payload in rows]
        need = sum(map(len, frames))
        if data and not self._make_room(need):
            with self._cond:
                self._refuse(recording, rows, "budget")
            self._note_refusal(recording)
            return
        try:
            for frame in frames:
                self.total_bytes += writer.write(frame)
        except OSError as exc:
            self._fail(recording, f"{exc.strerror or exc}")
            return
        recording.entries += len(rows)
        recording.steps += sum(1 for kind, *_ in rows if kind is Kind.STEP)
        recording.dirty = True
        if recording.refused and "noted" not in recording.told:
            self._note_refusal(recording)

    def _writer(self, recording: Recording) -> RecordingWriter | None:
        if recording.writer is not None or recording.failure:
            return recording.writer
        session = recording.session
        stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(session.created))
        base = f"{_SAFE_NAME.sub('_', session.name)[:80] or 'session'}-{stamp}"
        for attempt in range(1000):
            path = self.directory / f"{base}{'-' + str(attempt) if attempt else ''}{SUFFIX}"
            try:
                recording.writer = RecordingWriter(path, session.name, session.created)
                break
            except FileExistsError:
                continue
            except OSError as exc:
                self._fail(recording, f"cannot create {path}: {exc.strerror or exc}")
                return None
        else:
            self._fail(recording, f"no free file name for {base}{SUFFIX} in {self.directory}")
            return None
        self.total_bytes += recording.writer.size
        logger.info("session %s: recording to %s", session.name, recording.writer.path)
        return recording.writer

    def _make_room(self, need: int) -> bool:
        """Evict the oldest finished recordings until ``need`` more bytes fit the budget; False if they cannot."""
        evictable = [item for item in self._finished if item[1].resolve() not in self.protected]
        while self.total_bytes + need > self.budget and evictable:
            item = evictable.pop(0)
            self._finished.remove(item)
            _, path, size = item
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.error("recorder: cannot evict %s (%s); it stays, and counts against --record-budget",
                             path, exc.strerror or exc)
                continue
            self.total_bytes -= size
            self.evicted_recordings += 1
            self.evicted_bytes += size
            logger.warning("recorder: evicted the oldest recording %s (%d bytes) to stay within --record-budget "
                           "%d bytes (%d evicted so far)", path.name, size, self.budget, self.evicted_recordings)
        return self.total_bytes + need <= self.budget

    def _refuse(self, recording: Recording, rows: Sequence[Row], reason: str) -> None:
        """The first data refused: from here on the recording takes no data (caller holds the lock)."""
        if not recording.refused:
            recording.refused = reason
            recording.refused_from_step = _first_step(rows)
            why = {"budget": f"the recordings in {self.directory} reached --record-budget ({self.budget} bytes) and "
                             "no finished recording is left to evict",
                   "writer_behind": f"the recorder's queue is full ({self.queue_bytes} bytes): the disk or the "
                                    "core is slower than the streams"}[reason]
            message = (f"recording stopped taking data at step {recording.refused_from_step}: {why}; the recording "
                       "keeps the steps before it (raise --record-budget or free space to record whole sessions)")
            logger.warning("session %s: %s", recording.session.name, message)
            recording.session.events.publish(pb.Event(alert=pb.AlertNotice(
                level="warning", message=message, kind="recording")), keep=True)
            if reason == "writer_behind":
                self._queue.append((recording, [], 0))  # the writer notes it in the file, in order
        self._count_refused(recording, rows, reason)

    def _count_refused(self, recording: Recording, rows: Sequence[Row], reason: str) -> None:
        steps = sum(1 for kind, *_ in rows if kind is Kind.STEP)
        recording.steps_refused += steps
        self.refused_steps[reason] = self.refused_steps.get(reason, 0) + steps

    def _note_refusal(self, recording: Recording) -> None:
        if recording.writer is None or "noted" in recording.told:
            return
        recording.told.add("noted")
        note = {"refused_from_step": recording.refused_from_step, "reason": recording.refused}
        try:
            self.total_bytes += recording.writer.write(recording.writer.encode_note(note))
        except OSError as exc:
            self._fail(recording, f"{exc.strerror or exc}")

    def _fail(self, recording: Recording, why: str) -> None:
        if not recording.failure:
            recording.failure = why
            logger.error("session %s: its recording stops: %s", recording.session.name, why)
            recording.session.events.publish(pb.Event(alert=pb.AlertNotice(
                level="warning", message=f"the recording of this session stopped: {why}", kind="recording")),
                keep=True)

    def _flush_and_finish(self, stopping: bool) -> None:
        """Flush what was written; end the recordings of sessions that left memory (all, when stopping)."""
        with self._cond:
            recordings = list(self._open)
        for recording in recordings:
            done = stopping or recording.session.archived
            if recording.writer is not None and (recording.dirty or done):
                try:
                    if done:
                        self._end(recording, "server stopped" if stopping else "session archived")
                    recording.writer.flush()
                except OSError as exc:
                    self._fail(recording, f"{exc.strerror or exc}")
                recording.dirty = False
            if done:
                with self._cond:
                    self._open.remove(recording)
                    recording.closed = True
                if recording.writer is not None:
                    recording.writer.close()
                    self._finished.append((time.time(), recording.writer.path, recording.writer.size))

    def _end(self, recording: Recording, why: str) -> None:
        writer = recording.writer
        assert writer is not None
        end = {"why": why, "entries": recording.entries, "steps": recording.steps,
               "steps_refused": recording.steps_refused, "refused": recording.refused,
               "refused_from_step": recording.refused_from_step}
        self.total_bytes += writer.write(writer.encode_note(end, final=True))


def _nbytes(payload: object) -> int:
    if payload is None:
        return 0
    if isinstance(payload, memoryview):
        return payload.nbytes
    return len(payload)  # type: ignore[arg-type]


def _first_step(rows: Sequence[Row]) -> int:
    return next((entry_step(kind, header) for kind, _, header, _ in rows if kind in _DATA_KINDS), -1)
