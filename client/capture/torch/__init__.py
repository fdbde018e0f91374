"""PyTorch capture backend."""

from twinstep.capture.torch.backend import TorchBackend

__all__ = ["TorchBackend"]
