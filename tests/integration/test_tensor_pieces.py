"""Tensors streamed ahead of their step in pieces: compared whole; malformed pieces refused clearly."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, pieces, step, step_with_pieces
from tests.integration.test_bad_input import assert_serving, joined
from twinstep.server import ServerConfig
from twinstep.server.config import WindowConfig
from twinstep.v1 import twinstep_pb2 as pb

RNG = np.random.default_rng(7)
A = RNG.standard_normal((6, 50)).astype(np.float32)


def send_all(stream: RawStream, messages: list[pb.ClientMessage]) -> None:
    for message in messages:
        stream.send(message)


def finish(*streams: RawStream, last_step: int) -> None:
    for stream in streams:
        stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=last_step)))
        stream.close()
        stream.wait_end()


def test_a_tensor_in_pieces_compares_as_the_whole_tensor(server):
    """The candidate differs in one element of the last piece: only full-tensor metrics can see it."""
    b = A.copy()
    b[5, 49] += 1e-2  # rel_l2 ~6e-4 > 1e-4; statistics barely move
    base = joined(server.address, "pieces", "base", True)
    cand = joined(server.address, "pieces", "cand", False)
    send_all(base, step_with_pieces(0, [(0, A)], per_piece=7))  # 43 pieces, the last one short
    send_all(cand, step_with_pieces(0, [(0, b)], per_piece=128))
    finish(base, cand, last_step=0)
    report = wait_for(lambda: (r := server.report("pieces"))["steps_compared"] == 1 and r)
    first = report["first_divergence"]
    assert (first["module"], first["metric"]) == ("fc", "rel_l2")
    expected = np.linalg.norm((A - b).astype(np.float64)) / np.linalg.norm(A.astype(np.float64))
    assert first["value"] == pytest.approx(expected, rel=1e-6)


def test_close_tensors_in_different_pieces_are_aligned(server):
    close = A + np.float32(1e-6) * RNG.standard_normal(A.shape).astype(np.float32)
    base = joined(server.address, "same", "base", True)
    cand = joined(server.address, "same", "cand", False)
    send_all(base, step_with_pieces(0, [(0, A), (1, A * 2)], per_piece=11))
    send_all(cand, step_with_pieces(0, [(0, close), (1, A * 2)]))
    finish(base, cand, last_step=0)
    report = wait_for(lambda: (r := server.report_proto("same")).steps_compared == 1 and r)
    assert not report.HasField("first_divergence") and not report.errors
    # Full tensors were compared, not only statistics: the worst rel_l2 is the exact one of "fc".
    (rel_l2,) = [h for h in report.headroom if h.metric == "rel_l2"]
    expected = np.linalg.norm((A - close).astype(np.float64)) / np.linalg.norm(A.astype(np.float64))
    assert rel_l2.module == "fc" and rel_l2.value == pytest.approx(expected, rel=1e-6)


def _refused(server, session: str, messages: list[pb.ClientMessage], expected: str) -> None:
    stream = joined(server.address, session, "base", True)
    send_all(stream, messages)
    error = stream.error()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in error.details(), error.details()
    assert_serving(server, f"{session}-after")


def test_pieces_announced_but_missing_are_refused(server):
    sent = step_with_pieces(0, [(0, A)], per_piece=100)
    sent[-1].step.tensor_pieces += 1
    _refused(server, "missing", sent, "announces 4 tensor pieces, 3 arrived")


def test_a_gap_between_pieces_is_refused(server):
    sent = step_with_pieces(0, [(0, A)], per_piece=100)
    del sent[1]
    _refused(server, "gap", sent, "piece starts at element 200, expected 100")


def test_pieces_short_of_the_tensor_are_refused(server):
    sent = step_with_pieces(0, [(0, A)], per_piece=100)
    del sent[2]
    sent[-1].step.tensor_pieces = 2
    _refused(server, "short", sent, "tensor pieces cover 200 of its 300 elements")


def test_pieces_of_two_steps_interleaved_are_refused(server):
    sent = pieces(0, [(0, A)], per_piece=100) + pieces(1, [(0, A)], per_piece=100)
    _refused(server, "interleaved", sent, "tensor piece for step 1 arrived while step 0 is incomplete")


def test_a_piece_for_a_record_that_does_not_exist_is_refused(server):
    sent = pieces(0, [(0, A), (1, A)])
    records = step(0, [(0, A)])
    records.step.tensor_pieces = 2
    _refused(server, "norecord", sent + [records], "tensor piece for record 1, only 1 records")


@pytest.mark.parametrize("server", [{"config": ServerConfig(window=WindowConfig(bytes=4096))}], indirect=True)
def test_pieces_beyond_the_window_are_refused_before_memory_grows(server):
    noise = RNG.standard_normal(100_000).astype(np.float32)  # incompressible
    _refused(server, "huge", pieces(0, [(0, noise)], per_piece=1000),
             "tensor pieces exceed 4096 bytes")


def test_a_piece_before_hello_is_refused(server):
    stream = RawStream(server.address).send(pieces(0, [(0, A)])[0])
    error = stream.error()
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "first message must be hello" in error.details()


def test_a_corrupt_piece_is_reported_not_fatal(server):
    base = joined(server.address, "corrupt-piece", "base", True)
    cand = joined(server.address, "corrupt-piece", "cand", False)
    send_all(base, step_with_pieces(0, [(0, A)]))
    bad = step_with_pieces(0, [(0, A)])
    bad[0].tensor.data = b"\x28\xb5\x2f\xfd" + b"\x00" * 16  # zstd magic, broken frame
    send_all(cand, bad)
    finish(base, cand, last_step=0)
    report = wait_for(lambda: (r := server.report_proto("corrupt-piece")).steps_compared >= 1 and r)
    assert any("corrupt zstd payload" in e for e in report.errors), list(report.errors)
    assert not report.HasField("first_divergence")  # statistics still compared; no false alarm
    assert_serving(server)
