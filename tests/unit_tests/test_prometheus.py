"""Prometheus metrics read from live sessions: exact values, valid exposition, and a scrape that stays short.

A real in-process server on port 0 fed by real gRPC streams (tests/integration/rawclient.py).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, hello, manifest, step
from twinstep.server import ServerConfig, serve
from twinstep.server.config import SessionsConfig
from twinstep.server.alert.prometheus import MAX_DROP_REASONS, _bounded_reasons, collect_text, read_session

SESSIONS, MODULES, BASE_STEPS, CAND_STEPS = 16, 64, 30, 24


@pytest.fixture(scope="module")
def busy_server():
    """16 sessions of 2 runs: the baseline sent 30 steps of 64 modules, the candidate 24 (one off at step 5)."""
    handle = serve(port=0, config=ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5)))
    modules = [(i, f"layers.{i}", "Linear") for i in range(MODULES)]
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(16).astype(np.float32) for _ in range(MODULES)]
    streams = []
    for s in range(SESSIONS):
        name = f"s{s}"
        base = RawStream(handle.address).send(hello(name, "torch", baseline=True)).send(manifest(*modules))
        cand = RawStream(handle.address).send(hello(name, "paddle", framework="paddle")).send(manifest(*modules))
        for n in range(BASE_STEPS):
            base.send(step(n, list(enumerate(values))))
        for n in range(CAND_STEPS):
            off = [(i, v * 1.5 if (n == 5 and i == 3) else v) for i, v in enumerate(values)]
            cand.send(step(n, off))
        streams += [base, cand]
    wait_for(lambda: all((session := handle.registry.get(f"s{s}")) is not None and session.steps_compared() == CAND_STEPS
                         for s in range(SESSIONS)), timeout=120)
    yield handle
    for stream in streams:
        stream.close()
    handle.stop(grace=0.5)


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_values_are_those_the_streams_sent(busy_server):
    samples = _samples(collect_text(busy_server.registry))
    assert samples[("twinstep_sessions", ())] == SESSIONS
    for s in range(SESSIONS):
        base = (("run", "torch"), ("session", f"s{s}"))
        cand = (("run", "paddle"), ("session", f"s{s}"))
        assert samples[("twinstep_run_steps_received_total", base)] == BASE_STEPS
        assert samples[("twinstep_run_steps_received_total", cand)] == CAND_STEPS
        assert samples[("twinstep_run_records_received_total", cand)] == CAND_STEPS * MODULES
        assert samples[("twinstep_run_last_step", base)] == BASE_STEPS - 1
        assert samples[("twinstep_run_lag_steps", base)] == 0
        assert samples[("twinstep_run_lag_steps", cand)] == BASE_STEPS - CAND_STEPS
        assert samples[("twinstep_run_steps_compared_total", cand)] == CAND_STEPS
        assert samples[("twinstep_run_divergences_total", cand)] == 1  # step 5, layers.3
        assert samples[("twinstep_session_status", (("session", f"s{s}"), ("status", "diverged")))] == 1
        assert samples[("twinstep_run_state", (*cand[:1], *cand[1:], ("state", "streaming")))] == 1
        assert samples[("twinstep_session_halts_total", (("session", f"s{s}"),))] == 0
    held = sum(v for (name, _), v in samples.items() if name == "twinstep_session_held_bytes")
    assert samples[("twinstep_server_held_bytes", ())] == held


def test_a_scrape_of_16_sessions_is_short_and_holds_each_session_briefly(busy_server):
    registry = busy_server.registry
    scrapes, holds = [], []
    for _ in range(20):
        started = time.perf_counter()
        collect_text(registry)
        scrapes.append(time.perf_counter() - started)
    for name in registry.names():
        session = registry.get(name)
        started = time.perf_counter()
        read_session(session)  # what the scrape does under this session's lock (and a little after)
        holds.append(time.perf_counter() - started)
    print(f"scrape of {SESSIONS} sessions x 2 runs: median {statistics.median(scrapes) * 1e3:.2f} ms, "
          f"max {max(scrapes) * 1e3:.2f} ms; one session read: max {max(holds) * 1e3:.3f} ms")
    # Generous bounds for a loaded 2-core CI machine; measured figures are printed (README: docs/alerts.md).
    assert statistics.median(scrapes) < 0.25
    assert max(holds) < 0.05


def test_drop_reasons_from_clients_are_bounded():
    reasons = {f"reason{i:02d}": 1 for i in range(40)}
    bounded = _bounded_reasons(reasons)
    assert len(bounded) == MAX_DROP_REASONS and bounded["other"] == 40 - (MAX_DROP_REASONS - 1)
    assert sum(bounded.values()) == 40
    assert _bounded_reasons({"queue_full": 3, "server_window": 2}) == {"queue_full": 3, "server_window": 2}
