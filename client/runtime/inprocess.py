"""``twinstep.compare``: both models in one process, one forward and backward each.

A replacement for PaDiff's ``auto_diff`` on twinstep's engine: an embedded
server receives both models' records over loopback and judges them exactly
as it judges two live trainings.  With ``isolate=True`` every module of
``model_b`` is fed the input the same module of ``model_a`` saw, so each
module's own error shows apart from what it inherits (forward only: the
substituted inputs cut the backward graph).

A call leaves both models' gradients as it found them, and its embedded
server keeps its own lines below ERROR out of the caller's log.
"""

from __future__ import annotations

import logging
import threading
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from twinstep.runtime.api import attach
from twinstep.runtime.capture import backend_for
from twinstep.runtime.capture.base import CallInputs, CaptureBackend, RemovableHandle
from twinstep.server.report.render import render_text, report_to_dict
from twinstep.v1 import twinstep_pb2 as pb


@dataclass
class CompareResult:
    report: dict[str, Any]
    """The JSON form (as ``twinstep report --json``)."""
    proto: pb.Report

    @property
    def aligned(self) -> bool:
        return self.report["first_divergence"] is None

    @property
    def first_divergence(self) -> dict[str, Any] | None:
        return self.report["first_divergence"]

    def __str__(self) -> str:
        return render_text(self.proto)


def compare(
    model_a: Any,
    model_b: Any,
    inputs_a: Sequence[Any],
    inputs_b: Sequence[Any],
    *,
    loss_a: Callable[[Any], Any] | None = None,
    loss_b: Callable[[Any], Any] | None = None,
    isolate: bool = False,
    config: Any = None,
    capture: str = "stats",
) -> CompareResult:
    """Run ``model_a(*inputs_a)`` (the baseline) and ``model_b(*inputs_b)``, forward and backward; return the report.

    ``loss_a``/``loss_b`` turn a model's output into a scalar loss (default:
    the sum of the means of its floating outputs).  ``config`` is a
    ``twinstep.server.ServerConfig`` (tolerances, name mapping).

    Gradients: the call sets aside the gradients both models hold (from
    the caller's own backward or an earlier call), runs from none, and puts
    them back when it returns: the report holds this call's gradients only,
    a second call on the same models gives the same verdict, and the models'
    ``.grad`` are what they were before.  With ``isolate=True`` no
    backward runs, so no parameter gradient is compared.

    Logging: the embedded server's own lines below ERROR (listening, runs
    joining and ending, alerts the report repeats) stay out of the caller's
    log; its errors, and the lines of the two attached runs (the divergence
    they are told of, what they could not capture), still reach it.
    """
    from twinstep.server import ServerConfig, serve  # single-process mode embeds the server

    session = f"compare-{uuid.uuid4().hex[:8]}"
    backend_a, backend_b = backend_for(model_a), backend_for(model_b)
    with ExitStack() as scope:
        scope.enter_context(_quiet_server_lines(session))
        scope.enter_context(_gradients_set_aside(model_a, backend_a))
        scope.enter_context(_gradients_set_aside(model_b, backend_b))
        handle = serve(port=0, config=config or ServerConfig())
        try:
            return _run_both(handle, session, model_a, model_b, backend_a, backend_b, inputs_a, inputs_b,
                             loss_a, loss_b, isolate, capture)
        finally:
            handle.stop(grace=0.5)


def _run_both(handle: Any, session: str, model_a: Any, model_b: Any, backend_a: CaptureBackend,
              backend_b: CaptureBackend, inputs_a: Sequence[Any], inputs_b: Sequence[Any],
              loss_a: Callable[[Any], Any] | None, loss_b: Callable[[Any], Any] | None, isolate: bool,
              capture: str) -> CompareResult:
    substitutes: list[RemovableHandle] = []
    try:
        if isolate:
            substitutes = _feed_inputs_of(model_a, backend_a, model_b, backend_b, inputs_a)
        for model, backend, inputs, loss_fn, name, baseline in (
            (model_a, backend_a, inputs_a, loss_a, "a", True),
            (model_b, backend_b, inputs_b, loss_b, "b", False),
        ):
            # The embedded server is plaintext and open on loopback: the user's TWINSTEP_TOKEN/TLS settings are not for it,
            # nor their jobs' TWINSTEP_* pacing and numbering (lockstep would wait for a run that starts after this one).
            mon = attach(model, session=session, run=name, baseline=baseline, server=handle.address, capture=capture,
                         backward=not isolate, token="", tls_ca="", tls_client_cert="", tls_client_key="",
                         lockstep=0, every=1, start_step=0, rank=0, world_size=1)
            output = model(*inputs)
            loss = loss_fn(output) if loss_fn else _default_loss(backend, output)
            if not isolate:
                loss.backward()
            mon.step(loss=loss)
            mon.close()
    finally:
        for substitute in substitutes:
            substitute.remove()
    proto = handle.report_proto(session)
    return CompareResult(report=report_to_dict(proto), proto=proto)


