"""The weight-sync RPCs: PublishWeights (a baseline's upload) and FetchWeights (a candidate's download).

Authorized as a Stream is (a session token may publish and fetch its own
session's weights).  An upload is checked piece by piece and held only once
complete; a fetch waits (within the candidate's deadline) for the session's
publication, plans the conversion under the server's mapping and layout rules,
refuses the whole plan if any shape cannot be reconciled, and otherwise sends
the plan and then each parameter, converted, in pieces.  The server converts
because it holds the mapping, the fused rules and the layout rules already;
the candidate only copies what it receives into its parameters.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Iterator

import grpc

from twinstep.wire.codec import WIRE_TO_DTYPE, storage_dtype
from twinstep.server.errors import InputError, invalid
from twinstep.server.registry import SessionRegistry
from twinstep.server.security import Authorizer, Denied
from twinstep.server.weights.convert import Param, build_plan
from twinstep.server.weights.store import Publication, WeightStore
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.wire.weight_pieces import MAX_NAME, MAX_PARAMETERS, Assembler, Expected, PieceError, pieces

logger = logging.getLogger("twinstep.server")

#: How often a waiting fetch looks at its session (a baseline that declines, a candidate that left).
_POLL = 0.5
#: Longest a fetch without a deadline waits for the baseline's weights.
_MAX_WAIT = 3600.0


class WeightExchange:
    """The publications of one server and the two RPCs that fill and read them."""

    def __init__(self, registry: SessionRegistry, auth: Authorizer) -> None:
        self.registry = registry
        self.auth = auth
        self.store = WeightStore(registry.config.sync.weights_budget_bytes)

    # -- the baseline's upload ---------------------------------------------------------------

    def publish(self, requests: Iterator[pb.WeightsUpload], context: grpc.ServicerContext) -> pb.WeightsPublished:
        caller = self.auth.authorize(context, "stream", check=False)
        first = next(requests, None)
        if first is None or first.WhichOneof("body") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PublishWeights: the first message must be the header")
        header = first.header
        try:
            self.auth.check(caller, "stream", header.session)
        except Denied as denied:
            self.auth.note(context.peer(), "stream", denied)
            context.abort(denied.code, denied.message)
        try:
            params = _parameters(header.parameters, "the baseline's upload")
            if not header.run:
                raise invalid("PublishWeights needs the baseline's run name")
            session = self.registry.get_or_create(header.session)
        except InputError as error:
            context.abort(error.code, error.message)
        roles = session.run_roles()
        baseline = next((name for name, role in roles.items() if role == "baseline"), None)
        refused = roles.get(header.run, "baseline") != "baseline" or baseline not in (None, header.run)
        if refused:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"run {header.run!r} is not the baseline of session "
                          f"{header.session!r}: only the baseline shares its weights")
        nbytes = sum(_nbytes(p) for p in params)
        why_not = self.store.reserve(header.session, nbytes)
        if why_not:
            self.store.fail(header.session, 0, f"the server refused the baseline's weights: {why_not}")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"session {header.session!r}: {why_not}")
        started = time.monotonic()
        assembler = Assembler({p.id: Expected(p.name, p.dtype, _numel(p)) for p in params})
        try:
            for message in requests:
                if message.WhichOneof("body") != "piece":
                    raise PieceError("after the header only pieces may follow")
                assembler.add(message.piece)
            arrays = assembler.finish()
        except PieceError as error:
            self.store.fail(header.session, nbytes, f"the baseline's upload was malformed: {error}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"PublishWeights of session {header.session!r}: {error}")
        except grpc.RpcError:  # the baseline left mid-upload
            self.store.fail(header.session, nbytes, "the baseline's upload broke off before it was complete")
            raise
        except BaseException:
            self.store.fail(header.session, nbytes, "the server failed while taking the baseline's upload")
            raise
        self.store.publish(Publication(header.session, header.run, header.framework, params, arrays, nbytes,
                                       weakref.ref(session)), nbytes)
        logger.info("session %s: baseline run %r shared %d parameters (%.1f MiB) in %.2f s", header.session,
                    header.run, len(params), nbytes / 2**20, time.monotonic() - started)
        return pb.WeightsPublished(parameters=len(params), bytes=nbytes)

    # -- a candidate's download --------------------------------------------------------------

    def fetch(self, request: pb.WeightsRequest, context: grpc.ServicerContext) -> Iterator[pb.WeightsDownload]:
        self.auth.authorize(context, "stream", request.session)
        try:
            if not request.session or not request.run:
                raise invalid("FetchWeights needs the session and the candidate's run name")
            params = _parameters(request.parameters, "the candidate's request")
        except InputError as error:
            context.abort(error.code, error.message)
        publication = self._wait(request, context)
        if publication is None:
            return
        mapping = self.registry.config.mapping
        if mapping.layer_mapping:
            mapping = mapping.bind({m.name: m.type for m in request.modules})
        plan = build_plan(publication.framework, publication.parameters, request.framework, params, mapping)
        if plan.problems:
            logger.warning("session %s: run %r cannot take the baseline's weights: %s", request.session, request.run,
                           plan.describe_problems())
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the baseline's weights cannot be loaded into run {request.run!r}, so none were sent: "
                          f"{plan.describe_problems()}")
        started = time.monotonic()
        yield pb.WeightsDownload(plan=plan.to_proto(publication.run, publication.framework))
        for load in plan.loads:
            if not context.is_active():
                return
            for piece in pieces(load.target.id, load.convert(publication.arrays), compress=request.compress):
                yield pb.WeightsDownload(piece=piece)
        logger.info("session %s: sent run %r %d parameters (%.1f MiB) of baseline run %r in %.2f s; %d without a "
                    "counterpart", request.session, request.run, len(plan.loads), plan.nbytes / 2**20,
                    publication.run, time.monotonic() - started, len(plan.no_counterpart))

    def _wait(self, request: pb.WeightsRequest, context: grpc.ServicerContext) -> Publication | None:
        """The session's publication once there is one; aborts when the baseline will not share."""
        remaining = context.time_remaining()
        deadline = time.monotonic() + min(_MAX_WAIT, remaining if remaining is not None else _MAX_WAIT)
        while context.is_active():
            session = self.registry.get(request.session)
            declined = session.weights_declined_by() if session is not None else ""
            if declined:
                self.store.forget(request.session)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"baseline run {declined!r} of session {request.session!r} attached without "
                              "share_weights=True (or could not copy its weights: see its log), so it shares none: "
                              "attach it with share_weights=True (TWINSTEP_SHARE_WEIGHTS=1), or start this run "
                              "without init_from_baseline")
            left = deadline - time.monotonic()
            if left <= 0:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"no weights from the baseline of session {request.session!r} yet")
            found = self.store.wait(request.session, session, min(_POLL, left)) if session is not None else None
            if isinstance(found, str):
                context.abort(grpc.StatusCode.UNAVAILABLE, f"session {request.session!r}: {found}")
            if found is not None:
                return found
            if session is None:
                self.registry.wait_for(request.session, min(_POLL, left))
        return None


