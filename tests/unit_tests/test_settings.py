"""twinstep.runtime.settings: arguments > TWINSTEP_* environment > config file > defaults, and errors that name the culprit."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

import twinstep
from twinstep.runtime import settings
from twinstep.runtime.api import attach
from twinstep.runtime.capture.recorder import CAPTURE_MODES
from twinstep.runtime.transport.messages import COMPRESSIONS
from tests.conftest import run_status


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


def test_every_attach_parameter_is_a_setting():
    parameters = set(inspect.signature(attach).parameters) - settings.ARGUMENT_ONLY
    assert parameters == set(settings.BY_NAME)
    assert all(inspect.signature(attach).parameters[name].default is None for name in parameters)


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
