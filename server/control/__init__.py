"""Live capture control: changing what the runs of a session capture, at one step on every rank.

``zoom.py`` coordinates a change (asked by an operator, by ``auto_zoom`` after a
divergence, or with a reproducer bundle on halt); ``steps.py`` finds a step
every rank can still apply it at; ``names.py`` turns the baseline's module
names into each run's own; ``tensor_steps.py`` records which steps were in
fact compared with full tensors, for the report.
"""

from twinstep.server.control.tensor_steps import TensorStepLedger
from twinstep.server.control.zoom import ZoomCoordinator, ZoomRefused

__all__ = ["TensorStepLedger", "ZoomCoordinator", "ZoomRefused"]
