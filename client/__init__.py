"""twinstep: keep two deep-learning trainings in precision alignment while they run.

    import twinstep
    mon = twinstep.attach(model, session="llama-port", run="paddle", server="127.0.0.1:50051")
    for batch in loader:
        ...; optimizer.step()
        mon.step(loss=loss)
        optimizer.zero_grad()
    mon.close()
"""

from twinstep._version import PROTOCOL_VERSION, __version__
from twinstep.api import Monitor, attach
from twinstep.errors import Halted
from twinstep.inprocess import CompareResult, compare

__all__ = ["CompareResult", "Halted", "Monitor", "PROTOCOL_VERSION", "__version__", "attach", "compare"]
