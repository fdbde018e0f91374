"""Recordings: the file format reads back what was written and never more than an intact prefix of a damaged
file; the recorder keeps to its budget (oldest finished recordings evicted, then steps refused, each told and
counted); a recorded baseline is played at the live candidate's pace, and a truncated one up to where it ends.

Sessions here are driven by hand-made streams over real gRPC on loopback (tests/integration/rawclient.py);
tests/integration/test_record_replay.py does it with real torch and paddle jobs.
"""

from __future__ import annotations

import logging
import pathlib
import struct

import numpy as np
import pytest

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, hello, manifest, step, step_with_pieces
from twinstep.server import ServerConfig, serve
from twinstep.server.config import HaltConfig, JournalConfig, RecordingConfig, SessionsConfig, WindowConfig
from twinstep.server.journal.entries import Kind
from twinstep.server.record import compare as record_compare
from twinstep.server.record.catalog import find, scan, split_source
from twinstep.server.record.format import (COMPRESSED, FORMAT_VERSION, RecordingError, RecordingReader, RecordingWriter,
                                           describe, entry_step)
from twinstep.v1 import twinstep_pb2 as pb

VALUES = np.linspace(-1.0, 1.0, 64, dtype=np.float32)


# -- the file format ---------------------------------------------------------------------------------


def _entries() -> list[tuple[Kind, int, bytes, bytes | None]]:
    piece = pb.TensorPiece(step=3, record=0, numel=16, codec=pb.RAW, raw_nbytes=64)
    zstd_piece = pb.TensorPiece(step=3, record=1, numel=4, codec=pb.ZSTD, raw_nbytes=16)
    records = step(3, [(0, VALUES)]).step
    return [
        (Kind.HELLO, 1, hello("s", "torch", baseline=True).hello.SerializeToString(), None),
        (Kind.MANIFEST, 1, manifest((0, "fc", "Linear")).manifest.SerializeToString(), None),
        (Kind.PIECE, 1, piece.SerializeToString(), bytes(64)),
        (Kind.PIECE, 1, zstd_piece.SerializeToString(), b"\x28\xb5\x2f\xfd" + bytes(12)),
        (Kind.STEP, 1, records.SerializeToString(), None),
        (Kind.STEP, 1, step(0, [(0, VALUES)]).step.SerializeToString(), None),  # step 0: proto3 leaves it out
        (Kind.CLOSE, 1, pb.Close(reason="finished", last_step=3).SerializeToString(), None),
    ]


def _write(path: pathlib.Path, entries=None, end: bool = True) -> pathlib.Path:
    writer = RecordingWriter(path, "s", created=1.0)
    for kind, stream, header, payload in entries or _entries():
        writer.write(writer.encode_entry(kind, stream, header, payload))
    if end:
        writer.write(writer.encode_note({"why": "test"}, final=True))
    writer.close()
    return path


def test_entries_read_back_as_written(tmp_path):
    path = _write(tmp_path / "a.twrec")
    with RecordingReader(path) as reader:
        frames = list(reader.frames())
        assert reader.ended
    entries = [f.entry for f in frames if f.entry is not None]
    assert [(e.kind, e.stream, e.header, e.payload) for e in entries] == _entries()
    assert [f.head.step for f in frames[:6]] == [-1, -1, 3, 3, 3, 0]
    assert describe(path).session == "s" and describe(path).version == FORMAT_VERSION
    # Statistics are compressed (when that pays); a tensor piece the client compressed already is stored as it came.
    assert [bool(f.head.flags & COMPRESSED) for f in frames[2:4]] == [True, False]
    many = step(1, [(i, VALUES) for i in range(100)]).step.SerializeToString()
    assert len(RecordingWriter(tmp_path / "b.twrec", "s").encode_entry(Kind.STEP, 1, many, None)) < len(many) / 4
    # A reader of one stream skips the others' frames without reading them.
    with RecordingReader(path) as reader:
        assert list(reader.frames(want=lambda head: head.stream == 2)) == [frames[-1]]


def test_the_step_is_read_off_the_wire_without_parsing_the_message():
    for number in (0, 1, 300, 2**40):
        records = step(number, [(0, VALUES)]).step.SerializeToString()
        assert entry_step(Kind.STEP, records) == number
        assert entry_step(Kind.PIECE, pb.TensorPiece(step=number, numel=1).SerializeToString()) == number
    assert entry_step(Kind.HELLO, b"anything") == -1


