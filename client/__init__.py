"""twinstep: keep two deep-learning trainings in precision alignment while they run.

    import twinstep
    mon = twinstep.attach(model, session="llama-port", run="paddle", server="127.0.0.1:50051")
    for batch in loader:
        ...; optimizer.step()
        mon.step(loss=loss)
        optimizer.zero_grad()
    mon.close()

The names below are loaded on first use (PEP 562), so ``import twinstep.server``
or a shared module (``twinstep.wire.phases``, ``twinstep.wire.codec``) does not start the
training-side runtime (the gRPC sender, the capture hooks, the kernel loader).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from twinstep._version import PROTOCOL_VERSION, __version__

if TYPE_CHECKING:  # for type checkers and IDEs; at run time they load lazily
    from twinstep.runtime.api import Monitor, attach
    from twinstep.errors import BatchSyncError, Halted, WeightSyncError
    from twinstep.runtime.inprocess import CompareResult, compare

#: Public name -> the module that defines it.
_LAZY = {
    "attach": "twinstep.runtime.api",
    "Monitor": "twinstep.runtime.api",
    "Halted": "twinstep.errors",
    "BatchSyncError": "twinstep.errors",
    "WeightSyncError": "twinstep.errors",
    "compare": "twinstep.runtime.inprocess",
    "CompareResult": "twinstep.runtime.inprocess",
}

__all__ = ["BatchSyncError", "CompareResult", "Halted", "Monitor", "PROTOCOL_VERSION", "__version__", "attach", "compare", "WeightSyncError"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'twinstep' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
