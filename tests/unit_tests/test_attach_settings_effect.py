"""Every attach setting changes what the runtime does: each test runs it with a value other than its
default and shows the difference, against a real in-process server.

That a value reaches ``attach`` alike from its keyword, its ``TWINSTEP_*`` variable, its YAML key and its
``twinstep run`` option (the same typed settings are handed to the runtime) is tests/unit_tests/test_settings.py;
together they show every setting takes effect from every source.  A few settings are shown by a test
elsewhere (``ELSEWHERE``); ``test_every_setting_has_a_test_of_its_effect`` keeps the two lists complete.
"""

from __future__ import annotations

import ast
import itertools
import logging
import time
from pathlib import Path
from typing import Any, Callable

import grpc
import numpy as np
import pytest
import torch

import twinstep
from tests.conftest import run_status, wait_for
from twinstep.runtime import api, settings
from twinstep.server import ServerConfig, serve
from twinstep.server.config import SessionsConfig
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

#: setting -> the test of this module that shows its effect (filled by @shows).
EFFECTS: dict[str, Callable[..., Any]] = {}
#: setting -> a test elsewhere that shows its effect against its default ("path::name").
ELSEWHERE = {
    "tls_client_cert": "tests/integration/test_security.py::test_mutual_tls_refuses_a_client_without_a_certificate",
    "tls_client_key": "tests/integration/test_security.py::test_mutual_tls_refuses_a_client_without_a_certificate",
    "share_weights": "tests/unit_tests/test_weight_sync_in_process.py::"
                     "test_a_baseline_that_does_not_share_its_weights_is_told_at_once",
    "init_from_baseline": "tests/unit_tests/test_weight_sync_in_process.py::"
                          "test_sixteen_bit_weights_reach_paddle_bit_for_bit_with_square_transposes",
    "init_timeout": "tests/unit_tests/test_weight_sync_in_process.py::test_no_baseline_within_init_timeout_is_a_clear_error",
    "publish_batches": "tests/unit_tests/test_batch_sync.py::"
                       "test_the_model_s_first_call_is_published_and_replaced_by_the_baseline_s_in_each_step",
    "sync_batches": "tests/unit_tests/test_batch_sync.py::"
                    "test_the_model_s_first_call_is_published_and_replaced_by_the_baseline_s_in_each_step",
    "batch_timeout": "tests/unit_tests/test_batch_sync.py::"
                     "test_each_rank_gets_its_own_rank_s_batch_and_a_missing_one_is_a_clear_error",
    # Parallel layouts: real processes over gloo, or the declared layout's records.
    "layout_detect": "tests/integration/test_capture_parallel.py::test_dtensors_are_captured_as_their_local_shards",
    **dict.fromkeys(("tensor_parallel", "data_parallel", "tensor_parallel_split"),
                    "tests/integration/test_capture_parallel.py::test_declared_layout_places_the_declared_modules"),
    **dict.fromkeys(("pipeline_parallel", "tensor_parallel_rank", "data_parallel_rank", "pipeline_parallel_rank"),
                    "tests/integration/test_capture_parallel.py::test_declared_layout_ranks_in_megatrons_order"),
}
_SESSIONS = itertools.count()
ROOT = Path(__file__).resolve().parents[2]


