"""Every server setting changes what the server does: each has a test that shows it (here, or named in EFFECT).

A new setting without an entry in EFFECT fails test_every_setting_has_a_test_that_it_takes_effect:
give it a test, or let it go.  Settings read by a component the session builds are checked on that
component (found by its type, wherever the session keeps it); the component's own tests show what
the value does there.
"""

from __future__ import annotations

import ast
import concurrent.futures
import os
from pathlib import Path

import pytest

import twinstep.server
import twinstep.server.memory
from twinstep.cli import serve as serve_cli
from twinstep.cli.main import build_parser
from twinstep.server import serve
from twinstep.server._settings import all_settings
from twinstep.server.config import (AlertsConfig, ComparisonConfig, DashboardConfig, DiagnosisConfig, HaltConfig,
                                    JournalConfig, LimitsConfig, ServerConfig, SessionsConfig)
from twinstep.server.registry import SessionRegistry
from twinstep.v1 import twinstep_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
HERE = "tests/unit_tests/test_server_settings_effect.py"

#: setting -> tests that fail when the setting stops taking effect ("path::test" from the repository root).
EFFECT: dict[str, list[str]] = {
    "listen.host": [f"{HERE}::test_serve_listens_on_the_host_and_port_of_its_settings"],
    "listen.port": [f"{HERE}::test_serve_listens_on_the_host_and_port_of_its_settings"],
    "halt.on_divergence": ["tests/unit_tests/test_recording.py::test_a_halt_of_the_session_halts_the_played_baseline"],
    "halt.after_gap": ["tests/integration/test_coverage.py::test_halt_after_gap_off_holds_the_halt_for_the_user"],
    "halt.prepare_timeout": [f"{HERE}::test_session_components_take_their_settings"],
    "halt.bundle": ["tests/integration/test_reproduce.py::"
                    "test_a_bundle_from_a_halted_run_reproduces_the_modules_error_in_one_process"],
    "window.steps": ["tests/integration/test_server_policies.py::"
                     "test_window_bounds_a_run_that_is_far_ahead_and_the_report_says_so"],
    "window.bytes": ["tests/unit_tests/test_tensor_stream.py::"
                     "test_a_step_whose_tensors_the_server_cannot_hold_is_dropped_by_the_client"],
    "window.inflight_steps": ["tests/unit_tests/test_recording.py::test_a_recorded_baseline_is_played_at_the_candidates_pace",
                              "tests/unit_tests/test_credits.py::"
                              "test_a_stream_may_send_at_most_max_inflight_steps_past_what_the_server_took"],
    "comparison.auto_mapping": ["tests/integration/test_mapping_resolution.py::"
                                "test_layer_rules_keep_applying_once_automatic_matching_fires",
                                f"{HERE}::test_session_components_take_their_settings"],
    "comparison.noise_multiple": [f"{HERE}::test_session_components_take_their_settings"],
    "comparison.noise_floor": [f"{HERE}::test_session_components_take_their_settings"],
    "comparison.drift_window": [f"{HERE}::test_session_components_take_their_settings"],
    "comparison.layouts": ["tests/integration/test_layout_sessions.py::"
                           "test_the_layouts_setting_forces_rank_by_rank_and_shapes_that_differ_are_named"],
    "diagnosis.trace_origins": [f"{HERE}::test_session_components_take_their_settings"],
    "diagnosis.auto_zoom": ["tests/integration/test_zoom.py::"
                            "test_auto_zoom_after_a_divergence_brings_the_module_and_its_neighbours_in_full_tensors"],
    "diagnosis.auto_zoom_steps": ["tests/integration/test_zoom.py::"
                                  "test_auto_zoom_after_a_divergence_brings_the_module_and_its_neighbours_in_full_tensors"],
    "diagnosis.auto_ops": ["tests/integration/test_operations.py::"
                           "test_a_bug_in_a_modules_inline_code_is_named_by_its_operation_and_line"],
    "sessions.ttl": ["tests/integration/test_durable_sessions.py::"
                     "test_without_a_journal_finished_sessions_keep_their_report_in_memory"],
    "sessions.reconnect_grace": ["tests/integration/test_durable_sessions.py::"
                                 "test_a_grace_that_ran_out_before_a_restart_stays_run_out"],
    "sessions.resume_grace": ["tests/integration/test_durable_sessions.py::"
                              "test_a_stream_that_never_returns_after_a_restart_is_lost"],
    "sessions.max_archived": [f"{HERE}::test_max_archived_forgets_the_oldest_kept_report"],
    "journal.directory": ["tests/unit_tests/test_journal.py::test_a_failing_journal_leaves_the_session_going_in_memory"],
    "journal.sync": [f"{HERE}::test_journal_sync_sets_how_the_journal_commits"],
    "recording.directory": ["tests/unit_tests/test_recording.py::test_a_session_restored_from_the_journal_is_recorded_whole"],
    "recording.budget_bytes": ["tests/unit_tests/test_recording.py::"
                               "test_the_budget_evicts_the_oldest_finished_recording_then_refuses_steps"],
    "recording.replay": ["tests/unit_tests/test_recording.py::test_a_recorded_baseline_is_played_at_the_candidates_pace"],
    "dashboard.port": [f"{HERE}::test_the_dashboard_is_served_where_its_settings_say"],
    "dashboard.host": [f"{HERE}::test_the_dashboard_is_served_where_its_settings_say"],
    "dashboard.history_steps": [f"{HERE}::test_session_components_take_their_settings"],
    "dashboard.history_rows": [f"{HERE}::test_session_components_take_their_settings"],
    "alerts.webhooks": ["tests/integration/test_alerts.py::test_webhooks_post_divergence_halt_lost_run_and_capture_failure_as_json"],
    "alerts.webhook_urls": [f"{HERE}::test_webhook_urls_become_receivers_in_their_format"],
    "alerts.webhook_format": [f"{HERE}::test_webhook_urls_become_receivers_in_their_format"],
    "security.tls_cert": [f"{HERE}::test_serve_secures_itself_as_its_settings_say"],
    "security.tls_key": [f"{HERE}::test_serve_secures_itself_as_its_settings_say"],
    "security.tls_client_ca": [f"{HERE}::test_serve_secures_itself_as_its_settings_say"],
    "security.self_signed": [f"{HERE}::test_self_signed_generates_the_pair_serve_presents",
                             "tests/integration/test_security.py::test_self_signed_tls_serves_trusted_clients_only"],
    "security.operator_token": [f"{HERE}::test_serve_secures_itself_as_its_settings_say",
                                "tests/integration/test_security.py::test_self_signed_tls_serves_trusted_clients_only"],
    "security.session_tokens": [f"{HERE}::test_serve_secures_itself_as_its_settings_say",
                                "tests/integration/test_security.py::test_self_signed_tls_serves_trusted_clients_only"],
    "security.tokens_file": [f"{HERE}::test_serve_secures_itself_as_its_settings_say"],
    "security.insecure": [f"{HERE}::test_serve_secures_itself_as_its_settings_say"],
    "limits.max_workers": [f"{HERE}::test_max_workers_sizes_the_grpc_thread_pool"],
    "limits.max_message_bytes": ["tests/integration/test_bad_input.py::test_oversized_message_is_refused"],
    "limits.max_sessions": ["tests/integration/test_limits.py::test_sessions_past_the_limit_are_refused_and_the_others_go_on"],
    "limits.max_runs_per_session": ["tests/integration/test_limits.py::test_runs_past_the_limit_are_refused"],
    "memory.budget_bytes": ["tests/integration/test_limits.py::"
                            "test_memory_budget_frees_ended_sessions_first_and_keeps_their_reports"],
    "memory.release_freed": [f"{HERE}::test_serve_keeps_freed_memory_unless_told_to_release_it"],
    "sync.weights_budget_bytes": ["tests/unit_tests/test_weight_sync_in_process.py::"
                                  "test_weights_beyond_the_servers_budget_are_refused_and_the_candidate_is_told"],
    "sync.batch_buffer_bytes": ["tests/unit_tests/test_batch_sync.py::"
                                "test_batches_over_the_limit_are_refused_and_those_dropped_for_room_say_so_at_once"],
    "sync.batch_max_bytes": ["tests/unit_tests/test_batch_sync.py::"
                             "test_batches_over_the_limit_are_refused_and_those_dropped_for_room_say_so_at_once"],
    "sharding.shards": ["tests/integration/test_sharded_sessions.py::"
                        "test_the_sharding_settings_decide_the_shards_and_what_each_owns"],
    "sharding.key": ["tests/integration/test_sharded_sessions.py::"
                     "test_the_sharding_settings_decide_the_shards_and_what_each_owns"],
    "sharding.poll_interval": ["tests/integration/test_sharded_sessions.py::test_the_poll_interval_paces_the_coordinator"],
    "sharding.ray_address": ["tests/integration/test_shards_on_ray.py::"
                            "test_shards_start_on_a_running_ray_cluster_and_outlive_a_front_that_dies"],
    "sharding.ray_cpus": ["tests/integration/test_shards_on_ray.py::"
                         "test_a_local_ray_instance_declares_the_cpus_asked_and_a_killed_shard_comes_back"],
    "tolerances": [f"{HERE}::test_the_session_compares_with_the_configured_tolerances_and_mapping"],
    "mapping": [f"{HERE}::test_the_session_compares_with_the_configured_tolerances_and_mapping",
                "tests/integration/test_server_policies.py::test_mapping_file_matches_renamed_modules"],
}


