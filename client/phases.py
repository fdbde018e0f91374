"""The phases of a training step: one definition for the client, the server and the reports.

The wire carries a phase as ``twinstep.v1.Phase``; configuration, reports and
logs name it in lower case ("forward").  A step happens in ``STEP_ORDER``;
``input`` (a module's first input) is evidence for culprit analysis, not a
phase of the step, so it has a name but no place in that order.

Imports only the generated contract: the server and the client's renderers
use it without loading anything of the training-side runtime.
"""

from __future__ import annotations

from twinstep.v1 import twinstep_pb2 as pb

__all__ = [
    "BACKWARD", "FORWARD", "GRAD", "INPUT", "LOSS", "MODULE_PHASES", "NAMES", "PARAM", "PARAM_PHASES",
    "STEP_ORDER", "describe", "name", "step_position", "value",
]

FORWARD: int = pb.FORWARD
LOSS: int = pb.LOSS
BACKWARD: int = pb.BACKWARD
GRAD: int = pb.GRAD
PARAM: int = pb.PARAM
INPUT: int = pb.INPUT

#: Wire value -> name, for every phase a record can have.
NAMES: dict[int, str] = {FORWARD: "forward", LOSS: "loss", BACKWARD: "backward", GRAD: "grad", PARAM: "param",
                         INPUT: "input"}
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
