"""A module call's first input: the one rule the hooks, ``twinstep.compare`` and dump readers follow.

A call's input (the ``input`` record, culprit evidence) is the first tensor among its
positional arguments, else the first tensor among its keyword arguments taken in the order
of the module's forward signature, then any keyword the signature does not name, in call
order.  Both frameworks then pick the same logical input however a call is spelled:
transformers calls attention as ``self_attn(hidden_states=h, position_embeddings=pe,
attention_mask=m)`` where paddleformers passes ``hidden_states`` positionally, and
``hidden_states`` comes first in both forward signatures.  Where the signature is not
known (a dump written by another tool), ``order`` is empty and keywords count in call order.

Plain Python: the training side reads the signature (twinstep.runtime.capture.base) and
the server reads dumps with it, neither loading the other.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

__all__ = ["call_inputs", "keyword_order"]


def keyword_order(kwargs: Mapping[str, Any], order: tuple[str, ...]) -> Iterator[str]:
    """The names of ``kwargs`` in the rule's order: those ``order`` names, in its order, then the rest in call order."""
    named = 0
    for name in order:
        if name in kwargs:
            named += 1
            yield name
    if named < len(kwargs):
        known = set(order)
        yield from (name for name in kwargs if name not in known)


def call_inputs(args: tuple, kwargs: Mapping[str, Any] | None, order: tuple[str, ...] = ()) -> tuple:
    """``args`` followed by ``kwargs``' values in :func:`keyword_order`.

    The first tensor found in the result is the call's input by the rule above.
    """
    if not kwargs:
        return tuple(args)
    return (*args, *(kwargs[name] for name in keyword_order(kwargs, order)))
