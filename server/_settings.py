"""The server's side of the settings machinery behind its one definition (``twinstep.server.config``).

A setting is a field of a group dataclass, declared once with ``setting(...)``: its default,
its help, its bounds or choices, and what the sources need (a flag spelling that differs from
the derived one, an environment variable of an older name, the flat YAML key it had before
the groups).  The declaration, the readers of each kind and ``Resolved`` are shared with attach's
settings (twinstep._settings); here are the server's names and words, and its sources.  From the
fields come:

- the YAML file: ``GROUP: {FIELD: value}`` (flat keys of older files still read, with a warning);
- the environment: ``TWINSTEP_SERVER_<GROUP>_<FIELD>`` unless the setting keeps an older name;
- the command line of ``twinstep serve``: ``--<group>-<field>`` unless it keeps an older spelling;
- the docs' table (scripts/gen_settings_docs.py) and ``twinstep serve --show-config``.

Resolution order: flag, then environment, then YAML file, then default; each value remembers
where it came from.  A value that cannot be read, or is out of bounds, is a ValueError naming
the flag, variable or file key, and the dotted setting (``halt.prepare_timeout must not be
negative``).  Hand-written rather than pydantic: see the module docstring of twinstep.server.config.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
from dataclasses import MISSING, dataclass
from typing import Any, Callable, ClassVar, Mapping

from twinstep import _settings
from twinstep._settings import Resolved, all_settings, build, bytes_text, groups_of, option_sections, settings_of

__all__ = ["ENV_CONFIG", "ENV_PREFIX", "Group", "Resolved", "Setting", "Spec", "add_flag", "add_flags", "all_settings",
           "build", "flag_help", "flags_given", "groups_of", "read_environment", "read_file", "read_mapping", "resolve",
           "setting", "settings_of"]

logger = logging.getLogger("twinstep.server")

ENV_PREFIX = "TWINSTEP_SERVER_"
#: Not a setting: the YAML file ``twinstep serve`` reads when --config is not given.
ENV_CONFIG = "TWINSTEP_SERVER_CONFIG"


class Setting(_settings.Setting):
    """One field of one group of the server's settings: its key is its dotted name (``halt.on_divergence``),
    its variable ``TWINSTEP_SERVER_HALT_ON_DIVERGENCE`` unless it keeps an older one, its flag
    ``--halt-on-divergence`` unless it keeps an older spelling.  Besides twinstep._settings' kinds, a
    structured setting (``Spec.load``) is read from the YAML file only, by its own function."""

    env_prefix: ClassVar[str] = ENV_PREFIX
    whole_floats: ClassVar[bool] = True  # YAML writes 1e9 as a float
    numbers_as_text: ClassVar[bool] = True  # a token of digits, written unquoted

    @classmethod
    def kind_of(cls, annotation: Any, spec: _settings.Spec) -> tuple[str, tuple[str, ...]]:
        if getattr(spec, "load", None) is not None:
            return "structured", ()
        return super().kind_of(annotation, spec)

    @property
    def flag(self) -> str | None:
        if self.kind == "structured" or self.spec.flag == "":
            return None
        if self.spec.flag:
            return self.spec.flag
        prefix = getattr(self.owner, "flag_prefix", None)
        prefix = self.group if prefix is None else prefix
        stem = f"{prefix}-{self.name}" if prefix else self.name
        return "--" + stem.replace("_", "-")

    @property
    def env(self) -> str | None:
        if self.kind == "structured" or self.spec.env == "":
            return None
        return self.spec.env or super().env

    def naming(self, where: str) -> str:
        """Where the value came from, then the dotted setting: ``--window-steps: window.steps``."""
        return f"{where}: {self.dotted}"

    def verify(self, typed: Any, value: Any, where: str) -> None:
        try:
            self.validate(typed)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def given(self, value: Any) -> Any:
        self.validate(value)
        return value

    def validate(self, value: Any) -> None:
        """Bounds, choices and the setting's own check; ValueError naming the dotted setting."""
        spec = self.spec
        if value is None:
            return
        if self.kind in ("integer", "bytes", "seconds", "number"):
            if spec.minimum is not None and value < spec.minimum:
                raise ValueError(f"{self.dotted} {_bound_words(spec.minimum)}, got {value!r}")
            if spec.maximum is not None and value > spec.maximum:
                raise ValueError(f"{self.dotted} must be at most {_number_text(spec.maximum)}, got {value!r}")
        if spec.choices and value not in spec.choices:
            raise ValueError(f"{self.dotted} must be one of {', '.join(spec.choices)}, got {value!r}")
        if spec.check is not None:
            spec.check(value, self.dotted)

    def show(self, value: Any) -> str:
        if self.kind == "structured":
            return "(default)" if value == self.default else "(set)"
        return super().show(value)

    def default_text(self) -> str:
        if self.kind == "structured":
            return "(see its page)"
        if self.kind == "bytes" and self.default is not None:
            return bytes_text(self.default, " ")
        return super().default_text()


