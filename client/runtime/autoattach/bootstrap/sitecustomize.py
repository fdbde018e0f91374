"""``twinstep run``'s bootstrap, run by Python's ``site`` at the start of every process of the job.

It first runs the ``sitecustomize`` this one hides (the next one on
``sys.path``, as Debian's or a virtualenv's), the way opentelemetry-instrument
and ddtrace-run chain theirs, then arms twinstep's probes when
``TWINSTEP_AUTO_ATTACH=1``.  Nothing here may stop the program: a failure is
one line on stderr and the training runs untouched.
"""

import os
import sys


def _chain() -> None:
    """Run the sitecustomize module that would have run without this folder on the path."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.path[:] = rest  # this folder has done its job; the program's imports never see it
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _arm() -> None:
    if os.environ.get("TWINSTEP_AUTO_ATTACH") != "1":
        return
    try:
        from twinstep.runtime.autoattach import install
    except ImportError as error:
        sys.stderr.write(f"twinstep: {sys.executable} cannot import twinstep ({error}); this process runs "
                         "without it: install twinstep in this Python\n")
        return
    install()


for _part in (_chain, _arm):
    try:
        _part()
    except Exception as _error:  # the training comes first
        sys.stderr.write(f"twinstep: the zero-code bootstrap skipped {_part.__name__}: {_error!r}; "
                         "the program runs without it\n")
