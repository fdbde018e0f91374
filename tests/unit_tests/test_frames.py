"""The frames between the training process and its sender process: typed, versioned, nothing else accepted."""

from __future__ import annotations

import dataclasses
import pickle
import socket
import threading

import numpy as np
import pytest

from twinstep.runtime.transport import frames

pytestmark = pytest.mark.skipif(not hasattr(socket, "send_fds"), reason="descriptor passing is Unix's")

_STATE = frames.SenderState(dropped={"queue_full": 2}, steps_sent=3, tensor_bytes=10, tensor_wire_bytes=8,
                            reconnects=1, connected=True, rejected="", credit=5, welcomed=True, pending=1, received=4)
EXAMPLES = [
    frames.Start(b"hello", {"target": "127.0.0.1:1", "max_queue_steps": 4}),
    frames.Segment(3, 4096),
    frames.Forget(3),
    frames.Manifest((b"m1", b"m2"), (b"p1",)),
    frames.Health(b"health"),
    frames.Setup(b"setup"),
    frames.Missing(7, "capture_failed", "ValueError: x"),
    frames.Batch({"step": 7, "dims": [2, 3], "phase": np.arange(3, dtype=np.int32)},
                 (frames.SharedTensor((0, 2), "float32", 24, 3, "<f4", (2, 3)),
                  frames.InlineTensor((1,), "int64", 16, np.arange(2))), 8),
    frames.StepAnswer(1, 9),
    frames.Close("finished", 9, 10.0),
    frames.Release((1, 2)),
    frames.ServerCommand(b"command"),
    frames.AskStep(1),
    frames.Log(30, "text"),
    frames.State(_STATE),
    frames.Closed(_STATE),
]


def test_the_examples_cover_every_kind():
    assert {type(f) for f in EXAMPLES} == frames.KINDS


@pytest.mark.parametrize("frame", EXAMPLES, ids=lambda f: type(f).__name__)
def test_a_frame_of_each_kind_round_trips_through_a_socket(frame):
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        frames.send(left, frames.encode(frame))
        back = frames.FrameReader(right).read()
    assert type(back) is type(frame)
    for f in dataclasses.fields(frame):
        mine, theirs = getattr(frame, f.name), getattr(back, f.name)
        if f.name == "state" and isinstance(mine, dict):
            assert mine.keys() == theirs.keys() and np.array_equal(mine["phase"], theirs["phase"])
        elif f.name == "tensors":
            assert mine[0] == theirs[0] and np.array_equal(mine[1].array, theirs[1].array)
        else:
            assert theirs == mine
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.__setattr__(dataclasses.fields(back)[0].name, None)


def test_a_segment_s_descriptor_rides_with_it():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = socket.socketpair()
    with left, right, r, w:
        frames.send(left, frames.encode(frames.Segment(1, 8)), fd=w.fileno())
        reader = frames.FrameReader(right)
        assert reader.read() == frames.Segment(1, 8)
        with socket.socket(fileno=reader.fds.popleft()) as received:
            received.sendall(b"x")
            assert r.recv(1) == b"x"


def test_anything_but_a_frame_is_refused_with_a_clear_error():
    with pytest.raises(frames.FrameError, match="not a twinstep frame: tuple"):
        frames.encode(("batch", {}, [], 1))
    with pytest.raises(frames.FrameError, match=r"not a twinstep frame: builtins\.tuple"):
        frames.decode(pickle.dumps(("batch", {}, [], 1)))
    with pytest.raises(frames.FrameError, match="unreadable frame"):
        frames.decode(b"not a pickle")


def test_the_sender_process_refuses_another_frame_version_and_frames_before_start():
    from twinstep.runtime.transport.sidecar_main import SenderProcess

    for first, words in ((dataclasses.replace(EXAMPLES[0], version=frames.VERSION + 1), "frame version"),
                         (frames.Health(b""), "Health frame before Start"),
                         (frames.Release((1,)), "only the sender process sends")):
        left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with left, right:
            errors: list[BaseException] = []
            process = SenderProcess(right)

            def run() -> None:
                try:
                    process.run()
                except frames.FrameError as error:
                    errors.append(error)

            worker = threading.Thread(target=run)
            worker.start()
            frames.send(left, frames.encode(first))
            worker.join(10)
            assert not worker.is_alive() and len(errors) == 1 and words in str(errors[0]), errors
