"""Turn a StepBatch into its wire message (runs on a background thread)."""

from __future__ import annotations

from twinstep import codec
from twinstep.capture.recorder import StepBatch
from twinstep.stats import DEVICE_FIELDS
from twinstep.v1 import twinstep_pb2 as pb

_COLUMN = {name: i for i, name in enumerate(DEVICE_FIELDS)}
_COUNTS = ("nan_count", "inf_count")


def step_message(batch: StepBatch, rank: int, dropped: dict[str, int]) -> pb.ClientMessage:
    """The StepRecords of one batch; statistics columns absent from the batch (m2 of an older backend) are not sent."""
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
    for record, _dtype, copy in batch.tensors:
        raw = batch.storage_array(copy) if batch.storage_array else copy
        kind, data, raw_nbytes = codec.encode(raw)
        message.tensors.append(pb.TensorPayload(record=record, codec=kind, data=data, raw_nbytes=raw_nbytes))
    return pb.ClientMessage(step=message)
