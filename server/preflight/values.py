"""Equality and rendering of set-up values: numbers within a relative tolerance, text and flags exactly.

A value read from the framework (an epsilon, a learning rate) is the number the
user wrote, through float64 on both sides: 1e-6 relative allows only printing
noise.  A derived value (a rotary base recovered from a float32 inv_freq table,
~1e-7 off) gets 1e-5, still ten times below the smallest corpus difference
(a rotary base of 10001 against 10000).  A whole number is written as an integer
(a seed has every digit; one beyond a double's exact range travels as text:
twinstep.runtime.setup.base.setup_value).
"""

from __future__ import annotations

import math

from twinstep.v1 import twinstep_pb2 as pb

READ_TOLERANCE = 1e-6
DERIVED_TOLERANCE = 1e-5


def equal(a: pb.SetupValue, b: pb.SetupValue) -> bool:
    kind_a, kind_b = a.WhichOneof("value"), b.WhichOneof("value")
    if kind_a != kind_b:
        return False
    if kind_a == "number":
        tolerance = DERIVED_TOLERANCE if a.derived or b.derived else READ_TOLERANCE
        return math.isclose(a.number, b.number, rel_tol=tolerance, abs_tol=1e-300)
    return getattr(a, kind_a or "text") == getattr(b, kind_b or "text")


def render(value: pb.SetupValue | None) -> str:
    if value is None:
        return "(none)"
    kind = value.WhichOneof("value")
    if kind == "number":
        number = value.number
        if number.is_integer() and abs(number) < 2.0**64 and not value.derived:
            return str(int(number))  # a seed, a vocabulary size: every digit, never 4.905462e+18
        text = f"{number:.6g}" if value.derived else f"{number:.7g}"
        return text + " (derived)" if value.derived else text
    if kind == "flag":
        return "true" if value.flag else "false"
    return value.text if kind == "text" else "(none)"
