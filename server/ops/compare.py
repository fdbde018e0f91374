"""Compare two aligned operation sequences and name the first operation that creates a difference.

Each matched pair's output is compared with the forward tolerances of the
module (statistics always; rel_l2, cosine and max_abs when both sides sent
values).  Its error is the largest ratio of a metric to its tolerance.  The
culprit is the first pair whose output is out of tolerance while its inputs'
error, on the one scale of twinstep.server.detect.evidence, is at most
1/``GROWTH`` of its output's (an input within its tolerance can already carry
the whole error: "matches" is judged on that scale, not on the metric that crossed):
captured a few steps after a divergence, the module's inputs and parameters
already differ a little, and an operation that only passes that on (a
matmul of slightly different inputs) is not the one that creates it.  An
input coming from an operation only one side has (an extra scale) makes that
operation the culprit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from twinstep.server.compare import metrics
from twinstep.server.compare.tolerance import ToleranceConfig, effective_dtype
from twinstep.server.detect.evidence import CREATES, STAT_METRICS
from twinstep.server.ops.align import LAYOUT_OPS, align
from twinstep.server.ops.trace import OpCall, OpTensor, OpTrace
from twinstep.wire.stats import FIELDS
from twinstep.v1 import twinstep_pb2 as pb

#: An output error this many times its inputs' is created by the operation, not passed on.
GROWTH = CREATES
#: The operation name of a hooked child module's whole call (twinstep.runtime.capture.ops.trace).
CHILD_MODULE = "module"
#: Below this share of the computing operations paired, the two sequences are not one computation.
MIN_ALIGNED = 0.5
_STAT_METRICS = ("rms", "mean", "extrema", "nonfinite")


@dataclass(frozen=True)
class Error:
    ratio: float
    """The largest metric / tolerance (0: equal; inf: a tolerance of 0 exceeded)."""
    metric: str
    value: float
    tolerance: float
    scale: float = 0.0
    """The error on one scale (twinstep.server.detect.evidence): the worst metric itself, over its tolerance or not."""
    scale_metric: str = "rms"


_EQUAL = Error(0.0, "rms", 0.0, 0.0)


def tensor_error(base: OpTensor, cand: OpTensor, tolerances: ToleranceConfig, module: str) -> Error:
    """How far two tensors are apart, judged by the module's forward tolerances."""
    limits = tolerances.for_record("forward", module, effective_dtype(base.dtype, cand.dtype))
    table_b = {k: np.array([base.stats[k]]) for k in FIELDS}
    table_c = {k: np.array([cand.stats[k]]) for k in FIELDS}
    values = {m: float(v[0]) for m, v in metrics.from_statistics(table_b, table_c).items() if m in _STAT_METRICS}
    if base.values is not None and cand.values is not None and base.values.size == cand.values.size:
        values.update(metrics.from_tensors(base.values, cand.values))
    worst = _EQUAL
    for metric, value in values.items():
        limit = limits.get(metric, math.inf)
        if math.isinf(limit):
            continue
        ratio = value / limit if limit > 0 else (math.inf if value > 0 else 0.0)
        if ratio > worst.ratio:
            worst = Error(ratio, metric, value, limit)
    # Statistics only: an operation's inputs include weights in each framework's own layout ([in, out] against
    # [out, in]), which element-wise metrics would compare as unrelated tensors.
    on_scale = [(v, m) for m, v in values.items() if m in STAT_METRICS]
    scale, scale_metric = max(on_scale, default=(0.0, "rms"))
    return replace(worst, scale=scale, scale_metric=scale_metric)


