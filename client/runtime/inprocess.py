"""``twinstep.compare``: both models in one process, one forward and backward each.

A replacement for PaDiff's ``auto_diff`` on twinstep's engine: an embedded
server receives both models' records over loopback and judges them exactly
as it judges two live trainings.  With ``isolate=True`` every module of
``model_b`` is fed the input the same module of ``model_a`` saw, so each
module's own error shows apart from what it inherits (forward only: the
substituted inputs cut the backward graph).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

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
    """
    from twinstep.server import ServerConfig, serve  # single-process mode embeds the server

    handle = serve(port=0, config=config or ServerConfig())
    session = f"compare-{uuid.uuid4().hex[:8]}"
    try:
        backend_a, backend_b = backend_for(model_a), backend_for(model_b)
        substitutes: list[RemovableHandle] = []
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
        for substitute in substitutes:
            substitute.remove()
        proto = handle.report_proto(session)
        return CompareResult(report=report_to_dict(proto), proto=proto)
    finally:
        handle.stop(grace=0.5)


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
