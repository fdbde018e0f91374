"""Compare recorded runs in this process, through the Session a live server uses: no gRPC, same verdicts.

A recorded run is what its training's streams would have sent: per rank a Hello,
then Manifest deltas, capture health, tensor pieces and StepRecords in step
order, and perhaps its Close (``twinstep compare-dumps`` makes them from msprobe
dumps: twinstep.server.ingest.msprobe; ``twinstep compare-recordings`` reads
them from recordings: twinstep.server.record.compare).  Each rank
becomes a stand-in Connection whose outbox is closed (nothing to send to), as
the journal's replay does; messages go through the same Session methods that
take a live stream's, so ingest, alignment, comparison, detection and the
report are the live server's code.  Steps are fed in step order, alternating
between the runs, so every pair is compared as soon as both halves are in and
the session holds few steps at a time; each rank's messages are read lazily, so
a run need not fit in memory.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence, Union

from twinstep.server.config import ServerConfig
from twinstep.server.connection import Connection
from twinstep.server.ingest.wire import ReceivedPiece
from twinstep.server.report.builder import build_report
from twinstep.server.session import Session
from twinstep.v1 import twinstep_pb2 as pb

Message = Union[pb.Hello, pb.Manifest, pb.CaptureHealth, pb.Setup, ReceivedPiece, pb.StepRecords, pb.Close]
"""What a recorded stream holds after its first Hello (a later Hello: the rank reconnected)."""


@dataclass
class RecordedRun:
    """One run: per rank its Hello and its messages (Manifest deltas and StepRecords, in step order)."""

    hellos: dict[int, pb.Hello]
    messages: dict[int, Iterable[Message]] = field(default_factory=dict)
    """Per rank, in the order its stream sent them; iterated once, lazily."""
    close_missing: str = "finished"
    """A rank whose messages hold no Close: "finished" (a dump ends where its run did) or "lost"
    (a recording cut short: the rank ends lost, and the verdict cannot be aligned)."""


def compare_recorded(runs: list[RecordedRun], config: ServerConfig | None = None,
                     session: str = "offline", errors: Sequence[str] = ()) -> pb.Report:
    """The report of ``runs`` (the first is the baseline) judged as a live server would; InputError on bad input.

    ``errors``: problems met while reading the runs (a damaged recording), read once every run has
    been fed and listed among the report's errors.
    """
    target = Session(session, config or ServerConfig())
    streams: list[tuple[Connection, RecordedRun, _Progress]] = []
    chunks = []
    for run in runs:
        for rank, hello in sorted(run.hellos.items()):
            conn = Connection(f"offline:{hello.run}:{rank}", target.config.window.bytes)
            conn.finish()  # a closed outbox: welcomes, credits and events go nowhere
            conn.session, conn.run, conn.rank = hello.session, hello.run, rank
            target.join(conn, hello)
            progress = _Progress()
            chunks.append(_tagged(len(streams), _by_step(run.messages.get(rank, ()))))
            streams.append((conn, run, progress))
    # Every stream's steps merged by step number (the baseline's first on a tie), each with what preceded it.
    for _, k, chunk in heapq.merge(*chunks, key=lambda item: (item[0], item[1])):
        conn, _, progress = streams[k]
        for message in chunk:
            _feed(target, conn, message, progress)
    for conn, run, progress in streams:
        if not progress.closed and run.close_missing == "finished":
            target.close_stream(conn, pb.Close(reason="finished", last_step=progress.last_step))
        target.leave(conn, grace=0)
    target.add_errors(errors)
    return build_report(target.snapshot())


@dataclass
class _Progress:
    last_step: int = -1
    closed: bool = False


def _feed(target: Session, conn: Connection, message: Message, progress: _Progress) -> None:
    if isinstance(message, pb.StepRecords):
        target.add_step(conn, message)
        progress.last_step = max(progress.last_step, message.step)
    elif isinstance(message, ReceivedPiece):
        conn.pieces.add(message.header, message.data)
    elif isinstance(message, pb.Manifest):
        target.add_manifest(conn, message)
    elif isinstance(message, pb.CaptureHealth):
        target.add_health(conn, message)
    elif isinstance(message, pb.Setup):
        target.add_setup(conn, message)
    elif isinstance(message, pb.Close):
        target.close_stream(conn, message)
        progress.closed = True
    elif isinstance(message, pb.Hello):
        target.join(conn, message)
    else:
        raise TypeError(f"a recorded stream holds a {type(message).__name__}")


def _tagged(k: int, chunks: Iterator[tuple[int, list[Message]]]) -> Iterator[tuple[int, int, list[Message]]]:
    for step, chunk in chunks:
        yield step, k, chunk


def _by_step(messages: Iterable[Message]) -> Iterator[tuple[int, list[Message]]]:
    """(step, [what came before it..., its records]) in order; what follows the last step goes with it."""
    chunk: list[Message] = []
    last = -1
    for message in messages:
        chunk.append(message)
        if isinstance(message, pb.StepRecords):
            last = message.step
            yield last, chunk
            chunk = []
    if chunk:
        yield last, chunk
