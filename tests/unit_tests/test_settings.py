"""twinstep.runtime.settings: arguments > TWINSTEP_* environment > config file > defaults, and errors that name the culprit."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

import twinstep
from twinstep.runtime import settings
from twinstep.runtime.api import attach
from twinstep.runtime.capture.recorder import CAPTURE_MODES
from twinstep.runtime.transport.messages import COMPRESSIONS
from tests.conftest import run_status
from twinstep.cli import run as run_cli
from twinstep.cli.main import build_parser
from twinstep.runtime import api

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text: str, name: str = "twinstep.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


FILE = """\
    session: from-file
    server: 127.0.0.1:1
    capture: tensors
    every: 4
    sketch: true
    runs:
      paddle:
        every: 2
        exclude: ["*.dropout", lm_head]
        tls_ca: certs/ca.pem
"""


def test_each_layer_wins_over_the_next(tmp_path):
    path = write(tmp_path, FILE)
    env = {"TWINSTEP_CONFIG": path, "TWINSTEP_RUN": "paddle", "TWINSTEP_CAPTURE": "lossy", "TWINSTEP_SKETCH": ""}
    resolved = settings.resolve({"every": 7}, environ=env)
    values, sources = resolved.values, resolved.sources
    assert (values["every"], sources["every"]) == (7, "argument")  # argument over the file's run section
    assert (values["capture"], sources["capture"]) == ("lossy", "TWINSTEP_CAPTURE")  # environment over the file
    assert values["sketch"] is True  # an empty variable counts as unset: the file's value
    assert values["session"] == "from-file" and sources["session"] == f"{path}: session"
    assert values["exclude"] == ("*.dropout", "lm_head") and sources["exclude"] == f"{path}: runs.paddle.exclude"
    assert values["tls_ca"] == str(tmp_path.resolve() / "certs" / "ca.pem")  # relative to the file's folder
    assert (values["stats_workers"], sources["stats_workers"]) == (1, "default")
    assert values["include"] == ("*",)
    # Another run of the same file takes the common section only.
    other = settings.resolve({}, environ={"TWINSTEP_CONFIG": path, "TWINSTEP_RUN": "torch"}).values
    assert (other["every"], other["exclude"], other["tls_ca"]) == (4, (), None)


def test_environment_values_are_typed():
    env = {"TWINSTEP_BASELINE": "yes", "TWINSTEP_BACKWARD": "off", "TWINSTEP_INCLUDE": "layers.*, lm_head",
           "TWINSTEP_MAX_QUEUE_BYTES": "512MiB", "TWINSTEP_LOCKSTEP_TIMEOUT": "2.5", "TWINSTEP_START_STEP": "100",
           "TWINSTEP_INSECURE": "0"}
    values = settings.resolve({}, environ=env).values
    assert values["baseline"] is True and values["backward"] is False and values["insecure"] is False
    assert values["include"] == ("layers.*", "lm_head")
    assert values["max_queue_bytes"] == 512 << 20 and values["lockstep_timeout"] == 2.5 and values["start_step"] == 100
    assert settings.resolve({}, environ={"TWINSTEP_MAX_QUEUE_BYTES": "2G"}).values["max_queue_bytes"] == 2 << 30


def test_rank_comes_from_twinstep_then_the_launcher_then_the_file(tmp_path):
    path = write(tmp_path, "rank: 5\nworld_size: 8\n")
    assert settings.resolve({}, environ={"TWINSTEP_CONFIG": path}).values["rank"] == 5
    launcher = {"TWINSTEP_CONFIG": path, "RANK": "2", "WORLD_SIZE": "4", "PADDLE_TRAINER_ID": "3"}
    values = settings.resolve({}, environ=launcher).values
    assert (values["rank"], values["world_size"]) == (2, 4)
    values = settings.resolve({}, environ={"PADDLE_TRAINER_ID": "3", "PADDLE_TRAINERS_NUM": "4"}).values
    assert (values["rank"], values["world_size"]) == (3, 4)
    assert settings.resolve({}, environ={**launcher, "TWINSTEP_RANK": "1"}).values["rank"] == 1
    assert settings.resolve({"rank": 0}, environ=launcher).values["rank"] == 0


@pytest.mark.parametrize("variable, value, accepted", [
    ("TWINSTEP_CAPTURE", "tensor", "stats, tensors, lossy"),
    ("TWINSTEP_EVERY", "0", "integer >= 1"),
    ("TWINSTEP_EVERY", "2.5", "integer >= 1"),
    ("TWINSTEP_BASELINE", "maybe", "true or false"),
    ("TWINSTEP_MAX_QUEUE_BYTES", "lots", "512MiB"),
    ("TWINSTEP_LOCKSTEP_TIMEOUT", "-1", "positive number"),
    ("TWINSTEP_SENDER", "proc", "auto, thread, process"),
])
def test_a_bad_variable_is_named_with_what_it_accepts(variable, value, accepted):
    with pytest.raises(ValueError, match=variable) as caught:
        settings.resolve({}, environ={variable: value})
    assert variable in str(caught.value) and accepted in str(caught.value) and repr(value) in str(caught.value)


@pytest.mark.parametrize("text, message", [
    ("sesion: x\n", r"unknown settings \['sesion'\] \(known: .*session"),
    ("runs:\n  torch:\n    capure: stats\n", r"runs.torch: unknown settings \['capure'\]"),
    ("runs:\n  paddle:\n    run: other\n", r"runs.paddle: unknown settings \['run'\]"),
    ("every: many\n", r"twinstep.yaml: every must be an integer >= 1, got 'many'"),
    ("runs:\n  paddle:\n    every: 0\n", r"twinstep.yaml: runs.paddle.every must be an integer >= 1"),
    ("baseline: 3\n", r"baseline must be true or false"),
    ("include: 7\n", r"include must be glob patterns"),
    ("- a\n- b\n", r"expected a mapping of settings at the top level"),
    ("runs: [torch]\n", r"runs must map each run name"),
    ("capture: [stats\n", r"not valid YAML"),
])
def test_a_bad_file_is_named_with_its_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=message) as caught:
        settings.resolve({}, environ={"TWINSTEP_CONFIG": path, "TWINSTEP_RUN": "paddle"})
    assert path in str(caught.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"TWINSTEP_CONFIG=.*nowhere.yaml: cannot read"):
        settings.resolve({}, environ={"TWINSTEP_CONFIG": str(tmp_path / "nowhere.yaml")})


#: Every setting attach had before the definition was grouped, by its keyword (= YAML key): the
#: variables keep these names exactly, and none of them may go without a way for users to know.
EARLIER = ("session run baseline reference server capture include exclude every rank world_size lockstep "
           "lockstep_timeout max_queue_steps max_queue_bytes backward precision sketch compression sender start_step "
           "token tls_ca tls_client_cert tls_client_key insecure stats_workers share_weights init_from_baseline "
           "init_timeout publish_batches sync_batches batch_timeout bundle_dir layout_detect tensor_parallel "
           "data_parallel pipeline_parallel tensor_parallel_rank data_parallel_rank pipeline_parallel_rank "
           "tensor_parallel_split").split()


def test_every_earlier_setting_keeps_its_keyword_key_and_variable():
    assert sorted(settings.BY_NAME) == sorted(EARLIER)
    assert all(settings.BY_NAME[name].env == "TWINSTEP_" + name.upper() for name in EARLIER)
    assert {s.name for s in settings.SETTINGS if not s.option} == {  # the launcher's, and what follows from them
        "rank", "world_size", "tensor_parallel_rank", "data_parallel_rank", "pipeline_parallel_rank"}
    assert all(s.help and s.group for s in settings.SETTINGS)


def test_attach_s_keywords_are_the_settings_in_their_order_with_their_types():
    parameters = inspect.signature(attach).parameters
    keywords = [name for name in parameters if name not in settings.ARGUMENT_ONLY]
    assert keywords == [item.name for item in settings.SETTINGS]
    for item in settings.SETTINGS:
        parameter = parameters[item.name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None, item.name
        # api.py is `from __future__ import annotations`: its annotations are source text, as ast writes it
        assert parameter.annotation == ast.unparse(ast.parse(item.annotation, mode="eval")), item.name


def test_what_is_generated_from_the_definition_is_current():
    """attach's keywords and docstring entries (api.py) and the docs' table: run scripts/gen_settings_docs.py."""
    spec = importlib.util.spec_from_file_location("gen_settings_docs", ROOT / "scripts" / "gen_settings_docs.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.stale("attach keywords", "attach settings") == [], "stale: run python scripts/gen_settings_docs.py"
    doc = inspect.cleandoc(attach.__doc__)  # Python 3.13 dedents docstrings itself; earlier ones do not
    for item in settings.SETTINGS:
        assert f"\n    {item.name}: " in doc and f"| `{item.name}` | `{item.env}`" in generator.attach_table()


def test_vocabularies_agree_with_their_owners():
    assert settings.CAPTURE_MODES == CAPTURE_MODES
    assert settings.COMPRESSIONS == COMPRESSIONS


def test_a_bad_variable_stops_attach_before_any_hook(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    monkeypatch.setenv("TWINSTEP_SERVER", "127.0.0.1:9")
    monkeypatch.setenv("TWINSTEP_COMPRESSION", "gzip")
    with pytest.raises(ValueError, match="TWINSTEP_COMPRESSION must be one of auto, zstd, none; got 'gzip'"):
        twinstep.attach(model, session="s", run="r")
    assert all(not m._forward_hooks for m in model.modules())


def test_attach_by_environment_alone_and_by_file_alone(monkeypatch, tmp_path, server):
    for name in ("RANK", "WORLD_SIZE", "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM"):
        monkeypatch.delenv(name, raising=False)
    model = torch.nn.Linear(2, 2)
    monkeypatch.setenv("TWINSTEP_SESSION", "by-env")
    monkeypatch.setenv("TWINSTEP_RUN", "env")
    monkeypatch.setenv("TWINSTEP_BASELINE", "true")
    monkeypatch.setenv("TWINSTEP_SERVER", server.address)
    monkeypatch.setenv("TWINSTEP_EVERY", "2")
    with twinstep.attach(model) as mon:
        for _ in range(3):
            mon.step()
    status = run_status(server, "by-env", "env")
    assert status.baseline and status.last_step == 2  # steps 0 and 2: every=2 came from the environment
    for name in ("TWINSTEP_SESSION", "TWINSTEP_RUN", "TWINSTEP_BASELINE", "TWINSTEP_SERVER", "TWINSTEP_EVERY"):
        monkeypatch.delenv(name)
    path = write(tmp_path, f"session: by-file\nserver: {server.address}\nruns:\n  file:\n    start_step: 10\n")
    monkeypatch.setenv("TWINSTEP_CONFIG", path)
    with twinstep.attach(model, run="file") as mon:
        assert mon.current_step == 10
        mon.step()
    assert run_status(server, "by-file", "file").last_step == 10


# -- every setting reaches the runtime alike from every source ------------------------------------------


def _probe(item: settings.Setting) -> Any:
    """A value of the setting other than its default, as attach hands it to the runtime."""
    if item.kind == "flag":
        return not item.default
    if item.kind == "integer":
        return (item.spec.minimum or 0) + 3
    if item.kind == "bytes":
        return 512 << 20
    if item.kind == "seconds":
        return 2.5
    if item.kind == "choice":
        return next(c for c in item.choices if c != item.default)
    if item.kind == "patterns":
        return ("layers.*", "lm_head")
    if item.kind == "pairs":
        return {"layers.*.q_proj": "-1", "layers.*.o_proj": "input=-1"}
    return f"/probe/{item.name}.pem" if item.spec.path else f"probe-{item.name}"


def _given(item: settings.Setting, source: str, tmp_path) -> tuple[dict[str, Any], dict[str, str]]:
    """(attach's keyword arguments, environment) that give the probe value by ``source``."""
    value = _probe(item)
    text = "512MiB" if item.kind == "bytes" else item.text(value)
    if source == "keyword":
        return {item.name: list(value) if isinstance(value, tuple) else value}, {}
    if source == "environment":
        return {}, {item.env: text}
    if source == "file":
        raw = list(value) if isinstance(value, tuple) else text if item.kind == "bytes" else value
        return {}, {"TWINSTEP_CONFIG": write(tmp_path, yaml.safe_dump({item.name: raw}))}
    assert source == "option"
    if item.kind == "flag":
        argv = [item.option if value else "--no-" + item.option[2:]]
    elif item.kind == "patterns":
        argv = [a for pattern in value for a in (item.option, pattern)]
    else:
        argv = [item.option, text]
    args = build_parser().parse_args(["run", *argv, "--", "python", "train.py"])
    return {}, {k: v for k, v in run_cli.child_environment(args, base={}).items() if k.startswith("TWINSTEP_")}


SOURCES = [(item.name, source) for item in settings.SETTINGS
           for source in ("keyword", "environment", "file", "option") if source != "option" or item.option]


@pytest.mark.parametrize("name, source", SOURCES)
def test_every_setting_reaches_the_runtime_from_every_source(name, source, monkeypatch, tmp_path):
    """What attach hands the runtime (api.start) holds the value, whichever source gave it.

    That the runtime then behaves differently with it: tests/unit_tests/test_attach_settings_effect.py.
    """
    for variable in [n for n in __import__("os").environ if n.startswith("TWINSTEP_")] + ["RANK", "WORLD_SIZE"]:
        monkeypatch.delenv(variable, raising=False)
    item = settings.BY_NAME[name]
    keywords, environ = _given(item, source, tmp_path)
    for variable, text in environ.items():
        monkeypatch.setenv(variable, text)
    handed = []
    monkeypatch.setattr(api, "start", lambda model, chosen, optimizer=None: handed.append(chosen))
    twinstep.attach(torch.nn.Linear(2, 2), **keywords)
    (chosen,) = handed
    assert _probe(item) != item.default
    assert getattr(getattr(chosen, item.group), name) == _probe(item)
    others = {other.name: other.default for other in settings.SETTINGS if other.name != name}
    assert {k: v for k, v in chosen.as_dict().items() if k != name} == others  # nothing else changed


def test_show_config_aligns_its_columns_and_hides_the_token(capsys, monkeypatch, tmp_path):
    for variable in [n for n in __import__("os").environ if n.startswith("TWINSTEP_")]:
        monkeypatch.delenv(variable)
    path = write(tmp_path, "session: s\nserver: 127.0.0.1:1\ntoken: secret-token\nruns:\n  paddle:\n    every: 2\n")
    monkeypatch.setenv("TWINSTEP_CAPTURE", "lossy")
    args = build_parser().parse_args(["run", "--config", path, "--run", "paddle", "--show-config"])
    assert run_cli.run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"config file: {path}" and lines[1].split() == ["GROUP", "SETTING", "VALUE", "SOURCE"]
    rows = {line.split()[1]: line for line in lines[2:]}
    assert list(rows) == [item.name for item in settings.SETTINGS]
    for column in ("SETTING", "VALUE", "SOURCE"):  # every column starts where its heading does, on every line
        at = lines[1].index(column)
        assert all(line[at - 2:at] == "  " and line[at] != " " for line in lines[2:]), column
    assert rows["every"].split()[2:] == ["2", f"{path}:", "runs.paddle.every"]
    assert rows["capture"].split()[2:] == ["lossy", "TWINSTEP_CAPTURE"]
    assert rows["run"].split()[2:] == ["paddle", "--run"]
    assert rows["token"].split()[2:4] == ["(set,", "hidden)"] and "secret-token" not in "\n".join(lines)


def test_a_group_written_as_a_mapping_in_the_file_is_named(tmp_path):
    path = write(tmp_path, "transport:\n  max_queue_steps: 4\n")
    with pytest.raises(ValueError, match=r"unknown settings \['transport'\].*flat keys of the file.*max_queue_steps"):
        settings.resolve({}, environ={"TWINSTEP_CONFIG": path})
    path = write(tmp_path, "capture:\n  every: 2\n")
    with pytest.raises(ValueError, match=r"capture: settings are flat keys of the file: write every at the top level"):
        settings.resolve({}, environ={"TWINSTEP_CONFIG": path})


def test_a_bad_argument_is_named_like_a_bad_variable():
    with pytest.raises(ValueError, match=r"^every must be an integer >= 1, got 0$"):
        settings.resolve({"every": 0}, environ={})
    with pytest.raises(ValueError, match="include takes a sequence of glob patterns, not a string"):
        settings.resolve({"include": "fc*"}, environ={})
    resolved = settings.resolve({"max_queue_bytes": "2GiB", "lockstep": np.int64(2)}, environ={})
    assert resolved.values["max_queue_bytes"] == 2 << 30 and resolved.values["lockstep"] == 2
