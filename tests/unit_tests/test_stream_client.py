"""The client pipeline's promises, against a real gRPC server on loopback."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest

from tests.conftest import last_step as server_last_step
from tests.conftest import run_status, wait_for
from tests.unit_tests.tiny_server import TinyServer, TinyServicer
from twinstep._version import PROTOCOL_VERSION
from twinstep.runtime.capture.recorder import StepBatch
from twinstep.server import serve
from twinstep.runtime.transport import StreamClient, StreamConfig
from twinstep.v1 import twinstep_pb2 as pb


def hello(session: str, run: str = "base", baseline: bool = True) -> pb.Hello:
    return pb.Hello(protocol_version=PROTOCOL_VERSION, session=session, run=run, baseline=baseline,
                    framework="torch", rank=0, world_size=1)


def batch(step: int) -> StepBatch:
    """One LOSS record: a valid step with no manifest needed."""
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
        device_stats=np.array([[2.0 + step, (2.0 + step) ** 2, 2.0 + step, 2.0 + step, 2.0 + step, 0, 0, 0.0]]),  # m2 last
    )


def client(target: str, session: str, **config) -> StreamClient:
    commands: list[pb.Command] = []
    c = StreamClient(hello(session), StreamConfig(target=target, backoff_initial=0.05, backoff_max=0.2, **config),
                     commands.append, lambda: 0)
    c.commands = commands
    c.start()
    return c


def last_step(server, session: str) -> int:
    return server_last_step(server, session, "base")


def test_server_down_submit_never_blocks_and_drops_oldest(caplog, refused_address):
    c = client(refused_address, "down", max_queue_steps=10)
    accepted = [c.submit(batch(i)) for i in range(1000)]
    assert all(accepted)
    assert c.stats.dropped == {"queue_full": 990}
    assert [b.step for b in c._steps] == list(range(990, 1000))  # the newest are kept
    started = time.monotonic()
    c.close("finished", 999, timeout=1.0)
    assert time.monotonic() - started < 3.0  # bounded shutdown
    assert c.submit(batch(1000)) is False
    assert c.stats.dropped["already_shutdown"] == 1
    warnings = [r for r in caplog.records if "cannot reach the comparison server" in r.getMessage()]  # never reached
    assert len(warnings) == 1


def test_steps_arrive_in_order_and_close_is_clean(server):
    c = client(server.address, "clean")
    for i in range(50):
        c.submit(batch(i))
    c.close("finished", 49, timeout=10)
    run = run_status(server, "clean", "base")
    assert run.last_step == 49 and run.state == "finished"
    assert c.stats.steps_sent == 50 and not c.stats.dropped


def test_reconnects_after_a_server_restart():
    first = serve(port=0)
    port = first.port  # the restart binds the port the first server had: that is the test
    c = client(f"127.0.0.1:{port}", "restart")
    for i in range(5):
        c.submit(batch(i))
    wait_for(lambda: last_step(first, "restart") == 4)
    first.stop(grace=0.1)
    for i in range(5, 10):
        c.submit(batch(i))
    second = serve(port=port)
    try:
        wait_for(lambda: last_step(second, "restart") == 9, timeout=30)
        assert c.stats.reconnects >= 1
    finally:
        c.close("finished", 9, timeout=5)
        second.stop(grace=0.1)


def test_a_refusing_server_stops_the_client_without_retrying(server, caplog):
    keeper = client(server.address, "refuse")
    keeper.submit(batch(0))
    wait_for(lambda: last_step(server, "refuse") == 0)
    # A second baseline in the same session is refused (ALREADY_EXISTS): no retry can fix it.
    intruder = StreamClient(hello("refuse", run="other"), StreamConfig(target=server.address), lambda c: None, lambda: 0)
    intruder.start()
    wait_for(lambda: intruder.stats.rejected)
    assert "ALREADY_EXISTS" in intruder.stats.rejected
    assert intruder.submit(batch(1)) is False
    assert intruder.stats.dropped == {"server_rejected": 1}
    assert any("refused this run" in r.getMessage() for r in caplog.records)
    intruder.close("finished", 0, timeout=1)
    keeper.close("finished", 0, timeout=5)


def _child_submits(target: str, result: "multiprocessing.Queue") -> None:
    c = _FORK_PARENT_CLIENT[0]
    result.put((c.submit(batch(1)), dict(c.stats.dropped)))


_FORK_PARENT_CLIENT: list[StreamClient] = []


def test_a_forked_child_gets_an_inert_client(server):
    c = client(server.address, "fork")
    _FORK_PARENT_CLIENT.append(c)
    c.submit(batch(0))
    wait_for(lambda: last_step(server, "fork") == 0)
    ctx = multiprocessing.get_context("fork")
    result = ctx.Queue()
    child = ctx.Process(target=_child_submits, args=(server.address, result))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    accepted, dropped = result.get(timeout=5)
    assert accepted is False and dropped == {"forked_child": 1}
    # The parent is unaffected.
    c.submit(batch(1))
    wait_for(lambda: last_step(server, "fork") == 1)
    c.close("finished", 1, timeout=5)
    _FORK_PARENT_CLIENT.clear()


def test_stream_config_is_validated():
    with pytest.raises(ValueError, match="host:port"):
        StreamConfig(target="nowhere")


def test_a_step_the_server_fails_on_is_dropped_not_resent_forever(caplog):
    """INTERNAL on step 2 and on step 4 (a server bug those steps trigger): each is sent once, dropped with
    reason "server_error", listed for the server, warned once in all; the steps after them arrive."""
    tiny = TinyServer(TinyServicer(fail_on=frozenset({2, 4})))
    c = client(tiny.address, "server-error")
    try:
        for i in range(7):
            c.submit(batch(i))
        wait_for(lambda: tiny.servicer.held() == [0, 1, 3, 5, 6], timeout=20)
        c.close("finished", 6, timeout=10)
        seen = tiny.servicer.seen
        assert seen.steps.count(2) == 1 and seen.steps.count(4) == 1, seen.steps  # tried once, not again
        assert c.stats.dropped == {"server_error": 2} and c.pending_steps == 0
        assert [(m.first_step, m.last_step, m.reason) for m in seen.health.missing] == [
            (2, 2, "server_error"), (4, 4, "server_error")]
        assert "a bug on step 2" in seen.health.missing[0].detail
        assert dict(seen.health.dropped) == {"server_error": 2} and dict(seen.close.dropped) == {"server_error": 2}
        messages = [r.getMessage() for r in caplog.records if r.name == "twinstep" and r.levelname == "WARNING"]
        assert sum("server failed while taking step 2" in m for m in messages) == 1, messages
        assert not any("step 4" in m or "lost contact" in m for m in messages), messages
    finally:
        c.close("finished", 6, timeout=1)
        tiny.stop()
