"""The Zoom RPC: an operator changes what a session's runs capture (twinstep zoom)."""

from __future__ import annotations

import grpc

from twinstep.server.control.zoom import ZoomRefused
from twinstep.v1 import twinstep_pb2 as pb


class ZoomService:
    """Mixed into the servicer (which provides ``auth`` and ``registry``): authorized as Halt, the operator's."""

    def Zoom(self, request: pb.ZoomRequest, context: grpc.ServicerContext) -> pb.ZoomResponse:
        self.auth.authorize(context, "zoom", request.session)  # type: ignore[attr-defined]
        session = self.registry.get(request.session)  # type: ignore[attr-defined]
        if session is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session!r} on this server")
        try:
            return session.zoom(request)
        except ZoomRefused as refused:
            context.abort(refused.code, refused.message)
            raise  # abort raises; never reached
