"""PyTorch capture backend."""

from twinstep.runtime.capture.torch.backend import TorchBackend

__all__ = ["TorchBackend"]
