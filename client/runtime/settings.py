"""Where ``twinstep.attach``'s settings come from, so a job is attached by its launch script alone.

Each parameter of ``attach`` is taken, in this order, from:

1. the argument, when the call gives one (not None);
2. the environment variable ``TWINSTEP_<NAME>`` (``TWINSTEP_SESSION``, ``TWINSTEP_EVERY``, ...);
   ``rank`` and ``world_size`` then fall back to the launcher's ``RANK``/``WORLD_SIZE``
   (torchrun) or ``PADDLE_TRAINER_ID``/``PADDLE_TRAINERS_NUM`` (paddle.distributed.launch);
3. the YAML config file named by ``attach(config=...)`` or ``TWINSTEP_CONFIG``: its top-level
   keys, overridden by the section of this run under ``runs:``;
4. the default.

An empty environment variable counts as unset.  A value that cannot be read is a ValueError
naming the variable or the file and key, and the values it accepts: a bad setting stops
``attach`` before any hook is installed, never later inside the training.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

logger = logging.getLogger("twinstep")

ENV_PREFIX = "TWINSTEP_"
ENV_CONFIG = "TWINSTEP_CONFIG"
#: Launchers' variables for rank and world size, read after TWINSTEP_RANK / TWINSTEP_WORLD_SIZE.
LAUNCHER_ENV = {"rank": ("RANK", "PADDLE_TRAINER_ID"), "world_size": ("WORLD_SIZE", "PADDLE_TRAINERS_NUM")}

# The vocabularies of the modules that own them (tests/unit_tests/test_settings.py checks they agree);
# repeated here so that resolving settings (in `twinstep run`'s launcher too) imports no runtime.
CAPTURE_MODES = ("stats", "tensors", "lossy")
COMPRESSIONS = ("auto", "zstd", "none")
SENDERS = ("auto", "thread", "process")
PRECISIONS = ("auto", "fp32", "tf32")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_SIZE = re.compile(r"^\s*(\d+)\s*(|k|ki|kib|m|mi|mib|g|gi|gib|t|ti|tib)\s*$", re.I)
_SIZE_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


# -- typed readers: (raw value, where it came from) -> value, or ValueError naming where ----------


def _text(value: Any, where: str) -> str:
    if isinstance(value, (bool, int, float)) or not isinstance(value, str):
        raise ValueError(f"{where} must be text, got {value!r}")
    return value


def _flag(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{where} must be true or false ({'/'.join(_TRUE)} or {'/'.join(_FALSE)}), got {value!r}")


def _integer(minimum: int) -> Callable[[Any, str], int]:
    def read(value: Any, where: str) -> int:
        number: int | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            number = int(value)
        if number is None or number < minimum:
            raise ValueError(f"{where} must be an integer >= {minimum}, got {value!r}")
        return number

    return read


def _positive_number(value: Any, where: str) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    if not number > 0:
        raise ValueError(f"{where} must be a positive number of seconds, got {value!r}")
    return number


def _size(value: Any, where: str) -> int:
    """Bytes: an integer, or with a binary unit (``512MiB``, ``2G``: powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    found = _SIZE.match(value) if isinstance(value, str) else None
    if found is None or int(found.group(1)) <= 0:
        raise ValueError(f"{where} must be a positive number of bytes (e.g. 1073741824, 512MiB, 1GiB), got {value!r}")
    return int(found.group(1)) * 1024 ** _SIZE_UNITS[found.group(2)[:1].lower()]


def _choice(*values: str) -> Callable[[Any, str], str]:
    def read(value: Any, where: str) -> str:
        if not isinstance(value, str) or value.strip() not in values:
            raise ValueError(f"{where} must be one of {', '.join(values)}; got {value!r}")
        return value.strip()

    read.choices = values  # type: ignore[attr-defined]  # for the command line's --help
    return read


def _patterns(value: Any, where: str) -> tuple[str, ...]:
    """Glob patterns: a YAML list (or one string), or comma-separated in an environment variable."""
    if isinstance(value, str):
        return tuple(p.strip() for p in value.split(","))
    if isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        return tuple(value)
    raise ValueError(f"{where} must be glob patterns: a list of strings, or comma-separated text; got {value!r}")


# -- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One parameter of ``attach``: how to read it from text or YAML, its default, and what it means."""

    name: str
    read: Callable[[Any, str], Any]
    default: Any
    help: str
    path: bool = False
    """A file name: relative names in the config file are relative to the file's folder."""

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def is_flag(self) -> bool:
        return self.read is _flag

    @property
    def is_patterns(self) -> bool:
        return self.read is _patterns

    @property
    def choices(self) -> tuple[str, ...]:
        """The accepted values of a setting that has a fixed set of them, else ()."""
        return getattr(self.read, "choices", ())


#: Every parameter of twinstep.attach (but the model and ``config``), in attach's order.
SETTINGS: tuple[Setting, ...] = (
    Setting("session", _text, None, "comparison session name; every run of a comparison uses the same one"),
    Setting("run", _text, None, "this training's name within the session (e.g. torch, paddle)"),
    Setting("baseline", _flag, False, "this run is the one the others are judged against"),
    Setting("reference", _flag, False, "this run is a rerun of the baseline that measures its noise"),
    Setting("server", _text, None, "host:port of the comparison server"),
    Setting("capture", _choice(*CAPTURE_MODES), "stats", "statistics, plus full tensors (tensors) or within the error budget (lossy)"),
    Setting("include", _patterns, ("*",), "glob patterns over module names to hook ('' is the whole model)"),
    Setting("exclude", _patterns, (), "glob patterns over module names to leave out"),
    Setting("every", _integer(1), 1, "capture every N-th step"),
    Setting("rank", _integer(0), None, "this process's rank (default: the launcher's RANK or PADDLE_TRAINER_ID, else 0)"),
    Setting("world_size", _integer(1), None, "ranks of this run (default: WORLD_SIZE or PADDLE_TRAINERS_NUM, else 1)"),
    Setting("lockstep", _integer(0), 0, "if N > 0, wait while this run leads the slowest other run by N steps"),
    Setting("lockstep_timeout", _positive_number, 300.0, "longest single lockstep wait, in seconds"),
    Setting("max_queue_steps", _integer(1), 256, "steps held while the server is behind or away"),
    Setting("max_queue_bytes", _size, 1 << 30, "bytes held while the server is behind or away (512MiB, 1GiB, ...)"),
    Setting("backward", _flag, True, "record gradients with respect to module outputs"),
    Setting("precision", _choice(*PRECISIONS), "auto", "how this run multiplies float32 matrices"),
    Setting("sketch", _flag, False, "also send a count-sketch of every floating tensor"),
    Setting("compression", _choice(*COMPRESSIONS), "auto", "lossless compression of full tensors"),
    Setting("sender", _choice(*SENDERS), "auto", "who encodes and sends full tensors"),
    Setting("start_step", _integer(0), 0, "the number of the first step recorded (a resumed run)"),
    Setting("token", _text, None, "the session's (or operator's) token"),
    Setting("tls_ca", _text, None, "PEM file of the CA (or self-signed certificate) to trust", path=True),
    Setting("tls_client_cert", _text, None, "PEM client certificate (mutual TLS)", path=True),
    Setting("tls_client_key", _text, None, "its PEM key", path=True),
    Setting("insecure", _flag, None, "plaintext to a server that is not on loopback"),
    Setting("stats_workers", _integer(0), 1, "threads computing statistics off the training thread (0: in the hooks)"),
    Setting("share_weights", _flag, False, "baseline: share the initial parameters with candidates (weight sync)"),
    Setting("init_from_baseline", _flag, False, "candidate: load the baseline's initial parameters before the first step"),
    Setting("init_timeout", _positive_number, 300.0, "longest wait for the baseline's weights, in seconds"),
    Setting("publish_batches", _flag, False, "baseline: publish the model's first-call inputs of every step"),
    Setting("sync_batches", _flag, False, "candidate: feed the model the baseline's published inputs"),
    Setting("batch_timeout", _positive_number, 300.0, "longest wait for the baseline's batch of a step, in seconds"),
    Setting("bundle_dir", _text, "twinstep-bundles", "where reproducer bundles are written when the server asks",
            path=True),
)
BY_NAME = {s.name: s for s in SETTINGS}
#: Parameters of attach that are not settings: objects of the training, never read from the environment or a file.
ARGUMENT_ONLY = frozenset({"model", "config", "optimizer"})
#: Keys of a config file: every setting, plus ``runs`` (a section per run name).
FILE_KEYS = frozenset(BY_NAME) | {"runs"}


@dataclass
class Resolved:
    """Every setting's value, and where each came from (for messages and ``twinstep run --show-config``)."""

    values: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)
    config_file: str | None = None

    def describe(self) -> str:
        """One line per setting: name, value and origin."""
        return "\n".join(f"{name:16} {self.values[name]!r:32} {self.sources[name]}" for name in self.values)


