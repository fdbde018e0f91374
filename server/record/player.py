"""A recorded run played into a live session as its baseline, at the pace of the live candidates.

Each rank of the recorded run is played by a thread of its own that behaves
as that rank's client would: it joins with the recorded Hello, reads the
server's messages to it (Welcome, credits, halt commands) from a Connection's
outbox like a stream handler does, and sends the recorded inputs through the
same Session methods a stream's messages take (twinstep.server.journal.replay
applies them).  So pacing is the live server's own credit policy
(twinstep.server.runs.credits): a recorded step is fed only when the credit
allows it, that is at most ``window_steps`` ahead of the slowest live run of
its rank, and the session's alignment window holds what it would hold for a
live baseline.  Memory: each thread reads its recording a frame at a time
(twinstep.server.record.format), holding one step's tensor pieces at most.

Before its first step a rank waits for a live run of that rank to join (a
baseline alone would fill, then overflow, the alignment window).  A recording
that is truncated or damaged is played up to the damage; the session's report
then names the file, the byte and the last step played, and the recorded run
ends ``lost``, so the verdict cannot be ``aligned``.
"""

from __future__ import annotations

import logging
import pathlib
import threading

from twinstep.server.connection import Connection, StreamEnd, StreamFailure
from twinstep.server.errors import InputError
from twinstep.server.journal.entries import Kind
from twinstep.server.journal.replay import apply_entry
from twinstep.server.journal.store import JournalClosed
from twinstep.server.record.catalog import RecordedRun
from twinstep.server.record.format import NOTE, Frame, RecordingError, RecordingReader, entry_step
from twinstep.server.session import Session
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")

_POLL = 0.05
"""Seconds between looks at the session while waiting for a candidate to join (credits wake the player)."""
_IGNORED = (Kind.LEAVE, Kind.GIVE_UP, Kind.HALT)
"""The recorded stream's ends and halts: the live session decides its own (the player leaves at the end)."""


