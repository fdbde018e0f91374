"""paddleformers' ``Trainer``: a callback that attaches twinstep to the trainer's model.

    from twinstep.integrations.paddleformers import TwinstepCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[
        TwinstepCallback(session="llama-port", run="paddle", server="127.0.0.1:50051")])

paddleformers 1.2's loop (``Trainer._inner_training_loop``) scales the
accumulated gradients by 1/N, calls ``on_optimizer_begin``, then
``optimizer_step``, which runs ``optimizer.step()``, ``lr_scheduler.step()``
and ``optimizer.clear_grad()`` in one go, then ``on_optimizer_end``.  No
callback sees the updated parameters while the gradients are still there, so:

- ``on_optimizer_begin`` wraps this optimizer's ``clear_grad`` once: its next
  call first records the step (``Monitor.step``: gradients and updated
  parameters), then clears, and the wrapper removes itself;
- ``on_optimizer_end`` records the step itself if ``clear_grad`` was not called
  (``freeze_training``; the gradients are then not captured), and stops the
  training after a halt from the server (``control.should_training_stop``).

The step's loss is the mean of the micro-batches' model ``loss`` (the trainer
divides each by N): a forward post-hook on the model keeps them.
"""

from __future__ import annotations

from typing import Any

from paddleformers.trainer import TrainerCallback

from twinstep.integrations.base import AttachmentViews, TrainerAttachment

__all__ = ["TwinstepCallback"]


class TwinstepCallback(AttachmentViews, TrainerCallback):
    """Attach twinstep for the length of ``Trainer.train()``; takes ``twinstep.attach``'s options.

    ``close_timeout``: seconds ``on_train_end`` waits to flush what is queued.
    An option attach does not take is a TypeError here; bad values, or a server
    that cannot be reached, are logged and the training goes on without capture.
    """

    def __init__(self, *, close_timeout: float = 10.0, **attach_options: Any) -> None:
        self.attachment = TrainerAttachment("paddleformers", attach_options, close_timeout)
        self._armed: tuple[Any, bool, Any] | None = None  # (optimizer, had its own clear_grad, that attribute)
        self._stepped = False
        self._halt_pending = False
        self._accumulation = 1

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        self._accumulation = max(int(getattr(args, "gradient_accumulation_steps", 1) or 1), 1)
        self._halt_pending = False
        self.attachment.begin(model, int(getattr(state, "global_step", 0) or 0), self._install_loss_hook,
                              kwargs.get("optimizer"), kwargs.get("lr_scheduler"))
        return control

    def on_optimizer_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> Any:
        self._stepped = False
        if self.attachment.monitor is None:
            return control
        try:
            self._arm(optimizer)
        except Exception as error:
            self.attachment.warn_once("clear-grad", f"cannot wrap the optimizer's clear_grad ({type(error).__name__}: "
                                  f"{error}); steps are recorded after it, without gradients")
        return control

    def on_optimizer_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._disarm()
        if not self._stepped and self.attachment.monitor is not None:
            self._record_step()
        if self._halt_pending:
            control.should_training_stop = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._disarm()
        self.attachment.end()
        return control

    # -- internals -------------------------------------------------------------------

    def _record_step(self) -> None:
        self._stepped = True
        if self.attachment.end_step():
            self._halt_pending = True

    def _arm(self, optimizer: Any) -> None:
        """Make ``optimizer.clear_grad``'s next call record the step first (then it is the optimizer's own again)."""
        self._disarm()
        original = getattr(optimizer, "clear_grad", None)
        if original is None:
            raise AttributeError(f"{type(optimizer).__name__} has no clear_grad")
        own = "clear_grad" in vars(optimizer)
        callback = self

        def clear_grad(*args: Any, **kwargs: Any) -> Any:
            callback._disarm()
            callback._record_step()  # never raises (TrainerAttachment.end_step)
            return original(*args, **kwargs)

        self._armed = (optimizer, own, original)
        optimizer.clear_grad = clear_grad

    def _disarm(self) -> None:
        armed, self._armed = self._armed, None
        if armed is None:
            return
        optimizer, own, original = armed
        try:
            if own:
                optimizer.clear_grad = original
            else:
                del optimizer.clear_grad
        except Exception as error:
            self.attachment.warn_once("clear-grad-restore", f"could not restore the optimizer's clear_grad "
                                  f"({type(error).__name__}: {error})")

    def _install_loss_hook(self, model: Any) -> Any:
        attachment = self.attachment
        weight = 1.0 / self._accumulation  # the trainer scales the accumulated gradients by 1/N, whatever N was

        def keep_loss(layer: Any, inputs: Any, output: Any) -> None:
            attachment.add_loss(output, weight, layer.training)

        return model.register_forward_post_hook(keep_loss).remove
