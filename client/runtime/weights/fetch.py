"""A candidate's side of weight sync: get the baseline's initial parameters and load them, all or none.

Runs on the training thread inside ``attach(..., init_from_baseline=True)``,
before any hook is installed and before the first step, and waits at most
``init_timeout`` seconds (for the server, the baseline's upload, and the
transfer together).  The server plans the conversion (names through the
session's mapping, fused and split modules, layouts) and refuses the whole
plan if any shape cannot be reconciled; this side checks every piece against
the plan and its own parameters, and loads only once everything has arrived.

Strict by design: on any failure ``attach`` raises WeightSyncError and the
model is left as it was.  A candidate that asked for the baseline's weights
and trained from its own would differ from step 0 in every module, so its
comparison would say nothing; better that it does not start.
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any

import grpc
import numpy as np

from twinstep.runtime.capture.base import CaptureBackend
from twinstep.wire.codec import DTYPE_TO_WIRE, WIRE_TO_DTYPE
from twinstep.errors import WeightSyncError
from twinstep.runtime.transport.security import ClientSecurity, explain
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc
from twinstep.wire.weight_pieces import Assembler, Expected, PieceError

logger = logging.getLogger("twinstep")

#: Entries the Hello (and so the report) lists per list of a WeightSync; the rest are counted.
MAX_LISTED = 10_000
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


def load_from_baseline(model: Any, backend: CaptureBackend, *, session: str, run: str, target: str,
                       security: ClientSecurity, timeout: float, compress: bool = False) -> pb.WeightSync:
    """Load the baseline's initial parameters into ``model``; what was loaded, for the Hello and the report.

    Raises WeightSyncError, with the model untouched, when they cannot all be loaded.
    """
    started = time.monotonic()
    params = list(backend.named_parameters(model))
    request = pb.WeightsRequest(session=session, run=run, framework=backend.framework, compress=compress)
    for pid, (name, param, owner, owner_type) in enumerate(params):
        dtype, shape = backend.describe(param)
        request.parameters.add(id=pid, name=name, module=owner, module_type=owner_type, shape=shape,
                               dtype=DTYPE_TO_WIRE[dtype])
    for mid, (name, module) in enumerate(backend.named_modules(model)):
        request.modules.add(id=mid, name=name, type=type(module).__name__)
    plan, arrays = _download(request, target, security, timeout)
    values = []
    for loaded in plan.loaded:
        param = params[loaded.parameter][1]
        info = request.parameters[loaded.parameter]
        values.append((param, arrays[loaded.parameter].reshape(tuple(info.shape)), WIRE_TO_DTYPE[loaded.dtype]))
    loader = importlib.import_module(f"twinstep.runtime.weights.{backend.framework}")
    try:
        loader.load(values)
    except Exception as error:
        raise WeightSyncError(f"twinstep: init_from_baseline could not load the baseline's weights into run {run!r}: "
                              f"{type(error).__name__}: {error}; nothing was loaded") from error
    plan.seconds = time.monotonic() - started
    _log(plan, run)
    return _bounded(plan)


def _download(request: pb.WeightsRequest, target: str, security: ClientSecurity,
              timeout: float) -> tuple[pb.WeightSync, dict[int, np.ndarray]]:
    """The plan and every planned parameter's flat storage array, each piece checked as it arrives."""
    try:
        with security.channel(target, options=_CHANNEL_OPTIONS) as channel:
            replies = pb_grpc.TwinstepStub(channel).FetchWeights(
                request, timeout=timeout, metadata=security.metadata(), wait_for_ready=True)
            first = next(replies, None)
            if first is None or first.WhichOneof("body") != "plan":
                raise WeightSyncError(_failed(request, "the server sent no plan; is it a twinstep server of "
                                               "this version?"))
            plan = first.plan
            expected = _expected(plan, request)
            assembler = Assembler(expected)
            for reply in replies:
                if reply.WhichOneof("body") != "piece":
                    raise PieceError("a second plan arrived among the pieces")
                assembler.add(reply.piece)
            arrays = assembler.finish()
    except grpc.RpcError as error:
        raise WeightSyncError(_failed(request, _explain(error, request, target, timeout, security))) from None
    except PieceError as error:
        raise WeightSyncError(_failed(request, f"the server's pieces do not make up the plan: {error}")) from None
    return plan, arrays


