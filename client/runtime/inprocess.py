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
from twinstep.runtime.capture.base import CaptureBackend, RemovableHandle
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
    """Record every module input of model_a (one dry forward), then make model_b's modules use them."""
    seen: dict[str, list[Any]] = {}
    recorders = []
    for name, module in backend_a.named_modules(model_a):
        def record(mod: Any, args: tuple, name: str = name) -> None:
            tensors = backend_a.output_tensors(args)
            seen.setdefault(name, []).append(backend_a.to_numpy(tensors[0]) if tensors else None)
        recorders.append(backend_a.add_input_hook(module, record))
    model_a(*inputs_a)
    for handle in recorders:
        handle.remove()

    calls: dict[str, int] = {}
    substitutes = []
    for name, module in backend_b.named_modules(model_b):
        if not name or name not in seen:
            continue

        def substitute(mod: Any, args: tuple, name: str = name) -> tuple | None:
            call = calls.get(name, 0)
            calls[name] = call + 1
            recorded = seen[name][call] if call < len(seen[name]) else None
            if recorded is None or not args or not hasattr(args[0], "shape"):
                return None
            if tuple(args[0].shape) != recorded.shape:
                return None  # a layout the caller must map: leave this module's input alone
            return (backend_b.from_numpy(recorded, like=args[0]), *args[1:])

        substitutes.append(backend_b.add_input_hook(module, substitute))
    return substitutes
