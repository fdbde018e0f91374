"""Hugging Face ``transformers.Trainer``: a callback that attaches twinstep to the trainer's model.

    from twinstep.integrations.transformers import TwinstepCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[
        TwinstepCallback(session="llama-port", run="torch", baseline=True, server="127.0.0.1:50051")])

Where it acts in the Trainer's loop (transformers 5.x, ``_inner_training_loop``):

- ``on_train_begin``: attach to ``model`` (unwrapped), numbered from ``state.global_step``;
- a forward hook on the model keeps each micro-batch's ``loss``, weighted as the
  Trainer weights it before ``backward``: 1 when it passed ``num_items_in_batch``
  to the model (the model then divides by the step's token count), else 1/N over
  the N micro-batches of the step (the Trainer divides by them);
- ``on_optimizer_step``: ``Monitor.step`` right after ``optimizer.step()``, before
  the scheduler and ``model.zero_grad()`` (``on_step_end`` would come after the
  gradients are cleared);
- ``on_train_end``: close, bounded by ``close_timeout``.

A halt from the server sets ``control.should_training_stop``: the Trainer ends
after that step, as it does at ``max_steps``; ``callback.halted`` holds the halt.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from twinstep.integrations.base import AttachmentViews, TrainerAttachment

__all__ = ["TwinstepCallback"]


class TwinstepCallback(AttachmentViews, TrainerCallback):
    """Attach twinstep for the length of ``Trainer.train()``; takes ``twinstep.attach``'s options.

    ``close_timeout``: seconds ``on_train_end`` waits to flush what is queued.
    An option attach does not take is a TypeError here; bad values, or a server
    that cannot be reached, are logged and the training goes on without capture.
    """

    def __init__(self, *, close_timeout: float = 10.0, **attach_options: Any) -> None:
        self.attachment = TrainerAttachment("transformers", attach_options, close_timeout)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        self.attachment.begin(model, int(getattr(state, "global_step", 0) or 0), self._install_loss_hook,
                              kwargs.get("optimizer"), kwargs.get("lr_scheduler"))
        return control

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.attachment.end_step():
            control.should_training_stop = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.attachment.end()
        return control

    def _install_loss_hook(self, model: Any) -> Any:
        attachment = self.attachment

        def keep_loss(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            # The Trainer passes num_items_in_batch to a model that takes loss kwargs, and then does not
            # divide the loss by the accumulation steps itself (Trainer.training_step).
            normalized = kwargs.get("num_items_in_batch") is not None
            attachment.add_loss(output, 1.0 if normalized else None, module.training)

        return model.register_forward_hook(keep_loss, with_kwargs=True).remove
