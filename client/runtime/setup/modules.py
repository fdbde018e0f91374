"""Per-module hyper-parameters the frameworks expose: norm epsilon, activation, rotary base, dropout.

Read from attributes by name, so one walk serves torch and paddle (and any
framework whose set-up module gives ``named_modules`` and ``buffer``).  A
rotary base with no attribute is derived from the module's ``inv_freq``
table: its last entry is ``base ** (-(d - 2) / d)``, so the base comes back
to within a few float32 ulps (a base of 10001 against 10000 is 1e-4 apart).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

from twinstep.runtime.setup import canonical
from twinstep.runtime.setup.base import SetupBuilder, setup_value

_EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon", "_epsilon", "variance_eps")
_ROPE_ATTRIBUTES = ("rope_theta", "base")
_DROPOUT_ATTRIBUTES = ("attention_dropout", "dropout", "attn_dropout", "attention_dropout_prob")
_INV_FREQ = ("inv_freq", "full_attention_inv_freq", "global_inv_freq")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(float(value)) else None


def module_values(module: Any, buffer: Callable[[Any, str], Any]) -> list:
    """The hyper-parameters of one module (none for most modules)."""
    values = []
    for attribute in _EPS_ATTRIBUTES:
        eps = _number(getattr(module, attribute, None))
        if eps is not None:
            values.append(setup_value("norm_eps", "eps", eps))
            break
    act = canonical.activation(module)
    if act is not None:
        values.append(setup_value("activation", "activation", act))
    class_name = type(module).__name__
    if "Dropout" in class_name:
        p = _number(getattr(module, "p", None))
        if p is not None:
            values.append(setup_value("dropout", "p", p))
    for attribute in _DROPOUT_ATTRIBUTES:
        rate = _number(getattr(module, attribute, None))
        if rate is not None:
            values.append(setup_value("dropout", "attention_dropout" if "att" in attribute else "dropout", rate))
    rope = _rope_base(module, class_name, buffer)
    if rope is not None:
        values.append(rope)
    return values


def _rope_base(module: Any, class_name: str, buffer: Callable[[Any, str], Any]) -> Any:
    lowered = class_name.lower()
    rotary = "rotary" in lowered or "rope" in lowered
    if rotary:
        for attribute in _ROPE_ATTRIBUTES:
            base = _number(getattr(module, attribute, None))
            if base is not None:
                return setup_value("rope_base", "rope_base", base)
    for name in _INV_FREQ:
        table = buffer(module, name)
        if table is None:
            continue
        flat = [float(x) for x in table.reshape(-1)]
        if len(flat) < 2 or not 0 < flat[-1] < 1:
            return None
        dim = 2 * len(flat)
        return setup_value("rope_base", "rope_base", flat[-1] ** (-dim / (dim - 2)), derived=True)
    return None


def collect_modules(builder: SetupBuilder, named_modules: Iterable[tuple[str, Any]],
                    buffer: Callable[[Any, str], Any]) -> None:
    for name, module in named_modules:
        try:
            builder.module(name, type(module).__name__, module_values(module, buffer))
        except Exception as error:  # one odd module must not hide the others
            builder.failed(f"hyper-parameters of module {name!r}", error)
