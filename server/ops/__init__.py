"""Operations inside a module: which functional operation of a module's own code creates a difference.

``trace.py`` validates a run's ``OpTrace`` (sent with a step when a zoom
asked for a module's operations), ``align.py`` lines up the two runs'
sequences, ``compare.py`` names the first operation whose output differs
while its inputs match, ``inspector.py`` keeps a session's captures until
both sides are in, ``target.py`` picks the module to ask for after a
divergence.  The training side is ``twinstep.runtime.capture.ops``.
"""

from twinstep.server.ops.inspector import OperationsInspector

__all__ = ["OperationsInspector"]
