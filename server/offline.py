"""Compare recorded runs in this process, through the Session a live server uses: no gRPC, same verdicts.

A recorded run is what its training's streams would have sent: per rank a Hello,
then Manifest deltas and StepRecords in step order (``twinstep compare-dumps``
makes them from msprobe dumps: twinstep.server.ingest.msprobe).  Each rank
becomes a stand-in Connection whose outbox is closed (nothing to send to), as
the journal's replay does; messages go through the same Session methods that
take a live stream's, so ingest, alignment, comparison, detection and the
report are the live server's code.  Steps are fed in step order, alternating
between the runs, so every pair is compared as soon as both halves are in and
the session holds few steps at a time.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from twinstep.server.config import ServerConfig
from twinstep.server.connection import Connection
from twinstep.server.report.builder import build_report
from twinstep.server.session import Session
from twinstep.v1 import twinstep_pb2 as pb


@dataclass
class RecordedRun:
    """One run: per rank its Hello and its messages (Manifest deltas and StepRecords, in step order)."""

    hellos: dict[int, pb.Hello]
    messages: dict[int, list[pb.Manifest | pb.StepRecords]] = field(default_factory=dict)


def compare_recorded(runs: list[RecordedRun], config: ServerConfig | None = None,
                     session: str = "offline") -> pb.Report:
    """The report of ``runs`` (the first is the baseline) judged as a live server would; InputError on bad input."""
    target = Session(session, config or ServerConfig())
    streams: list[tuple[Connection, list[pb.Manifest | pb.StepRecords]]] = []
    for run in runs:
        for rank, hello in sorted(run.hellos.items()):
            conn = Connection(f"offline:{hello.run}:{rank}", target.config.window_bytes)
            conn.finish()  # a closed outbox: welcomes, credits and events go nowhere
            conn.session, conn.run, conn.rank = hello.session, hello.run, rank
            target.join(conn, hello)
            streams.append((conn, run.messages.get(rank, [])))
    # Every stream's steps merged by step number (the baseline's first on a tie), each with its manifests.
    chunks = [[(step, k, chunk) for step, chunk in _by_step(messages)] for k, (_, messages) in enumerate(streams)]
    for _, k, chunk in heapq.merge(*chunks, key=lambda item: (item[0], item[1])):
        conn = streams[k][0]
        for message in chunk:
            if isinstance(message, pb.Manifest):
                target.add_manifest(conn, message)
            else:
                target.add_step(conn, message)
    for conn, messages in streams:
        last = max((m.step for m in messages if isinstance(m, pb.StepRecords)), default=-1)
        target.close_stream(conn, pb.Close(reason="finished", last_step=last))
        target.leave(conn)
    return build_report(target.snapshot())


def _by_step(messages: list[pb.Manifest | pb.StepRecords]) -> list[tuple[int, list[pb.Manifest | pb.StepRecords]]]:
    """(step, [its manifests..., its records]) in order; manifests after the last step go with it."""
    out: list[tuple[int, list[pb.Manifest | pb.StepRecords]]] = []
    chunk: list[pb.Manifest | pb.StepRecords] = []
    for message in messages:
        chunk.append(message)
        if isinstance(message, pb.StepRecords):
            out.append((message.step, chunk))
            chunk = []
    if chunk and out:
        out[-1][1].extend(chunk)
    return out
