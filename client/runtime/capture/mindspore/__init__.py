"""MindSpore capture backend (PyNative mode)."""

from twinstep.runtime.capture.mindspore.backend import GraphModeError, MindSporeBackend, check_pynative

__all__ = ["GraphModeError", "MindSporeBackend", "check_pynative"]
