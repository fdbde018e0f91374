"""A Setup a client sent, checked before the session keeps it: bounded, or one stream's clear error."""

from __future__ import annotations

from twinstep.server.errors import invalid
from twinstep.v1 import twinstep_pb2 as pb

MAX_VALUES = 4096
MAX_GROUPS = 1024
MAX_PARAMETERS = 100_000
MAX_MODULES = 20_000
MAX_TEXT = 1000


def check_setup(setup: pb.Setup) -> None:
    """Raise InputError (INVALID_ARGUMENT) naming what is too large in ``setup``."""
    if len(setup.values) > MAX_VALUES:
        raise invalid(f"setup lists {len(setup.values)} values; at most {MAX_VALUES}")
    if len(setup.groups) > MAX_GROUPS:
        raise invalid(f"setup lists {len(setup.groups)} parameter groups; at most {MAX_GROUPS}")
    parameters = sum(len(g.parameters) for g in setup.groups)
    if parameters > MAX_PARAMETERS:
        raise invalid(f"setup's parameter groups name {parameters} parameters; at most {MAX_PARAMETERS}")
    if len(setup.modules) > MAX_MODULES:
        raise invalid(f"setup lists {len(setup.modules)} modules; at most {MAX_MODULES}")
    values = [*setup.values, *(v for g in setup.groups for v in g.values), *(v for m in setup.modules for v in m.values)]
    for value in values:
        if len(value.key) > MAX_TEXT or len(value.category) > MAX_TEXT or len(value.text) > MAX_TEXT:
            raise invalid(f"setup value {value.key[:60]!r} is longer than {MAX_TEXT} characters")