def resolve(arguments: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
            config: str | None = None) -> Resolved:
    """Every attach setting: arguments (not None) > environment > config file > default.

    ``config`` names the YAML file (else ``$TWINSTEP_CONFIG``).  Raises ValueError naming
    the variable, or the file and key, of a value that cannot be read.
    """
    arguments = dict(arguments or {})
    env = os.environ if environ is None else environ
    unknown = set(arguments) - set(BY_NAME)
    if unknown:
        raise ValueError(f"unknown twinstep settings {sorted(unknown)} (known: {', '.join(BY_NAME)})")
    path = config or env.get(ENV_CONFIG) or None
    where_path = "config=" if config else ENV_CONFIG + "="
    file_values: dict[str, Any] = {}
    file_sources: dict[str, str] = {}
    if path:
        run = arguments.get("run") or env.get(BY_NAME["run"].env) or None
        file_values, file_sources = _read_file(path, run, f"{where_path}{path}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        name = setting.name
        if arguments.get(name) is not None:
            values[name], sources[name] = arguments[name], "argument"
            continue
        raw = env.get(setting.env)
        if raw is not None and raw.strip() != "":
            values[name], sources[name] = setting.read(raw, setting.env), setting.env
            continue
        launcher = _from_launcher(name, env)
        if launcher is not None:
            values[name], sources[name] = launcher
            continue
        if name in file_values:
            values[name], sources[name] = file_values[name], file_sources[name]
            continue
        values[name], sources[name] = setting.default, "default"
    return Resolved(values, sources, path)


def _from_launcher(name: str, env: Mapping[str, str]) -> tuple[int, str] | None:
    """rank / world_size from torchrun's or paddle.distributed.launch's variables (a bad one is warned and skipped)."""
    for variable in LAUNCHER_ENV.get(name, ()):
        value = env.get(variable)
        if value is None or value == "":
            continue
        try:
            return int(value), variable
        except ValueError:
            logger.warning("twinstep: ignoring %s=%r (not an integer)", variable, value)
    return None


def _read_file(path: str, run: str | None, where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The file's common settings, overridden by ``runs: {RUN: {...}}``; typed, with relative paths made absolute."""
    import yaml  # only a job that has a config file pays for it

    file = pathlib.Path(path)
    try:
        data = yaml.safe_load(file.read_text())
    except OSError as exc:
        raise ValueError(f"{where}: cannot read the twinstep config file: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML: {exc}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of settings at the top level, got {type(data).__name__}")
    _check_keys(data, FILE_KEYS, where)
    runs = data.get("runs") or {}
    if not isinstance(runs, dict) or not all(isinstance(v, dict) or v is None for v in runs.values()):
        raise ValueError(f"{where}: runs must map each run name to a mapping of its settings")
    for name, section in runs.items():  # a typo in any run's section is caught by every run
        _check_keys(section or {}, frozenset(BY_NAME) - {"run"}, f"{where}: runs.{name}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    common = {k: v for k, v in data.items() if k != "runs"}
    if run is None:
        run = common.get("run") if isinstance(common.get("run"), str) else None
    sections: list[tuple[str, dict[str, Any]]] = [("", common)]
    if run is not None and runs.get(run):
        sections.append((f"runs.{run}.", runs[run]))
    for prefix, section in sections:
        for key, raw in section.items():
            if raw is None:  # `key:` with no value: as if absent
                continue
            setting = BY_NAME[key]
            label = f"{where}: {prefix}{key}"
            value = setting.read(raw, label)
            if setting.path and value and not os.path.isabs(value):
                value = str(file.parent.resolve() / value)
            values[key], sources[key] = value, f"{path}: {prefix}{key}"
    return values, sources


def _check_keys(section: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = [k for k in section if k not in known]
    if unknown:
        raise ValueError(f"{where}: unknown settings {sorted(map(str, unknown))} (known: {', '.join(sorted(known))})")
