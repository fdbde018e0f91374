"""What every trainer callback shares: one monitor over a training, the loss of each optimizer step, fail-open.

A trainer owns the loop, so a callback can only act at the points the trainer
calls it.  Both trainers give it a moment after ``optimizer.step()`` and before
the gradients are cleared (Hugging Face: ``on_optimizer_step``; paddleformers:
none, see its module), which is where ``Monitor.step`` must run: it reads the
parameter gradients and the updated parameters there.

The loss is the one the trainer optimises for that step: the model output's
``loss`` of each micro-batch (taken by a forward hook on the model, as the
trainers' own ``compute_loss`` reads it), weighted as the trainer weights it
before ``backward`` (``1/N`` over N accumulated micro-batches, or 1 where the
model already divides by the step's token count), and summed over the step.
The tensors stay on their device: no synchronisation per step.

Everything here is fail-open: an error is logged once per kind and the
training goes on without capture; only a halt from the server changes the
training, and then through the trainer's own ``should_training_stop``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

logger = logging.getLogger("twinstep")

#: Wrappers a trainer puts around the user's model, and the attribute holding the model inside.
_WRAPPERS = {
    "DistributedDataParallel": "module",  # torch
    "DataParallel": "module",  # torch; paddle.DataParallel keeps it in _layers (tried below)
    "OptimizedModule": "_orig_mod",  # torch.compile
}
_DEFAULT_CLOSE_TIMEOUT = 10.0


def unwrap_model(model: Any) -> Any:
    """The user's model inside a trainer's wrappers (DDP, DataParallel, torch.compile), or the model itself."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        attribute = _WRAPPERS.get(type(model).__name__)
        inner = getattr(model, attribute, None) if attribute else None
        if inner is None and type(model).__name__ == "DataParallel":
            inner = getattr(model, "_layers", None)
        if inner is None:
            return model
        model = inner
    return model


def check_attach_options(options: dict[str, Any]) -> None:
    """TypeError now, at the callback's construction, for an option ``twinstep.attach`` does not take.

    Values are checked by ``attach`` itself at the start of training (it also
    resolves what is left out from the environment and the config file).
    """
    from twinstep.runtime.api import attach

    if "model" in options:
        raise TypeError("the callback attaches to the trainer's model; do not pass model=")
    try:
        inspect.signature(attach).bind(None, **options)
    except TypeError as error:
        raise TypeError(f"twinstep callback: {error} (it takes twinstep.attach's options)") from None


def output_loss(output: Any) -> Any | None:
    """The loss a trainer reads from a model output, as both trainers' ``compute_loss`` do; None if absent.

    A mapping's ``"loss"`` (ModelOutput), else the first element of a tuple;
    kept only if it is a one-element floating tensor.
    """
    if isinstance(output, dict) or hasattr(output, "keys") and hasattr(output, "get"):
        value = output.get("loss")
    elif isinstance(output, (tuple, list)):
        value = output[0] if output else None
    else:
        value = output
    shape = getattr(value, "shape", None)
    if shape is None or not callable(getattr(value, "is_floating_point", None)):
        return None
    size = 1
    for dim in shape:
        size *= int(dim)
    return value if size == 1 and value.is_floating_point() else None


