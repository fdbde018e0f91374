"""Reproducer bundles: one module's call at one step, written by a training, replayed in seconds.

``capture.py`` writes a bundle in a training process when the server asks
(a halt on a divergence with ``bundle_on_halt``, or ``twinstep zoom --bundle``);
``bundle.py`` is the versioned file format; ``replay.py`` rebuilds the
baseline's and the candidate's modules in one process, runs them on the
recorded inputs and compares them with the server's metrics
(``twinstep reproduce``).  See docs/zoom-and-reproduce.md.
"""

from twinstep.tools.reproduce.bundle import Bundle, BundleError, read_bundle

__all__ = ["Bundle", "BundleError", "read_bundle"]