def _parameters(infos: "list[pb.ParameterInfo]", what: str) -> list[Param]:
    """Declared parameters, checked: ids 0..n-1 in order, names unique and bounded, known dtypes."""
    if len(infos) > MAX_PARAMETERS:
        raise invalid(f"{what} lists {len(infos)} parameters; at most {MAX_PARAMETERS}")
    params: list[Param] = []
    names: set[str] = set()
    for k, info in enumerate(infos):
        if info.id != k:
            raise invalid(f"{what}: parameter {k} has id {info.id}; ids must be 0, 1, 2, ... in order")
        if info.dtype not in WIRE_TO_DTYPE:
            raise invalid(f"{what}: parameter {info.name!r} has unknown dtype {info.dtype}")
        if len(info.name) > MAX_NAME or info.name in names:
            raise invalid(f"{what}: parameter name {info.name[:80]!r} is {'too long' if len(info.name) > MAX_NAME else 'listed twice'}")
        if any(d < 0 for d in info.shape):
            raise invalid(f"{what}: parameter {info.name!r} has a negative dimension {list(info.shape)}")
        names.add(info.name)
        params.append(Param.from_proto(info))
    return params


def _numel(param: Param) -> int:
    count = 1
    for d in param.shape:
        count *= d
    return count


def _nbytes(param: Param) -> int:
    return _numel(param) * storage_dtype(param.dtype).itemsize


class WeightSyncService:
    """PublishWeights and FetchWeights, mixed into the servicer, which sets ``weights`` (a WeightExchange)."""

    weights: WeightExchange

    def PublishWeights(self, request_iterator: Iterator[pb.WeightsUpload],
                       context: grpc.ServicerContext) -> pb.WeightsPublished:
        return self.weights.publish(request_iterator, context)

    def FetchWeights(self, request: pb.WeightsRequest, context: grpc.ServicerContext) -> Iterator[pb.WeightsDownload]:
        return self.weights.fetch(request, context)
