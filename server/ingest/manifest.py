"""What one stream has declared: module and parameter ids -> names (append-only, ids unique)."""

from __future__ import annotations

from dataclasses import dataclass, field

from twinstep.server.errors import invalid
from twinstep.server.ingest.layouts import LayoutCache
from twinstep.v1 import twinstep_pb2 as pb


@dataclass
class ParameterMeta:
    name: str
    module_type: str


@dataclass
class Manifest:
    """One stream's ids -> names, and the record layouts resolved under them.

    A manifest only grows and never redefines an id, so a layout resolved under
    it stays valid: its cache lives and dies with it (a reconnecting client
    starts a new manifest).
    """

    modules: dict[int, tuple[str, str]] = field(default_factory=dict)  # id -> (name, type)
    parameters: dict[int, ParameterMeta] = field(default_factory=dict)
    module_order: list[str] = field(default_factory=list)
    layouts: LayoutCache = field(default_factory=LayoutCache, repr=False, compare=False)

    def add(self, message: pb.Manifest) -> None:
        for module in message.modules:
            known = self.modules.get(module.id)
            if known is not None and known != (module.name, module.type):
                raise invalid(f"manifest redefines module id {module.id} ({known[0]!r} -> {module.name!r})")
            if known is None:
                self.modules[module.id] = (module.name, module.type)
                self.module_order.append(module.name)
        for param in message.parameters:
            known_p = self.parameters.get(param.id)
            if known_p is not None and known_p.name != param.name:
                raise invalid(f"manifest redefines parameter id {param.id} ({known_p.name!r} -> {param.name!r})")
            if not param.name:
                raise invalid(f"manifest parameter id {param.id} has no name")
            self.parameters[param.id] = ParameterMeta(param.name, param.module_type)