def test_every_setting_has_a_test_that_it_takes_effect():
    settings = {s.dotted: s for s in all_settings(ServerConfig)}
    assert sorted(EFFECT) == sorted(settings), "each setting needs a test that it takes effect, or it goes"
    for dotted, tests in EFFECT.items():
        item = settings[dotted]
        for test in tests:
            path, _, name = test.partition("::")
            text = (ROOT / path).read_text()
            names = {n.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}
            assert name in names, f"{dotted}: {test} does not exist"
            spelled = {item.name, item.spec.legacy, item.flag, dotted} - {None}
            assert any(s in text for s in spelled), f"{dotted}: {path} never sets it"


@pytest.fixture
def no_twinstep_environment(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TWINSTEP_")]:
        monkeypatch.delenv(name)


class _Served(Exception):
    """Raised by a stand-in for serve(): what `twinstep serve` would start, without starting it."""


def _serve_command(monkeypatch, *argv: str) -> dict:
    calls: dict = {"retained": False}

    def fake_serve(**kwargs):
        calls.update(kwargs)
        raise _Served

    monkeypatch.setattr(twinstep.server, "serve", fake_serve)
    monkeypatch.setattr(twinstep.server.memory, "retain_freed_memory", lambda: calls.update(retained=True))
    with pytest.raises(_Served):
        serve_cli.run(build_parser().parse_args(["serve", *argv]))
    return calls


def test_serve_listens_on_the_host_and_port_of_its_settings(monkeypatch, no_twinstep_environment):
    assert (_serve_command(monkeypatch)["host"], _serve_command(monkeypatch)["port"]) == ("127.0.0.1", 50051)
    calls = _serve_command(monkeypatch, "--host", "127.0.0.2", "--port", "4321")
    assert (calls["host"], calls["port"]) == ("127.0.0.2", 4321)
    monkeypatch.setenv("TWINSTEP_SERVER_LISTEN_PORT", "4322")
    assert _serve_command(monkeypatch)["port"] == 4322


def test_serve_keeps_freed_memory_unless_told_to_release_it(monkeypatch, no_twinstep_environment):
    assert _serve_command(monkeypatch)["retained"] is True
    assert _serve_command(monkeypatch, "--release-freed-memory")["retained"] is False


def test_serve_secures_itself_as_its_settings_say(monkeypatch, tmp_path, no_twinstep_environment):
    assert not _serve_command(monkeypatch)["security"].tls and not _serve_command(monkeypatch)["security"].insecure
    tokens = tmp_path / "tokens"
    tokens.write_text("# teams\nb=tok-b\n")
    monkeypatch.setenv("TWINSTEP_OPERATOR_TOKEN", "op-token")
    security = _serve_command(monkeypatch, "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem",
                              "--session-token", "a=tok-a", "--tokens-file", str(tokens), "--insecure")["security"]
    assert (security.tls_cert, security.tls_key, security.tls_client_ca) == ("c.pem", "k.pem", "ca.pem")
    assert security.operator_token == "op-token" and security.insecure is True
    assert security.session_tokens == [("b", "tok-b"), ("a", "tok-a")]


def test_self_signed_generates_the_pair_serve_presents(monkeypatch, tmp_path, no_twinstep_environment):
    pytest.importorskip("cryptography")
    security = _serve_command(monkeypatch, "--self-signed", str(tmp_path / "tls"))["security"]
    assert security.tls_cert == str(tmp_path / "tls" / "server.crt") and Path(security.tls_key).is_file()


def test_the_dashboard_is_served_where_its_settings_say():
    handle = serve(port=0, config=ServerConfig())
    try:
        assert handle.http_url is None
    finally:
        handle.stop(grace=0.2)
    handle = serve(port=0, config=ServerConfig(dashboard=DashboardConfig(port=0, host="localhost")))
    try:
        assert handle.http_url.startswith("http://localhost:") and handle.http_port > 0
    finally:
        handle.stop(grace=0.2)


def test_webhook_urls_become_receivers_in_their_format():
    config = ServerConfig(alerts=AlertsConfig(webhook_urls=["http://127.0.0.1:9/a"], webhook_format="slack"))
    handle = serve(port=0, config=config)
    try:
        assert [(r.config.url, r.config.format) for r in handle.webhooks.receivers] == [("http://127.0.0.1:9/a", "slack")]
    finally:
        handle.stop(grace=0.2)


def test_max_workers_sizes_the_grpc_thread_pool(monkeypatch):
    sizes = []
    real = concurrent.futures.ThreadPoolExecutor

    def pool(*args, **kwargs):
        sizes.append(kwargs.get("max_workers"))
        return real(*args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", pool)
    handle = serve(port=0, config=ServerConfig(limits=LimitsConfig(max_workers=7)))
    handle.stop(grace=0.2)
    assert 7 in sizes


def _reachable(root, kind, depth: int = 3):
    """Instances of ``kind`` among root's attributes, and theirs, ``depth`` levels down."""
    found, seen, level = [], {id(root)}, [root]
    for _ in range(depth):
        below = []
        for obj in level:
            for value in getattr(obj, "__dict__", {}).values():
                if id(value) in seen or isinstance(value, (str, bytes, int, float, dict, list, tuple)):
                    continue
                seen.add(id(value))
                if isinstance(value, kind):
                    found.append(value)
                below.append(value)
        level = below
    return found


@pytest.mark.parametrize("group, values, component, check", [
    ("halt", {"prepare_timeout": 0.25}, "twinstep.server.runs.halt:HaltCoordinator",
     lambda c: c.prepare_timeout == 0.25),
    ("comparison", {"noise_multiple": 5.0, "noise_floor": 0.5}, "twinstep.server.detect.noise:NoiseBands",
     lambda c: (c.multiple, c.floor_fraction) == (5.0, 0.5)),
    ("comparison", {"drift_window": 7}, "twinstep.server.detect.drift:LongRunTracker", lambda c: c.window == 7),
    ("comparison", {"auto_mapping": False}, "twinstep.server.compare.mapping_resolver:MappingResolver",
     lambda c: c.automatic is False),
    ("diagnosis", {"trace_origins": False}, "twinstep.server.detect.first_divergence:FirstDivergenceTracker",
     lambda c: c.origins is None),
    ("dashboard", {"history_steps": 9, "history_rows": 11}, "twinstep.server.view.history:SessionHistory",
     lambda c: (c.steps, c.max_rows) == (9, 11)),
])
def test_session_components_take_their_settings(group, values, component, check):
    import importlib

    module, _, name = component.partition(":")
    kind = getattr(importlib.import_module(module), name)
    classes = {"halt": HaltConfig, "comparison": ComparisonConfig, "diagnosis": DiagnosisConfig,
               "dashboard": DashboardConfig}
    registry = SessionRegistry(ServerConfig(**{group: classes[group](**values)}))
    try:
        found = _reachable(registry.get_or_create("s"), kind)
        assert found and all(check(c) for c in found), f"{name} of the session does not take {group} {values}"
        default = _reachable(SessionRegistry(ServerConfig()).get_or_create("s"), kind)
        assert not any(check(c) for c in default), "the check must fail for the default"
    finally:
        registry.close()


def test_max_archived_forgets_the_oldest_kept_report():
    registry = SessionRegistry(ServerConfig(sessions=SessionsConfig(max_archived=1)))
    try:
        for name in ("first", "second"):
            registry._keep(registry.get_or_create(name), pb.Report(session=name))
        assert registry.archived_report("first") is None and registry.archived_report("second") is not None
    finally:
        registry.close()


@pytest.mark.parametrize("sync, pragma", [("normal", 1), ("full", 2)])
def test_journal_sync_sets_how_the_journal_commits(tmp_path, sync, pragma):
    registry = SessionRegistry(ServerConfig(journal=JournalConfig(directory=str(tmp_path), sync=sync)))
    try:
        assert registry.store._db.execute("PRAGMA synchronous").fetchone()[0] == pragma
    finally:
        registry.close()


def test_the_session_compares_with_the_configured_tolerances_and_mapping():
    from twinstep.server.compare.mapping import NameMapping
    from twinstep.server.compare.tolerance import ToleranceConfig

    tolerances = ToleranceConfig.from_dict({"forward": {"mean": 1e-3}})
    mapping = NameMapping.from_dict({"prefix": [{"candidate": "model.", "baseline": ""}]})
    registry = SessionRegistry(ServerConfig(tolerances=tolerances, mapping=mapping))
    try:
        session = registry.get_or_create("s")
        assert any(t is tolerances for t in _reachable(session, ToleranceConfig))
        assert any(m is mapping for m in _reachable(session, NameMapping))
    finally:
        registry.close()
