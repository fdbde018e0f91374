"""Capturing one module's operations in its first call of one step, when a zoom asks (``ZoomSpec.ops_module``).

Armed by the monitor at the start of that step: the module's ``forward`` is
wrapped (an attribute of the instance, removed again when the call ends, so
the class and every other call stay untouched).  During that one call the
framework's interceptor is active (torch: a ``TorchFunctionMode``; paddle:
wrappers around its public APIs, restored exactly afterwards); each child
module's call is recorded as one operation ("module") and what runs inside
it is not (its hooks and twinstep's own records of it included).  A step with
no such zoom pays nothing: no wrapper, no mode, no hook.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from twinstep.runtime.capture.base import CaptureBackend
from twinstep.runtime.capture.health import describe_error
from twinstep.runtime.capture.ops.trace import OpTraceBuilder
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")
_NONE = object()


class Interceptor(Protocol):
    """What a framework provides (``twinstep.runtime.capture.ops.torch`` / ``.paddle``)."""

    framework_dir: str

    def start(self, builder: OpTraceBuilder) -> None:
        """Begin routing the thread's framework calls to ``builder.on_call``."""

    def stop(self) -> None:
        """Undo :meth:`start` exactly; safe to call twice."""

    def child_hooks(self, module: Any, builder: OpTraceBuilder) -> list[Any]:
        """Hooks on ``module``'s direct children: their calls count as one operation each (removable handles)."""


def interceptor_for(framework: str) -> Interceptor:
    if framework == "torch":
        from twinstep.runtime.capture.ops.torch import TorchInterceptor

        return TorchInterceptor()
    if framework == "paddle":
        from twinstep.runtime.capture.ops.paddle import PaddleInterceptor

        return PaddleInterceptor()
    raise ValueError(f"operations are captured for torch and paddle, not {framework!r}")


class OpsCapture:
    """One module's operations at one step: armed at the step's start, finished at its end."""

    def __init__(self, backend: CaptureBackend, module: Any, name: str, spec: pb.ZoomSpec, step: int) -> None:
        from twinstep.runtime.capture.ops.source import SourceFinder

        self.step = step
        self.spec = spec
        self._module = module
        self._interceptor = interceptor_for(backend.framework)
        self.builder = OpTraceBuilder(backend, spec, name, SourceFinder(self._interceptor.framework_dir),
                                      values=spec.capture in ("tensors", "lossy"))
        self._called = False
        self._armed = False
        self._previous: Any = _NONE  # an instance attribute "forward" already there (another library's wrapper)
        if module is None:
            self.builder.stop(f"this run has no module named {name!r}")

    def arm(self) -> None:
        """Wrap the module's forward for its next call (the first of the step)."""
        module = self._module
        if module is None:
            return
        inner = module.forward
        capture = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            capture._disarm()
            if capture._called:
                return inner(*args, **kwargs)
            capture._called = True
            return capture._run(inner, args, kwargs)

        try:
            self._previous = module.__dict__.get("forward", _NONE)
            module.__dict__["forward"] = forward  # an instance attribute: Layer and Module __setattr__ bypassed
            self._armed = True
        except Exception as error:
            self.builder.stop(f"its forward could not be wrapped ({describe_error(error)})")

    def _disarm(self) -> None:
        if self._armed:
            self._armed = False
            if self._previous is _NONE:
                self._module.__dict__.pop("forward", None)
            else:
                self._module.__dict__["forward"] = self._previous

    def _run(self, inner: Any, args: tuple, kwargs: dict) -> Any:
        builder = self.builder
        hooks: list[Any] = []
        started = False
        try:
            hooks = self._interceptor.child_hooks(self._module, builder)
            self._interceptor.start(builder)
            started = True
        except Exception as error:  # a capture must never break the training: run the call as it is
            builder.stop(f"the operations could not be intercepted ({describe_error(error)})")
        try:
            return inner(*args, **kwargs)
        finally:
            if started:
                self._interceptor.stop()
            for handle in hooks:
                handle.remove()
            builder.stopped = True

    def finish(self) -> bytes:
        """The serialized OpTrace of the step (the module not called: an empty trace saying so)."""
        self._disarm()
        self._interceptor.stop()
        if not self._called and not self.builder.error:
            self.builder.error = f"the module was not called in step {self.step}"
        trace = self.builder.finish()
        # Information (a zoom asked for it), unless the capture is incomplete.
        logger.log(logging.WARNING if trace.error else logging.INFO, "twinstep: captured %d operations of %r at step "
                   "%d%s", len(trace.calls), trace.module, self.step, f" ({trace.error})" if trace.error else "")
        return trace.SerializeToString()