def test_a_truncated_recording_yields_an_intact_prefix_and_a_clear_error_at_every_cut(tmp_path):
    data = _write(tmp_path / "full.twrec").read_bytes()
    whole = [(e.kind, e.header, e.payload) for e in _read(tmp_path / "full.twrec")[0]]
    header_end = describe(tmp_path / "full.twrec").data_offset
    with RecordingReader(tmp_path / "full.twrec") as reader:
        boundaries = {frame.head.offset for frame in reader.frames()}
    cut = tmp_path / "cut.twrec"
    for size in range(len(data)):
        cut.write_bytes(data[:size])
        if size < header_end:
            with pytest.raises(RecordingError, match="not a twinstep recording|truncated inside its header"):
                describe(cut)
            continue
        entries, error, ended = _read(cut)
        assert [(e.kind, e.header, e.payload) for e in entries] == whole[:len(entries)] and not ended
        if error is None:  # cut between two frames: only the missing END frame tells
            assert size in boundaries, size
        else:
            assert f"truncated at byte {size}" in str(error), size


def test_a_flipped_byte_anywhere_yields_an_intact_prefix_and_a_clear_error(tmp_path):
    data = bytearray(_write(tmp_path / "full.twrec").read_bytes())
    whole = [(e.kind, e.header, e.payload) for e in _read(tmp_path / "full.twrec")[0]]
    start = describe(tmp_path / "full.twrec").data_offset
    damaged = tmp_path / "flipped.twrec"
    for position in range(start, len(data)):
        data[position] ^= 0x10
        damaged.write_bytes(data)
        data[position] ^= 0x10
        entries, error, _ = _read(damaged)
        assert [(e.kind, e.header, e.payload) for e in entries] == whole[:len(entries)], position
        assert error is not None or len(entries) == len(whole), position
        if error is not None:
            assert "corrupt at byte" in str(error) or "truncated at byte" in str(error)


def _read(path: pathlib.Path):
    entries, error, ended = [], None, False
    try:
        with RecordingReader(path) as reader:
            for frame in reader.frames():
                if frame.entry is not None:
                    entries.append(frame.entry)
            ended = reader.ended
    except RecordingError as exc:
        error = exc
    return entries, error, ended


def test_a_newer_format_and_a_stranger_file_are_refused_with_what_to_do(tmp_path):
    path = _write(tmp_path / "a.twrec")
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 8, FORMAT_VERSION + 1)
    path.write_bytes(data)
    with pytest.raises(RecordingError, match=f"format {FORMAT_VERSION + 1}, written by a newer twinstep"):
        describe(path)
    (tmp_path / "b.twrec").write_text("hello")
    with pytest.raises(RecordingError, match="is not a twinstep recording"):
        RecordingReader(tmp_path / "b.twrec")
    with pytest.raises(RecordingError, match="holds recordings of: nothing"):
        find(tmp_path, "s")  # neither is readable


def test_sources_name_a_file_or_the_newest_recording_of_a_session_and_a_run(tmp_path):
    first = _write(tmp_path / "one.twrec")
    assert split_source(f"{first}:torch") == (first, "torch")
    assert split_source(str(first)) == (first, None)
    assert find(tmp_path, "s") == first
    with pytest.raises(RecordingError, match=r"no recording of session 'other' in .* recordings of: s"):
        find(tmp_path, "other")
    index = scan(first)
    assert index.run(None).name == "torch" and index.ended and not index.problem
    with pytest.raises(RecordingError, match="has no run 'paddle'; it holds: torch"):
        index.run("paddle")
    with pytest.raises(RecordingError, match="has no candidate run"):
        index.run(None, default="candidate")


# -- recording sessions on a server -------------------------------------------------------------------


def _send_run(address: str, session: str, run: str, steps: range, *, baseline: bool, offset: float = 0.0,
              diverge_at: int | None = None, pieces: bool = False) -> RawStream:
    stream = RawStream(address).send(hello(session, run, baseline=baseline)).send(manifest((0, "fc", "Linear")))
    assert stream.next().WhichOneof("body") == "welcome"
    for number in steps:
        values = VALUES + offset + (0.5 if diverge_at is not None and number >= diverge_at else 0.0)
        for message in (step_with_pieces(number, [(0, values)]) if pieces else [step(number, [(0, values)])]):
            stream.send(message)
    stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=steps[-1]))).close()
    return stream


def _ended(handle, session: str, runs: int = 2) -> bool:
    try:
        report = handle.report_proto(session)
    except KeyError:
        return False
    return len(report.runs) == runs and all(r.state != "streaming" for r in report.runs)


