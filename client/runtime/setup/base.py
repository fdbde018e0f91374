"""What every set-up collector writes into: a bounded builder of one ``Setup`` message.

A collector adds values, parameter groups and modules; the builder caps them
(a 70B model has ~1000 modules and parameters: the caps sit well above that)
and turns what did not fit, or could not be read, into set-up warnings.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Iterable

from twinstep.v1 import twinstep_pb2 as pb

MAX_VALUES = 1024
"""Run-wide values (versions, flags, optimizer, config keys)."""
MAX_GROUPS = 256
MAX_PARAMETERS = 20_000
"""Parameter names over every group; past it, groups count the rest (parameters_unlisted)."""
MAX_MODULES = 8192
MAX_TEXT = 200
MAX_WARNINGS = 32


def setup_value(category: str, key: str, value: Any, derived: bool = False) -> pb.SetupValue | None:
    """One value as read: a bool is a flag, a finite number a number, anything else its text (None: '(none)').

    An integer a double cannot hold exactly (a 64-bit seed) is its digits, so it is shown and compared whole."""
    out = pb.SetupValue(category=category, key=key[:MAX_TEXT], derived=derived)
    if isinstance(value, bool):
        out.flag = value
    elif isinstance(value, int) and abs(value) > 2**53:
        out.text = str(value)
    elif isinstance(value, (int, float)) and math.isfinite(float(value)):
        out.number = float(value)
    elif value is None:
        out.text = "(none)"
    else:
        out.text = str(value)[:MAX_TEXT]
    return out


class SetupBuilder:
    """Collects one Setup within its caps; every cut and failure becomes a warning, never an exception."""

    def __init__(self, framework: str, rank: int) -> None:
        self.setup = pb.Setup(framework=framework, rank=rank)
        self._keys: set[tuple[str, str]] = set()
        self._parameters = 0

    def value(self, category: str, key: str, value: Any, derived: bool = False) -> None:
        """A run-wide value; the first one given for a key wins."""
        if (category, key) in self._keys:
            return
        if len(self.setup.values) >= MAX_VALUES:
            self.warn_once(f"more than {MAX_VALUES} run-wide set-up values: the rest are not compared")
            return
        self._keys.add((category, key))
        self.setup.values.append(setup_value(category, key, value, derived))

    def group(self, values: Iterable[pb.SetupValue], parameters: list[str]) -> None:
        """Parameters that share every optimizer hyper-parameter in ``values``."""
        if len(self.setup.groups) >= MAX_GROUPS:
            self.warn_once(f"more than {MAX_GROUPS} distinct optimizer parameter groups: the rest are not compared")
            return
        room = max(MAX_PARAMETERS - self._parameters, 0)
        listed = parameters[:room]
        self._parameters += len(listed)
        group = self.setup.groups.add(values=list(values), parameters=listed,
                                      parameters_unlisted=len(parameters) - len(listed))
        if group.parameters_unlisted:
            self.warn_once(f"more than {MAX_PARAMETERS} optimized parameters: the rest are counted, not compared")

    def module(self, name: str, type_name: str, values: list[pb.SetupValue]) -> None:
        if not values:
            return
        if len(self.setup.modules) >= MAX_MODULES:
            self.warn_once(f"more than {MAX_MODULES} modules with hyper-parameters: the rest are not compared")
            return
        self.setup.modules.add(name=name, type=type_name[:MAX_TEXT], values=values)

    def warn_once(self, text: str) -> None:
        if text not in self.setup.warnings and len(self.setup.warnings) < MAX_WARNINGS:
            self.setup.warnings.append(text[:4 * MAX_TEXT])

    def failed(self, what: str, error: BaseException) -> None:
        """A collector's error: the set-up says what could not be read, the training never sees it."""
        self.warn_once(f"could not read the {what}: {type(error).__name__}: {error}")

    def finish(self) -> pb.Setup:
        """The Setup with its digest (over everything but the digest and the rank)."""
        body = pb.Setup()
        body.CopyFrom(self.setup)
        body.rank = 0
        self.setup.digest = hashlib.sha1(body.SerializeToString(deterministic=True)).hexdigest()
        return self.setup