class RecordingPlayer:
    """Plays run ``run`` of the recording at ``path`` into ``session`` as its baseline (one thread per rank).

    ``baseline=False`` plays it as a candidate instead, paced by the session's baseline (benchmarks, and
    comparing two recordings through a live server's session).
    """

    def __init__(self, session: Session, path: str | pathlib.Path, run: RecordedRun, baseline: bool = True) -> None:
        self.session = session
        self.path = pathlib.Path(path)
        self.run = run
        self.baseline = baseline
        self._stop = threading.Event()
        self._ranks = [_RankPlayer(self, rank, streams) for rank, streams in sorted(run.streams.items())]
        self._threads = [threading.Thread(target=player.play, name=f"twinstep-replay-{session.name}-{player.rank}",
                                          daemon=True) for player in self._ranks]

    def start(self) -> "RecordingPlayer":
        for thread in self._threads:
            thread.start()
        logger.info("session %s: its baseline is run %r of the recording %s (%d rank(s)); waiting for a candidate",
                    self.session.name, self.run.name, self.path, len(self._threads))
        return self

    @property
    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)

    @property
    def waiting_for(self) -> set[str]:
        """What the ranks wait for now: "a candidate" (before the first step), "credit" (ahead of the live runs)."""
        return {player.waiting_for for player in self._ranks if player.waiting_for}

    @property
    def steps_played(self) -> int:
        return sum(player.steps for player in self._ranks)

    def stop(self, timeout: float = 2.0) -> None:
        """The server is stopping: stop feeding (the session keeps what was fed, in its journal if it has one)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)


class _RankPlayer:
    """One rank of the recorded run, behaving as its client."""

    def __init__(self, owner: RecordingPlayer, rank: int, streams: set[int]) -> None:
        self.owner = owner
        self.session = owner.session
        self.rank = rank
        self.streams = frozenset(streams)
        self.conn = Connection(f"recording:{owner.path.name}:{owner.run.name}:{rank}",
                               self.session.config.window.bytes)
        self.joined = False
        self.closed = False
        self.allowed = -1
        """The highest step the latest credit lets this rank send."""
        self.resume_after = -1
        """Steps up to this one the session holds already (a session restored from its journal)."""
        self.halt_at: int | None = None
        self.replaced = False
        self.steps = 0
        self.last_step = -1
        self.waiting_for = ""

    def play(self) -> None:
        problem = ""
        try:
            problem = self._feed()
        except JournalClosed:
            return  # the server is stopping; what was fed is journaled, a restarted server resumes after it
        except Exception:  # a player's fault ends this rank's playback, never the server
            logger.exception("session %s: playing rank %d of %s failed", self.session.name, self.rank, self.owner.path)
            problem = f"playing the recording {self.owner.path} failed (see the server log)"
        finally:
            self.conn.pieces.discard()
        if self.owner._stop.is_set() or self.replaced or not self.joined:
            if problem:
                logger.error("session %s: %s", self.session.name, problem)
            return
        if problem:
            self._tell(problem)
        try:
            if self.halt_at is not None and not self.closed:
                self.session.close_stream(self.conn, pb.Close(reason="halted", last_step=self.last_step))
            self.session.leave(self.conn, grace=0)
        except (InputError, JournalClosed):
            pass
        logger.info("session %s: recorded run %r rank %d played to its end (%d steps)", self.session.name,
                    self.owner.run.name, self.rank, self.steps)

    def _feed(self) -> str:
        """Feed the recording; returns why it stopped early ("" at its end, on a halt or a stop)."""
        try:
            with RecordingReader(self.owner.path) as reader:
                try:
                    for frame in reader.frames(want=lambda head: head.stream in self.streams):
                        if self._stopped() or not self._take(frame):
                            return ""
                except RecordingError as error:
                    if self.closed:  # damage past this rank's goodbye: its part of the recording is whole
                        logger.warning("session %s: %s (after the recorded run's end: it was played whole)",
                                       self.session.name, error)
                        return ""
                    return f"the recorded baseline is incomplete: {error}; {self._played()}"
                if not reader.ended and not self.closed and self.joined:
                    return (f"the recorded baseline is incomplete: {self.owner.path} ends without its end mark "
                            f"(cut between two frames, or its server died or still writes it); {self._played()}")
        except RecordingError as error:
            return str(error)
        except InputError as error:
            return (f"the session refused the recording {self.owner.path} (rank {self.rank}, after step "
                    f"{self.last_step}): {error.message}")
        return ""

    def _played(self) -> str:
        return (f"the run {self.owner.run.name!r} rank {self.rank} was played up to step {self.last_step} "
                f"({self.steps} steps)")

    def _take(self, frame: Frame) -> bool:
        """Apply one frame of this rank as its client would have sent it; False when playback must stop."""
        if frame.note is not None:
            if frame.head.type == NOTE:
                self._tell(f"the recording {self.owner.path} took no data from step "
                           f"{frame.note.get('refused_from_step')} on ({frame.note.get('reason')}): the recorded "
                           "run ends there")
            return True
        entry = frame.entry
        assert entry is not None
        if entry.kind is Kind.HELLO:
            self._join(pb.Hello.FromString(entry.header))
        elif entry.kind in _IGNORED or not self.joined:
            pass
        elif entry.kind in (Kind.PIECE, Kind.STEP):
            step = entry_step(entry.kind, entry.header)
            if step <= self.resume_after:
                return True  # the session holds it already
            if entry.kind is Kind.STEP and not self._wait_for_credit(step):
                return False
            apply_entry(self.session, entry, self.conn)
            if entry.kind is Kind.STEP:
                self.steps += 1
                self.last_step = step
                self._drain()
        else:
            apply_entry(self.session, entry, self.conn)
            self.closed = self.closed or entry.kind is Kind.CLOSE
        return True

    def _join(self, hello: pb.Hello) -> None:
        hello.baseline, hello.reference = self.owner.baseline, False  # the role it plays, whatever it was
        self.session.join(self.conn, hello)
        self.joined = True
        self._drain()

    def _stopped(self) -> bool:
        return self.owner._stop.is_set() or self.replaced

    def _wait_for_credit(self, step: int) -> bool:
        """Block until the session lets this rank send ``step``; False when it never will (halt, stop).

        A halt at step N (a run of several ranks stops at one step) lets the steps before N through,
        as a client's ``step()`` raises at N; a halt at -1 stops at once.
        """
        while True:
            self._drain()
            if self._stopped() or (self.halt_at is not None and (self.halt_at < 0 or step >= self.halt_at)):
                return False
            joined = self._counterpart_joined()
            if joined and step <= self.allowed:
                self.waiting_for = ""
                return True
            self.waiting_for = "credit" if joined else "a candidate"
            item = self.conn.next(_POLL)
            if item is not None:
                self._handle(item)

    def _counterpart_joined(self) -> bool:
        """A run to compare with joined on this rank, or none will (every such run has fewer ranks)."""
        return self.session.counterpart_joined(self.rank, self.owner.baseline)

    def _drain(self) -> None:
        while True:
            item = self.conn.next(0)
            if item is None:
                return
            self._handle(item)
            if isinstance(item, (StreamEnd, StreamFailure)):
                return

    def _handle(self, item: object) -> None:
        if isinstance(item, (StreamEnd, StreamFailure)):
            self.replaced = True  # a live stream took this run's rank over (the newest wins)
            return
        assert isinstance(item, pb.ServerMessage)
        body = item.WhichOneof("body")
        if body == "welcome":
            self.resume_after = item.welcome.last_step_received
        elif body == "credit":
            self.allowed = item.credit.max_step
        elif body == "command":
            command = item.command
            if command.kind == pb.Command.HALT:
                self.halt_at = command.at_step
            elif command.request_id:  # a question about where this rank is (halt prepare, zoom)
                self.session.halt_ack(self.conn, pb.HaltAck(request_id=command.request_id,
                                                            current_step=self.last_step))

    def _tell(self, message: str) -> None:
        """An error of this session: in its report's errors and to its watchers."""
        logger.error("session %s: %s", self.session.name, message)
        self.session.note_error(message, kind="recording")
