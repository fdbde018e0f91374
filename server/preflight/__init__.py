"""Preflight (docs/preflight.md): the training set-ups of the runs, diffed before the first step is compared.

``check.py`` bounds what a client sends, ``values.py`` says when two values are
equal, ``diff.py`` diffs two set-ups through the candidate's mapping, and
``tracker.py`` keeps a session's set-ups and findings.
"""

from twinstep.server.preflight.check import check_setup
from twinstep.server.preflight.diff import diff_setups
from twinstep.server.preflight.tracker import PreflightTracker

__all__ = ["PreflightTracker", "check_setup", "diff_setups"]
