"""The comparator sharded over processes (Ray actors): one front address, shards that own ranks, one global view.

docs/scale.md says when to use it and what it costs.  ``ownership`` is the
routing rule and loads nothing; the rest loads on first use (Ray only when the
Ray runtime is asked for).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ShardedServerHandle", "serve_sharded"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from twinstep.server.shards import app

        return getattr(app, name)
    raise AttributeError(name)
