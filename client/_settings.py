"""Settings declared once, as typed fields of dataclasses: the machinery both sides' definitions stand on.

Two definitions use it: ``attach``'s (twinstep.runtime.settings: keywords, ``TWINSTEP_*`` variables,
flat YAML keys, ``twinstep run``'s options) and the server's (twinstep.server.config, with
twinstep.server._settings for its nested YAML groups and ``twinstep serve``'s flags).  Shared here:

- the declaration: a setting is a field of a group dataclass (a ``Group``), made by the side's
  ``setting(...)`` with ``declare(spec, default)``; its kind comes from its type (``Setting.kind_of``);
- ``settings_of``, ``groups_of``, ``all_settings``: each field's ``Setting``, in declaration order;
  ``build`` makes the top-level class from values by key;
- reading a value from any source (``Setting.read``): one reader per kind for both sides, and a
  value it cannot take is a ValueError naming where it came from, what the setting takes and the value;
- ``Resolved``: the values, where each came from, and the table ``--show-config`` prints.

What differs is each side's: the names of its variables and options, the order of its sources,
the layout of its file, and the words of its bounds (attach folds them into what a value "must
be"; the server names the dotted setting and says its bounds apart, for groups built in code too).
The few ways the two sides have always read values differently are class attributes of ``Setting``
(``bits``, ``whole_floats``, ``numbers_as_text``), each side's kept as it was.

Standard library only, and nothing else loaded when imported: the server imports it (it is one of
the modules both sides share, tests/unit_tests/test_architecture.py), and so do every training job
and ``twinstep run``'s launcher.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import pathlib
import re
import types
import typing
import unicodedata
from dataclasses import MISSING, dataclass
from typing import Any, Callable, ClassVar, Iterator, Literal, Mapping

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
_INTEGER = re.compile(r"[+-]?\d+")
_SIZE = re.compile(r"^\s*(\d+)\s*(|k|ki|kib|m|mi|mib|g|gi|gib|t|ti|tib)\s*$", re.I)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def bytes_text(size: int, space: str = "") -> str:
    """``1GiB`` (``1 GiB`` with a space) for a whole number of a binary unit, readable back as bytes; else the integer."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if size >= 1024 ** power and size % 1024 ** power == 0:
            return f"{size // 1024 ** power}{space}{unit}"
    return str(size)


