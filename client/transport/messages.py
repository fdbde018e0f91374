"""Turn a StepBatch into its wire message (runs on a background thread)."""

from __future__ import annotations

import math
from typing import Mapping

from twinstep import codec
from twinstep.capture.recorder import StepBatch
from twinstep.stats import DEVICE_FIELDS
from twinstep.v1 import twinstep_pb2 as pb

_COLUMN = {name: i for i, name in enumerate(DEVICE_FIELDS)}
_COUNTS = ("nan_count", "inf_count")
#: Dtypes the lossy codec quantises; others travel losslessly.
_LOSSY_DTYPES = frozenset({"float32", "float16", "bfloat16"})


def step_message(batch: StepBatch, rank: int, dropped: dict[str, int],
                 lossy: Mapping[str, pb.LossyBound] | None = None) -> pb.ClientMessage:
    """The StepRecords of one batch; statistics columns absent from the batch (m2 of an older backend) are not sent.

    ``lossy``: the server's per-phase error budgets (Welcome.lossy); tensors of
    those phases are quantised within them, the others sent losslessly.
    """
    stats = batch.device_stats
    columns = {
        name: (stats[:, i].astype("int64") if name in _COUNTS else stats[:, i]).tolist()
        for name, i in _COLUMN.items()
        if i < stats.shape[1]
    }
    message = pb.StepRecords(
        rank=rank,
        step=batch.step,
        phase=batch.phase.tolist(),
        target=batch.target.tolist(),
        call_index=batch.call_index.tolist(),
        slot=batch.slot.tolist(),
        dtype=batch.dtype.tolist(),
        ndim=batch.ndim.tolist(),
        dims=batch.dims,
        stats=pb.Statistics(count=batch.count.tolist(), **columns),
        dropped=dropped,
    )
    for record, dtype, copy in batch.tensors:
        raw = batch.storage_array(copy) if batch.storage_array else copy
        bound = _error_bound(batch, record, dtype, lossy) if lossy else 0.0
        if bound > 0:
            kind, data, raw_nbytes, step = codec.encode_quantized(raw, bound, dtype=dtype)
            payload = pb.TensorPayload(record=record, codec=kind, data=data, raw_nbytes=raw_nbytes)
            if kind == pb.QUANT_ZSTD:
                payload.quant_step, payload.error_bound = step, bound
        else:
            kind, data, raw_nbytes = codec.encode(raw)
            payload = pb.TensorPayload(record=record, codec=kind, data=data, raw_nbytes=raw_nbytes)
        message.tensors.append(payload)
    if batch.sketch_records is not None and len(batch.sketch_records):
        buckets, seed = batch.sketch_spec
        message.sketches.CopyFrom(pb.Sketches(buckets=buckets, seed=seed, record=batch.sketch_records.tolist(),
                                              values=batch.sketches.astype("<f4", copy=False).tobytes()))
    return pb.ClientMessage(step=message)


def _error_bound(batch: StepBatch, record: int, dtype: str, lossy: Mapping[str, pb.LossyBound]) -> float:
    """The largest error an element of ``record`` may carry (0: send it losslessly).

    The server's budget is a fraction of the tensor's RMS, known from the
    statistics already computed for it, capped by an absolute budget.
    """
    budget = lossy.get(pb.Phase.Name(int(batch.phase[record])).lower())
    if budget is None or dtype not in _LOSSY_DTYPES:
        return 0.0
    row = batch.device_stats[record]
    finite = batch.count[record] - row[_COLUMN["nan_count"]] - row[_COLUMN["inf_count"]]
    if finite <= 0:
        return 0.0
    rms = math.sqrt(max(float(row[_COLUMN["sum_sq"]]), 0.0) / float(finite))
    bound = min(budget.rms_fraction * rms, budget.absolute)
    return bound if math.isfinite(bound) and bound > 0 else 0.0