def compare_traces(base: OpTrace, cand: OpTrace, tolerances: ToleranceConfig, candidate_run: str) -> pb.OperationFinding:
    """The finding of one module call compared between the baseline and one candidate rank."""
    finding = pb.OperationFinding(candidate_run=candidate_run, rank=cand.rank, step=cand.step, module=base.module,
                                  candidate_module=cand.module, zoom_id=cand.zoom_id,
                                  ops_baseline=len(base.calls), ops_candidate=len(cand.calls))
    problems = [f"{side} capture: {t.error}" for side, t in (("the baseline's", base), ("the candidate's", cand))
                if t.error]
    if base.step != cand.step:
        problems.append(f"captured at different steps (baseline {base.step}, candidate {cand.step}): a zoom "
                        "that arrived late applies from the next step")
    pairs = align(base.calls, cand.calls)
    finding.ops_matched = len(pairs)
    computing = min(sum(c.op not in LAYOUT_OPS for c in base.calls), sum(c.op not in LAYOUT_OPS for c in cand.calls))
    paired = sum(base.calls[i].op not in LAYOUT_OPS for i, _ in pairs)
    if not base.calls or not cand.calls or (computing and paired < MIN_ALIGNED * computing):
        finding.status = "unaligned"
        finding.message = (f"the operations of {base.module or '(model)'!r} do not line up: {paired} of "
                           f"{computing} computing operations paired ({len(base.calls)} in the baseline, "
                           f"{len(cand.calls)} in the candidate)" + "".join(f"; {p}" for p in problems))
        return finding
    pair_of_base = dict(pairs)
    pair_of_cand = {j: i for i, j in pairs}
    passed_on = None  # the first operation out of tolerance that only passes on what its inputs bring
    for i, j in pairs:
        a, b = base.calls[i], cand.calls[j]
        if a.op == CHILD_MODULE:
            # A hooked child's call: compared as a module of its own, and captured a few steps after the
            # divergence its parameters differ too, so its output can differ with matching inputs.  The
            # operations asked for are the module's own inline code.
            continue
        out = tensor_error(a.output, b.output, tolerances, base.module)
        if out.ratio <= 1:
            continue
        inputs = [tensor_error(base.tensor(x), cand.tensor(y), tolerances, base.module)
                  for x, y in zip(a.inputs, b.inputs)]
        given = max(inputs, key=lambda e: e.scale, default=_EQUAL)
        if given.scale * GROWTH <= out.scale:  # on one scale: the inputs bring at most 1/GROWTH of it
            _found(finding, a, b, out, given)
            break
        extra = (_unpaired_source(a, base, pair_of_base, "baseline")
                 or _unpaired_source(b, cand, pair_of_cand, "candidate"))
        if extra is not None:
            side, call = extra
            _found(finding, call if side == "baseline" else None, call if side == "candidate" else None, out, _EQUAL)
            finding.message = (f"{base.module or '(model)'!r}: the first difference comes from an operation only the "
                               f"{side} has: #{call.index} {call.op} ({call.api}) at {_where(call)}; it feeds "
                               f"#{a.index} {a.op}, whose output differs ({out.metric} {out.value:.3g} > "
                               f"{out.tolerance:.3g})")
            break
        if passed_on is None:
            passed_on = (a, b, out, max(inputs, key=lambda e: e.scale, default=_EQUAL))
    else:
        if passed_on is not None:
            _found(finding, *passed_on, status="inherited")
        else:
            finding.status = "matched"
            finding.message = (f"every one of {len(pairs)} paired operations of {base.module or '(model)'!r} "
                               f"matches within the forward tolerances at step {cand.step}")
    if problems:
        finding.message += "".join(f"; {p}" for p in problems)
        if finding.status == "matched":
            finding.status = "incomplete"
    return finding


def _unpaired_source(call: OpCall, trace: OpTrace, paired: dict[int, int], side: str) -> tuple[str, OpCall] | None:
    """An input of ``call`` made by a computing operation the other side has no counterpart of."""
    for ref in call.inputs:
        if ref >= 0 and ref not in paired and trace.calls[ref].op not in LAYOUT_OPS:
            return side, trace.calls[ref]
    return None


def _site(call: OpCall | None) -> pb.OperationSite:
    if call is None:
        return pb.OperationSite()
    return pb.OperationSite(index=call.index, op=call.op, api=call.api, file=call.file, line=call.line, code=call.code,
                            shape=call.output.shape)


def _where(call: OpCall) -> str:
    return f"{call.file.rsplit('/', 1)[-1]}:{call.line}" if call.file else "(unknown line)"


def _found(finding: pb.OperationFinding, a: OpCall | None, b: OpCall | None, out: Error, given: Error,
           status: str = "found") -> None:
    finding.status = status
    finding.baseline.CopyFrom(_site(a))
    finding.candidate.CopyFrom(_site(b))
    finding.metric, finding.value, finding.tolerance, finding.input_value = (out.metric, out.value, out.tolerance,
                                                                             given.scale)
    if a is None or b is None:
        return
    module = finding.module or "(model)"
    inputs = ("match exactly" if given.scale == 0 else
              f"are off by at most {given.scale_metric} {given.scale:.3g} against its {out.scale_metric} "
              f"{out.scale:.3g}")
    if status == "found":
        finding.message = (
            f"{module!r}: operation #{b.index} {b.op} ({b.api}) at {_where(b)} `{b.code}` is the first whose output "
            f"differs ({out.metric} {out.value:.3g} > {out.tolerance:.3g}) while its inputs {inputs}; the "
            f"baseline's #{a.index} {a.op} ({a.api}) at {_where(a)} `{a.code}`")
    else:
        finding.message = (
            f"{module!r}: no operation creates a difference; the first that differs, #{b.index} {b.op} at "
            f"{_where(b)}, already gets inputs off by {given.scale_metric} {given.scale:.3g} (its output "
            f"{out.scale_metric} {out.scale:.3g}), and none grows it {GROWTH:g} times: the difference comes from "
            "the module's inputs or parameters")
