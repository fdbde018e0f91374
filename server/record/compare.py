"""Two recorded runs judged offline by the server's own Session (``twinstep compare-recordings``).

Each side is one run of a recording, read lazily rank by rank (each rank's
frames only, a frame at a time) and fed through twinstep.server.offline, the
path compare-dumps takes: the same alignment, comparison, detection and report
as a live session.  A recording that is truncated or damaged is compared up to
the damage: the report lists where each reader stopped among its errors, and
the ranks it cut short end ``lost``, so the verdict cannot be ``aligned``.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Iterator

from twinstep.server import offline
from twinstep.server.config import ServerConfig
from twinstep.server.ingest.wire import ReceivedPiece
from twinstep.server.journal.entries import Kind
from twinstep.server.record.catalog import RecordedRun, RecordingIndex, find, scan, split_source
from twinstep.server.record.format import NOTE, RecordingError, RecordingReader
from twinstep.v1 import twinstep_pb2 as pb

SESSION = "compare-recordings"
_PARSERS = {Kind.MANIFEST: pb.Manifest, Kind.HEALTH: pb.CaptureHealth, Kind.SETUP: pb.Setup, Kind.STEP: pb.StepRecords,
            Kind.CLOSE: pb.Close}


@dataclass
class Side:
    """One run of one recording, and the name it has in the report."""

    index: RecordingIndex
    run: RecordedRun
    name: str

    def describe(self) -> str:
        return (f"run {self.run.name!r} ({self.run.role}, {self.run.framework}, {self.run.world_size} rank(s)) of "
                f"{self.index.path} (session {self.index.description.session!r})")


def resolve(a: str, b: str | None, session: str | None = None, names: tuple[str, str] | None = None) -> list[Side]:
    """The baseline side (``A``: ``PATH[:RUN]``, default its baseline) and the candidate side (``B``, default
    A's recording; its run default the first candidate).  RecordingError naming what cannot be found."""
    path_a, run_a = split_source(a)
    index_a = scan(find(path_a, session))
    if b is None:
        index_b, run_b = index_a, None
    else:
        path_b, run_b = split_source(b)
        found = find(path_b, session)
        index_b = index_a if found.resolve() == index_a.path.resolve() else scan(found)
    base = index_a.run(run_a)
    try:
        cand = index_b.run(run_b, default="candidate")
    except RecordingError:
        if index_b is index_a:
            raise
        cand = index_b.run(None)  # another recording's baseline, judged as the candidate
    if index_b is index_a and cand.name == base.name:
        raise RecordingError(f"A and B are the same run ({base.name!r} of {index_a.path}): name two runs")
    base_name, cand_name = names or (base.name, cand.name)
    if base_name == cand_name:
        cand_name = f"{cand_name}-b"
    return [Side(index_a, base, base_name), Side(index_b, cand, cand_name)]


def compare_sides(sides: list[Side], config: ServerConfig | None = None) -> tuple[pb.Report, list[str]]:
    """The report of the candidate side against the baseline side, and the problems met reading them."""
    problems: list[str] = []  # damage each rank's reader meets before its run's goodbye
    runs = [_recorded(side, baseline=k == 0, problems=problems) for k, side in enumerate(sides)]
    report = offline.compare_recorded(runs, config, SESSION, errors=problems)
    return report, problems


def _recorded(side: Side, baseline: bool, problems: list[str]) -> offline.RecordedRun:
    hellos = {rank: _as_run(hello, side.name, baseline) for rank, hello in side.run.hellos.items()}
    messages = {rank: _messages(side, rank, baseline, problems) for rank in side.run.hellos}
    return offline.RecordedRun(hellos, messages, close_missing="lost")


def _as_run(hello: pb.Hello, name: str, baseline: bool) -> pb.Hello:
    copy = pb.Hello()
    copy.CopyFrom(hello)
    copy.session, copy.run, copy.baseline, copy.reference = SESSION, name, baseline, False
    return copy


def _messages(side: Side, rank: int, baseline: bool, problems: list[str]) -> Iterator[offline.Message]:
    """One rank's recorded messages after its first Hello, read lazily; stops (and says so) at damage."""
    streams = frozenset(side.run.streams[rank])
    path = side.index.path
    joined = closed = False
    last_step = -1
    try:
        with RecordingReader(path) as reader:
            for frame in reader.frames(want=lambda head: head.stream in streams):
                if frame.note is not None:
                    if frame.head.type == NOTE:
                        problems.append(f"{path}: the recording took no data from step "
                                        f"{frame.note.get('refused_from_step')} on ({frame.note.get('reason')})")
                    continue
                entry = frame.entry
                assert entry is not None
                if entry.kind is Kind.HELLO:
                    if joined:  # the rank reconnected: it resends its manifest in full
                        yield _as_run(pb.Hello.FromString(entry.header), side.name, baseline)
                    joined = True
                elif entry.kind is Kind.PIECE:
                    data = None if entry.payload is None else memoryview(entry.payload)
                    yield ReceivedPiece(pb.TensorPiece.FromString(entry.header), data)  # type: ignore[arg-type]
                elif entry.kind in _PARSERS:
                    message = _PARSERS[entry.kind].FromString(entry.header)
                    if entry.kind is Kind.STEP:
                        last_step = message.step
                    closed = closed or entry.kind is Kind.CLOSE
                    yield message
            if not reader.ended and not closed:
                raise RecordingError(f"{path} ends without its end mark (cut between two frames, or its server "
                                     "died or still writes it)")
    except RecordingError as error:
        if closed:
            return  # damage past this rank's goodbye: its part of the recording is whole
        if str(error) not in problems:
            problems.append(str(error))
        read = f"up to step {last_step}" if last_step >= 0 else "before its first step"
        problems.append(f"run {side.name!r} rank {rank} was read {read}: the rest of {pathlib.Path(path).name} "
                        "could not be read")
