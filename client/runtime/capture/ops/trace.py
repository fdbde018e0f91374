"""The framework-neutral record of one module call's operations (an ``OpTrace``), built on the training thread.

The framework's interceptor (``torch.py``: a function mode; ``paddle.py``:
API wrappers) calls :meth:`OpTraceBuilder.on_call` after each call the
module's own code makes.  The builder keeps, per call, its canonical name,
the line that made it, which earlier call produced each tensor input (or
which external tensor it is: an argument, a parameter) and its first
output's statistics (on the device: read at :meth:`finish`), plus the
output's values when the zoom asked for tensors, within a byte bound.

Bounded: at most ``max_calls`` calls (the rest are counted), values up to
``max_value_bytes`` each and ``max_total_bytes`` together.  Nothing here
raises into training: a failure stops the capture and is said in the trace.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from twinstep.runtime.capture.base import CaptureBackend
from twinstep.runtime.capture.health import describe_error
from twinstep.runtime.capture.ops.names import canonical
from twinstep.runtime.capture.ops.source import SourceFinder
from twinstep.wire.codec import DTYPE_TO_WIRE
from twinstep.v1 import twinstep_pb2 as pb

#: Calls recorded per capture; an attention block makes a few dozen.
MAX_CALLS = 1024
#: Values of one output sent in full at most (larger ones: statistics only).
MAX_VALUE_BYTES = 4 << 20
#: Values of one capture sent in full at most, so one step's message stays far below the server's limit.
MAX_TOTAL_BYTES = 32 << 20


class OpTraceBuilder:
    """One capture's calls; used on the training thread that runs the module (others pass through)."""

    def __init__(self, backend: CaptureBackend, spec: pb.ZoomSpec, module: str, source: SourceFinder, *,
                 values: bool, max_calls: int = MAX_CALLS, max_value_bytes: int = MAX_VALUE_BYTES,
                 max_total_bytes: int = MAX_TOTAL_BYTES) -> None:
        self.backend = backend
        self.spec = spec
        self.module = module
        self.source = source
        self.values = values
        self.max_calls = max_calls
        self.max_value_bytes = max_value_bytes
        self.max_total_bytes = max_total_bytes
        self.thread = threading.get_ident()
        self.busy = 0
        """Above 0: calls pass through unrecorded (twinstep's own work, a child module's inside)."""
        self.stopped = False
        self.calls: list[pb.OpCall] = []
        self.externals: list[pb.OpTensor] = []
        self.dropped = 0
        self.error = ""
        self._ids: dict[int, int] = {}  # id(tensor) -> input reference (call index, or -1 - external index)
        self._alive: list[Any] = []  # every tensor referenced, so no id is reused during the capture
        self._stats: list[tuple[pb.OpTensor, Any]] = []  # (message, device statistics handle) read at finish
        self._value_bytes = 0

    def passes_through(self) -> bool:
        """This call is not the module's own: recorded by nobody."""
        return self.busy > 0 or self.stopped or threading.get_ident() != self.thread

    def on_call(self, api: str, args: tuple, kwargs: dict, result: Any, op: str | None = None) -> None:
        """A call the module's code made, after it returned; never raises."""
        if self.stopped:
            return
        self.busy += 1
        try:
            outputs = self.backend.output_tensors(result)
            if not outputs:
                return  # .shape, .dim(), a Python number: not a tensor operation
            if len(self.calls) >= self.max_calls:
                self.dropped += 1
                return
            inputs = [self._reference(t) for t in self.backend.output_tensors((args, kwargs))]
            file, line, code = self.source.caller()
            call = pb.OpCall(op=op or canonical(api), api=api, file=file, line=line, code=code, inputs=inputs)
            self._describe(call.output, outputs[0])
            index = len(self.calls)
            self.calls.append(call)
            for tensor in outputs:
                self._ids[id(tensor)] = index
                self._alive.append(tensor)
        except Exception as error:  # a capture must never break the training
            self.stop(f"call {len(self.calls)} ({api}) could not be recorded: {describe_error(error)}")
        finally:
            self.busy -= 1

    def stop(self, error: str = "") -> None:
        if error and not self.error:
            self.error = error
        self.stopped = True

    def _reference(self, tensor: Any) -> int:
        found = self._ids.get(id(tensor))
        if found is not None:
            return found
        external = -1 - len(self.externals)
        self.externals.append(self._describe(pb.OpTensor(), tensor))
        self._ids[id(tensor)] = external
        self._alive.append(tensor)
        return external

    def _describe(self, message: pb.OpTensor, tensor: Any) -> pb.OpTensor:
        """Fill ``message`` (kept: its statistics are written at finish) with what is known of ``tensor`` now."""
        if self.backend.has_shards and type(tensor) not in self.backend.plain_types:
            tensor = self.backend.local_shard(tensor)  # a DTensor: this rank's shard
        dtype, shape = self.backend.describe(tensor)
        message.dtype = DTYPE_TO_WIRE[dtype]
        message.shape.extend(shape)
        self._stats.append((message, self.backend.device_stats(tensor)))
        if self.values and dtype in ("float32", "float16", "bfloat16", "float64"):
            nbytes = 4 * math.prod(shape)
            if nbytes <= self.max_value_bytes and self._value_bytes + nbytes <= self.max_total_bytes:
                message.values = np.ascontiguousarray(self.backend.to_numpy(tensor), dtype="<f4").tobytes()
                self._value_bytes += nbytes
        return message

    def finish(self) -> pb.OpTrace:
        """The trace (statistics read now, once per device); the tensors are let go."""
        self.stopped = True
        self.busy += 1
        try:
            if self._stats:
                rows = self.backend.stats_to_host([handle for _, handle in self._stats])
                for (message, _), row in zip(self._stats, rows):
                    message.stats.extend(float(v) for v in row)
        except Exception as error:
            self.error = self.error or f"statistics could not be read: {describe_error(error)}"
        finally:
            self.busy -= 1
        self._stats, self._alive, self._ids = [], [], {}
        if self.dropped and not self.error:
            self.error = f"{self.dropped} calls past the bound of {self.max_calls} were not recorded"
        return pb.OpTrace(zoom_id=self.spec.id, module=self.module, calls=self.calls, externals=self.externals,
                          calls_dropped=self.dropped, error=self.error)


def child_module_hooks(name: str, builder: OpTraceBuilder) -> tuple[Any, Any]:
    """A (pre-hook, hook) pair for a child module of the captured one: its whole call is one "module"
    operation, and the operations inside it are not recorded (torch and paddle hooks share the signatures)."""
    def enter(child: Any, args: tuple) -> None:
        builder.busy += 1

    def leave(child: Any, args: tuple, output: Any) -> None:
        builder.busy = max(builder.busy - 1, 0)
        if not builder.passes_through():
            builder.on_call(name, args, {}, output, op="module")

    return enter, leave
