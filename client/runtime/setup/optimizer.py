"""The optimizer's hyper-parameters per parameter, grouped back into the groups that share them.

Each framework's set-up module reads, per parameter, the values that really
apply to it (paddle: the group's, the optimizer's, the parameter's learning
rate multiplier, and weight decay switched off where ``apply_decay_param_fun``
says so; torch: its param_group's).  Grouping parameters by equal values
makes the message small and makes the server's diff name exactly the
parameters a difference touches.
"""

from __future__ import annotations

from typing import Any, Iterable

from twinstep.runtime.setup import canonical
from twinstep.runtime.setup.base import SetupBuilder, setup_value

#: (category, key, value) of one hyper-parameter.
Row = tuple[str, str, Any]


def canonical_rows(raw: dict[str, Any]) -> list[Row]:
    """Framework keys (``eps``, ``epsilon``, ``betas``, ...) to the canonical ones; unknown keys are left out."""
    rows: list[Row] = []
    for key, value in raw.items():
        if key == "betas" and isinstance(value, (tuple, list)) and len(value) == 2:
            rows += [("betas", "beta1", _plain(value[0])), ("betas", "beta2", _plain(value[1]))]
            continue
        known = canonical.OPTIMIZER_KEYS.get(key)
        if known is not None:
            rows.append((*known, _plain(value)))
    return sorted(rows, key=lambda row: row[1])


def _plain(value: Any) -> Any:
    """A 0-d tensor (paddle keeps beta1 as one sometimes) as a Python number."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def add_groups(builder: SetupBuilder, per_parameter: Iterable[tuple[str, list[Row]]]) -> None:
    """One ParameterGroup per distinct set of values, listing its parameters in the model's order."""
    groups: dict[tuple, list[str]] = {}
    for name, rows in per_parameter:
        groups.setdefault(tuple(rows), []).append(name)
    for rows, names in groups.items():
        builder.group([setup_value(category, key, value) for category, key, value in rows], names)
