"""Find the model and the optimizer step of a training that never calls twinstep, and attach to them.

The rule, the same for torch and paddle (their probes report the events):

- every optimizer is noted when it is constructed;
- the model is the first module called with autograd on whose parameters an
  optimizer updates: the outermost one of the training forward (a module's
  forward starts before its children's), unwrapped from DDP/FSDP's
  ``.module`` or paddle DataParallel's ``._layers``.  twinstep attaches there,
  before that forward runs, so step 0 is captured whole;
- a step ends when that optimizer's ``step()`` returns: ``monitor.step(loss)``
  runs there, after the update and before the gradients are cleared;
- the loss is the sum of the scalars ``.backward()`` was called on since the
  previous step: the loss itself, or with gradient accumulation the sum of the
  micro-batch losses as scaled for backward (the objective whose gradient the
  optimizer applied).

Fail-open: an exception here is warned once and twinstep lets go of the
training; only ``twinstep.Halted`` (the server halting the run) passes through
``optimizer.step()``.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any

from twinstep.runtime.autoattach.base import Probe

logger = logging.getLogger("twinstep")

#: Optimizer steps taken with no model found before the probes are removed.
MAX_STEPS_UNATTACHED = 10


class AutoAttach:
    """The installer's state for one framework: optimizers seen, the model found, the monitor, the loss."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.monitor: Any = None
        self.given_up = False
        self._lock = threading.Lock()
        self._optimizers: list[weakref.ref] = []  # in construction order
        self._steps_taken: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._not_the_model: weakref.WeakSet = weakref.WeakSet()  # modules checked: no optimized parameter
        self._optimizer: Any = None  # a weakref to the optimizer whose step ends a twinstep step
        self._loss: Any = None
        self._unattached_steps = 0
        self._warned_unattached = False

    # -- events (training thread) ------------------------------------------------------------

    def on_optimizer(self, optimizer: Any) -> None:
        """An optimizer was constructed."""
        if self.monitor is not None or self.given_up:
            return
        try:
            with self._lock:
                self._optimizers.append(weakref.ref(optimizer))
                self._not_the_model = weakref.WeakSet()  # a module checked before may hold its parameters
        except Exception as error:  # an optimizer that cannot be weakly referenced, say
            self.give_up(f"noting {type(optimizer).__name__} failed: {error!r}")

    def on_forward(self, module: Any) -> None:
        """A module's forward is about to run: is it the model?"""
        if self.monitor is not None or self.given_up or not self._optimizers:
            return
        try:
            if module in self._not_the_model or not self.probe.grad_enabled():
                return
            optimizer = self._optimizer_of(module)
            if optimizer is None:
                self._not_the_model.add(module)
                return
            with self._lock:
                if self.monitor is None and not self.given_up:
                    self._attach(module, optimizer)
        except Exception as error:
            self.give_up(f"finding the model failed: {error!r}")

    def on_backward(self, tensors: Any, gradient: Any) -> None:
        """``.backward()`` is about to run on ``tensors``: add them to the step's loss."""
        if self.monitor is None:
            return
        try:
            loss = self.probe.scalar_loss(tensors, gradient)
            if loss is not None:
                self._loss = loss if self._loss is None else self._loss + loss
        except Exception as error:  # the loss is one record: the step still goes out without it
            self._loss = None
            logger.warning("twinstep: could not read the loss: %r", error)

    def on_step_end(self, optimizer: Any) -> None:
        """``optimizer.step()`` returned.  Raises twinstep.Halted when the server halts this run."""
        monitor = self.monitor
        if monitor is None:
            if not self.given_up:
                try:
                    self._count_unattached(optimizer)
                except Exception as error:
                    self.give_up(f"counting {type(optimizer).__name__}'s steps failed: {error!r}")
            return
        if self._optimizer is None or self._optimizer() is not optimizer:
            return  # another optimizer of the training: the step ends at the model's
        loss, self._loss = self._loss, None
        from twinstep.errors import Halted

        try:
            monitor.step(loss=loss)
        except Halted:
            self.remove()
            raise
        except Exception as error:  # Monitor.step is fail-open itself; this is a last guard
            self.give_up(f"ending a step failed: {error!r}")

    # -- internals ---------------------------------------------------------------------------

    def _optimizer_of(self, module: Any) -> Any | None:
        """The first optimizer (in construction order) that updates one of the module's parameters."""
        owned = {id(p) for p in self.probe.parameters(module)}
        if not owned:
            return None
        for ref in self._optimizers:
            optimizer = ref()
            if optimizer is not None and any(id(p) in owned for p in self.probe.optimizer_parameters(optimizer)):
                return optimizer
        return None

    def _attach(self, module: Any, optimizer: Any) -> None:
        from twinstep.runtime import settings
        from twinstep.runtime.api import start

        model, wrappers = self.probe.unwrap(module)
        taken = self._steps_taken.get(optimizer, 0)
        chosen = settings.resolve().settings
        # An optimizer created after the first forward: the steps it took before were missed.
        chosen = chosen.replace(start_step=chosen.capture.start_step + taken)
        try:
            self.monitor = start(model, chosen, optimizer=optimizer)
        except Exception as error:
            self.give_up(f"attach failed: {error}")
            return
        self._optimizer = weakref.ref(optimizer)
        self.probe.remove_discovery()
        self._report(model, wrappers, optimizer, chosen, taken)

    def _report(self, model: Any, wrappers: list[str], optimizer: Any, chosen: Any, taken: int) -> None:
        """One line per process: what was attached, to what, where (``chosen``: its AttachSettings)."""
        monitor = self.monitor
        params = list(self.probe.parameters(model))
        count = sum(self.probe.numel(p) for p in params)
        where = f"rank {monitor.rank} of {monitor.world_size}, " if monitor.world_size > 1 else ""
        inside = f" inside {', '.join(wrappers)}" if wrappers else ""
        late = f"; from step {chosen.capture.start_step} (the optimizer stepped {taken} times before the model was found)" if taken else ""
        print(f"twinstep: run {monitor.run!r} ({where}{'baseline, ' if chosen.identity.baseline else ''}"
              f"session {monitor.session!r} at {chosen.connection.server}) attached to {type(model).__name__}{inside}: "
              f"{count:,} parameters in {len(params)} tensors; steps end at {type(optimizer).__name__}.step(){late}",
              file=sys.stderr, flush=True)

    def _count_unattached(self, optimizer: Any) -> None:
        self._steps_taken[optimizer] = self._steps_taken.get(optimizer, 0) + 1
        self._unattached_steps += 1
        if not self._warned_unattached:
            self._warned_unattached = True
            logger.warning("twinstep: %s stepped, but no model was found: no module whose parameters it updates ran "
                           "a forward with autograd on after it was created; twinstep keeps looking for %d steps",
                           type(optimizer).__name__, MAX_STEPS_UNATTACHED)
        if self._unattached_steps >= MAX_STEPS_UNATTACHED:
            self.give_up(f"no model found in {MAX_STEPS_UNATTACHED} optimizer steps (call twinstep.attach(model) "
                          "in the script instead)")

    def give_up(self, why: str) -> None:
        """Warn once and let go of the training: every probe removed, the monitor (if any) closed."""
        if self.given_up:
            return
        self.given_up = True
        logger.warning("twinstep: %s; training continues without twinstep", why)
        self.remove()

    def remove(self) -> None:
        """Remove every probe and close the monitor (idempotent); nothing is looked for after this."""
        self.given_up = True
        self.probe.remove()
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            try:
                monitor.close()
            except Exception as error:
                logger.warning("twinstep: closing the monitor failed: %r", error)
