"""Which recording and which run: ``PATH[:RUN]`` resolved, and a recording's runs found without reading its data.

A scan reads only the hellos (and the notes): every other frame's body is
skipped, so finding the runs and ranks of a recording of tensors costs a pass
over its frame headers, not a decompression of its data.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from twinstep.server.journal.entries import Kind
from twinstep.server.record.format import (Description, RecordingError, RecordingReader, describe,
                                           recordings_in)
from twinstep.v1 import twinstep_pb2 as pb


@dataclass
class RecordedRun:
    """One run of a recording: its role, and per rank its first hello and the streams that spoke for it."""

    name: str
    baseline: bool
    reference: bool
    framework: str
    world_size: int
    hellos: dict[int, pb.Hello] = field(default_factory=dict)
    streams: dict[int, set[int]] = field(default_factory=dict)
    """rank -> the recording's stream numbers of that rank (more than one after a reconnect)."""

    @property
    def role(self) -> str:
        return "baseline" if self.baseline else "reference" if self.reference else "candidate"


@dataclass
class RecordingIndex:
    description: Description
    runs: dict[str, RecordedRun] = field(default_factory=dict)
    notes: list[dict] = field(default_factory=list)
    """NOTE frames (data refused from a step on) and the END frame's counts."""
    ended: bool = False
    """The recording was finished properly (its END frame was read)."""
    problem: str = ""
    """Why the scan stopped early (truncated, corrupt): the runs found before it are listed."""

    @property
    def path(self) -> pathlib.Path:
        return self.description.path

    def summary(self) -> str:
        runs = ", ".join(f"{r.name} ({r.role}, {r.framework}, {r.world_size} rank(s))" for r in self.runs.values())
        return f"{self.path}: session {self.description.session!r}, runs {runs or 'none'}"

    def run(self, name: str | None, default: str = "baseline") -> RecordedRun:
        """The run named ``name``; without one, the baseline (``default="baseline"``) or the first candidate."""
        if name:
            found = self.runs.get(name)
            if found is None:
                raise RecordingError(f"{self.path} has no run {name!r}; it holds: "
                                     f"{', '.join(self.runs) or 'no run'}{self._damage()}")
            return found
        wanted = [r for r in self.runs.values() if (r.baseline if default == "baseline" else not r.baseline)]
        if default != "baseline":
            wanted.sort(key=lambda r: r.reference)  # candidates before references
        if not wanted:
            raise RecordingError(f"{self.path} has no {default} run; name one as {self.path}:RUN "
                                 f"(runs: {', '.join(self.runs) or 'none'}){self._damage()}")
        return wanted[0]

    def _damage(self) -> str:
        return f" (runs that joined after the damage cannot be found: {self.problem})" if self.problem else ""


def scan(path: str | pathlib.Path) -> RecordingIndex:
    """The runs of a recording; RecordingError only when its file header cannot be read."""
    with RecordingReader(path) as reader:
        index = RecordingIndex(reader.description)
        try:
            for frame in reader.frames(want=lambda head: head.kind == Kind.HELLO):
                if frame.note is not None:
                    index.notes.append(frame.note)
                    continue
                assert frame.entry is not None
                try:
                    hello = pb.Hello.FromString(frame.entry.header)
                except Exception:
                    raise RecordingError(f"{reader.path} is corrupt at byte {frame.head.offset}: a hello that "
                                         "cannot be parsed", frame.head.offset) from None
                run = index.runs.get(hello.run)
                if run is None:
                    run = index.runs[hello.run] = RecordedRun(hello.run, hello.baseline, hello.reference,
                                                              hello.framework, hello.world_size)
                run.hellos.setdefault(hello.rank, hello)
                run.streams.setdefault(hello.rank, set()).add(frame.entry.stream)
        except RecordingError as error:
            index.problem = str(error)
        index.ended = reader.ended
    return index


def split_source(spec: str) -> tuple[pathlib.Path, str | None]:
    """``PATH[:RUN]`` -> (path, run or None); a path that exists as written wins over a split at its last colon."""
    path = pathlib.Path(spec).expanduser()
    if path.exists() or ":" not in spec:
        return path, None
    head, run = spec.rsplit(":", 1)
    return pathlib.Path(head).expanduser(), run or None


def find(path: str | pathlib.Path, session: str | None = None) -> pathlib.Path:
    """A recording file: ``path`` itself, or in directory ``path`` the newest recording of ``session``
    (of any session without one).  RecordingError, listing what is there, when none fits."""
    path = pathlib.Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise RecordingError(f"no recording at {path} (neither a file nor a directory)")
    found: list[tuple[float, pathlib.Path, str]] = []
    unreadable = 0
    for candidate in recordings_in(path):
        try:
            description = describe(candidate)
        except RecordingError:
            unreadable += 1
            continue
        found.append((description.created, candidate, description.session))
    matching = sorted(item for item in found if session is None or item[2] == session)
    if not matching:
        sessions = sorted({item[2] for item in found})
        what = f"of session {session!r} " if session else ""
        more = f" ({unreadable} unreadable file(s) skipped)" if unreadable else ""
        raise RecordingError(f"no recording {what}in {path}{more}; it holds recordings of: "
                             f"{', '.join(sessions) or 'nothing'}")
    return matching[-1][1]
