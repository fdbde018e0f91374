"""Capture: hooks inside the training process that turn tensors into records.

Framework backends live in ``capture/torch``, ``capture/paddle`` and
``capture/mindspore``; each is imported only when a model of its framework is
attached, so a torch job never imports paddle or MindSpore and vice versa.
"""

from __future__ import annotations

import sys
from typing import Any

from twinstep.runtime.capture.base import CaptureBackend
from twinstep.runtime.capture.recorder import CaptureConfig, Recorder, StepBatch

__all__ = ["CaptureBackend", "CaptureConfig", "Recorder", "StepBatch", "backend_for", "FRAMEWORKS"]

#: Frameworks with a capture backend.
FRAMEWORKS = frozenset({"torch", "paddle", "mindspore"})


def backend_for(model: Any) -> CaptureBackend:
    """The backend for a model, decided by its class without importing other frameworks."""
    if "torch" in sys.modules:
        import torch

        if isinstance(model, torch.nn.Module):
            from twinstep.runtime.capture.torch import TorchBackend

            return TorchBackend()
    if "paddle" in sys.modules:
        import paddle

        if isinstance(model, paddle.nn.Layer):
            from twinstep.runtime.capture.paddle import PaddleBackend

            return PaddleBackend()
    if "mindspore" in sys.modules:
        import mindspore

        if isinstance(model, mindspore.nn.Cell):
            from twinstep.runtime.capture.mindspore import MindSporeBackend

            return MindSporeBackend()
    raise TypeError(
        f"twinstep cannot attach to {type(model).__module__}.{type(model).__name__}: "
        f"expected a torch.nn.Module, a paddle.nn.Layer or a mindspore.nn.Cell (supported: {sorted(FRAMEWORKS)})"
    )
