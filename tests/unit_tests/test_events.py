"""The event bus: bounded history for late watchers, verdicts kept over chatter."""

from __future__ import annotations

from twinstep.server.alert.events import MAX_KEPT_ALERTS, MAX_KEPT_VERDICTS, EventBus
from twinstep.v1 import twinstep_pb2 as pb


def test_history_is_bounded_and_keeps_the_divergence_over_many_alerts():
    bus = EventBus("s")
    bus.publish(pb.Event(divergence=pb.Divergence(step=3, module="fc")), keep=True)
    for i in range(10 * MAX_KEPT_ALERTS):
        bus.publish(pb.Event(alert=pb.AlertNotice(level="warning", message=str(i))), keep=True)
    for i in range(3):
        bus.publish(pb.Event(progress=pb.Progress(steps_compared=i)))  # never kept
    history = bus.history
    assert len(history) == MAX_KEPT_ALERTS + 1
    assert history[0].divergence.module == "fc"
    assert [e.alert.message for e in history[1:3]] == [str(9 * MAX_KEPT_ALERTS), str(9 * MAX_KEPT_ALERTS + 1)]
    watcher = bus.subscribe()  # a late watcher gets exactly the kept events, oldest first
    replayed = [watcher.get_nowait() for _ in range(watcher.qsize())]
    assert [e.WhichOneof("body") for e in replayed] == ["divergence"] + ["alert"] * MAX_KEPT_ALERTS


def test_verdicts_are_bounded_too():
    bus = EventBus("s")
    for i in range(MAX_KEPT_VERDICTS + 10):
        bus.publish(pb.Event(halt=pb.HaltNotice(run=str(i))), keep=True)
    assert len(bus.history) == MAX_KEPT_VERDICTS and bus.history[-1].halt.run == str(MAX_KEPT_VERDICTS + 9)
