"""PaddlePaddle capture backend."""

from twinstep.runtime.capture.paddle.backend import PaddleBackend

__all__ = ["PaddleBackend"]
