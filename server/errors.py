"""Errors that end one stream with a status code and leave the server serving."""

from __future__ import annotations

import grpc


class InputError(Exception):
    """Bad input from a client: reported as ``code`` with a message saying what and where."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> InputError:
    return InputError(grpc.StatusCode.INVALID_ARGUMENT, message)
