"""A sharded server (shards in this process, real gRPC) against the embedded one, on raw multi-rank streams.

What only the coordinator can get right: the first divergence over shards (a
shard's own earlier declaration is not the session's until every other shard
has passed its step), one halt step on every shard, the merged report and
session list, the front's redirects, and a shard restarted from its journal.
The same shards run as Ray actors in tests/integration/test_sharded_server.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, hello, manifest, step
from twinstep.server import serve
from twinstep.server.config import ServerConfig
from twinstep.server.shards import serve_sharded
from twinstep.server.shards.ownership import RankShare, shard_of
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

import grpc

WORLD = 4
MODULES = [(1, "layer1", "Linear"), (2, "layer2", "Linear")]


def _values(step_number: int, rank: int, off: float = 0.0) -> list[tuple[int, np.ndarray]]:
    base = np.linspace(-1.0, 1.0, 64, dtype=np.float32) * (1 + 0.01 * step_number + 0.001 * rank)
    return [(1, base), (2, base * 2 + off)]


class Rank:
    """One rank's stream: to the front, which sends it to its shard (or straight to an embedded server)."""

    def __init__(self, address: str, session: str, run: str, rank: int, baseline: bool) -> None:
        first = RawStream(address).send(hello(session, run, baseline=baseline, rank=rank, world_size=WORLD))
        welcome = first.next()
        assert isinstance(welcome, pb.ServerMessage) and welcome.WhichOneof("body") == "welcome", welcome
        self.redirected = welcome.welcome.stream_to
        if self.redirected:
            first.close()
            self.stream = RawStream(self.redirected).send(hello(session, run, baseline=baseline, rank=rank,
                                                                world_size=WORLD))
            reply = self.stream.next()
            assert reply.WhichOneof("body") == "welcome" and not reply.welcome.stream_to, reply
        else:
            self.stream = first
        self.rank = rank
        self.stream.send(manifest(*MODULES))

    def steps(self, numbers, off_at: dict[int, float] | None = None) -> None:
        for number in numbers:
            self.stream.send(step(number, _values(number, self.rank, (off_at or {}).get(number, 0.0)),
                                  rank=self.rank))

    def close(self) -> None:
        self.stream.send(pb.ClientMessage(close=pb.Close()))
        self.stream.close()


def _session(address: str, name: str) -> dict[tuple[str, int], Rank]:
    ranks = {}
    for run, baseline in (("base", True), ("cand", False)):
        for rank in range(WORLD):
            ranks[(run, rank)] = Rank(address, name, run, rank, baseline)
    return ranks


def _divergence(report: dict) -> tuple | None:
    first = report.get("first_divergence")
    return None if not first else (first["step"], first["phase"], first["module"], first["rank"])


def _ended(report: dict) -> bool:
    """Every rank of both runs said goodbye and was taken in: nothing more will be compared."""
    return len(report["runs"]) == 2 and all(run["state"] == "finished" for run in report["runs"])


@pytest.fixture(scope="module")
def servers():
    config = ServerConfig()
    config.sharding.poll_interval = 0.05
    embedded = serve(port=0, config=ServerConfig())
    sharded = serve_sharded(port=0, config=config, shards=2, runtime="inprocess")
    yield embedded, sharded
    sharded.stop(0.5)
    embedded.stop(0.5)


def test_ownership_rule() -> None:
    assert [shard_of("s", rank, 2, "rank") for rank in range(4)] == [0, 1, 0, 1]
    assert len({shard_of("s", rank, 4, "session") for rank in range(8)}) == 1
    share = RankShare(1, 2, "rank")
    assert share.ranks("s", 5) == [1, 3] and share.owns("s", 3) and not share.owns("s", 2)


