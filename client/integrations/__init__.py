"""twinstep inside the trainers people already use: callbacks that attach, step and close for them.

    from twinstep.integrations.transformers import TwinstepCallback     # Hugging Face transformers.Trainer
    from twinstep.integrations.paddleformers import TwinstepCallback    # paddleformers.trainer.Trainer

Each callback takes ``twinstep.attach``'s options and hands them on unchanged.
Importing this package imports no trainer library; importing one of its
modules imports that library (its callback class derives from the library's).
``base`` holds what both callbacks share: the monitor's life across a
training, the loss of each optimizer step, and fail-open error handling.
"""

from twinstep.integrations.base import TrainerAttachment, unwrap_model

__all__ = ["TrainerAttachment", "unwrap_model"]