def _expected(plan: pb.WeightSync, request: pb.WeightsRequest) -> dict[int, Expected]:
    """What each planned parameter's pieces must hold; a plan naming parameters this run lacks is refused."""
    expected: dict[int, Expected] = {}
    for loaded in plan.loaded:
        if loaded.parameter >= len(request.parameters) or loaded.parameter in expected:
            raise WeightSyncError(_failed(request, f"the plan names parameter {loaded.parameter} "
                                                   f"({loaded.name!r}) twice or beyond this run's"))
        info = request.parameters[loaded.parameter]
        if loaded.name != info.name or loaded.dtype not in WIRE_TO_DTYPE:
            raise WeightSyncError(_failed(request, f"the plan's parameter {loaded.parameter} is {loaded.name!r}, "
                                                   f"this run's is {info.name!r}"))
        numel = int(np.prod(info.shape, dtype=np.int64))
        expected[loaded.parameter] = Expected(info.name, WIRE_TO_DTYPE[loaded.dtype], numel)
    return expected


def _failed(request: pb.WeightsRequest, why: str) -> str:
    return (f"twinstep: init_from_baseline failed for run {request.run!r} of session {request.session!r}: {why}; "
            "nothing was loaded")


def _explain(error: grpc.RpcError, request: pb.WeightsRequest, target: str, timeout: float,
             security: ClientSecurity) -> str:
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else "") or str(error)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return (f"no weights from the baseline within {timeout:g} s (init_timeout): attach the baseline with "
                f"share_weights=True (TWINSTEP_SHARE_WEIGHTS=1) and check that it runs and reaches the server "
                f"at {target}, or raise init_timeout")
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"{details}{explain(details, security.uses_tls(target))}"
    return f"{code.name if code is not None else 'error'}: {details}"


def _log(plan: pb.WeightSync, run: str) -> None:
    transposed = sum(1 for w in plan.loaded if any(w.transposed))
    fused = sum(1 for w in plan.loaded if len(w.sources) > 1)
    split = sum(1 for w in plan.loaded if w.part >= 0)
    cast = sum(1 for w in plan.loaded if w.dtype != w.candidate_dtype)
    logger.info("twinstep: run %r loaded %d parameters (%.1f MiB) from baseline run %r (%s) in %.2f s: "
                "%d transposed, %d fused from parts, %d split from a fused parameter, %d cast; "
                "%d without a counterpart kept their own values, %d baseline parameters unused",
                run, len(plan.loaded), plan.bytes / 2**20, plan.baseline_run, plan.baseline_framework, plan.seconds,
                transposed, fused, split, cast, len(plan.no_counterpart), len(plan.unused))
    for w in plan.loaded:
        logger.debug("twinstep: %s <- %s", w.name, ", ".join(w.sources))
    if plan.no_counterpart:
        shown = ", ".join(plan.no_counterpart[:10]) + (" ..." if len(plan.no_counterpart) > 10 else "")
        logger.warning("twinstep: run %r: %d parameters have no counterpart in the baseline and keep their own "
                       "initial values: %s (add a mapping rule if they should)", run, len(plan.no_counterpart), shown)


def _bounded(plan: pb.WeightSync) -> pb.WeightSync:
    """The plan as the Hello carries it: at most MAX_LISTED entries per list, the rest counted."""
    for entries in (plan.loaded, plan.no_counterpart, plan.unused):
        extra = len(entries) - MAX_LISTED
        if extra > 0:
            plan.unlisted += extra
            del entries[MAX_LISTED:]
    return plan
