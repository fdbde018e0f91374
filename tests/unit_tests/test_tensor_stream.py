"""Tensor mode's pipeline: pooled host copies, shared copies sent once, pieces, compression, wire format."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import last_step
from google.protobuf.message import DecodeError

from tests.unit_tests.test_recorder import FRAMEWORKS, toy
from twinstep.wire import codec
from twinstep.runtime.capture import CaptureConfig, Recorder, backend_for
from twinstep.server import ServerConfig
from twinstep.server.config import WindowConfig
from twinstep.server.ingest.pieces import PieceCollector
from twinstep.server.ingest.wire import ReceivedPiece, Unreadable, parse_client_message
from twinstep.runtime.transport.messages import TensorEncoder, encoded_pieces, step_message
from twinstep.v1 import twinstep_pb2 as pb


def _recorded_step(framework: str, steps: int = 1, **config):
    model, train_step = toy(framework)
    recorder = Recorder(model, backend_for(model), CaptureConfig(capture="tensors", **config))
    batches = []
    for step in range(steps):
        loss = train_step()
        batches.append(recorder.finish_step(step, loss))
    return recorder, batches


def _server_side(batch, wires: list[bytes]):
    """What the server makes of the wire bytes: every record's decoded tensor."""
    collector = PieceCollector(1 << 30)
    for wire in wires:
        received = parse_client_message(wire)
        assert isinstance(received, ReceivedPiece)  # the zero-copy path, not protobuf's
        collector.add(received.header, received.data)
    records = step_message(batch, 0, {}, len(wires)).step
    tensors = collector.take(batch.step, records.tensor_pieces, len(batch.phase), batch.count.tolist())
    dtypes = [codec.WIRE_TO_DTYPE[d] for d in batch.dtype.tolist()]
    return {r: t.decode(dtypes[r], batch.dims_of(r)) for r, t in tensors.items()}


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("piece_bytes", [32, 4 << 20])
def test_every_record_arrives_bit_exact_whatever_the_piece_size(framework, piece_bytes):
    _, (batch,) = _recorded_step(framework)
    originals = {r: np.array(batch.storage_array(host.copy)) for host in batch.tensors for r in host.records}
    # Every record has its tensor, but module inputs: those are compared by their statistics.
    assert sorted(originals) == np.flatnonzero(batch.phase != pb.INPUT).tolist()
    wires = list(encoded_pieces(batch, TensorEncoder("zstd", piece_bytes), None))
    if piece_bytes == 32:
        assert len(wires) > len(batch.tensors)  # some tensors were cut into several pieces
    decoded = _server_side(batch, wires)
    assert sorted(decoded) == sorted(originals)
    for record, original in originals.items():
        np.testing.assert_array_equal(decoded[record].reshape(original.shape), original)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_tensor_recorded_twice_is_copied_and_sent_once(framework):
    """ReLU called on its own output: its input record is the previous call's output, the same tensor."""
    _, (batch,) = _recorded_step(framework, inputs=False, parameters=False)
    shared = [host for host in batch.tensors if len(host.records) > 1]
    assert shared, [host.records for host in batch.tensors]
    assert sum(len(h.records) for h in batch.tensors) == len(batch.phase) > len(batch.tensors)  # no inputs here
    pieces = [pb.ClientMessage.FromString(w).tensor for w in encoded_pieces(batch, TensorEncoder(), None)]
    assert len(pieces) == len(batch.tensors)
    sent = {p.record: list(p.same_records) for p in pieces}
    for host in shared:
        assert sent[host.records[0]] == host.records[1:]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_encoding_gives_the_host_buffers_back(framework):
    recorder, (batch,) = _recorded_step(framework)
    pooled = [host for host in batch.tensors if host.buffer is not None]
    assert len(pooled) == len(batch.tensors)  # CPU tensors of both frameworks land in pooled buffers
    list(encoded_pieces(batch, TensorEncoder(), None))
    assert all(host.copy is None and host.buffer is None for host in batch.tensors)
    assert recorder.pool.stats.allocated == len(pooled)
    assert recorder.pool.free_bytes == sum(host.nbytes for host in pooled)


def test_pool_reuse_across_steps_with_torch():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    recorder = Recorder(model, backend_for(model), CaptureConfig(capture="tensors"))
    encoder = TensorEncoder()
    first_copies = None
    for step in range(3):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        batch = recorder.finish_step(step, loss)
        pointers = {host.copy.data_ptr() for host in batch.tensors}
        if first_copies is None:
            first_copies = pointers
        else:
            assert pointers == first_copies  # the same memory, step after step
        list(encoded_pieces(batch, encoder, None))
        model.zero_grad()
    assert recorder.pool.stats.reused == 2 * len(first_copies)
    assert recorder.pool.stats.allocated == len(first_copies)


def test_the_pool_keeps_at_most_its_cap_of_free_buffers():
    from twinstep.runtime.capture.buffers import HostBufferPool

    pool = HostBufferPool(lambda n: np.empty(n, np.uint8), max_free_bytes=1000)
    buffers = [pool.take(400) for _ in range(3)]
    for b in buffers:
        pool.give(b, 400)
    assert pool.free_bytes == 800 and pool.stats.discarded == 1
    assert pool.take(400) is buffers[1]  # last in, first out
    assert pool.take(300) is not None and pool.stats.allocated == 4


