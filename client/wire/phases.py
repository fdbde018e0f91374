"""The phases of a training step: one definition for the client, the server and the reports.

The wire carries a phase as ``twinstep.v1.Phase``; configuration, reports and
logs name it in lower case ("forward").  A step happens in ``STEP_ORDER``;
``input`` (a module's first input) is evidence for culprit analysis, not a
phase of the step, so it has a name but no place in that order.  ``record``
(a value the training named, ``Monitor.record``) has no fixed place either:
each record sits where the training recorded it (``record_position``).

Imports only the generated contract: the server and the client's renderers
use it without loading anything of the training-side runtime.
"""

from __future__ import annotations

from twinstep.v1 import twinstep_pb2 as pb

__all__ = [
    "BACKWARD", "FORWARD", "GRAD", "INPUT", "LOSS", "MODULE_PHASES", "NAMES", "PARAM", "PARAM_PHASES", "RECORD",
    "STEP_ORDER", "describe", "name", "record_position", "step_position", "value",
]

FORWARD: int = pb.FORWARD
LOSS: int = pb.LOSS
BACKWARD: int = pb.BACKWARD
GRAD: int = pb.GRAD
PARAM: int = pb.PARAM
INPUT: int = pb.INPUT
RECORD: int = pb.RECORD

#: Wire value -> name, for every phase a record can have.
NAMES: dict[int, str] = {FORWARD: "forward", LOSS: "loss", BACKWARD: "backward", GRAD: "grad", PARAM: "param",
                         INPUT: "input", RECORD: "record"}
_VALUES: dict[str, int] = {text: number for number, text in NAMES.items()}

#: The phases of one step in the order they happen (``input`` is not one of them).
STEP_ORDER: tuple[str, ...] = ("forward", "loss", "backward", "grad", "param")
_POSITION = {text: i for i, text in enumerate(STEP_ORDER)}

#: Phases whose records are parameters (gradients, updated values); their target is a parameter id.
PARAM_PHASES = frozenset({GRAD, PARAM})
#: Phases whose records are a module's tensors; their target is a module id.
MODULE_PHASES = frozenset({FORWARD, BACKWARD, INPUT})


def name(number: int) -> str:
    """The name of a wire value ("forward"); raises ValueError for a value that is not a record's phase."""
    found = NAMES.get(number)
    if found is None:
        raise ValueError(f"unknown phase {number} (expected one of {', '.join(map(str, NAMES))})")
    return found


def describe(number: int) -> str:
    """The name of a wire value, or "phase N" for one no record can have: for text about a client's word."""
    return NAMES.get(number, f"phase {number}")


def value(text: str) -> int:
    """The wire value of a phase name; raises ValueError for an unknown name."""
    found = _VALUES.get(text)
    if found is None:
        raise ValueError(f"unknown phase {text!r} (expected one of {', '.join(_VALUES)})")
    return found


def step_position(text: str) -> int:
    """Where a phase comes in a step (forward is 0); after every step phase for any other name (input)."""
    return _POSITION.get(text, len(STEP_ORDER))


def record_position(after: str | None) -> float:
    """Where a named record comes in a step: just after the step phase ``after`` (None: before forward).

    A value recorded before the model's first call (a batch's input ids) comes
    before every module; one recorded after backward (a learning rate) before
    the parameters' update, so it is found at the step it starts to differ.
    """
    return -0.5 if after is None else step_position(after) + 0.5
