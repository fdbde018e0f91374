"""Batch sync without touching the loop: the model's first call of each step is its batch.

``attach(publish_batches=True)`` on the baseline publishes the positional and
keyword arguments of the model's first call in every step;
``attach(sync_batches=True)`` on a candidate replaces the arguments of its
model's first call in every step by the baseline's (each tensor moved to the
device of the candidate's own first tensor argument).  Both come from one
forward pre-hook on the model itself (torch and paddle >= 3.0 pass keyword
arguments to such a hook; a framework that cannot falls back to positional
arguments only).  The two models must take the same arguments: a batch is
``{"args": [...], "kwargs": {...}}`` on the wire.

The step boundary (``Monitor.step``) re-arms the hook; later calls of the same
step (an evaluation forward, a second micro-batch) are left alone.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger("twinstep")


class FirstCallHook:
    """A forward pre-hook on ``model`` that calls ``on_first(args, kwargs)`` on the first call of each step.

    ``on_first`` returns None (leave the call alone) or ``(args, kwargs)`` to call the model with instead.
    """

    def __init__(self, model: Any, on_first: Callable[[tuple, dict], tuple[tuple, dict] | None]) -> None:
        self._on_first = on_first
        self._armed = True
        self.with_kwargs = True
        try:
            self._handle = model.register_forward_pre_hook(self._hook_with_kwargs, with_kwargs=True)
        except TypeError:  # a framework without keyword arguments for pre-hooks
            self.with_kwargs = False
            self._handle = model.register_forward_pre_hook(self._hook_args_only)

    def new_step(self) -> None:
        """The next call of the model is the first of a new step."""
        self._armed = True

    def remove(self) -> None:
        self._handle.remove()

    def _hook_with_kwargs(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not self._armed:
            return None
        self._armed = False
        return self._on_first(tuple(args), dict(kwargs or {}))

    def _hook_args_only(self, module: Any, args: tuple) -> tuple | None:
        if not self._armed:
            return None
        self._armed = False
        replaced = self._on_first(tuple(args), {})
        return None if replaced is None else tuple(replaced[0])


def as_batch(args: tuple, kwargs: dict) -> dict[str, Any]:
    """A first call's arguments as the batch published for it."""
    return {"args": list(args), "kwargs": kwargs}


def as_call(batch: Any) -> tuple[tuple, dict]:
    """The arguments of a published first call; ValueError for a batch that is not one."""
    if not isinstance(batch, dict) or set(batch) != {"args", "kwargs"} or not isinstance(batch["kwargs"], dict):
        raise ValueError("the baseline's batch is not a model call (publish it with attach(publish_batches=True), "
                         "or fetch it with Monitor.baseline_batch() and feed it yourself)")
    return tuple(batch["args"]), dict(batch["kwargs"])


def first_tensor_device(framework: str, args: tuple, kwargs: dict) -> Callable[[Any], Any] | None:
    """A function moving a tensor to where the candidate's own first tensor argument lives (None: leave it)."""
    for value in (*args, *kwargs.values()):
        if framework == "torch":
            import torch

            if isinstance(value, torch.Tensor):
                device = value.device
                return None if device.type == "cpu" else (lambda t: t.to(device))
        elif framework == "paddle":
            import paddle

            if isinstance(value, paddle.Tensor):
                place = value.place
                return None if place.is_cpu_place() else (lambda t: t._copy_to(place, False))
    return None


def mover(framework: str, device: Any) -> Callable[[Any], Any] | None:
    """A function moving a tensor of ``framework`` to ``device`` (None: leave it on the CPU)."""
    if device is None:
        return None
    if framework == "torch":
        return lambda t: t.to(device)
    if framework == "paddle":
        import paddle

        return lambda t: paddle.to_tensor(t, place=device)
    raise ValueError(f"unknown framework {framework!r}")
