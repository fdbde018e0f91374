"""Which shard compares what: the one rule the front, the shards and the coordinator share.

Runs compared rank by rank need nothing across ranks until the first divergence
is declared, so a session's rank r of every run goes to shard ``r % shards``
(key ``rank``): rank r of the baseline meets rank r of each candidate, and a
step's records stay together for the culprit, stage and origin analysis.  Runs
of different parallel layouts are merged per logical tensor from every rank
(twinstep.server.layouts), so with key ``session`` all of a session goes to one
shard, chosen by the session's name; sessions spread over the shards.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

KEYS = ("rank", "session")


def shard_of(session: str, rank: int, shards: int, key: str) -> int:
    """The shard (0-based) that compares ``rank`` of ``session`` among ``shards``."""
    if shards <= 1:
        return 0
    if key == "session":
        return zlib.crc32(session.encode()) % shards  # stable across processes, unlike hash()
    return rank % shards


@dataclass(frozen=True)
class RankShare:
    """The part of every session one server compares: all of it (an embedded server), or one shard's."""

    index: int = 0
    count: int = 1
    key: str = "rank"
    front: str = ""
    """The front's address: where a stream that reached the wrong shard is sent back to."""

    @property
    def whole(self) -> bool:
        return self.count <= 1

    def owns(self, session: str, rank: int) -> bool:
        return self.whole or shard_of(session, rank, self.count, self.key) == self.index

    def ranks(self, session: str, world: int) -> list[int]:
        """The ranks below ``world`` this server compares."""
        if self.whole or self.key == "session":
            return list(range(world)) if self.owns(session, 0) or self.whole else []
        return list(range(self.index, world, self.count))

    def label(self) -> str:
        return "" if self.whole else f"shard {self.index} of {self.count} (by {self.key})"


WHOLE = RankShare()
