"""The server's one definition of settings: every setting reached by its flag, variable and YAML key,
in that order of precedence, checked where it is defined, and the docs' table current.

That each setting then changes what the server does: tests/unit_tests/test_server_settings_effect.py.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from pathlib import Path

import pytest
import yaml

from twinstep.cli import serve as serve_cli
from twinstep.cli.main import build_parser, main
from twinstep.server._settings import all_settings, groups_of
from twinstep.server.config import HaltConfig, ServerConfig, WindowConfig, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {s.dotted: s for s in all_settings(ServerConfig)}
PLAIN = [s for s in SETTINGS.values() if s.kind != "structured"]

#: Every flag `twinstep serve` had before the settings were grouped: user commands keep working.
EARLIER_FLAGS = {
    "--port": "listen.port", "--host": "listen.host", "--halt-on-divergence": "halt.on_divergence",
    "--release-freed-memory": "memory.release_freed", "--journal": "journal.directory",
    "--session-ttl": "sessions.ttl", "--record": "recording.directory", "--record-budget": "recording.budget_bytes",
    "--replay": "recording.replay", "--http-port": "dashboard.port", "--http-host": "dashboard.host",
    "--webhook": "alerts.webhook_urls", "--webhook-format": "alerts.webhook_format", "--tls-cert": "security.tls_cert",
    "--tls-key": "security.tls_key", "--tls-client-ca": "security.tls_client_ca", "--self-signed": "security.self_signed",
    "--operator-token": "security.operator_token", "--session-token": "security.session_tokens",
    "--tokens-file": "security.tokens_file", "--insecure": "security.insecure",
}
#: Variables read before the settings were grouped, by the same names.
EARLIER_VARIABLES = {
    "TWINSTEP_JOURNAL": "journal.directory", "TWINSTEP_TLS_CERT": "security.tls_cert",
    "TWINSTEP_TLS_KEY": "security.tls_key", "TWINSTEP_TLS_CLIENT_CA": "security.tls_client_ca",
    "TWINSTEP_OPERATOR_TOKEN": "security.operator_token", "TWINSTEP_TOKENS_FILE": "security.tokens_file",
    "TWINSTEP_INSECURE": "security.insecure",
}


@pytest.fixture(autouse=True)
def _no_twinstep_environment(monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("TWINSTEP_")]:
        monkeypatch.delenv(name)


def _sample(item):
    """A value of the setting other than its default."""
    if item.kind == "flag":
        return not item.default
    if item.spec.choices:
        return next(c for c in item.spec.choices if c != item.default)
    if item.kind in ("integer", "bytes"):
        return 4321
    if item.kind in ("seconds", "number"):
        return 0.75
    if item.kind == "list":
        return ["s=tok1", "t=tok2"] if item.name == "session_tokens" else ["http://a.example/x", "http://b.example/y"]
    if item.kind == "pairs":
        return {"s": "rec"}
    return "sample"


def _flag_args(item, value) -> list[str]:
    if item.kind == "flag":
        return [item.flag if value else "--no-" + item.flag[2:]]
    if item.kind == "list":
        return [a for v in value for a in (item.flag, v)]
    if item.kind == "pairs":
        return [a for k, v in value.items() for a in (item.flag, f"{k}={v}")]
    return [item.flag, str(value)]


def _env_text(item, value) -> str:
    if item.kind == "flag":
        return "true" if value else "false"
    if item.kind == "list":
        return " ".join(value)
    if item.kind == "pairs":
        return " ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _value(config, item):
    return getattr(getattr(config, item.group), item.name)


def _resolve(argv: list[str], environ=None):
    args = build_parser().parse_args(["serve", *argv])
    return serve_cli.resolved(args, environ or {})


@pytest.mark.parametrize("dotted", [s.dotted for s in PLAIN if s.flag])
def test_a_flag_reaches_its_setting(dotted):
    item = SETTINGS[dotted]
    value = _sample(item)
    settings = _resolve(_flag_args(item, value))
    assert _value(settings.config, item) == value
    assert settings.sources[dotted] == item.flag


@pytest.mark.parametrize("dotted", [s.dotted for s in PLAIN if s.env])
def test_a_variable_reaches_its_setting(dotted):
    item = SETTINGS[dotted]
    value = _sample(item)
    settings = _resolve([], {item.env: _env_text(item, value)})
    assert _value(settings.config, item) == value
    assert settings.sources[dotted] == item.env


def _expected_from_file(item, value, folder: Path):
    if not item.spec.path:
        return value
    if isinstance(value, dict):
        return {k: str(folder / v) for k, v in value.items()}
    return str(folder / value)  # relative to the file's folder


@pytest.mark.parametrize("dotted", [s.dotted for s in PLAIN])
def test_a_file_key_reaches_its_setting(dotted, tmp_path):
    item = SETTINGS[dotted]
    value = _sample(item)
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({item.group: {item.name: value}}))
    settings = _resolve(["--config", str(path)])
    assert _value(settings.config, item) == _expected_from_file(item, value, tmp_path)
    assert settings.sources[dotted] == f"{path}: {dotted}"
    assert _value(load_config(path), item) == _expected_from_file(item, value, tmp_path)


@pytest.mark.parametrize("dotted", [s.dotted for s in PLAIN if s.spec.legacy])
def test_a_flat_key_of_an_earlier_file_still_reaches_its_setting_with_a_warning(dotted, tmp_path, caplog):
    item = SETTINGS[dotted]
    value = _sample(item)
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({item.spec.legacy: value}))
    with caplog.at_level(logging.WARNING, logger="twinstep.server"):
        config = load_config(path)
    assert _value(config, item) == _expected_from_file(item, value, tmp_path)
    assert f"{item.spec.legacy} -> {item.group}: {{{item.name}: ...}}" in caplog.text
    assert "deprecated" in caplog.text


def test_earlier_flags_and_variables_keep_their_spellings():
    assert {f: SETTINGS[d].flag for f, d in EARLIER_FLAGS.items()} == {f: f for f in EARLIER_FLAGS}
    assert {v: SETTINGS[d].env for v, d in EARLIER_VARIABLES.items()} == {v: v for v in EARLIER_VARIABLES}


def test_every_other_setting_has_a_derived_variable():
    for item in PLAIN:
        if item.env not in EARLIER_VARIABLES and item.dotted != "security.session_tokens":
            assert item.env == "TWINSTEP_SERVER_" + f"{item.group}_{item.name}".upper()
    assert SETTINGS["security.session_tokens"].env is None  # a list of secrets: the tokens file holds them


def test_a_flag_wins_over_the_variable_which_wins_over_the_file_which_wins_over_the_default(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text("window: {steps: 10, bytes: 1000}\nhalt: {prepare_timeout: 5}\n")
    environ = {"TWINSTEP_SERVER_WINDOW_STEPS": "20", "TWINSTEP_SERVER_WINDOW_BYTES": "2000"}
    settings = _resolve(["--config", str(path), "--window-steps", "30"], environ)
    window = settings.config.window
    assert (window.steps, window.bytes, window.inflight_steps) == (30, 2000, 16)
    assert settings.config.halt.prepare_timeout == 5.0
    assert settings.sources["window.steps"] == "--window-steps"
    assert settings.sources["window.bytes"] == "TWINSTEP_SERVER_WINDOW_BYTES"
    assert settings.sources["halt.prepare_timeout"] == f"{path}: halt.prepare_timeout"
    assert settings.sources["window.inflight_steps"] == "default"


def test_the_config_file_may_come_from_its_variable(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text("halt: {on_divergence: true}\n")
    settings = _resolve([], {"TWINSTEP_SERVER_CONFIG": str(path)})
    assert settings.config.halt.on_divergence is True and settings.config_file == str(path)


def test_replay_entries_of_the_flags_add_to_the_files(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text("recording: {replay: {a: one.twrec, b: two.twrec}}\n")
    settings = _resolve(["--config", str(path), "--replay", "b=/x/three.twrec"])
    assert settings.config.recording.replay == {"a": str(tmp_path / "one.twrec"), "b": "/x/three.twrec"}
    assert settings.sources["recording.replay"] == f"{path}: recording.replay + --replay"


def test_a_self_signed_flag_wins_over_certificate_variables_and_two_flags_are_refused(tmp_path):
    environ = {"TWINSTEP_TLS_CERT": "c.pem", "TWINSTEP_TLS_KEY": "k.pem"}
    settings = _resolve(["--self-signed", str(tmp_path)], environ)
    assert settings.config.security.tls_cert is None and settings.config.security.self_signed == str(tmp_path)
    with pytest.raises(ValueError, match="--self-signed and --tls-cert/--tls-key are exclusive"):
        _resolve(["--self-signed", str(tmp_path), "--tls-cert", "c.pem", "--tls-key", "k.pem"])


@pytest.mark.parametrize("argv, environ, text, message", [
    (["--window-steps", "0"], {}, "", "--window-steps: window.steps must be at least 1, got 0"),
    (["--window-steps", "many"], {}, "", "--window-steps: window.steps must be an integer, got 'many'"),
    (["--halt-prepare-timeout", "-1"], {}, "", "--halt-prepare-timeout: halt.prepare_timeout must not be negative"),
    ([], {"TWINSTEP_SERVER_HALT_PREPARE_TIMEOUT": "soon"}, "", "TWINSTEP_SERVER_HALT_PREPARE_TIMEOUT: "
                                                              "halt.prepare_timeout must be a number of seconds"),
    ([], {"TWINSTEP_INSECURE": "maybe"}, "", "TWINSTEP_INSECURE: security.insecure must be true or false"),
    ([], {"TWINSTEP_SERVER_LIMITS_MAX_WORKERS": "2"}, "", "limits.max_workers must be at least 4, got 2"),
    (["--port", "70000"], {}, "", "listen.port must be at most 65535"),
    ([], {}, "halt: {prepare_timeout: -1}", "server.yaml: halt.prepare_timeout must not be negative, got -1.0"),
    ([], {}, "journal: {sync: sometimes}", "server.yaml: journal.sync must be one of normal, full, got 'sometimes'"),
    ([], {}, "halt: {on_divergence: 1}", "server.yaml: halt.on_divergence must be true or false"),
    ([], {}, "halt: {when: now}", r"server.yaml: halt: unknown options \['when'\] \(known: on_divergence,"),
    ([], {}, "stop_on_divergence: true", r"server.yaml: unknown options \['stop_on_divergence'\]"),
    ([], {}, "halt: true", "server.yaml: halt must be a mapping of its settings"),
    ([], {}, "window_steps: 4\nwindow: {steps: 5}", "window_steps and window.steps are the same setting"),
    ([], {}, "sync: {batch_max_bytes: 1GiBs}", "sync.batch_max_bytes must be an integer .bytes"),
    (["--session-token", "nosession"], {}, "", "security.session_tokens: session token 'nosession'...: "
                                               "expected SESSION=TOKEN"),
])
def test_a_bad_value_names_where_it_came_from_and_the_setting(argv, environ, text, message, tmp_path):
    if text:
        (tmp_path / "server.yaml").write_text(text)
        argv = [*argv, "--config", str(tmp_path / "server.yaml")]
    with pytest.raises(ValueError, match=message):
        _resolve(argv, environ)


def test_groups_check_their_fields_when_built_in_code():
    with pytest.raises(ValueError, match="^halt.prepare_timeout must not be negative, got -1$"):
        HaltConfig(prepare_timeout=-1)
    with pytest.raises(ValueError, match="^window.steps must be at least 1, got 0$"):
        ServerConfig(window=WindowConfig(steps=0))


def test_sizes_take_binary_units():
    settings = _resolve(["--window-bytes", "512MiB"], {"TWINSTEP_SERVER_MEMORY_BUDGET_BYTES": "2GiB"})
    assert settings.config.window.bytes == 512 << 20 and settings.config.memory.budget_bytes == 2 << 30


def test_tolerances_mapping_and_webhooks_come_from_the_file(tmp_path):
    (tmp_path / "names.yaml").write_text("prefix: [{candidate: 'model.', baseline: ''}]\n")
    path = tmp_path / "server.yaml"
    path.write_text("tolerances: {forward: {mean: 1.0e-3}}\nmapping_file: names.yaml\n"
                    "alerts: {webhooks: [http://hooks.example/a]}\n")
    settings = _resolve(["--config", str(path)])
    config = settings.config
    assert config.tolerances.for_record("forward", "x", "float32")["mean"] == 1e-3
    assert config.mapping.to_baseline("model.layers.0") == "layers.0"
    assert [w.url for w in config.alerts.webhooks] == ["http://hooks.example/a"]
    assert settings.sources["mapping"] == f"{path}: mapping_file"
    assert settings.sources["tolerances"] == f"{path}: tolerances"


def test_the_readme_style_flat_file_reads_as_before(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text("halt_on_divergence: true\njournal: journal/\nsession_ttl: 60\nreplay: {s: rec}\n"
                    "webhooks: [http://hooks.example/a]\nmax_message_bytes: 1048576\n")
    config = load_config(path)
    assert config.halt.on_divergence is True and config.sessions.ttl == 60.0
    assert config.journal.directory == str(tmp_path / "journal/")
    assert config.recording.replay == {"s": str(tmp_path / "rec")}
    assert config.limits.max_message_bytes == 1 << 20 and len(config.alerts.webhooks) == 1
    assert config_from_dict({"journal": None}).journal.directory is None


def test_show_config_prints_each_value_and_its_source_in_columns_and_hides_secrets(capsys, monkeypatch):
    monkeypatch.setenv("TWINSTEP_OPERATOR_TOKEN", "s3cret")
    assert main(["serve", "--show-config", "--window-steps", "8", "--session-token", "a=tok"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "a=tok" not in out
    lines = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert lines["window.steps"].split() == ["window.steps", "8", "--window-steps"]
    assert lines["security.operator_token"].split()[-1] == "TWINSTEP_OPERATOR_TOKEN"
    assert lines["halt.on_divergence"].split() == ["halt.on_divergence", "false", "default"]
    column = {line.index(line.split()[1]) for line in out.splitlines()[1:] if len(line.split()) == 3}
    assert len(column) == 1, "values start in one column"


def test_a_bad_setting_on_the_command_line_exits_2_with_the_message(capsys):
    assert main(["serve", "--window-steps", "0"]) == 2
    assert "twinstep serve: --window-steps: window.steps must be at least 1, got 0" in capsys.readouterr().err


def test_the_demo_takes_its_dashboard_port_by_the_same_setting():
    args = build_parser().parse_args(["demo", "--http-port", "0"])
    assert serve_cli.server_flag(args, "dashboard.port") == 0
    assert serve_cli.server_flag(build_parser().parse_args(["demo"]), "dashboard.port") is None
    with pytest.raises(ValueError, match="dashboard.port must not be negative"):
        serve_cli.server_flag(build_parser().parse_args(["demo", "--http-port", "-3"]), "dashboard.port")


def test_every_setting_is_read_outside_its_definition():
    """A setting no code reads is a setting that does nothing: it goes, or something reads it."""
    sources = "\n".join(p.read_text() for folder in ("server", "client") for p in (ROOT / folder).rglob("*.py")
                        if p.name not in ("config.py", "_settings.py"))
    methods = {name: "\n".join(inspect.getsource(f) for f in vars(cls).values() if inspect.isfunction(f)
                                and not f.__name__.startswith("__"))
               for name, cls in groups_of(ServerConfig)}  # a group's own build() or receivers()
    unread = [d for d, s in SETTINGS.items()
              if f".{d}" not in sources and f"self.{s.name}" not in methods.get(s.group, "")]
    assert not unread


def _generator():
    spec = importlib.util.spec_from_file_location("gen_settings_docs", ROOT / "scripts" / "gen_settings_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_of_server_settings_is_current():
    assert _generator().stale("server settings") == [], "run: python scripts/gen_settings_docs.py"
    text = (ROOT / "docs" / "server.md").read_text()
    for item in SETTINGS.values():
        assert f"| `{item.dotted}` |" in text
