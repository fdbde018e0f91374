"""Error budgets for lossy tensor payloads, told to each client in its Welcome.

A lossy payload may change an element by at most its budget; the budget is
derived (twinstep.wire.codec) so that no element-wise verdict changes except within
``MARGIN`` of a tolerance.  It must hold for the tightest tolerance a record
can be judged by: the float32 defaults and every override of the phase.
Low-precision records have looser tolerances, so the float32 budget serves
them too.  Noise bands from a reference rerun never tighten the element-wise
tolerances of a lossy record below these (the comparator sees to it):
lossy mode trades that sensitivity for bytes, while statistics, computed on
the exact tensors, keep it.
"""

from __future__ import annotations

import math

from twinstep.wire import codec
from twinstep.wire.phases import STEP_ORDER
from twinstep.server.compare.tolerance import ToleranceConfig
from twinstep.v1 import twinstep_pb2 as pb

#: Share of a tolerance that quantisation may use up (see twinstep.wire.codec).
MARGIN = codec.DEFAULT_MARGIN
ELEMENTWISE = ("rel_l2", "cosine", "max_abs")


def lossy_bounds(tolerances: ToleranceConfig) -> dict[str, pb.LossyBound]:
    """phase -> budget; phases whose tightest tolerance is 0 are left out (sent losslessly)."""
    out: dict[str, pb.LossyBound] = {}
    for phase in STEP_ORDER:
        tightest = {m: tolerances.defaults.get(phase, {}).get(m, math.inf) for m in ELEMENTWISE}
        for override in tolerances.overrides:
            if override.phase in ("*", phase):
                for m in ELEMENTWISE:
                    tightest[m] = min(tightest[m], override.metrics.get(m, math.inf))
        fraction, absolute = codec.lossy_budget(tightest, MARGIN)
        if fraction > 0 and absolute > 0:
            out[phase] = pb.LossyBound(rms_fraction=fraction, absolute=absolute)
    return out