@contextmanager
def _gradients_set_aside(model: Any, backend: CaptureBackend) -> Iterator[None]:
    """The model's parameters start the block with no gradient and end it with the ones they had.

    torch: the gradient tensors themselves are kept and put back.  paddle frees a
    gradient's buffer when it is cleared, so a copy is kept.  MindSpore parameters
    hold no gradient between steps: nothing to do.
    """
    if backend.framework == "torch":
        kept = [(p, p.grad) for p in model.parameters()]
        for p, _ in kept:
            p.grad = None
        try:
            yield
        finally:
            for p, grad in kept:
                p.grad = grad
    elif backend.framework == "paddle":
        import paddle

        with paddle.no_grad():
            kept = [(p, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
        for p, _ in kept:
            p.clear_gradient(False)
        try:
            yield
        finally:
            for p, grad in kept:
                p.clear_gradient(False)
                if grad is not None:
                    p.grad = grad
    else:
        yield


_SERVER_LOG = logging.getLogger("twinstep.server")  # every module of the server logs under this one name


class _EmbeddedServerLines(logging.Filter):
    """Drops the lines below ERROR of one compare call's embedded server.

    Its lines are the ones logged on the calling thread while the call runs
    (starting and stopping the server) and the ones that name its session;
    another server in the same process logs neither, so it is not muted.
    """

    def __init__(self, session: str) -> None:
        super().__init__()
        self.session = session
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        if record.thread == self.thread:
            return False
        try:
            return self.session not in record.getMessage()
        except Exception:  # a malformed record is the handler's to report
            return True


@contextmanager
def _quiet_server_lines(session: str) -> Iterator[None]:
    quiet = _EmbeddedServerLines(session)
    _SERVER_LOG.addFilter(quiet)
    try:
        yield
    finally:
        _SERVER_LOG.removeFilter(quiet)


def _default_loss(backend: CaptureBackend, output: Any) -> Any:
    tensors = [t for t in backend.output_tensors(output) if backend.describe(t)[0].startswith(("float", "bfloat"))]
    if not tensors:
        raise ValueError("the model output has no floating tensor; pass loss_a= and loss_b=")
    total = tensors[0].mean()
    for t in tensors[1:]:
        total = total + t.mean()
    return total


def _feed_inputs_of(model_a: Any, backend_a: CaptureBackend, model_b: Any, backend_b: CaptureBackend,
                    inputs_a: Sequence[Any]) -> list[RemovableHandle]:
    """Record every module input of model_a (one dry forward), then make model_b's modules use them.

    A module's input is its first tensor argument by the rule the capture records
    (twinstep.wire.inputs): positional first, else by keyword in its forward signature's order,
    so a module one model calls by keyword is fed what the same module of the other saw.
    """
    seen: dict[str, list[Any]] = {}
    recorders = []
    for name, module in backend_a.named_modules(model_a):
        def record(mod: Any, args: tuple, kwargs: dict[str, Any], name: str = name,
                   reader: CallInputs = backend_a.call_reader()) -> None:
            where = reader.first(mod, args, kwargs)
            value = None if where is None else args[where] if isinstance(where, int) else kwargs[where]
            seen.setdefault(name, []).append(None if value is None else backend_a.to_numpy(value))
        recorders.append(backend_a.add_input_hook(module, record))
    model_a(*inputs_a)
    for handle in recorders:
        handle.remove()

    calls: dict[str, int] = {}
    substitutes = []
    for name, module in backend_b.named_modules(model_b):
        if not name or name not in seen:
            continue

        def substitute(mod: Any, args: tuple, kwargs: dict[str, Any], name: str = name,
                       reader: CallInputs = backend_b.call_reader()) -> tuple[tuple, dict[str, Any]] | None:
            call = calls.get(name, 0)
            calls[name] = call + 1
            recorded = seen[name][call] if call < len(seen[name]) else None
            where = reader.first(mod, args, kwargs)
            if recorded is None or where is None:
                return None
            value = args[where] if isinstance(where, int) else kwargs[where]
            if tuple(value.shape) != recorded.shape:
                return None  # a layout the caller must map: leave this module's input alone
            fed = backend_b.from_numpy(recorded, like=value)
            if isinstance(where, int):
                return (*args[:where], fed, *args[where + 1:]), kwargs
            return args, {**kwargs, where: fed}

        substitutes.append(backend_b.add_input_hook(module, substitute))
    return substitutes
