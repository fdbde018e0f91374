"""A run's training set-up (docs/preflight.md): what the server diffs before the first step is compared.

``SetupCollector`` reads it at attach and notices changes at step boundaries;
``SetupBuilder`` bounds the message; framework parts live in ``torch.py``,
``paddle.py`` and ``mindspore.py`` and are imported only for the framework attached.
"""

from twinstep.runtime.setup.base import SetupBuilder, setup_value
from twinstep.runtime.setup.collect import SetupCollector

__all__ = ["SetupBuilder", "SetupCollector", "setup_value"]