def test_auto_compression_sends_incompressible_floats_raw_and_compressible_ones_compressed():
    rng = np.random.default_rng(0)
    encoder = TensorEncoder("auto")
    noise = rng.standard_normal(50_000).astype(np.float32)
    kinds = [encoder._lossless(noise, "float32")[0] for _ in range(3)]
    assert kinds == [pb.ZSTD, pb.RAW, pb.RAW]  # zstd saved under 10% once: the next ones go raw
    ints = np.zeros(50_000, np.int64)
    assert [encoder._lossless(ints, "int64")[0] for _ in range(3)] == [pb.ZSTD] * 3
    always = TensorEncoder("zstd")
    assert [always._lossless(noise, "float32")[0] for _ in range(3)] == [pb.ZSTD] * 3
    assert TensorEncoder("none")._lossless(ints, "int64")[0] == pb.RAW


def test_auto_compression_probes_again_after_a_while():
    from twinstep.runtime.transport import messages

    encoder = TensorEncoder("auto")
    noise = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    kinds = [encoder._lossless(noise, "float32")[0] for _ in range(messages._PROBE_EVERY + 2)]
    assert kinds[0] == pb.ZSTD and kinds[-1] == pb.ZSTD and kinds.count(pb.ZSTD) == 2


def test_unknown_compression_is_refused():
    with pytest.raises(ValueError, match="compression must be one of"):
        TensorEncoder("lz4")


def test_hand_serialized_piece_equals_protobufs():
    data = np.arange(300, dtype=np.float32)
    header = pb.TensorPiece(step=3, record=2, offset=600, numel=300, codec=pb.RAW, raw_nbytes=1200, same_records=[5, 9])
    from twinstep.runtime.transport.messages import _serialize

    wire = _serialize(header, memoryview(data).cast("B"))
    expected = pb.ClientMessage(tensor=pb.TensorPiece(**{**_fields(header), "data": data.tobytes()}))
    assert pb.ClientMessage.FromString(wire) == expected
    assert wire == expected.SerializeToString()


def _fields(message) -> dict:
    return {f.name: v for f, v in message.ListFields()}


def test_the_server_reads_a_piece_whatever_its_field_order():
    payload = b"\x01\x02\x03" * 1000
    header = pb.TensorPiece(step=1, record=4, offset=0, numel=750, codec=pb.RAW, raw_nbytes=3000, error_bound=0.5)
    data_first = b"\x7a" + _varint(len(payload)) + payload + header.SerializeToString()
    body = data_first
    wire = bytes([(6 << 3) | 2]) + _varint(len(body)) + body
    received = parse_client_message(wire)
    assert isinstance(received, ReceivedPiece)
    assert received.header == header and bytes(received.data) == payload
    assert pb.ClientMessage.FromString(wire).tensor.data == payload  # what protobuf reads, too


def test_other_messages_and_malformed_pieces_go_through_protobuf():
    hello = pb.ClientMessage(hello=pb.Hello(session="s", run="r"))
    assert parse_client_message(hello.SerializeToString()) == hello
    truncated = pb.ClientMessage(tensor=pb.TensorPiece(step=1, data=b"x" * 100)).SerializeToString()[:-10]
    with pytest.raises(DecodeError):  # protobuf itself refuses it...
        pb.ClientMessage.FromString(truncated)
    unreadable = parse_client_message(truncated)  # ...and the server's reader says so, for an INVALID_ARGUMENT
    assert isinstance(unreadable, Unreadable) and unreadable.nbytes == len(truncated)


def _varint(value: int) -> bytes:
    from twinstep.runtime.transport.messages import _varint as varint

    return varint(value)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="CUDA not available")
def test_cuda_copies_land_in_pinned_buffers_and_the_fence_waits_for_them():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU()).cuda()
    recorder = Recorder(model, backend_for(model), CaptureConfig(capture="tensors"))
    x = torch.randn(64, 256, device="cuda")
    loss = model(x).square().mean()
    loss.backward()
    expected = model[0](x).detach().cpu().numpy()
    batch = recorder.finish_step(0, loss)
    assert batch.copies_ready is not None  # device-to-host copies may still be in flight
    assert all(host.buffer.is_pinned() for host in batch.tensors if host.buffer is not None)
    decoded = _server_side(batch, list(encoded_pieces(batch, TensorEncoder(), None)))  # waits on the fence first
    first_linear = next(host.records[0] for host in batch.tensors if batch.phase[host.records[0]] == pb.FORWARD)
    np.testing.assert_allclose(decoded[first_linear], expected, rtol=1e-6)


@pytest.mark.parametrize("server", [{"config": ServerConfig(window=WindowConfig(bytes=6000))}], indirect=True)
def test_a_step_whose_tensors_the_server_cannot_hold_is_dropped_by_the_client(server, caplog):
    """Not sent and refused (which would end the run's capture): dropped, counted, warned once; smaller ones go on."""
    import torch

    import twinstep

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    mon = twinstep.attach(model, session="window", run="base", baseline=True, server=server.address,
                          capture="tensors", backward=False, include=("0",))
    for batch_rows in (4, 64, 4):  # 64 rows: 4 KiB per activation, over the server's 6000 bytes with the weights
        model(torch.randn(batch_rows, 16)).sum().backward()
        mon.step()
        model.zero_grad()
    mon.close()
    assert mon.stats.dropped == {"oversized": 1} and not mon.stats.rejected
    assert mon.stats.steps_sent == 2
    assert last_step(server, "window", "base") == 2
    assert sum("over the 6000 bytes the server holds" in r.getMessage() for r in caplog.records) == 1