def test_a_shards_own_divergence_waits_for_the_other_shards(servers) -> None:
    """Shard 0 finds step 4 first; shard 1's rank 3 diverged at step 2, which the session must name."""
    embedded, sharded = servers
    for handle, name in ((embedded, "wait-e"), (sharded, "wait-s")):
        ranks = _session(handle.address, name)
        if handle is sharded:
            assert all(r.redirected for r in ranks.values())
            assert {shard_of(name, rank, 2, "rank") for rank in range(WORLD)} == {0, 1}
        for (run, rank), stream in ranks.items():
            if rank % 2 == 0:  # shard 0's ranks run ahead, with a divergence at step 4 on rank 0
                stream.steps(range(6), {4: 0.5} if (run, rank) == ("cand", 0) else None)
            else:
                stream.steps(range(2))
        if handle is sharded:
            wait_for(lambda: sharded.coordinator.views.get(name) is not None
                     and "cand" in sharded.coordinator.views[name].firsts(), timeout=20)
            report = handle.report(name)
            assert report["status"] == "running", report["status"]
            assert _divergence(report) is None  # shard 0's step 4 is not the session's first yet
            assert any("a shard found a divergence" in reason for reason in report["status_reasons"])
        for (run, rank), stream in ranks.items():
            if rank % 2 == 1:
                stream.steps(range(2, 6), {2: 0.5} if (run, rank) == ("cand", 3) else None)
        for stream in ranks.values():
            stream.close()
        wait_for(lambda: _ended(handle.report(name)), timeout=20)
    expected, got = embedded.report("wait-e"), sharded.report("wait-s")
    assert _divergence(got) == _divergence(expected) == (2, "forward", "layer2", 3)
    assert got["steps_compared"] == expected["steps_compared"]
    for run in ("base", "cand"):
        mine = next(r for r in got["runs"] if r["name"] == run)
        theirs = next(r for r in expected["runs"] if r["name"] == run)
        for field in ("ranks", "records_received", "last_step", "first_step", "state", "dropped"):
            assert mine.get(field) == theirs.get(field), (run, field, mine.get(field), theirs.get(field))
    assert got["stage"] == expected["stage"]
    listing = pb_grpc.TwinstepStub(grpc.insecure_channel(sharded.address)).ListSessions(pb.ListSessionsRequest())
    summary = next(s for s in listing.sessions if s.name == "wait-s")
    assert summary.status == "diverged" and "step 2" in summary.first_divergence


def test_a_wrong_shard_sends_the_stream_back_to_the_front(servers) -> None:
    _, sharded = servers
    wrong = sharded.shard_addresses()[1]
    stream = RawStream(wrong).send(hello("wrong", "base", baseline=True, rank=0, world_size=2))
    reply = stream.next()
    assert reply.welcome.stream_to == sharded.address


def test_halt_reaches_every_shard_at_one_step(servers) -> None:
    _, sharded = servers
    ranks = _session(sharded.address, "halt-s")
    for stream in ranks.values():
        stream.steps(range(3))
    wait_for(lambda: sharded.coordinator.views.get("halt-s") is not None
             and sharded.coordinator.views["halt-s"].steps_compared() >= 1, timeout=20)
    told = sharded.halt("halt-s", "stop here")
    assert told == ["base", "cand"]
    commands = []
    for stream in ranks.values():
        while True:
            message = stream.stream.next(timeout=20)
            if isinstance(message, pb.ServerMessage) and message.WhichOneof("body") == "command" \
                    and message.command.kind == pb.Command.HALT:
                commands.append(message.command.at_step)
                break
    assert len(commands) == 2 * WORLD and len(set(commands)) == 1, commands  # one step on every rank of both shards
    wait_for(lambda: sharded.report("halt-s")["halted"], timeout=20)


def test_a_killed_shard_comes_back_from_its_journal(servers) -> None:
    _, sharded = servers
    ranks = _session(sharded.address, "kill-s")
    for stream in ranks.values():
        stream.steps(range(3))
    wait_for(lambda: sharded.coordinator.views.get("kill-s") is not None
             and sharded.coordinator.views["kill-s"].steps_compared() >= 3, timeout=20)
    before = sharded.report("kill-s")
    address = sharded.shard_addresses()[1]
    sharded.kill_shard(1)
    wait_for(lambda: sharded.shard_addresses()[1] == address, timeout=20)  # the same port again
    after = sharded.report("kill-s")
    assert after["steps_compared"] == before["steps_compared"] == 3
    assert [r["records_received"] for r in after["runs"]] == [r["records_received"] for r in before["runs"]]


