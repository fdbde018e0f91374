"""Which mapping a candidate is compared with: the user's rules, msprobe layer rules, and automatic matches.

The user's mapping (exact, prefix, regex, fused, permuted, msprobe
``layer_mapping``) always applies.  When names still differ and automatic
matching is on, the first compared step's unmatched modules are aligned once
per candidate run (twinstep.server.compare.automatch) and those matches are
added as exact rules, under the user's own.  Layer rules need the candidate's
module classes, so the result is bound per (run, rank) to its manifest.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from twinstep.server.compare import automatch
from twinstep.server.compare.mapping import NameMapping

logger = logging.getLogger("twinstep.server")


class MappingResolver:
    """The mapping of every candidate of one session (call under the session's lock)."""

    def __init__(self, user: NameMapping, automatic: bool) -> None:
        self.user = user
        self.automatic = automatic
        self.proposals: dict[str, dict[str, str]] = {}
        """Candidate run -> automatic matches (candidate name -> baseline name); {} when none were needed."""
        self._bound: dict[tuple[str, int], tuple[int, NameMapping]] = {}

    def for_run(self, run: str, rank: int, module_types: Callable[[], dict[str, str]], module_count: int) -> NameMapping:
        """The mapping for one rank of a candidate; ``module_types`` lists its manifest's name -> class."""
        cached = self._bound.get((run, rank))
        if cached is not None and cached[0] == module_count:
            return cached[1]
        mapping = self.user
        auto = self.proposals.get(run)
        if auto:  # every user rule stays: a copy with the automatic matches added under the user's exact ones
            mapping = dataclasses.replace(mapping, exact={**auto, **mapping.exact})
        if mapping.layer_mapping:
            mapping = mapping.bind(module_types())
        self._bound[(run, rank)] = (module_count, mapping)
        return mapping

    def for_names(self, run: str, module_types: dict[str, str]) -> NameMapping:
        """The mapping of a candidate for names outside any step (its set-up's modules: preflight), not cached."""
        mapping = self.user
        auto = self.proposals.get(run)
        if auto:
            mapping = dataclasses.replace(mapping, exact={**auto, **mapping.exact})
        return mapping.bind(module_types) if mapping.layer_mapping else mapping

    def wants_proposal(self, run: str, unmatched_candidate: bool) -> bool:
        """Automatic matching runs once per candidate, on its first step with unmatched modules."""
        return self.automatic and unmatched_candidate and run not in self.proposals

    def propose(self, session: str, run: str, base_step: object, cand_step: object,
                unmatched_baseline: set[str], unmatched_candidate: set[str]) -> None:
        """Align the unmatched modules of a step pair and keep the matches for ``run``."""
        proposal = {c: b for c, b in automatch.propose(base_step, cand_step).items()
                    if c in unmatched_candidate and b in unmatched_baseline}
        self.proposals[run] = proposal
        self._bound = {key: value for key, value in self._bound.items() if key[0] != run}
        if proposal:
            logger.info("session %s: matched %d renamed modules of run %r automatically (twinstep mapping %s)",
                        session, len(proposal), run, session)
