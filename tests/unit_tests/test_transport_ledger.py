"""The drop ledger both senders keep, and the same drop counted the same way by each sender."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import wait_for
from tests.unit_tests.test_stream_client import batch, hello
from tests.unit_tests.tiny_server import TinyServer, TinyServicer
from twinstep.runtime.transport import DropLedger, StreamClient, StreamConfig
from twinstep.runtime.transport.shared_memory import AVAILABLE
from twinstep.v1 import twinstep_pb2 as pb


def _ranges(missing) -> list[tuple[int, int, str]]:
    return [(m.first_step, m.last_step, m.reason) for m in missing]


def test_the_ledger_counts_lists_and_warns_once_per_reason(caplog):
    ledger = DropLedger()
    for step in range(3):
        ledger.drop("queue_full", step)
    ledger.drop("oversized", 7)
    ledger.drop("shutdown", 8)  # said elsewhere: counted, not warned
    ledger.drop("sender_lost", count=2)  # steps unknown: counted, not listed
    assert ledger.counts() == {"queue_full": 3, "oversized": 1, "shutdown": 1, "sender_lost": 2}
    assert _ranges(ledger.missing()) == [(0, 2, "queue_full"), (7, 7, "oversized"), (8, 8, "shutdown")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["twinstep: dropping steps (queue_full); counted in the report, warned once",
                        "twinstep: dropping steps (oversized); counted in the report, warned once"]


def test_the_server_is_told_the_list_once_per_stream_with_the_counts():
    ledger = DropLedger()
    assert not ledger.unreported
    ledger.drop("queue_full", 4)
    ledger.mark_missing(5, "capture_failed", "ValueError: x")  # counted by the capture health, not here
    ledger.mark_missing(6, "queue_full", dropped=True)  # dropped and counted by the training process
    assert ledger.unreported
    health = pb.CaptureHealth(dropped={"stale": 9}, missing=[pb.MissingSteps(first_step=1, last_step=1)])
    ledger.report(health)
    assert not ledger.unreported
    assert _ranges(health.missing) == [(4, 4, "queue_full"), (5, 5, "capture_failed"), (6, 6, "queue_full")]
    assert dict(health.dropped) == {"queue_full": 2}
    assert ledger.counts() == {"queue_full": 1}  # the training process shows its own drop itself
    ledger.resend()  # a new stream
    assert ledger.unreported


def test_remote_counts_add_to_local_ones():
    ledger = DropLedger()
    ledger.drop("queue_full", 1)
    ledger.set_remote({"queue_full": 2, "oversized": 1, "shutdown": 0})
    assert ledger.counts() == {"queue_full": 3, "oversized": 1}
    ledger.set_remote({"queue_full": 5})  # cumulative: replaced, not added
    assert ledger.counts() == {"queue_full": 6}


def _sender(kind: str, address: str, session: str):
    config = StreamConfig(target=address, max_queue_steps=3, backoff_initial=0.05, backoff_max=0.2)
    if kind == "thread":
        return StreamClient(hello(session), config, lambda c: None, lambda: 0)
    if not AVAILABLE:
        pytest.skip("the sender process needs shared memory files (Linux)")
    from twinstep.runtime.transport.sidecar import SidecarClient

    return SidecarClient(hello(session), config, lambda c: None, lambda: 0)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_both_senders_count_a_full_queue_the_same_way(kind, caplog):
    """Eight steps into a queue of three before the sender starts: five dropped, oldest first, counted,
    listed by step, warned once; the server hears the same list and counts from either sender."""
    tiny = TinyServer(TinyServicer())
    sender = _sender(kind, tiny.address, f"queue-{kind}")
    try:
        assert all(sender.submit(batch(step)) for step in range(8))  # not started: nothing has left
        assert sender.stats.dropped == {"queue_full": 5}
        assert _ranges(sender.stats.ledger.missing()) == [(0, 4, "queue_full")]
        sender.start()
        wait_for(lambda: tiny.servicer.held() == [5, 6, 7], timeout=30)
        sender.close("finished", 7, timeout=10)
        seen = tiny.servicer.seen
        assert seen.close is not None and dict(seen.close.dropped) == {"queue_full": 5}
        assert _ranges(seen.health.missing) == [(0, 4, "queue_full")] and dict(seen.health.dropped) == {"queue_full": 5}
        assert sender.stats.dropped == {"queue_full": 5} and sender.stats.steps_sent == 3
        warnings = [r.getMessage() for r in caplog.records
                    if r.levelno == logging.WARNING and "dropping" in r.getMessage()]
        assert warnings == ["twinstep: dropping steps (queue_full); counted in the report, warned once"]
    finally:
        sender.close("finished", 7, timeout=1)
        tiny.stop()


def test_steps_not_sent_are_counted_in_words_with_their_reasons():
    from twinstep.runtime.transport.ledger import not_sent_in_words

    assert not_sent_in_words({}, reached=True) == ""
    assert not_sent_in_words({"shutdown": 30}, reached=False) == (
        "30 steps not sent: the training ended before the server was reached")
    assert not_sent_in_words({"shutdown": 1}, reached=True) == (
        "1 step not sent: the training ended before it was delivered")
    # The largest reason first; a reason this version does not know is named as it is.
    assert not_sent_in_words({"shutdown": 3, "queue_full": 990, "oversized": 1, "new_reason": 2}, reached=True) == (
        "996 steps not sent: 990 because the queue was full while the server was behind or away "
        "(max_queue_steps, max_queue_bytes), 3 because the training ended before they were delivered, "
        "2 because new_reason, 1 because it was larger than a message may be")
