"""The front of a sharded server: the one address clients attach to.

A training stream's hello is checked (protocol, token) and answered with a
Welcome naming the shard that compares its rank (``Welcome.stream_to``); the
client streams there.  Reports, watch streams, session lists and halts are the
coordinator's (merged over shards).  Weight and batch sync, zooms and the
dashboard's history (rank 0's shard's) are passed through to the shards that hold them, bytes as they came, with the caller's
token: each shard checks it again.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator

import grpc

from twinstep._version import PROTOCOL_VERSION
from twinstep.server.errors import InputError
from twinstep.server.ingest.wire import parse_client_message
from twinstep.server.runs.membership import check_hello
from twinstep.server.security import Authorizer, Denied
from twinstep.server.servicer import watch_events
from twinstep.server.shards.coordinator import ShardCoordinator
from twinstep.server.shards.ownership import shard_of
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")
_SERVICE = pb.DESCRIPTOR.services_by_name["Twinstep"]
#: Seconds the front waits for a restarting shard's address before telling the client to retry.
_ADDRESS_WAIT = 5.0


class ShardChannels:
    """One gRPC channel per shard address, for what the front passes through."""

    def __init__(self, credentials: grpc.ChannelCredentials | None) -> None:
        self._credentials = credentials
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                options = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
                channel = (grpc.insecure_channel(address, options=options) if self._credentials is None
                           else grpc.secure_channel(address, self._credentials, options=options))
                self._channels[address] = channel
            return channel

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


class FrontServicer:
    """The Twinstep service at the front (see the module docstring)."""

    def __init__(self, coordinator: ShardCoordinator, auth: Authorizer, channels: ShardChannels,
                 stopping: threading.Event) -> None:
        self.coordinator = coordinator
        self.auth = auth
        self.channels = channels
        self._stopping = stopping

    @property
    def shards(self) -> int:
        return self.coordinator.shards.count

    def _address(self, index: int) -> str:
        """Shard ``index``'s address; '' while it restarts and the coordinator has not found it again."""
        address = self.coordinator.addresses[index]
        if not address:
            self.coordinator.wait_polls(2, _ADDRESS_WAIT)
            address = self.coordinator.addresses[index]
        return address

    # -- training streams: where to go --------------------------------------------------------------

    def Stream(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[pb.ServerMessage]:
        caller = self.auth.authorize(context, "stream", check=False)
        first = next(request_iterator, None)
        if not isinstance(first, pb.ClientMessage) or first.WhichOneof("body") != "hello":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "first message must be hello")
        hello = first.hello
        try:
            self.auth.check(caller, "stream", hello.session)
            check_hello(hello)
        except Denied as denied:
            self.auth.note(context.peer(), "stream", denied)
            context.abort(denied.code, denied.message)
        except InputError as error:
            context.abort(error.code, error.message)
        index = shard_of(hello.session, hello.rank, self.shards, self.coordinator.key)
        address = self._address(index)
        if not address:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"shard {index} is restarting; reconnect to resume")
        yield pb.ServerMessage(welcome=pb.Welcome(protocol_version=PROTOCOL_VERSION, stream_to=address))

    # -- the session over every shard -------------------------------------------------------------------

    def GetReport(self, request: pb.ReportRequest, context: grpc.ServicerContext) -> pb.Report:
        caller = self.auth.authorize(context, "report", request.session)
        report = self.coordinator.report(request.session)
        if report is None:
            names = ""
            if caller.operator:
                names = f" (sessions: {', '.join(s.name for s in self.coordinator.sessions().sessions) or 'none'})"
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session!r} on this server{names}")
        return report

    def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.ServicerContext) -> pb.SessionList:
        caller = self.auth.authorize(context, "list", check=False)
        listing = self.coordinator.sessions()
        if not caller.operator:
            kept = [s for s in listing.sessions if s.name == caller.session]
            del listing.sessions[:]
            listing.sessions.extend(kept)
        return listing

    def Halt(self, request: pb.HaltRequest, context: grpc.ServicerContext) -> pb.HaltResponse:
        self.auth.authorize(context, "halt", request.session)
        if request.session not in self.coordinator.views:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session!r} on this server")
        return pb.HaltResponse(runs=self.coordinator.halt(request.session, request.reason or "halted by an operator"))

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        self.auth.authorize(context, "watch", request.session)
        if not request.session:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "watch needs a session name")
        yield from watch_events(self.coordinator.bus(request.session),
                                pb.Event(session=request.session, progress=pb.Progress()), context, self._stopping)

    # -- passed through to the shard that holds it -----------------------------------------------------

    def Zoom(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """A zoom is told to every shard (each tells its ranks); the answer is rank 0's shard's."""
        session = pb.ZoomRequest.FromString(request).session
        metadata = [(k, v) for k, v in (context.invocation_metadata() or ()) if k == "authorization"]
        path = f"/{_SERVICE.full_name}/Zoom"
        home = shard_of(session, 0, self.shards, self.coordinator.key)
        answers: dict[int, bytes] = {}
        for index in range(self.shards):
            address = self._address(index)
            if not address:
                continue
            stub = self.channels.get(address).unary_unary(path, request_serializer=None, response_deserializer=None)
            try:
                answers[index] = stub(request, metadata=metadata, timeout=context.time_remaining())
            except grpc.RpcError as error:
                if index == home or error.code() in (grpc.StatusCode.PERMISSION_DENIED,
                                                     grpc.StatusCode.UNAUTHENTICATED):
                    context.abort(error.code(), error.details())
                logger.warning("session %s: shard %d did not take the zoom: %s", session, index, error.details())
        if home not in answers:
            context.abort(grpc.StatusCode.UNAVAILABLE, "rank 0's shard is restarting; try again")
        return answers[home]

    def passthrough(self, method: str, kind: str, route: Callable[[bytes], tuple[str, int]]) -> Callable:
        """A handler that forwards ``method``'s bytes to the shard ``route`` names, with the caller's token."""
        path = f"/{_SERVICE.full_name}/{method}"

        def target(first: bytes, context: grpc.ServicerContext) -> tuple[grpc.Channel, list]:
            session, rank = route(first)
            address = self._address(shard_of(session, rank, self.shards, self.coordinator.key))
            if not address:
                context.abort(grpc.StatusCode.UNAVAILABLE, "that session's shard is restarting; try again")
            metadata = [(k, v) for k, v in (context.invocation_metadata() or ()) if k == "authorization"]
            return self.channels.get(address), metadata

        def relay(call: Callable[[], Any], context: grpc.ServicerContext) -> Any:
            try:
                return call()
            except grpc.RpcError as error:
                context.abort(error.code(), error.details())

        if kind == "unary":
            def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
                channel, metadata = target(request, context)
                stub = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
                return relay(lambda: stub(request, metadata=metadata, timeout=context.time_remaining()), context)
            return grpc.unary_unary_rpc_method_handler(unary)
        if kind == "server_stream":
            def server_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
                channel, metadata = target(request, context)
                stub = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
                try:
                    yield from stub(request, metadata=metadata)
                except grpc.RpcError as error:
                    context.abort(error.code(), error.details())
            return grpc.unary_stream_rpc_method_handler(server_stream)

        def client_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            first = next(requests, None)
            if first is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: no message")
            channel, metadata = target(first, context)
            stub = channel.stream_unary(path, request_serializer=None, response_deserializer=None)

            def again() -> Iterator[bytes]:
                yield first
                yield from requests
            return relay(lambda: stub(again(), metadata=metadata), context)
        return grpc.stream_unary_rpc_method_handler(client_stream)


def _by_rank(message: type) -> Callable[[bytes], tuple[str, int]]:
    def route(data: bytes) -> tuple[str, int]:
        parsed = message.FromString(data)
        return parsed.session, parsed.rank
    return route


def _rank_zero(message: type) -> Callable[[bytes], tuple[str, int]]:
    def route(data: bytes) -> tuple[str, int]:
        parsed = message.FromString(data)
        return parsed.session, 0
    return route


def _upload_route(data: bytes) -> tuple[str, int]:
    return pb.WeightsUpload.FromString(data).header.session, 0


def add_front(servicer: FrontServicer, server: grpc.Server) -> None:
    """Register the front's Twinstep service: its own methods, and the passed-through ones."""
    handlers = {
        "Stream": grpc.stream_stream_rpc_method_handler(
            servicer.Stream, request_deserializer=parse_client_message,
            response_serializer=pb.ServerMessage.SerializeToString),
        "Watch": grpc.unary_stream_rpc_method_handler(
            servicer.Watch, request_deserializer=pb.WatchRequest.FromString,
            response_serializer=pb.Event.SerializeToString),
        "GetReport": grpc.unary_unary_rpc_method_handler(
            servicer.GetReport, request_deserializer=pb.ReportRequest.FromString,
            response_serializer=pb.Report.SerializeToString),
        "Halt": grpc.unary_unary_rpc_method_handler(
            servicer.Halt, request_deserializer=pb.HaltRequest.FromString,
            response_serializer=pb.HaltResponse.SerializeToString),
        # The dashboard's history (heatmap, curves) is rank 0's shard's: the steps compared on its ranks.
        "GetHistory": servicer.passthrough("GetHistory", "unary", _rank_zero(pb.HistoryRequest)),
        "ListSessions": grpc.unary_unary_rpc_method_handler(
            servicer.ListSessions, request_deserializer=pb.ListSessionsRequest.FromString,
            response_serializer=pb.SessionList.SerializeToString),
        "PublishBatch": servicer.passthrough("PublishBatch", "unary", _by_rank(pb.PublishedBatch)),
        "GetBatch": servicer.passthrough("GetBatch", "unary", _by_rank(pb.BatchRequest)),
        "Zoom": grpc.unary_unary_rpc_method_handler(servicer.Zoom),
        "PublishWeights": servicer.passthrough("PublishWeights", "client_stream", _upload_route),
        "FetchWeights": servicer.passthrough("FetchWeights", "server_stream", _rank_zero(pb.WeightsRequest)),
    }
    missing = set(_SERVICE.methods_by_name) - set(handlers)
    if missing:  # a method added to the .proto must be answered or passed through here too
        raise RuntimeError(f"twinstep.server.shards.front does not register {sorted(missing)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),))
