"""One module's tensor operations for one step, captured when a zoom asks (``twinstep zoom --ops``).

``capture.py`` arms the capture on the module's next call; ``torch.py`` and
``paddle.py`` intercept the framework's calls during it; ``trace.py`` builds
the ``OpTrace`` the step carries; ``names.py`` gives each call the canonical
name both frameworks share; ``source.py`` finds the line that made it.
"""

from twinstep.runtime.capture.ops.capture import OpsCapture
from twinstep.runtime.capture.ops.names import canonical

__all__ = ["OpsCapture", "canonical"]
