"""What one journal entry holds, and how a session's inputs become entries and back."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass


class Kind(enum.IntEnum):
    """The input an entry records (values are stored: never renumber)."""

    HELLO = 1      # header: Hello
    MANIFEST = 2   # header: Manifest
    HEALTH = 3     # header: CaptureHealth
    PIECE = 4      # header: TensorPiece without data; payload: its data
    STEP = 5       # header: StepRecords
    CLOSE = 6      # header: Close
    LEAVE = 7      # header: JSON {"silent_for": seconds} (the stream ended)
    HALT = 8       # header: the reason, UTF-8
    GIVE_UP = 9    # header: empty; a lost stream's reconnect grace ran out (its run's steps are released)
    SETUP = 10     # header: Setup (the run's training set-up, docs/preflight.md)


@dataclass(frozen=True)
class Entry:
    seq: int
    kind: Kind
    stream: int
    """Which stream of the session sent it (numbered from 1 in the order streams joined)."""
    header: bytes
    payload: bytes | None = None


def leave_header(silent_for: float) -> bytes:
    return json.dumps({"silent_for": silent_for}).encode()  # exact: the report prints it rounded


def leave_silence(header: bytes) -> float:
    try:
        return float(json.loads(header or b"{}").get("silent_for", -1.0))
    except (ValueError, TypeError, AttributeError):
        return -1.0