def test_the_sharding_settings_decide_the_shards_and_what_each_owns() -> None:
    """sharding.shards starts that many; sharding.key = session puts all of a session on one shard."""
    config = ServerConfig()
    config.sharding.shards = 3
    config.sharding.key = "session"
    handle = serve_sharded(port=0, config=config, runtime="inprocess")
    try:
        assert len(handle.shard_addresses()) == 3 and all(handle.shard_addresses())
        ranks = _session(handle.address, "whole")
        owner = handle.shard_addresses()[shard_of("whole", 0, 3, "session")]
        assert {stream.redirected for stream in ranks.values()} == {owner}
        for stream in ranks.values():
            stream.steps(range(2))
        wait_for(lambda: handle.report("whole")["steps_compared"] == 2, timeout=20)
    finally:
        handle.stop(0.5)


def test_the_poll_interval_paces_the_coordinator() -> None:
    counts = {}
    for interval in (0.05, 30.0):
        config = ServerConfig()
        config.sharding.poll_interval = interval
        handle = serve_sharded(port=0, config=config, shards=2, runtime="inprocess")
        try:
            start = handle.coordinator.polls
            if interval < 1:
                assert handle.coordinator.wait_polls(10, timeout=20)
            else:
                import time

                time.sleep(1.0)
            counts[interval] = handle.coordinator.polls - start
        finally:
            handle.stop(0.5)
    assert counts[0.05] >= 10 and counts[30.0] == 0, counts


def test_a_restarted_coordinator_rebuilds_the_session_from_the_shards(servers) -> None:
    """The coordinator keeps nothing the shards do not: a new one gives the same report, halt included."""
    _, sharded = servers
    ranks = _session(sharded.address, "coord-s")
    for (run, rank), stream in ranks.items():
        stream.steps(range(4), {1: 0.5} if (run, rank) == ("cand", 2) else None)
    wait_for(lambda: _divergence(sharded.report("coord-s")) is not None, timeout=20)
    sharded.halt("coord-s", "operator")
    wait_for(lambda: sharded.report("coord-s")["halted"], timeout=20)
    before = sharded.report("coord-s")
    old = sharded.coordinator
    sharded.restart_coordinator()
    assert sharded.coordinator is not old and sharded.coordinator.views is not old.views
    wait_for(lambda: _divergence(sharded.report("coord-s")) is not None, timeout=20)
    after = sharded.report("coord-s")
    for field in ("status", "steps_compared", "halted", "first_divergence", "stage", "runs", "coverage"):
        assert after.get(field) == before.get(field), field
    assert _divergence(after) == (1, "forward", "layer2", 2)


def test_what_the_front_passes_through_reaches_rank_zeros_shard(servers) -> None:
    """The dashboard's history (``twinstep report --html``) comes from rank 0's shard, through the front."""
    _, sharded = servers
    ranks = _session(sharded.address, "history-s")
    for stream in ranks.values():
        stream.steps(range(3))
    wait_for(lambda: sharded.report("history-s")["steps_compared"] == 3, timeout=20)
    stub = pb_grpc.TwinstepStub(grpc.insecure_channel(sharded.address))
    history = stub.GetHistory(pb.HistoryRequest(session="history-s"), timeout=20)
    assert history.session == "history-s" and history.revision >= 3 and history.candidates, history


def test_weight_sync_goes_through_the_front_to_rank_zeros_shard(servers, monkeypatch) -> None:
    """The baseline's rank 0 publishes its weights, a candidate's rank 1 (compared on the other shard) loads them."""
    import torch

    import twinstep

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))

    _, sharded = servers
    base_model, cand_model = model(0), model(7)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    base = twinstep.attach(base_model, session="weights-s", run="torch", baseline=True, share_weights=True,
                           server=sharded.address)
    monkeypatch.setenv("RANK", "1")
    cand = twinstep.attach(cand_model, session="weights-s", run="cand", init_from_baseline=True, init_timeout=60,
                           server=sharded.address)
    try:
        assert shard_of("weights-s", 1, 2, "rank") == 1
        assert all(torch.equal(b, c) for b, c in zip(base_model.parameters(), cand_model.parameters()))
        assert len(cand.weight_sync.loaded) == 4
    finally:
        base.close(), cand.close()
