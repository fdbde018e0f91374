"""Weight sync, the training side: a baseline shares its initial parameters, a candidate starts from them.

``publish.py`` (the baseline: a copy at attach, uploaded in the background),
``fetch.py`` (a candidate: download, check, load all or nothing), and one
loader per framework (``torch.py``, ``paddle.py``, ``mindspore.py``), imported
only by a job of that framework.  The server plans the conversion (twinstep.server.weights).
See docs/weight-sync.md.
"""

from __future__ import annotations

from twinstep.runtime.weights.fetch import load_from_baseline
from twinstep.runtime.weights.publish import WeightPublisher

__all__ = ["WeightPublisher", "load_from_baseline"]
