"""The journal store: entries come back in order, archiving keeps the report, a newer format is refused, and a
journal that fails mid-session never stops the session."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, hello, manifest, step
from twinstep.server import ServerConfig, serve
from twinstep.server.config import JournalConfig
from twinstep.server.journal.entries import Kind
from twinstep.server.journal.store import JournalError, JournalStore
from twinstep.v1 import twinstep_pb2 as pb


def test_entries_come_back_in_order_and_archiving_keeps_only_the_report(tmp_path):
    store = JournalStore(tmp_path)
    journal = store.open_session("s")
    journal.append(Kind.HELLO, 1, b"hello")
    journal.append_many([(Kind.PIECE, 1, b"piece", memoryview(b"\x00\x01")), (Kind.STEP, 1, b"records", None)])
    journal.append(Kind.LEAVE, 1, b'{"silent_for": 2.5}')
    entries = list(store.entries(journal.session_id))
    assert [(e.seq, e.kind, e.header) for e in entries] == [
        (1, Kind.HELLO, b"hello"), (2, Kind.PIECE, b"piece"), (3, Kind.STEP, b"records"), (4, Kind.LEAVE, b'{"silent_for": 2.5}')]
    assert entries[1].payload == b"\x00\x01"
    resumed = store.resume(store.live_sessions()[0])
    resumed.append(Kind.HALT, 0, b"why")
    assert [e.seq for e in store.entries(journal.session_id)][-1] == 5
    report = pb.Report(session="s", status="aligned").SerializeToString()
    store.save_summary(journal.session_id, status="aligned", runs=["a", "b"], steps_compared=3, first_divergence="",
                       last_active=1.0, ended=2.0, report=report)
    store.archive(journal.session_id)
    assert list(store.entries(journal.session_id)) == [] and store.live_sessions() == []
    assert store.report("s") == report
    (row,) = store.sessions()
    assert (row.archived, row.status, row.runs, row.steps_compared) == (True, "aligned", ("a", "b"), 3)
    store.close()


def test_a_journal_of_a_newer_format_is_refused(tmp_path):
    JournalStore(tmp_path).close()
    db = sqlite3.connect(tmp_path / "journal.sqlite3")
    with db:
        db.execute("UPDATE meta SET value = '99' WHERE key = 'format'")
    db.close()
    with pytest.raises(JournalError, match="format 99, written by a newer twinstep"):
        JournalStore(tmp_path)


def test_a_failing_journal_leaves_the_session_going_in_memory(tmp_path):
    handle = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path))))
    values = np.linspace(-1, 1, 16)
    try:
        streams = []
        for run, baseline in (("torch", True), ("paddle", False)):
            stream = RawStream(handle.address).send(hello("f", run, baseline=baseline)).send(manifest((0, "fc", "Linear")))
            assert stream.next().WhichOneof("body") == "welcome"
            stream.send(step(0, [(0, values)]))
            streams.append(stream)
        wait_for(lambda: handle.report_proto("f").steps_compared == 1, timeout=10)
        handle.registry.store._db.close()  # the journal's file handle is gone: every later write fails
        for stream in streams:
            for number in (1, 2):
                stream.send(step(number, [(0, values)]))
        report = wait_for(lambda: (r := handle.report_proto("f")).steps_compared == 3 and r, timeout=10)
        assert any("the journal stopped taking this session" in error for error in report.errors), report.errors
        for stream in streams:
            stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=2)))
            stream.close()
            stream.wait_end()
        assert wait_for(lambda: handle.report_proto("f").status == "aligned", timeout=10)
    finally:
        handle.stop(grace=0.5)