class TrainerAttachment:
    """The monitor of one training under a trainer's callback: attach, one step per optimizer step, close.

    Methods are called from the callback on the training thread; none raises.
    """

    def __init__(self, trainer: str, attach_options: dict[str, Any],
                 close_timeout: float = _DEFAULT_CLOSE_TIMEOUT) -> None:
        check_attach_options(attach_options)
        if not close_timeout > 0:
            raise ValueError(f"close_timeout must be positive, got {close_timeout!r}")
        self.trainer = trainer
        self.options = dict(attach_options)
        self.close_timeout = close_timeout
        self.monitor: Any = None
        self.halted: Any = None
        """The twinstep.Halted the server sent, once it has (the callback then stops the training)."""
        self.last_loss: Any = None
        """The loss recorded for the latest step: a tensor on the training's device (None: no loss found)."""
        self._losses: list[tuple[Any, float | None]] = []  # (detached loss, its weight or None: 1/micro-batches)
        self._warned: set[str] = set()
        self._removers: list[Callable[[], None]] = []

    # -- the training's life ---------------------------------------------------------

    def begin(self, model: Any, global_step: int, install_loss_hook: Callable[[Any], Callable[[], None]],
              optimizer: Any = None, lr_scheduler: Any = None) -> None:
        """Attach to the trainer's model (unwrapped); ``install_loss_hook(model)`` returns its remover.

        ``optimizer``, ``lr_scheduler``: the trainer's, when it passes them: their set-up is diffed (preflight).
        """
        self.end()  # a second train() on the same callback starts a fresh monitor
        self.halted = None
        if model is None:
            self.warn_once("no-model", "the trainer passed no model to the callback; training goes on without capture")
            return
        model = unwrap_model(model)
        options = dict(self.options)
        if global_step > 0 and "start_step" not in options:
            options["start_step"] = global_step  # resumed from a checkpoint: number steps as the trainer does
        try:
            from twinstep.runtime.api import attach

            self.monitor = attach(model, **options)
            if optimizer is not None:
                self.monitor.set_optimizer(optimizer, lr_scheduler)
        except Exception as error:
            self.warn_once("attach", f"could not attach ({type(error).__name__}: {error}); training goes on "
                           "without capture", level=logging.ERROR)
            return
        try:
            self._removers.append(install_loss_hook(model))
        except Exception as error:
            self.warn_once("loss-hook", f"cannot read the loss from the model's output ({type(error).__name__}: "
                           f"{error}); the loss is not compared")

    def add_loss(self, output: Any, weight: float | None, training: bool) -> None:
        """A model forward finished: keep its loss for the step.  ``weight``: the trainer's scale, None for 1/N."""
        if self.monitor is None or not training:
            return
        try:
            loss = output_loss(output)
            if loss is not None:
                self._losses.append((loss.detach(), weight))
        except Exception as error:
            self.warn_once("loss", f"reading the loss failed ({type(error).__name__}: {error}); the loss is not "
                           "compared")

    def end_step(self) -> bool:
        """The optimizer step is done, gradients still held: record the step.  True when the server halted the run."""
        monitor = self.monitor
        if monitor is None:
            return False
        losses, self._losses = self._losses, []
        try:
            loss = self._step_loss(losses)
        except Exception as error:
            loss = None
            self.warn_once("loss-sum", f"summing the step's loss failed ({type(error).__name__}: {error}); the "
                           "loss is not compared")
        if loss is None and not losses:
            self.warn_once("no-loss", "the model's output carries no loss (a custom compute_loss?); the loss phase "
                           "is not compared")
        self.last_loss = loss
        from twinstep.errors import Halted

        try:
            monitor.step(loss=loss)
        except Halted as halt:
            self.halted = halt
            logger.warning("twinstep: the server halted run %r at step %d (%s); stopping the %s training after "
                           "this step", monitor.run, halt.step, halt.reason, self.trainer)
            self.monitor = None  # Monitor.step closed itself before raising
            self._remove_hooks()
            return True
        except Exception as error:  # Monitor.step is fail-open itself; this is a last guard
            self.warn_once("step", f"step failed ({type(error).__name__}: {error})")
        return False

    def end(self) -> None:
        """Training ended: flush what is queued (at most ``close_timeout`` s) and detach."""
        self._remove_hooks()
        self._losses = []
        monitor, self.monitor = self.monitor, None
        if monitor is None:
            return
        try:
            monitor.close(timeout=self.close_timeout)
        except Exception as error:
            self.warn_once("close", f"close failed ({type(error).__name__}: {error})")

    # -- internals -------------------------------------------------------------------

    @staticmethod
    def _step_loss(losses: list[tuple[Any, float | None]]) -> Any | None:
        if not losses:
            return None
        total = None
        for loss, weight in losses:
            term = loss * (weight if weight is not None else 1.0 / len(losses))
            total = term if total is None else total + term
        return total

    def _remove_hooks(self) -> None:
        removers, self._removers = self._removers, []
        for remove in removers:
            try:
                remove()
            except Exception as error:
                self.warn_once("remove", f"removing a hook failed ({type(error).__name__}: {error})")

    def warn_once(self, kind: str, message: str, level: int = logging.WARNING) -> None:
        """Log ``message`` the first time this kind of problem happens (a failing hook would repeat every step)."""
        if kind in self._warned:
            return
        self._warned.add(kind)
        logger.log(level, "twinstep (%s callback): %s", self.trainer, message)


class AttachmentViews:
    """What a trainer callback shows of its attachment; shared by every trainer's callback class."""

    attachment: TrainerAttachment

    @property
    def monitor(self) -> Any:
        """The twinstep Monitor while training runs (None before, after, or when attaching failed)."""
        return self.attachment.monitor

    @property
    def halted(self) -> Any:
        """The ``twinstep.Halted`` that stopped the training, or None."""
        return self.attachment.halted

    @property
    def last_loss(self) -> Any:
        """The loss recorded for the latest optimizer step (a tensor on the training's device), or None."""
        return self.attachment.last_loss
