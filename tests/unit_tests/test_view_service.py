"""server/view/service.py: views built from copies, shared by every page, at a bounded rate."""

from __future__ import annotations

import json
import threading

from twinstep.server.config import ServerConfig
from twinstep.server.registry import SessionRegistry
from twinstep.server.view.service import ViewService, _RateMeter
from twinstep.v1 import twinstep_pb2 as pb


def _service(min_interval: float = 60.0) -> tuple[ViewService, SessionRegistry]:
    registry = SessionRegistry(ServerConfig())
    registry.get_or_create("s")
    return ViewService(registry, halt_enabled=True, halt_message="", auth_required=False,
                       min_interval=min_interval), registry


def test_many_pages_share_one_build_per_interval():
    service, registry = _service()
    bodies = []
    threads = [threading.Thread(target=lambda: bodies.append(service.view("s"))) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert service.builds == 1 and len({etag for _, etag in bodies}) == 1
    assert json.loads(bodies[0][0])["session"] == "s"
    assert service.view("nope") is None
    registry.close()


def test_a_halt_shows_in_the_next_view_at_once():
    service, registry = _service()
    assert json.loads(service.view("s")[0])["report"]["halted"] is False
    assert service.halt("s", "checked") == []
    assert json.loads(service.view("s")[0])["report"]["halted"] is True
    assert service.builds == 2 and service.halt("nope", "x") is None
    registry.close()


def test_a_rebuild_waits_ten_times_what_the_last_build_took():
    service, registry = _service(min_interval=0.0)
    service.view("s")
    cached = service._cache["s"]
    assert cached.ready_at - cached.built >= 10 * (service.build_seconds - 1e-9)
    registry.close()


def test_steps_per_second_of_streaming_runs_only():
    meter = _RateMeter()

    def runs(base: int, cand: int, cand_state: str = "streaming") -> list[pb.RunStatus]:
        return [pb.RunStatus(name="base", last_step=base, state="streaming"),
                pb.RunStatus(name="cand", last_step=cand, state=cand_state)]

    assert meter.rates(100.0, runs(10, -1)) == {}  # one sample: no speed yet
    assert meter.rates(102.0, runs(30, 5)) == {"base": 10.0}  # the candidate had no step two seconds ago
    assert meter.rates(103.0, runs(40, 9)) == {"base": 10.0, "cand": 4.0}
    assert meter.rates(104.0, runs(50, 9, "finished")) == {"base": 10.0}
    assert meter.rates(120.0, runs(210, 9)) == {"base": 10.0, "cand": 0.0}  # the window moved on