def _number_text(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else str(number)


def _bound_words(minimum: float) -> str:
    return "must not be negative" if minimum == 0 else f"must be at least {_number_text(minimum)}"


@dataclass(frozen=True)
class Spec(_settings.Spec):
    """What a field's ``setting(...)`` says besides its default (twinstep._settings.Spec), and:"""

    setting_type = Setting

    maximum: float | None = None
    choices: tuple[str, ...] = ()
    """The values a text setting may take."""
    flag: str | None = None
    """The command-line spelling when it is not the derived ``--<group>-<field>``; "" for none."""
    env: str | None = None
    """The environment variable when it is not the derived one; "" for none."""
    legacy: str | None = None
    """The flat YAML key (and ServerConfig attribute) the setting had before the groups."""
    merge: bool = False
    """A mapping whose entries from a higher source add to (and override per key) a lower source's."""
    where: str = ""
    """Who reads it when it is not every embedder of ``serve()``: shown in help and docs (e.g. "twinstep serve")."""
    load: Callable[[Any, str, pathlib.Path], Any] | None = None
    """A structured setting: YAML value, where, the file's folder -> value (no flag, no variable)."""
    check: Callable[[Any, str], None] | None = None
    """Further validation: (value, dotted name) -> raises ValueError."""


def setting(default: Any = MISSING, *, default_factory: Any = MISSING, help: str, **spec: Any) -> Any:
    """A field of a settings group: its default (or factory), its help, and the rest of ``Spec``."""
    return _settings.declare(Spec(help=help, **spec), default, default_factory)


class Group(_settings.Group):
    """Base of a group of the server's settings: checks every field against its ``Spec`` after construction.

    Groups have slots: a misspelt or flat name (``config.halt.on_divergance = True``) is an
    AttributeError, never an attribute nothing reads.
    """

    __slots__ = ()

    flag_prefix: ClassVar[str | None] = None
    """Prefix of the derived flags (default: the group's key); "" for none."""


# -- resolving: flags > environment > YAML file > default ---------------------------------------


def read_file(path: str | pathlib.Path, config_cls: type) -> tuple[dict[str, Any], dict[str, str]]:
    """The YAML file's values by dotted name (typed, checked, paths relative to the file), and their sources."""
    import yaml

    path = pathlib.Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read config {path}: {exc}") from None
    return read_mapping(data or {}, config_cls, path.parent, str(path))


def read_mapping(data: Any, config_cls: type, base_dir: pathlib.Path, where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Values by dotted name from parsed YAML: nested groups, older flat keys (warned once), extra keys."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping at the top level")
    every = all_settings(config_cls)
    by_dotted = {s.dotted: s for s in every}
    legacy = {s.spec.legacy: s for s in every if s.spec.legacy}
    groups = dict(groups_of(config_cls))
    extra: dict[str, Callable[..., Any]] = getattr(config_cls, "file_only_keys", {})
    found: dict[str, tuple[Any, str]] = {}
    flat: list[str] = []
    unknown: list[str] = []
    for key, value in data.items():
        key = str(key)
        if key in groups and isinstance(value, dict):
            names = {s.name: s for s in settings_of(groups[key])}
            bad = sorted(str(k) for k in value if k not in names)
            if bad:
                raise ValueError(f"{where}: {key}: unknown options {bad} (known: {', '.join(names)})")
            for name, raw in value.items():
                if f"{key}.{name}" in found:
                    raise ValueError(f"{where}: {found[f'{key}.{name}'][1]} and {key}.{name} are the same setting; "
                                     f"keep {key}.{name}")
                found[f"{key}.{name}"] = (raw, f"{key}.{name}")
        elif key in by_dotted:  # a top-level structured setting (tolerances, mapping)
            found[key] = (value, key)
        elif key in legacy:
            target = legacy[key].dotted
            if target in found:
                raise ValueError(f"{where}: {key} and {target} are the same setting; keep {target}")
            found[target] = (value, key)
            flat.append(f"{key} -> {_nested_spelling(target)}")
        elif key in extra:
            continue
        elif key in groups:
            raise ValueError(f"{where}: {key} must be a mapping of its settings ({', '.join(s.name for s in settings_of(groups[key]))})")
        else:
            unknown.append(key)
    if unknown:
        known = sorted(set(groups) | {s.dotted for s in every if not s.group} | set(extra))
        raise ValueError(f"{where}: unknown options {sorted(unknown)} (known: {', '.join(known)}; older flat keys "
                         f"{', '.join(sorted(legacy))})")
    if flat:
        logger.warning("%s: flat keys are deprecated (still read, same meaning); write them in their groups: %s",
                       where, "; ".join(flat))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for dotted, (raw, label) in found.items():
        item = by_dotted[dotted]
        if raw is None:  # `key:` with no value: as if absent
            continue
        if item.kind == "structured":
            assert item.spec.load is not None
            values[dotted] = item.spec.load(raw, f"{where}: {label}", base_dir)
        else:
            value = item.read(raw, f"{where}: {label}" if label != dotted else where)
            values[dotted] = item.relative(value, base_dir)
        sources[dotted] = f"{where}: {label}"
    for key, load in extra.items():
        if key in data and data[key] is not None:
            for dotted, value in load(data[key], f"{where}: {key}", base_dir, values).items():
                values[dotted] = value
                sources[dotted] = f"{where}: {key}"
    return values, sources


def _nested_spelling(dotted: str) -> str:
    group, _, name = dotted.partition(".")
    return f"{group}: {{{name}: ...}}" if name else dotted


def read_environment(config_cls: type, environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Values by dotted name from the settings' variables (an empty variable counts as unset)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for item in all_settings(config_cls):
        found = item.from_environment(environ)
        if found is not None:
            values[item.dotted], sources[item.dotted] = found
    return values, sources


def resolve(config_cls: type, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
            config_file: str | None = None) -> Resolved:
    """Every setting: ``flags`` (dotted name -> text from the command line) > environment > file > default."""
    environ = os.environ if environ is None else environ
    path = config_file or environ.get(ENV_CONFIG) or None
    layers: list[tuple[dict[str, Any], dict[str, str]]] = []
    if path:
        layers.append(read_file(path, config_cls))
    layers.append(read_environment(config_cls, environ))
    by_dotted = {s.dotted: s for s in all_settings(config_cls)}
    flag_values: dict[str, Any] = {}
    flag_sources: dict[str, str] = {}
    for dotted, raw in (flags or {}).items():
        item = by_dotted[dotted]
        flag_values[dotted] = item.read(raw, item.flag or dotted)
        flag_sources[dotted] = item.flag or dotted
    layers.append((flag_values, flag_sources))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for layer_values, layer_sources in layers:  # lowest first: each layer overrides the one before
        for dotted, value in layer_values.items():
            item = by_dotted[dotted]
            if item.spec.merge and dotted in values:
                values[dotted] = {**values[dotted], **value}
                sources[dotted] = f"{sources[dotted]} + {layer_sources[dotted]}"
            else:
                values[dotted] = value
                sources[dotted] = layer_sources[dotted]
    hook = getattr(config_cls, "reconcile", None)
    if hook is not None:
        hook(values, sources)
    for dotted in by_dotted:
        sources.setdefault(dotted, "default")
    return Resolved(build(config_cls, values), sources, str(path) if path else None)


# -- the command line ---------------------------------------------------------------------------


def _metavar(item: Setting) -> str | None:
    if item.spec.metavar:
        return item.spec.metavar
    if item.kind == "flag" or item.spec.choices:
        return None
    return _settings.METAVARS.get(item.kind, "TEXT")


def flag_help(item: Setting, help: str | None = None) -> str:
    """A flag's help: the setting's first sentence, its default and variable, and who reads it (or ``help`` as is)."""
    if help is not None:
        return help.replace("%", "%%")
    extras = [f"default {item.default_text()}"]
    if item.env:
        extras.append(f"${item.env}")
    if item.spec.where:
        extras.append(item.spec.where + " only")
    return f"{item.summary} ({'; '.join(extras)})".replace("%", "%%")


def add_flag(parser: Any, item: Setting, help: str | None = None) -> None:
    """The setting's flag on ``parser`` (an ArgumentParser or an argument group); dest is its dotted name."""
    assert item.flag is not None, item.dotted
    kwargs: dict[str, Any] = {"dest": item.dotted, "default": argparse.SUPPRESS, "help": flag_help(item, help)}
    if item.kind == "flag":
        kwargs["action"] = argparse.BooleanOptionalAction
    elif item.kind in ("list", "pairs"):
        kwargs["action"] = "append"
    if item.spec.choices:
        kwargs["choices"] = item.spec.choices
    metavar = _metavar(item)
    if metavar and item.kind != "flag":
        kwargs["metavar"] = metavar
    parser.add_argument(item.flag, **kwargs)


def add_flags(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Every setting that has a flag, one argument group per settings group (its docstring's first line)."""
    for section, item in option_sections(parser, config_cls, lambda s: s.flag):
        add_flag(section, item)


def flags_given(args: argparse.Namespace, config_cls: type) -> dict[str, Any]:
    """Dotted name -> raw value of every setting's flag the command line gave."""
    given = vars(args)
    return {s.dotted: given[s.dotted] for s in all_settings(config_cls) if s.dotted in given}