@pytest.fixture(scope="module")
def recorded_pair(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """A baseline and a candidate that diverges at step 3, 10 steps each, recorded; and the live report."""
    directory = tmp_path_factory.mktemp("recordings")
    handle = serve(port=0, config=ServerConfig(recording=RecordingConfig(directory=str(directory))))
    try:
        for stream in (_send_run(handle.address, "pair", "torch", range(10), baseline=True),
                       _send_run(handle.address, "pair", "paddle", range(10), baseline=False, diverge_at=3)):
            stream.wait_end()
        wait_for(lambda: _ended(handle, "pair"), timeout=10)
        live = handle.report("pair")
    finally:
        handle.stop(grace=0.5)
    (path,) = directory.glob("*.twrec")
    return path, live


def test_the_recorded_pair_compares_offline_as_it_did_live(recorded_pair):
    path, live = recorded_pair
    report, problems = record_compare.compare_sides(record_compare.resolve(str(path), None))
    assert problems == [] and live["status"] == "diverged"
    assert report.status == "diverged" and report.first_divergence.step == 3 == live["first_divergence"]["step"]
    assert report.steps_compared == live["steps_compared"] == 10


def test_a_recorded_baseline_is_played_at_the_candidates_pace(recorded_pair):
    path, live = recorded_pair
    handle = serve(port=0, config=ServerConfig(window=WindowConfig(steps=2, inflight_steps=1), recording=RecordingConfig(replay={"pair": f"{path}:torch"})))
    try:
        session, player = handle.registry.get("pair"), handle.recording.players["pair"]
        assert session is not None and session.baseline == "torch"
        wait_for(lambda: player.waiting_for == {"a candidate"}, timeout=10)
        assert session.last_step("torch") == -1  # no candidate yet: nothing fed (it would overflow the window)
        stream = RawStream(handle.address).send(hello("pair", "paddle")).send(manifest((0, "fc", "Linear")))
        for number in range(3):  # a raw stream ignores credits: keep within the window of 2 as a client would
            stream.send(step(number, [(0, VALUES)]))
            wait_for(lambda: session.last_step("torch") >= number, timeout=10)
        wait_for(lambda: session.last_step("paddle") == 2
                 and player.waiting_for == {"credit"}, timeout=10)
        # Held back by the credit policy: window_steps ahead of the candidate, and no further.
        assert session.last_step("torch") == 2 + 2
        for number in range(3, 10):  # paced as above: a loaded machine must not push it out of the window
            stream.send(step(number, [(0, VALUES + (0.5 if number >= 3 else 0.0))]))
            wait_for(lambda: session.last_step("torch") >= number, timeout=10)
        stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=9))).close()
        wait_for(lambda: _ended(handle, "pair"), timeout=10)
        report = handle.report("pair")
    finally:
        handle.stop(grace=0.5)
    assert report["first_divergence"] == live["first_divergence"]
    assert report["steps_compared"] == 10 and report["errors"] == []
    assert [r["dropped"] for r in report["runs"]] == [0, 0]


def test_a_truncated_recorded_baseline_is_played_up_to_its_end_with_an_error_and_the_server_serves_on(
        recorded_pair, tmp_path):
    path, _ = recorded_pair
    torch_streams = scan(path).runs["torch"].streams[0]
    with RecordingReader(path) as reader:  # cut inside the baseline's step 6
        at = next(f.head.offset for f in reader.frames() if f.head.stream in torch_streams and f.head.step == 6)
    cut = tmp_path / "cut.twrec"
    cut.write_bytes(path.read_bytes()[:at + 30])
    handle = serve(port=0, config=ServerConfig(recording=RecordingConfig(replay={"pair": str(cut)})))
    try:
        _send_run(handle.address, "pair", "paddle", range(10), baseline=False, diverge_at=3).wait_end()
        wait_for(lambda: _ended(handle, "pair"), timeout=10)
        report = handle.report("pair")
        _send_run(handle.address, "other", "torch", range(2), baseline=True).wait_end()  # the server serves on
        wait_for(lambda: _ended(handle, "other", runs=1), timeout=10)
    finally:
        handle.stop(grace=0.5)
    assert any("truncated at byte" in error and "was played up to step 5 (6 steps)" in error
               for error in report["errors"]), report["errors"]
    base = report["runs"][0]
    assert base["name"] == "torch" and base["state"] == "lost" and base["last_step"] == 5
    assert report["status"] != "aligned"


def test_a_replay_of_a_missing_recording_or_run_is_refused_before_the_server_starts(tmp_path, recorded_pair):
    path, _ = recorded_pair
    with pytest.raises(ValueError, match="replay of session 'x': no recording of session 'x'"):
        serve(port=0, config=ServerConfig(recording=RecordingConfig(replay={"x": str(path.parent)})))
    with pytest.raises(ValueError, match="has no run 'jax'"):
        serve(port=0, config=ServerConfig(recording=RecordingConfig(replay={"x": f"{path}:jax"})))