# -- the declaration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """What a field's ``setting(...)`` says besides its type and default; each side's subclass adds its own."""

    setting_type: ClassVar[type[Setting]]
    """The side's ``Setting`` class: what describes a field declared with this spec."""

    help: str
    """What it does, in a sentence or a few (whitespace is normalised); the first sentence serves ``--help``."""
    minimum: float | None = None
    """The least value of a number."""
    unit: str = ""
    """"bytes" (an int, also read as 512MiB, 1GiB, ...), "seconds" (a float) or "steps": its kind, its help."""
    metavar: str = ""
    """How the docs and ``--help`` name a value (HOST:PORT, FILE, DIR)."""
    path: bool = False
    """A file or folder: relative in a config file means relative to the file's folder."""
    secret: bool = False
    """Never printed: ``--show-config`` says only whether it is set."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "help", " ".join(self.help.split()))


def declare(spec: Spec, default: Any = MISSING, default_factory: Any = MISSING) -> Any:
    """A dataclass field that is a setting: its default (immutable) or default factory, and its spec."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("a setting's default is immutable (a tuple, not a list; or a default_factory)")
    metadata = {"setting": spec}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Setting:
    """One setting: its name, group, kind and default, its spec, and what is derived from them.

    Each side subclasses it for its names (``env``, options or flags) and its words: ``naming``
    (how a message names the setting), ``takes`` (what a value must be), ``verify`` (its bounds
    after reading) and ``given`` (a value passed in code to a group's constructor).
    """

    name: str
    group: str
    """The group's name ("" for a setting of the top-level class)."""
    kind: str
    """How it is read, from its type: text (str), flag (bool), integer (int), bytes (int, unit "bytes"),
    seconds (float, unit "seconds"), number (another float), choice (a Literal), patterns (tuple[str, ...],
    comma-separated in text), list (list[str], separated by spaces in text), pairs (dict[str, str], KEY=VALUE
    items in text); a side may add its own (the server's structured)."""
    default: Any
    spec: Spec
    choices: tuple[str, ...] = ()
    """A choice's values, from its Literal type."""
    owner: type | None = dataclasses.field(default=None, compare=False, repr=False)
    """The class that declares it: its group, or the top-level class."""

    env_prefix: ClassVar[str] = ""
    """The variable is this prefix and the key, upper-cased, dots as underscores."""
    # Where the two sides have always read values differently (False: the value is refused):
    bits: ClassVar[bool] = False
    """0 and 1 read as false and true."""
    whole_floats: ClassVar[bool] = False
    """A float with no fraction (2.0, YAML's 1e9) read as an integer."""
    numbers_as_text: ClassVar[bool] = False
    """A number read as its text (a token of digits written unquoted in a YAML file)."""

    @classmethod
    def kind_of(cls, annotation: Any, spec: Spec) -> tuple[str, tuple[str, ...]]:
        """The kind of a field of this type (``X | None`` as X), and a choice's values."""
        base = annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # X | None
            (base,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        origin, args = typing.get_origin(base), typing.get_args(base)
        if origin is Literal:
            return "choice", args
        if base is bool:
            return "flag", ()
        if base is int:
            return ("bytes" if spec.unit == "bytes" else "integer"), ()
        if base is float:
            return ("seconds" if spec.unit == "seconds" else "number"), ()
        if base is str:
            return "text", ()
        if (origin, args) in ((tuple, (str, ...)), (list, (str,)), (dict, (str, str))):
            return {tuple: "patterns", list: "list", dict: "pairs"}[origin], ()
        raise TypeError(f"no setting is of type {annotation!r}")

    @property
    def help(self) -> str:
        return self.spec.help

    @property
    def summary(self) -> str:
        """The help's first sentence, without its full stop."""
        return re.split(r"(?<=\.)\s+(?=[A-Z(])", self.help, maxsplit=1)[0].rstrip(".")

    @property
    def dotted(self) -> str:
        return f"{self.group}.{self.name}" if self.group else self.name

    @property
    def key(self) -> str:
        """What its values and sources are keyed by: the dotted name, or the name where names are unique."""
        return self.dotted

    @property
    def env(self) -> str | None:
        """Its environment variable (None: none)."""
        return self.env_prefix + self.key.replace(".", "_").upper()

    # -- reading ------------------------------------------------------------------------------------

    def read(self, value: Any, where: str) -> Any:
        """A value from any source (text from a variable or an option; a YAML or Python value), typed and
        checked; a ValueError naming ``where`` and what the setting takes."""
        typed = _READERS[self.kind](self, value, where)
        self.verify(typed, value, where)
        return typed

    def naming(self, where: str) -> str:
        """How a message names the value: where it came from (a side may add the setting's name)."""
        return where

    def takes(self) -> str:
        """What a value must be, in the words of the message that refuses one ("be an integer")."""
        if self.kind == "choice":
            return "be one of " + ", ".join(self.choices)
        if self.kind == "pairs":
            return f"map names to text ({self.spec.metavar or 'KEY=VALUE'})"
        return _TAKES[self.kind]

    def refusal(self, value: Any, where: str) -> ValueError:
        """The error for a value this setting cannot take."""
        comma = ";" if self.kind in ("choice", "patterns") else ","  # after a list of its own commas
        return ValueError(f"{self.naming(where)} must {self.takes()}{comma} got {value!r}")

    def verify(self, typed: Any, value: Any, where: str) -> None:
        """Raise when a value read (``typed``, from ``value``) is out of the setting's bounds: the side's words."""

    def given(self, value: Any) -> Any:
        """A value passed in code to a group's constructor, checked (and typed, by a side that reads it)."""
        return value

    def from_environment(self, environ: Mapping[str, str]) -> tuple[Any, str] | None:
        """(value, variable) from its variable, or None when unset; an empty variable counts as unset."""
        name = self.env
        raw = environ.get(name) if name else None
        if raw is None or raw.strip() == "":
            return None
        return self.read(raw, name), name

    def relative(self, value: Any, folder: pathlib.Path) -> Any:
        """A path setting's value from a config file: a relative path made relative to the file's folder."""
        if not self.spec.path or not value:
            return value
        if isinstance(value, dict):
            return {k: self.relative(v, folder) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.relative(v, folder) for v in value)
        return value if os.path.isabs(value) else str(folder / value)

    # -- showing ------------------------------------------------------------------------------------

    def show(self, value: Any) -> str:
        """The value as ``--show-config`` prints it (a secret only as set or not)."""
        if self.spec.secret:
            if isinstance(value, (list, dict)):
                return f"({len(value)} set, hidden)" if value else "-"
            return "(set, hidden)" if value else "-"
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "true" if value else "false"
        if self.kind == "patterns":
            return ",".join(value) or "(none)"
        if self.kind == "list":
            return ", ".join(map(str, value)) or "-"
        if self.kind == "pairs":
            return ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        return str(value)

    def default_text(self) -> str:
        """The default, as the docs and ``--help`` show it."""
        if self.default is None or (isinstance(self.default, (tuple, list, dict)) and not self.default):
            return "none"
        return self.show(self.default)


#: What a value of each kind must be (choice and pairs: Setting.takes).
_TAKES = {
    "text": "be text",
    "flag": f"be true or false ({'/'.join(TRUE)} or {'/'.join(FALSE)})",
    "integer": "be an integer",
    "bytes": "be an integer (bytes: 1073741824, 512MiB, 1GiB, ...)",
    "seconds": "be a number of seconds",
    "number": "be a number",
    "patterns": "be glob patterns: a list of strings, or comma-separated text",
    "list": "be a list of text",
}


# -- readers: (setting, value, where) -> typed value, or the setting's refusal ---------------------
# Text comes from a variable or an option; a YAML value or an argument may already be typed.


def _text(item: Setting, value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if item.numbers_as_text and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise item.refusal(value, where)


def _flag(item: Setting, value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if item.bits and isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
        return value.strip().lower() in TRUE
    raise item.refusal(value, where)


def _integer(item: Setting, value: Any, where: str) -> int:
    """An integer, or bytes: also with a binary unit (``512MiB``, ``2G``: powers of 1024)."""
    if isinstance(value, str):
        text = value.strip()
        if _INTEGER.fullmatch(text):
            return int(text)
        found = _SIZE.match(text) if item.kind == "bytes" else None
        if found is not None:
            return int(found.group(1)) * 1024 ** _POWERS[found.group(2)[:1].lower()]
    elif isinstance(value, float):
        if item.whole_floats and value.is_integer():
            return int(value)
    elif not isinstance(value, bool) and hasattr(type(value), "__index__"):
        return operator.index(value)  # numpy's integers too
    raise item.refusal(value, where)


def _number(item: Setting, value: Any, where: str) -> float:
    if not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise item.refusal(value, where)


def _choice(item: Setting, value: Any, where: str) -> str:
    if isinstance(value, str) and value.strip() in item.choices:
        return value.strip()
    raise item.refusal(value, where)


def _strings(item: Setting, value: Any, where: str) -> tuple[str, ...] | list[str]:
    """Patterns (a tuple; comma-separated in text) or a list (separated by spaces in text)."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")] if item.kind == "patterns" else value.split()
    elif isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        parts = list(value)
    else:
        raise item.refusal(value, where)
    return tuple(parts) if item.kind == "patterns" else parts


def _pairs(item: Setting, value: Any, where: str) -> dict[str, str]:
    """A YAML mapping KEY: VALUE; on a command line or in a variable, KEY=VALUE items."""
    if isinstance(value, str):
        value = value.split()
    if isinstance(value, (list, tuple)):
        out: dict[str, str] = {}
        for entry in value:
            key, sep, rest = str(entry).partition("=")
            if not sep or not key.strip() or not rest.strip():
                raise ValueError(f"{item.naming(where)}: expected {item.spec.metavar or 'KEY=VALUE'}, got {entry!r}")
            out[key.strip()] = rest.strip()
        return out
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    raise item.refusal(value, where)


_READERS: dict[str, Callable[[Setting, Any, str], Any]] = {
    "text": _text, "flag": _flag, "integer": _integer, "bytes": _integer, "seconds": _number, "number": _number,
    "choice": _choice, "patterns": _strings, "list": _strings, "pairs": _pairs,
}


# -- walking a definition -------------------------------------------------------------------------


class Group:
    """Base of a settings group: after construction, each field is checked (and typed) by its setting."""

    __slots__ = ()  # a side's groups may have slots: a misspelt attribute is then an error

    group: ClassVar[str]
    """The group's name: in the docs, dotted names and ``--show-config``."""

    def __post_init__(self) -> None:
        for item in settings_of(type(self)):
            object.__setattr__(self, item.name, item.given(getattr(self, item.name)))


def title(group_cls: type) -> str:
    """A group's docstring's first line, as a title after its name: "capture: what is recorded, ..."."""
    text = (group_cls.__doc__ or getattr(group_cls, "group", "")).strip().splitlines()[0].rstrip(".")
    return text[:1].lower() + text[1:]


def settings_of(cls: type) -> tuple[Setting, ...]:
    """The settings declared by one class (a group, or the top-level class), in order; cached on the class."""
    cached = cls.__dict__.get("_settings_cache")
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    group = getattr(cls, "group", "")
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("setting")
        if spec is None:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        kind, choices = spec.setting_type.kind_of(hints[f.name], spec)
        out.append(spec.setting_type(f.name, group, kind, default, spec, choices, cls))
    result = tuple(out)
    setattr(cls, "_settings_cache", result)
    return result


def groups_of(config_cls: type) -> Iterator[tuple[str, type]]:
    """(attribute, group class) of each group field of a top-level class, in order."""
    for f in dataclasses.fields(config_cls):
        kind = f.default_factory  # type: ignore[misc]
        if isinstance(kind, type) and issubclass(kind, Group):
            yield f.name, kind


def all_settings(config_cls: type) -> tuple[Setting, ...]:
    """Every setting: each group's in order, then those of the top-level class itself."""
    out: list[Setting] = []
    for _, cls in groups_of(config_cls):
        out.extend(settings_of(cls))
    out.extend(settings_of(config_cls))
    return tuple(out)


def value_of(config: Any, item: Setting) -> Any:
    """A setting's value in a top-level instance."""
    return getattr(getattr(config, item.group) if item.group else config, item.name)


def build(config_cls: type, values: Mapping[str, Any]) -> Any:
    """The top-level class from values by key (the rest: defaults); each group checks its own."""
    kwargs: dict[str, Any] = {}
    for attribute, cls in groups_of(config_cls):
        kwargs[attribute] = cls(**{s.name: values[s.key] for s in settings_of(cls) if s.key in values})
    for item in settings_of(config_cls):
        if item.key in values:
            kwargs[item.name] = values[item.key]
    return config_cls(**kwargs)


#: How ``--help`` names a value of a kind, when the setting names none.
METAVARS = {"integer": "N", "bytes": "BYTES", "seconds": "SECONDS", "number": "X"}


def option_sections(parser: Any, config_cls: type, has_option: Callable[[Setting], Any]) -> Iterator[tuple[Any, Setting]]:
    """(argument group, setting) for each setting ``has_option`` keeps: one argparse group per settings
    group that has any, titled by the group ("capture: what is recorded, and at which steps")."""
    for attribute, cls in groups_of(config_cls):
        items = [item for item in settings_of(cls) if has_option(item)]
        if items:
            section = parser.add_argument_group(f"{attribute}: {title(cls)}")
            yield from ((section, item) for item in items)


# -- resolved values ------------------------------------------------------------------------------


@dataclass
class Resolved:
    """Every setting's value (``config``, the top-level class), and where each came from: ``sources`` by
    key, "default" where none is recorded (for messages and ``--show-config``)."""

    config: Any
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    config_file: str | None = None

    header: ClassVar[tuple[str, ...]] = ("SETTING", "VALUE", "SOURCE")

    def row(self, item: Setting) -> tuple[str, ...]:
        return item.key, item.show(value_of(self.config, item)), self.sources.get(item.key, "default")

    def describe(self) -> str:
        """One aligned line per setting: its name, its value and where it came from (aligned on a terminal:
        a wide character, as in a CJK session name or path, takes two columns)."""
        rows = [self.header, *(self.row(item) for item in all_settings(type(self.config)))]
        widths = [max(_columns(row[i]) for row in rows) for i in range(len(self.header) - 1)]
        return "\n".join("  ".join([*(cell + " " * (width - _columns(cell)) for cell, width in zip(row, widths)),
                                    row[-1]]).rstrip() for row in rows)


def _columns(text: str) -> int:
    """Terminal columns ``text`` takes: two for a wide (East Asian) character, none for a combining one."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1
               for c in text)
