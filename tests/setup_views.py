"""A run's Setup message (docs/preflight.md) as plain dicts, for the tests that check what a collector read."""

from __future__ import annotations

from twinstep.v1 import twinstep_pb2 as pb


def value(v: pb.SetupValue):
    return getattr(v, v.WhichOneof("value"))


def groups(setup: pb.Setup) -> dict[str, dict[str, object]]:
    """Parameter name -> {hyper-parameter: value}."""
    return {name: {v.key: value(v) for v in g.values} for g in setup.groups for name in g.parameters}


def modules(setup: pb.Setup) -> dict[str, dict[str, object]]:
    return {m.name: {v.key: value(v) for v in m.values} for m in setup.modules}


def run_wide(setup: pb.Setup) -> dict[str, object]:
    return {v.key: value(v) for v in setup.values}