def shows(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a test as the one that shows these settings take effect."""
    def register(test: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            assert name in settings.BY_NAME and name not in EFFECTS, name
            EFFECTS[name] = test
        return test

    return register


@pytest.fixture(scope="module")
def server():
    handle = serve(port=0, config=ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5)))
    yield handle
    handle.stop(grace=0.5)


@pytest.fixture(autouse=True)
def _no_settings_from_outside(monkeypatch):
    """Each test gives what it means: nothing from the environment (TWINSTEP_*, launchers')."""
    for name in [n for n in __import__("os").environ if n.startswith("TWINSTEP_")]:
        monkeypatch.delenv(name)
    for item in settings.SETTINGS:
        for variable in item.spec.launcher:
            monkeypatch.delenv(variable, raising=False)


def session_name() -> str:
    return f"effect-{next(_SESSIONS)}"


def model(width: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))


def train(address: str, net: torch.nn.Module | None = None, steps: int = 3, close: bool = True,
          **options: Any) -> twinstep.Monitor:
    """Attach, run ``steps`` training steps, and (by default) close; returns the monitor."""
    net = net if net is not None else model()
    options.setdefault("session", session_name())
    options.setdefault("run", "r")
    mon = twinstep.attach(net, server=address, **options)
    width = next(net.parameters()).shape[1]
    for step in range(steps):
        net(torch.full((2, width), 0.5 + step)).sum().backward()
        mon.step()
    if close:
        mon.close(timeout=10)
    return mon


def finished(server, session: str, run: str = "r") -> pb.RunStatus:
    """The run's status once the server holds every step it was sent and the run has ended."""
    return wait_for(lambda: (s := run_status(server, session, run)) is not None and s.state == "finished" and s,
                    timeout=30)


# -- identity ---------------------------------------------------------------------------------------


@shows("session", "run", "server")
def test_session_run_and_server_say_where_the_steps_go(server):
    with pytest.raises(ValueError, match="needs server="):
        twinstep.attach(model(), session="s", run="r")
    with pytest.raises(ValueError, match="non-empty session and run"):
        twinstep.attach(model(), server=server.address)
    train(server.address, session="effect-named", run="alpha")
    assert finished(server, "effect-named", "alpha").last_step == 2
    assert run_status(server, "effect-named", "r") is None


@shows("baseline")
def test_baseline_makes_the_run_the_one_judged_against(server):
    default, baseline = session_name(), session_name()
    train(server.address, session=default)
    train(server.address, session=baseline, baseline=True)
    assert not finished(server, default).baseline and finished(server, baseline).baseline


@shows("reference")
def test_reference_makes_the_run_a_measure_of_noise(server):
    default, reference = session_name(), session_name()
    train(server.address, session=default)
    train(server.address, session=reference, reference=True)
    assert not finished(server, default).reference and finished(server, reference).reference


@shows("precision")
def test_precision_is_what_the_preflight_compares(server):
    def findings(**candidate: Any) -> list[str]:
        session = session_name()
        base = train(server.address, session=session, run="base", baseline=True, precision="fp32", close=False)
        train(server.address, session=session, run="cand", **candidate)
        base.close()
        finished(server, session, "cand")
        return [f.key for f in server.report_proto(session).preflight]

    assert "float32_matmul" not in findings()  # auto: torch on the CPU multiplies in fp32
    assert "float32_matmul" in findings(precision="tf32")


@shows("rank")
def test_rank_is_the_rank_the_server_holds_the_run_s_reports_under(server):
    def reported_rank(**options: Any) -> int:
        session = session_name()
        mon = train(server.address, session=session, world_size=2, steps=0, close=False, **options)
        mon.record("unreadable", object())  # a value it cannot carry: its capture health says so, by rank
        mon.step()
        mon.close()
        return wait_for(lambda: [h.rank for h in run_status(server, session, "r").health], timeout=30)

    assert reported_rank() == [0] and reported_rank(rank=1) == [1]


@shows("world_size")
def test_world_size_is_the_run_s_number_of_ranks(server):
    default, two = session_name(), session_name()
    train(server.address, session=default)
    train(server.address, session=two, world_size=2)
    assert finished(server, default).ranks == 1 and finished(server, two).ranks == 2


# -- connection -------------------------------------------------------------------------------------


@shows("token")
def test_token_is_what_a_guarded_server_checks():
    from twinstep.server.security import ServerSecurity

    guarded = serve(port=0, security=ServerSecurity(session_tokens=[("guarded", "tok-0123456789")]))
    try:
        refused = train(guarded.address, session="guarded", steps=1, close=False)
        wait_for(lambda: refused.stats.rejected, timeout=30)
        refused.close(timeout=1)
        accepted = train(guarded.address, session="guarded", steps=1, close=False, token="tok-0123456789")
        wait_for(lambda: accepted.stats.steps_sent == 1, timeout=30)
        accepted.close()
        assert not accepted.stats.rejected and refused.stats.steps_sent == 0, refused.stats.rejected
    finally:
        guarded.stop(grace=0.5)


@shows("tls_ca")
def test_tls_ca_is_the_certificate_trusted(tmp_path):
    pytest.importorskip("cryptography")
    from twinstep.server.security import ServerSecurity, self_signed

    cert, key = self_signed(tmp_path)
    secured = serve(port=0, security=ServerSecurity(tls_cert=str(cert), tls_key=str(key)))
    try:
        plain = train(secured.address, steps=1, close=False)  # loopback without TLS settings: plaintext
        wait_for(lambda: plain.stats.reconnects, timeout=30)
        plain.close(timeout=0.5)
        trusting = train(secured.address, steps=1, close=False, tls_ca=str(cert))
        wait_for(lambda: trusting.stats.steps_sent == 1, timeout=30)
        trusting.close()
        assert plain.stats.steps_sent == 0 and trusting.stats.reconnects == 0
    finally:
        secured.stop(grace=0.5)


@shows("insecure")
def test_insecure_is_plaintext_to_a_server_off_loopback(monkeypatch):
    channels: list[tuple[str, str]] = []
    real = {"insecure_channel": grpc.insecure_channel, "secure_channel": grpc.secure_channel}

    def spy(kind: str) -> Callable[..., grpc.Channel]:
        def make(target: str, *args: Any, **kwargs: Any) -> grpc.Channel:
            channels.append((kind, target))
            return real[kind](target, *args, **kwargs)
        return make

    for kind in real:
        monkeypatch.setattr(grpc, kind, spy(kind))
    away = "192.0.2.1:9"  # a documentation address: never reached, only dialled
    default = train(away, steps=0, close=False)
    wait_for(lambda: ("secure_channel", away) in channels, timeout=30)
    default.close(timeout=0.2)
    channels.clear()
    plaintext = train(away, steps=0, close=False, insecure=True)
    wait_for(lambda: ("insecure_channel", away) in channels, timeout=30)
    plaintext.close(timeout=0.2)
    assert ("secure_channel", away) not in channels


# -- capture ----------------------------------------------------------------------------------------


@shows("capture")
def test_capture_tensors_sends_full_tensors(server):
    default = train(server.address, sender="thread")
    tensors = train(server.address, sender="thread", capture="tensors")
    assert default.stats.tensor_bytes == 0 and tensors.stats.tensor_bytes > 0


def _records(server, **options: Any) -> int:
    session = session_name()
    train(server.address, session=session, **options)
    return finished(server, session).records_received


@shows("include", "exclude", "backward")
def test_include_exclude_and_backward_choose_the_records(server):
    everything = _records(server)
    assert _records(server, include=["2"]) < _records(server, include=["0", "2"]) < everything
    assert _records(server, exclude=["0", "1"]) == _records(server, include=["", "2"])
    assert _records(server, backward=False) < everything


@shows("every")
def test_every_captures_every_nth_step(server):
    assert train(server.address, steps=5).stats.steps_sent == 5
    assert train(server.address, steps=5, every=2).stats.steps_sent == 3  # steps 0, 2, 4


@shows("start_step")
def test_start_step_numbers_the_steps(server):
    default, later = session_name(), session_name()
    train(server.address, session=default)
    mon = train(server.address, session=later, start_step=10)
    assert mon.current_step == 13
    assert (finished(server, default).first_step, finished(server, later).first_step) == (0, 10)


@shows("sketch")
def test_sketch_lets_the_server_estimate_whole_tensor_metrics(server):
    def estimated(**options: Any) -> float:
        """The largest rel_l2 the server estimated from sketches; the candidate's first weight is 1% larger."""
        session = session_name()
        base = train(server.address, model(256), session=session, run="base", baseline=True, close=False, **options)
        candidate = model(256)  # tensors larger than a sketch (256 buckets)
        with torch.no_grad():
            candidate[0].weight.mul_(1.01)
        train(server.address, candidate, session=session, run="cand", **options)
        base.close()
        finished(server, session, "cand")
        compared = wait_for(lambda: server.last_comparison(session), timeout=30)
        return float(np.max(compared.values.get("sketch_rel_l2", [0.0])))

    assert estimated() == 0.0  # without sketches: no estimate
    assert estimated(sketch=True) > 0.001


@shows("stats_workers")
def test_stats_workers_take_statistics_off_the_training_thread(server):
    def cost(**options: Any):
        net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
        return train(server.address, net, **options).capture_cost

    assert cost().offloaded > 0
    inline = cost(stats_workers=0)
    assert inline.offloaded == 0 and inline.inline > 0


# -- transport --------------------------------------------------------------------------------------


@shows("sender")
def test_sender_chooses_who_sends_full_tensors(server):
    chosen = {}
    for sender in ("auto", "thread"):
        mon = train(server.address, steps=1, capture="tensors", close=False,
                    **({} if sender == "auto" else {"sender": sender}))
        chosen[sender] = type(mon._client).__name__
        mon.close()
    # auto: a CPU model's tensors go through a sender process where shared memory exists (Linux)
    expected = "SidecarClient" if api.SHARED_MEMORY_AVAILABLE else "StreamClient"
    assert chosen == {"auto": expected, "thread": "StreamClient"}


@shows("compression")
def test_compression_zstd_compresses_what_auto_leaves(server):
    def ratio(**options: Any) -> float:
        net = model(512)
        with torch.no_grad():
            for p in net.parameters():
                p.zero_()  # every tensor is zeros: what zstd shrinks most
        stats = train(server.address, net, capture="tensors", sender="thread", **options).stats
        return stats.tensor_wire_bytes / stats.tensor_bytes

    # auto leaves float32 uncompressed (it rarely shrinks it by 10%); zstd is asked for over slow links
    assert ratio(compression="zstd") < 0.5 < ratio()


@shows("max_queue_steps", "max_queue_bytes")
def test_the_queue_bounds_drop_the_oldest_steps_while_the_server_is_away(refused_address):
    def dropped(**options: Any) -> dict[str, int]:
        mon = train(refused_address, steps=5, close=False, sender="thread", capture="tensors", **options)
        counts = mon.stats.dropped
        mon.close(timeout=0.2)
        return counts

    assert dropped().get("queue_full", 0) == 0
    assert dropped(max_queue_steps=2)["queue_full"] == 3
    assert dropped(max_queue_bytes=1)["queue_full"] >= 4  # no step fits: each is dropped for the next


# -- pacing -----------------------------------------------------------------------------------------


@shows("lockstep", "lockstep_timeout")
def test_lockstep_holds_a_run_ahead_of_the_others_for_at_most_its_timeout(server, caplog):
    caplog.set_level(logging.WARNING, logger="twinstep")

    def lead(**options: Any) -> float:
        """Seconds a candidate took for 3 steps while the baseline, connected, takes none."""
        session = session_name()
        idle = twinstep.attach(model(), session=session, run="base", baseline=True, server=server.address)
        net = model()
        mon = twinstep.attach(net, session=session, run="cand", server=server.address, **options)
        wait_for(lambda: idle.stats.connected and mon.stats.connected, timeout=30)
        started = time.monotonic()
        for step in range(3):
            net(torch.ones(2, 4)).sum().backward()
            mon.step()
        took = time.monotonic() - started
        mon.close()
        idle.close()
        return took

    def gave_up() -> bool:
        return any("lockstep wait for the other runs exceeded" in r.getMessage() for r in caplog.records)

    lead()
    assert not gave_up()  # lockstep 0: no wait
    assert 0.6 <= lead(lockstep=1, lockstep_timeout=0.6) < 60  # held 0.6 s (the default would hold 300 s)
    assert gave_up()


# -- reproduce --------------------------------------------------------------------------------------


@shows("bundle_dir")
def test_bundle_dir_is_where_asked_for_bundles_are_written(server, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="twinstep")  # the zoom's line is informational
    session = session_name()
    net = model()
    mon = twinstep.attach(net, session=session, run="r", baseline=True, server=server.address,
                          bundle_dir=str(tmp_path / "bundles"))

    def step() -> None:
        net(torch.ones(2, 4)).sum().backward()
        mon.step()

    step()
    wait_for(lambda: run_status(server, session, "r") is not None, timeout=30)
    with grpc.insecure_channel(server.address) as channel:
        told = pb_grpc.TwinstepStub(channel).Zoom(pb.ZoomRequest(session=session, modules=["0"], bundle=True),
                                                  timeout=30)
    # The training's own line (the server logs "zoom #" too, in this process, before the run has heard of it).
    wait_for(lambda: any("zoom #" in r.getMessage() and "from the server" in r.getMessage()
                         for r in caplog.records), timeout=30)
    while mon.current_step <= told.first_step:
        step()
    mon.close()
    assert len(mon.bundles) == 1 and mon.bundles[0].startswith(str(tmp_path / "bundles"))


# -- the lists are complete -------------------------------------------------------------------------


def test_every_setting_has_a_test_of_its_effect():
    assert not set(EFFECTS) & set(ELSEWHERE)
    assert set(EFFECTS) | set(ELSEWHERE) == set(settings.BY_NAME), "a setting without a test of its effect"
    for name, where in ELSEWHERE.items():  # read, not imported: those modules need what this one does not
        path, _, test = where.partition("::")
        source = (ROOT / path).read_text()
        found = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == test]
        assert found, f"{where} is gone"
        assert name in ast.get_source_segment(source, found[0]), f"{where} does not use {name}"