def test_the_budget_evicts_the_oldest_finished_recording_then_refuses_steps(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="twinstep.server")
    directory = tmp_path / "recordings"
    handle = serve(port=0, config=ServerConfig(recording=RecordingConfig(directory=str(directory)), sessions=SessionsConfig(ttl=0)))
    try:  # a session of 4 steps of tensors, recorded whole and finished (archived at once: session_ttl 0)
        _send_run(handle.address, "one", "torch", range(4), baseline=True, pieces=True).wait_end()
        wait_for(lambda: handle.registry.get("one") is None and not handle.recording.recorder.counts()["recordings"],
                 timeout=10)
        (first,) = directory.glob("*.twrec")
        size = first.stat().st_size
    finally:
        handle.stop(grace=0.5)
    # A budget one and a half times that: the next session evicts the first, then runs out of room.
    handle = serve(port=0, config=ServerConfig(recording=RecordingConfig(directory=str(directory), budget_bytes=size * 3 // 2)))
    try:
        _send_run(handle.address, "two", "torch", range(12), baseline=True, pieces=True, offset=1.0).wait_end()
        wait_for(lambda: _ended(handle, "two", runs=1), timeout=10)
        wait_for(lambda: handle.recording.recorder.counts()["refused_steps"].get("budget"), timeout=10)
        counts = handle.recording.recorder.counts()
    finally:
        handle.stop(grace=0.5)
    assert not first.exists() and counts["evicted_recordings"] == 1 and counts["evicted_bytes"] == size
    (second,) = directory.glob("*.twrec")
    assert second.stat().st_size <= size * 3 // 2
    index = scan(second)
    refused_from = index.notes[0]["refused_from_step"]
    assert 0 < refused_from < 12 and counts["refused_steps"]["budget"] == 12 - refused_from
    assert index.ended and index.notes[-1]["steps"] == refused_from  # the recording is steps 0..refused_from-1
    messages = [r.getMessage() for r in caplog.records]
    assert any("evicted the oldest recording" in m and first.name in m for m in messages)
    assert any(f"recording stopped taking data at step {refused_from}" in m for m in messages)


def test_a_session_restored_from_the_journal_is_recorded_whole(tmp_path):
    journal, directory = tmp_path / "journal", tmp_path / "recordings"
    handle = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(journal)), recording=RecordingConfig(directory=str(directory))))
    try:  # a baseline that streamed 3 steps when the server stopped
        stream = RawStream(handle.address).send(hello("kept", "torch", baseline=True))
        stream.send(manifest((0, "fc", "Linear")))
        for number in range(3):
            stream.send(step(number, [(0, VALUES)]))
        wait_for(lambda: (kept := handle.registry.get("kept")) is not None and kept.last_step("torch") == 2,
                 timeout=10)
    finally:
        handle.stop(grace=0.5)
    (before,) = directory.glob("*.twrec")
    before.unlink()  # what the new server records must come from the journal
    handle = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(journal)), recording=RecordingConfig(directory=str(directory))))
    try:
        stream = RawStream(handle.address).send(hello("kept", "torch", baseline=True))
        stream.send(manifest((0, "fc", "Linear")))
        assert stream.next().welcome.last_step_received == 2
        stream.send(step(3, [(0, VALUES)]))
        stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=3))).close()
        wait_for(lambda: _ended(handle, "kept", runs=1), timeout=10)
    finally:
        handle.stop(grace=0.5)
    (after,) = directory.glob("*.twrec")
    with RecordingReader(after) as reader:
        steps = [f.head.step for f in reader.frames() if f.head.kind == Kind.STEP]
    assert steps == [0, 1, 2, 3]


def test_a_halt_of_the_session_halts_the_played_baseline(recorded_pair):
    path, _ = recorded_pair
    handle = serve(port=0, config=ServerConfig(halt=HaltConfig(on_divergence=True), window=WindowConfig(steps=2), recording=RecordingConfig(replay={"pair": str(path)})))
    try:
        stream = RawStream(handle.address).send(hello("pair", "paddle")).send(manifest((0, "fc", "Linear")))
        for number in range(5):
            stream.send(step(number, [(0, VALUES + (0.5 if number >= 3 else 0.0))]))
        wait_for(lambda: handle.registry.get("pair").halted, timeout=10)
        stream.send(pb.ClientMessage(close=pb.Close(reason="halted", last_step=4))).close()
        wait_for(lambda: _ended(handle, "pair"), timeout=10)
        report = handle.report("pair")
    finally:
        handle.stop(grace=0.5)
    base = report["runs"][0]
    assert base["name"] == "torch" and base["state"] == "halted" and base["last_step"] < 9
    assert report["first_divergence"]["step"] == 3 and report["errors"] == []
