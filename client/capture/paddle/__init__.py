"""PaddlePaddle capture backend."""

from twinstep.capture.paddle.backend import PaddleBackend

__all__ = ["PaddleBackend"]
