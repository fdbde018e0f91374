"""The training-side stream follows a sharded server: the front's Welcome.stream_to names the shard that compares
this run and rank; the client streams there with the same hello, token and TLS trust, and comes back through the
front when that shard cannot be reached (it restarted elsewhere).  Real gRPC on loopback, real comparison servers.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.conftest import wait_for
from twinstep._version import PROTOCOL_VERSION
from twinstep.runtime.capture.recorder import StepBatch
from twinstep.runtime.transport import StreamClient, StreamConfig
from twinstep.runtime.transport.stream import MAX_REDIRECTS
from twinstep.server import ServerConfig
from twinstep.server.config import JournalConfig, SecurityConfig
from twinstep.server.shards import serve_sharded
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc


def hello(session: str, run: str, baseline: bool, rank: int = 0) -> pb.Hello:
    return pb.Hello(protocol_version=PROTOCOL_VERSION, session=session, run=run, baseline=baseline,
                    framework="torch", rank=rank, world_size=1)


def batch(step: int) -> StepBatch:
    """One LOSS record: a valid step with no manifest needed, the same in both runs (they agree)."""
    value = 2.0 + step
    return StepBatch(
        step=step,
        phase=np.array([pb.LOSS], dtype=np.int32),
        target=np.zeros(1, dtype=np.uint32),
        call_index=np.zeros(1, dtype=np.uint32),
        slot=np.zeros(1, dtype=np.uint32),
        dtype=np.array([pb.FLOAT32], dtype=np.int32),
        ndim=np.zeros(1, dtype=np.uint32),
        dims=[],
        count=np.ones(1, dtype=np.int64),
        device_stats=np.array([[value, value ** 2, value, value, value, 0, 0, 0.0]]),
    )


def client(target: str, session: str, run: str, baseline: bool, **config) -> StreamClient:
    c = StreamClient(hello(session, run, baseline),
                     StreamConfig(target=target, backoff_initial=0.05, backoff_max=0.2, **config),
                     lambda command: None, lambda: 0)
    c.start()
    return c


def run_row(report: dict, name: str) -> dict | None:
    return next((r for r in report.get("runs", []) if r["name"] == name), None)


def report_or_none(sharded, session: str) -> dict | None:
    try:
        return sharded.report(session)
    except KeyError:
        return None


class _RedirectingFront(pb_grpc.TwinstepServicer):
    """A misbehaving front for the loop guard: answers every hello with Welcome.stream_to = ``where(hello)``;
    records the hellos and anything a client sent after its hello (it should send nothing)."""

    def __init__(self, where) -> None:
        self.where = where
        self.lock = threading.Lock()
        self.hellos: list[pb.Hello] = []
        self.after_hello: list[str] = []

    def Stream(self, request_iterator, context):  # noqa: N802 (gRPC's name)
        first = next(request_iterator)
        with self.lock:
            self.hellos.append(first.hello)
        yield pb.ServerMessage(welcome=pb.Welcome(protocol_version=PROTOCOL_VERSION, stream_to=self.where(first.hello)))
        try:  # the client ends the stream: anything it sends first is recorded
            for message in request_iterator:
                with self.lock:
                    self.after_hello.append(message.WhichOneof("body"))
        except Exception:
            pass


def start_sharded(tmp: Path, config: ServerConfig | None = None):
    config = config or ServerConfig()
    config.journal = JournalConfig(directory=str(tmp / "journal"))
    return serve_sharded(port=0, shards=2, runtime="inprocess", config=config)


@pytest.fixture
def sharded(tmp_path):
    handle = start_sharded(tmp_path)
    yield handle
    handle.stop(grace=0.5)


def _stream_pair(address: str, session: str, steps: range, **config) -> tuple[StreamClient, StreamClient]:
    base = client(address, session, "base", True, **config)
    cand = client(address, session, "cand", False, **config)
    for i in steps:
        base.submit(batch(i))
        cand.submit(batch(i))
    return base, cand


def _compared(sharded, session: str, steps: int) -> dict:
    """The merged report once both runs finished and ``steps`` steps are compared (the front polls its shards)."""
    def ready():
        report = report_or_none(sharded, session)
        rows = [run_row(report or {}, name) for name in ("base", "cand")]
        done = report and report["steps_compared"] == steps and all(r and r["state"] == "finished" for r in rows)
        return report if done else None

    try:
        return wait_for(ready, timeout=30)
    except AssertionError:
        raise AssertionError(f"not compared: {report_or_none(sharded, session)}") from None


def _assert_compared_once(report: dict, steps: int) -> None:
    assert report["steps_compared"] == steps, report["steps_compared"]
    assert report["status"] == "aligned", (report["status"], report["status_reasons"])
    for name in ("base", "cand"):
        row = run_row(report, name)
        assert row["last_step"] == steps - 1 and row["state"] == "finished", row
        assert row["records_received"] == steps and row["dropped"] == 0, row  # each record once, nothing lost


# -- tests ------------------------------------------------------------------------------------------------------


def test_a_run_streams_to_the_shard_the_front_names(sharded, caplog):
    caplog.set_level(logging.WARNING, logger="twinstep")
    base, cand = _stream_pair(sharded.address, "redirected", range(10))
    base.close("finished", 9, timeout=15)
    cand.close("finished", 9, timeout=15)
    assert base.stats.reached and cand.stats.reached
    assert base.pending_steps == 0 and cand.pending_steps == 0 and not base.stats.dropped and not cand.stats.dropped
    assert base.stats.reconnects == 0 and cand.stats.reconnects == 0  # a redirect is not a reconnect
    _assert_compared_once(_compared(sharded, "redirected", 10), 10)
    assert not [r for r in caplog.records if r.name == "twinstep" and r.levelno >= logging.WARNING]


def test_a_rank_at_the_wrong_shard_is_sent_back_through_the_front(sharded):
    """A client given a shard's address for a rank that shard does not own: the shard sends it to the front,
    the front to the owner; two redirects, then an ordinary stream."""
    owner = sharded.shard_addresses()
    base = client(owner[0], "wrong-door", "base", True)  # rank 0 is compared on shard 0 (rank % 2)
    cand = StreamClient(hello("wrong-door", "cand", False), StreamConfig(target=owner[1], backoff_initial=0.05,
                                                                          backoff_max=0.2), lambda c: None, lambda: 0)
    cand.start()
    for i in range(4):
        base.submit(batch(i))
        cand.submit(batch(i))
    base.close("finished", 3, timeout=15)
    cand.close("finished", 3, timeout=15)
    assert not base.stats.dropped and not cand.stats.dropped and cand.stats.reconnects == 0
    _assert_compared_once(_compared(sharded, "wrong-door", 4), 4)


@pytest.mark.parametrize("moved", [False, True], ids=["same-port", "moved"])
def test_a_killed_shard_is_found_again_and_nothing_acknowledged_is_lost(sharded, caplog, moved):
    """Killed mid-run and started again from its journal: on its old port (the client retries the shard), or
    elsewhere (the client cannot reach the old address and comes back through the front, which knows the new)."""
    caplog.set_level(logging.WARNING, logger="twinstep")
    session = f"shard-restart-{'moved' if moved else 'same'}"
    base, cand = _stream_pair(sharded.address, session, range(5))
    try:
        wait_for(lambda: base.pending_steps == 0 and cand.pending_steps == 0, timeout=30)  # acknowledged
        before = sharded.shard_addresses()[0]
        if moved:  # the shard remembers its port in its journal folder: forgotten, it starts on a free one
            (Path(sharded.journal) / "shard-0.port").unlink()
        sharded.kill_shard(0)
        for i in range(5, 10):
            base.submit(batch(i))
            cand.submit(batch(i))
        wait_for(lambda: base.pending_steps == 0 and cand.pending_steps == 0, timeout=60)
        after = wait_for(lambda: next((a for a in sharded.shard_addresses()[:1] if a != before or not moved), None),
                         timeout=30)
    finally:
        base.close("finished", 9, timeout=15)
        cand.close("finished", 9, timeout=15)
    assert base.stats.reconnects >= 1 and cand.stats.reconnects >= 1
    assert not base.stats.dropped and not cand.stats.dropped
    _assert_compared_once(_compared(sharded, session, 10), 10)
    messages = [r.getMessage() for r in caplog.records if r.name == "twinstep"]
    shard_of = f"(shard of {sharded.address})"
    assert any(f"lost contact with the comparison server at {before} {shard_of}" in m for m in messages), messages
    assert any(f"reconnected to {after} {shard_of}" in m for m in messages), messages


def test_the_same_token_and_tls_trust_reach_the_shard(tmp_path):
    pytest.importorskip("cryptography")
    from twinstep.server.security import self_signed

    cert, key = self_signed(tmp_path / "tls", hosts=["127.0.0.1"])
    config = ServerConfig(security=SecurityConfig(tls_cert=str(cert), tls_key=str(key),
                                                  session_tokens=["secured=s3cret-token"]))
    sharded = start_sharded(tmp_path, config)
    try:
        base, cand = _stream_pair(sharded.address, "secured", range(3), token="s3cret-token", tls_ca=str(cert))
        base.close("finished", 2, timeout=15)
        cand.close("finished", 2, timeout=15)
        assert not base.stats.rejected and not cand.stats.rejected
        assert base.stats.reached and cand.stats.reached and not base.stats.dropped
        _assert_compared_once(_compared(sharded, "secured", 3), 3)
        # A shard asked directly, without the token: refused, as the front would.
        intruder = client(sharded.shard_addresses()[0], "secured", "other", False, tls_ca=str(cert))
        wait_for(lambda: intruder.stats.rejected, timeout=20)
        assert "UNAUTHENTICATED" in intruder.stats.rejected, intruder.stats.rejected
        intruder.close("finished", 0, timeout=1)
    finally:
        sharded.stop(grace=0.5)


def test_a_redirect_loop_is_warned_once_and_paced_by_the_backoff(caplog):
    """A misbehaving server that always sends the run on to itself: the client follows MAX_REDIRECTS redirects at
    once, then warns once and keeps trying at the backoff's pace; it never blocks the training nor its close."""
    caplog.set_level(logging.WARNING, logger="twinstep")
    address: list[str] = []
    front = _RedirectingFront(lambda h: address[0])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_TwinstepServicer_to_server(front, server)
    address.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
    server.start()
    c = client(address[0], "loop", "base", True, max_queue_steps=4)
    try:
        assert all(c.submit(batch(i)) for i in range(10))
        wait_for(lambda: len(front.hellos) > MAX_REDIRECTS + 3, timeout=30)
        assert not c.stats.reached and c.stats.reconnects >= 2  # past the guard, each try is a paced reconnect
        assert front.after_hello == []
    finally:
        c.close("finished", 9, timeout=1)
        server.stop(0.2).wait(5)
    warnings = [r.getMessage() for r in caplog.records if "times in a row" in r.getMessage()]
    assert len(warnings) == 1 and address[0] in warnings[0], warnings


@pytest.mark.parametrize("sender", ["thread", "process"])
def test_torch_runs_attached_to_the_front_are_compared_on_their_shard(sharded, sender):
    """twinstep.attach with the front's address: the thread sender and the sender process both follow it."""
    torch = pytest.importorskip("torch")
    import twinstep
    from twinstep.runtime import api

    if sender == "process" and not api.SHARED_MEMORY_AVAILABLE:
        pytest.skip("the sender process needs shared memory files (Linux)")
    session = f"torch-{sender}"
    for run, baseline in (("base", True), ("cand", False)):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        mon = twinstep.attach(net, server=sharded.address, session=session, run=run, baseline=baseline,
                              capture="tensors", sender=sender)
        assert type(mon._client).__name__ == ("SidecarClient" if sender == "process" else "StreamClient")
        for step in range(3):
            net(torch.full((2, 4), 0.5 + step)).sum().backward()
            mon.step()
        mon.close(timeout=15)
        assert mon.stats.reached and not mon.stats.dropped
    report = _compared(sharded, session, 3)
    assert report["status"] == "aligned", report["status_reasons"]
    assert [run_row(report, name)["last_step"] for name in ("base", "cand")] == [2, 2]
