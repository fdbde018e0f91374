"""Frames between the training process and its sender process (``sender="process"``).

One frozen dataclass per kind, so each side dispatches on the type.  On the
socket a frame is a 4-byte length and a pickle (both ends run the same code in
one process tree); a buffer's file descriptor rides with its :class:`Segment`
(``SCM_RIGHTS``).  :class:`Start` carries :data:`VERSION`, which the sender
process checks before anything else.  Anything that unpickles to something
other than a frame of this module is refused with :class:`FrameError`.
"""

from __future__ import annotations

import pickle
import socket
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Raised with any change to a frame's fields.
VERSION = 2

_HEADER = struct.Struct("<I")


class FrameError(Exception):
    """Bytes on the control socket that are not a frame this code knows."""


@dataclass(frozen=True)
class Frame:
    """Base of every frame."""


# -- training process -> sender process ----------------------------------------------------------


@dataclass(frozen=True)
class Start(Frame):
    """The first frame: run a StreamClient with this Hello and StreamConfig (as a dict)."""

    hello: bytes
    config: dict[str, Any]
    version: int = VERSION


@dataclass(frozen=True)
class Segment(Frame):
    """Shared buffer ``number`` of ``nbytes``; its descriptor comes with this frame."""

    number: int
    nbytes: int


@dataclass(frozen=True)
class Forget(Frame):
    """Shared buffer ``number`` is no longer used: unmap it."""

    number: int


@dataclass(frozen=True)
class Manifest(Frame):
    """Serialized ModuleInfo and ParameterInfo messages."""

    modules: tuple[bytes, ...]
    parameters: tuple[bytes, ...]


@dataclass(frozen=True)
class Health(Frame):
    """A serialized CaptureHealth snapshot."""

    health: bytes


@dataclass(frozen=True)
class Setup(Frame):
    """A serialized Setup (the run's training set-up)."""

    setup: bytes


@dataclass(frozen=True)
class Missing(Frame):
    """A step the server will not get; ``dropped``: the training process dropped it (and counts it)."""

    step: int
    reason: str
    detail: str = ""
    dropped: bool = False


@dataclass(frozen=True)
class SharedTensor:
    """A full tensor in shared buffer ``number``: ``shape`` elements of numpy dtype ``np_dtype`` from its start."""

    records: tuple[int, ...]
    dtype: str
    nbytes: int
    number: int
    np_dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class InlineTensor:
    """A full tensor not in shared memory, copied into the frame."""

    records: tuple[int, ...]
    dtype: str
    nbytes: int
    array: np.ndarray = field(compare=False)


@dataclass(frozen=True)
class Batch(Frame):
    """One step: the StepBatch's plain fields, its tensors, and the training's step when it was sent."""

    state: dict[str, Any]
    tensors: tuple[SharedTensor | InlineTensor, ...]
    current_step: int


@dataclass(frozen=True)
class StepAnswer(Frame):
    """The answer to :class:`AskStep` ``token``: the step training is at."""

    token: int
    step: int


@dataclass(frozen=True)
class Close(Frame):
    """After the last batch: flush within ``timeout`` seconds, say Close to the server, answer :class:`Closed`."""

    reason: str
    last_step: int
    timeout: float


# -- sender process -> training process ----------------------------------------------------------


@dataclass(frozen=True)
class Release(Frame):
    """These shared buffers are encoded: the training process may reuse them."""

    numbers: tuple[int, ...]


@dataclass(frozen=True)
class ServerCommand(Frame):
    """A serialized Command from the server."""

    command: bytes


@dataclass(frozen=True)
class AskStep(Frame):
    """A halt is being prepared: which step is training at now?"""

    token: int


@dataclass(frozen=True)
class Log(Frame):
    """A log record of the sender process, for the training process's ``twinstep`` logger."""

    level: int
    text: str


@dataclass(frozen=True)
class SenderState:
    """The sender process's StreamClient, as the training process's SidecarClient shows it."""

    dropped: dict[str, int]
    steps_sent: int
    tensor_bytes: int
    tensor_wire_bytes: int
    reconnects: int
    connected: bool
    rejected: str
    credit: int
    welcomed: bool
    pending: int
    received: int
    """Batch frames the sender process has taken in."""
    reached: bool = False
    """The server has welcomed the sender process's client at least once."""
    failed_before_reached: bool = False
    """A connection attempt failed before that."""


@dataclass(frozen=True)
class State(Frame):
    """Sent whenever the state changed (checked every 20 ms)."""

    state: SenderState


@dataclass(frozen=True)
class Closed(Frame):
    """The answer to :class:`Close`: the final state; the sender process exits next."""

    state: SenderState


KINDS: frozenset[type[Frame]] = frozenset(
    {Start, Segment, Forget, Manifest, Health, Setup, Missing, Batch, StepAnswer, Close,
     Release, ServerCommand, AskStep, Log, State, Closed}
)


def encode(frame: Frame) -> bytes:
    """A frame as its length and pickle."""
    if type(frame) not in KINDS:
        raise FrameError(f"not a twinstep frame: {type(frame).__qualname__}")
    body = pickle.dumps(frame, protocol=5)
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> Frame:
    """The frame in one pickle; FrameError for anything else."""
    try:
        frame = pickle.loads(body)
    except Exception as error:
        raise FrameError(f"unreadable frame ({type(error).__name__}: {error})") from error
    if type(frame) not in KINDS:
        raise FrameError(f"not a twinstep frame: {type(frame).__module__}.{type(frame).__qualname__}")
    return frame


def send(sock: socket.socket, frame: bytes, fd: int | None = None) -> None:
    """Send one whole encoded frame (blocking, without the GIL), with a file descriptor if given."""
    if fd is None:
        sock.sendall(frame)
        return
    sent = socket.send_fds(sock, [frame], [fd])
    if sent < len(frame):
        sock.sendall(frame[sent:])


class FrameReader:
    """Reads frames and the descriptors sent with them, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._data = bytearray()
        self.fds: deque[int] = deque()

    def read(self) -> Frame | None:
        """The next frame; None at end of stream; FrameError for bytes that are not one."""
        while True:
            if len(self._data) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(self._data)
                if len(self._data) >= _HEADER.size + size:
                    body = bytes(self._data[_HEADER.size : _HEADER.size + size])
                    del self._data[: _HEADER.size + size]
                    return decode(body)
            data, fds, _, _ = socket.recv_fds(self._sock, 1 << 20, 64)
            self.fds.extend(fds)
            if not data:
                return None
            self._data += data
