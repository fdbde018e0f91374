"""Batch sync: batches captured, held within a budget by a real in-process server, fetched per rank, converted."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch

import twinstep
from twinstep.runtime.batches import wire
from twinstep.errors import BatchSyncError
from twinstep.server import ServerConfig, serve
from twinstep.server.config import SyncConfig
from twinstep.server.batches.buffer import BatchBuffer
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.runtime.values import UnsupportedValue

paddle = pytest.importorskip("paddle")


def _batch() -> dict:
    return {"input_ids": torch.arange(12, dtype=torch.int64).reshape(3, 4) + (1 << 40),
            "pixels": torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16),
            "mask": [torch.tensor([True, False])],
            "meta": (7, 0.25, None, "train", False)}


def test_a_torch_batch_reaches_paddle_with_its_structure_dtypes_and_values():
    message = pb.BatchValue.FromString(wire.to_proto(wire.capture(_batch())).SerializeToString())
    got = wire.from_proto(message, "paddle")
    assert set(got) == {"input_ids", "pixels", "mask", "meta"}
    assert str(got["input_ids"].dtype) == "paddle.int64" and got["input_ids"].numpy()[0, 0] == 1 << 40
    assert str(got["pixels"].dtype) == "paddle.bfloat16"
    assert got["pixels"].astype("float32").numpy().tolist() == [[1.5, -2.0]]
    assert isinstance(got["mask"], list) and got["mask"][0].numpy().tolist() == [True, False]
    assert got["meta"] == (7, 0.25, None, "train", False)
    back = wire.from_proto(wire.to_proto(wire.capture(got)), "torch")  # and from paddle to torch
    assert torch.equal(back["input_ids"], _batch()["input_ids"]) and back["pixels"].dtype == torch.bfloat16


def test_integer_tensors_are_compressed_and_unsupported_batches_named():
    ids = np.random.default_rng(0).integers(0, 32_000, size=(8, 2048))
    tensor = wire.to_proto(wire.capture({"ids": ids})).dict.values[0].tensor
    assert tensor.codec == pb.ZSTD and len(tensor.data) < ids.nbytes / 2
    with pytest.raises(UnsupportedValue, match="keys must be text"):
        wire.capture({1: ids})
    corrupt = pb.BatchValue(tensor=pb.BatchTensor(dtype=pb.INT64, shape=[2], codec=pb.RAW, raw_nbytes=16, data=b"x"))
    with pytest.raises(BatchSyncError, match="does not decode"):
        wire.from_proto(corrupt, "torch")


def _published(rank: int, step: int, nbytes: int) -> pb.PublishedBatch:
    return pb.PublishedBatch(session="s", run="base", rank=rank, step=step,
                             value=pb.BatchValue(string_value="x" * nbytes))


def test_the_buffer_keeps_its_budget_dropping_taken_batches_first_then_the_oldest():
    buffer = BatchBuffer(budget_bytes=3000)
    for step in range(3):
        buffer.publish(_published(0, step, 1000), 1000)
    assert buffer.take(0, 1, 0.0).batch.step == 1  # taken: the first to go
    buffer.publish(_published(0, 3, 1000), 1000)
    assert buffer.take(0, 1, 0.0).dropped and len(buffer) == 3
    buffer.publish(_published(0, 4, 1000), 1000)  # nothing taken left: the oldest goes
    assert buffer.take(0, 0, 0.0).dropped and buffer.take(0, 2, 0.0).batch is not None
    counts = buffer.snapshot()
    assert (counts.published, counts.dropped, counts.held_bytes) == (5, 1, 3000)
    # A request waits for a batch published meanwhile, and only as long as it is told to.
    threading.Timer(0.2, lambda: buffer.publish(_published(1, 0, 10), 10)).start()
    found = buffer.take(1, 0, 5.0)
    assert found.batch is not None and 0.1 < found.waited < 2.0
    assert buffer.take(1, 9, 0.1).batch is None


@pytest.fixture(scope="module")
def server():
    handle = serve(port=0, config=ServerConfig(sync=SyncConfig(batch_buffer_bytes=200_000, batch_max_bytes=100_000)))
    yield handle
    handle.stop(grace=0.5)


def _attach(server, session: str, run: str, **kwargs):
    model = kwargs.pop("model", None) or torch.nn.Linear(4, 2)
    return model, twinstep.attach(model, session=session, run=run, server=server.address, **kwargs)


def test_each_rank_gets_its_own_rank_s_batch_and_a_missing_one_is_a_clear_error(server):
    bases = [_attach(server, "ranks", "base", baseline=True, rank=r, world_size=2)[1] for r in range(2)]
    cands = [_attach(server, "ranks", "cand", rank=r, world_size=2, batch_timeout=0.5)[1] for r in range(2)]
    for rank, mon in enumerate(bases):
        mon.publish_batch({"ids": torch.full((2, 3), rank)})
    for rank, mon in enumerate(cands):
        assert mon.baseline_batch(timeout=10)["ids"].tolist() == [[rank] * 3] * 2
        mon.step()
    started = time.monotonic()
    with pytest.raises(BatchSyncError, match=r"step 1 \(rank 0, session 'ranks'\) did not come within 0.5 s"):
        cands[0].baseline_batch()
    assert time.monotonic() - started < 5
    with pytest.raises(ValueError, match="baseline_batch is a candidate's"):
        bases[0].baseline_batch()
    with pytest.raises(ValueError, match="publish_batch is the baseline's"):
        cands[0].publish_batch({"ids": torch.zeros(1)})
    for mon in bases + cands:
        mon.close(timeout=5)
    assert server.report_proto("ranks").batch_sync.delivered == 2


def test_batches_over_the_limit_are_refused_and_those_dropped_for_room_say_so_at_once(server, caplog):
    _, base = _attach(server, "budget", "base", baseline=True)
    _, cand = _attach(server, "budget", "cand")
    with caplog.at_level(logging.WARNING, logger="twinstep"):
        base.publish_batch(np.zeros(200_000, dtype=np.uint8))  # over batch_max_bytes
        for step in range(3):  # 80 kB each (floats travel uncompressed) in a 200 kB buffer: the first goes
            base.step()
            base.publish_batch(np.full(20_000, step, dtype=np.float32))
        base.close(timeout=10)
    assert base.batch_stats["dropped"] == {"refused": 1} and base.batch_stats["published"] == 3
    assert "batch_max_bytes" in caplog.text
    cand.step()  # to step 1: published, then dropped to make room
    started = time.monotonic()
    with pytest.raises(BatchSyncError, match="dropped from the server's buffer.*batch_buffer_bytes"):
        cand.baseline_batch(timeout=30)
    assert time.monotonic() - started < 5
    cand.step()
    assert cand.baseline_batch(timeout=10).tolist()[:2] == [1, 1]
    cand.close(timeout=5)
    sync = server.report_proto("budget").batch_sync
    assert (sync.published, sync.dropped, sync.refused, sync.delivered) == (3, 1, 1, 1)


class _Seen(paddle.nn.Layer):
    """A paddle model that remembers what it was called with."""

    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(3, 2)
        self.calls: list[tuple] = []

    def forward(self, ids, scale=1.0):
        self.calls.append((ids.numpy().tolist(), str(ids.dtype), scale))
        return paddle.cast(ids, "float32").sum() * scale + self.fc.weight.sum()


def test_the_model_s_first_call_is_published_and_replaced_by_the_baseline_s_in_each_step(server):
    base_model, base = _attach(server, "auto", "base", baseline=True, publish_batches=True)
    cand_model = _Seen()
    cand = twinstep.attach(cand_model, session="auto", run="cand", server=server.address, sync_batches=True)
    for step in range(2):
        ids = torch.full((1, 4), float(step))
        base_model(ids)
        base_model(ids + 100)  # a second call in the step is not published
        base.step()
        cand_model(paddle.full([1, 3], 9, dtype="int64"), scale=3.0)  # replaced by the baseline's first call
        cand_model(paddle.full([1, 3], 9, dtype="int64"), scale=3.0)  # the second call stays its own
        cand.step()
    base.close(timeout=5)
    cand.close(timeout=5)
    assert cand_model.calls[0] == ([[0.0] * 4], "paddle.float32", 1.0)
    assert cand_model.calls[1] == ([[9] * 3], "paddle.int64", 3.0)
    assert cand_model.calls[2][0] == [[1.0] * 4]
    with pytest.raises(ValueError, match="publish_batches is the baseline's"):
        twinstep.attach(torch.nn.Linear(2, 2), session="auto", run="x", server=server.address, publish_batches=True)


def test_a_malformed_batch_is_one_call_s_error_and_the_session_goes_on(server):
    import grpc

    from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

    bad = [pb.BatchValue(tensor=pb.BatchTensor(dtype=pb.INT64, shape=[3], codec=pb.RAW, raw_nbytes=24, data=b"12")),
           pb.BatchValue(tensor=pb.BatchTensor(dtype=99, shape=[1], codec=pb.RAW, raw_nbytes=8, data=b"1" * 8)),
           pb.BatchValue(dict=pb.BatchDict(keys=["a", "b"], values=[pb.BatchValue(none=True)])),
           pb.BatchValue()]
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TwinstepStub(channel)
        for value, words in zip(bad, ["carries 2 bytes, its shape needs 24", "unknown dtype 99",
                                      "2 keys and 1 values", "node of the batch is empty"]):
            with pytest.raises(grpc.RpcError) as error:
                stub.PublishBatch(pb.PublishedBatch(session="bad", run="base", step=0, value=value), timeout=10)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in error.value.details()
        good = pb.PublishedBatch(session="bad", run="base", step=0, value=pb.BatchValue(int_value=5))
        stub.PublishBatch(good, timeout=10)
        reply = stub.GetBatch(pb.BatchRequest(session="bad", run="cand", step=0), timeout=10)
        assert reply.ready and reply.batch.value.int_value == 5
    assert server.report_proto("bad").batch_sync.refused == 4
