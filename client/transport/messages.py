"""Turn a StepBatch into its wire message (runs on a background thread)."""

from __future__ import annotations

from twinstep import codec
from twinstep.capture.recorder import StepBatch
from twinstep.v1 import twinstep_pb2 as pb


def step_message(batch: StepBatch, rank: int, dropped: dict[str, int]) -> pb.ClientMessage:
    stats = batch.device_stats
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
        stats=pb.Statistics(
            count=batch.count.tolist(),
            sum=stats[:, 0].tolist(),
            sum_sq=stats[:, 1].tolist(),
            min=stats[:, 2].tolist(),
            max=stats[:, 3].tolist(),
            abs_max=stats[:, 4].tolist(),
            nan_count=stats[:, 5].astype("int64").tolist(),
            inf_count=stats[:, 6].astype("int64").tolist(),
        ),
        dropped=dropped,
    )
    for record, _dtype, copy in batch.tensors:
        raw = batch.storage_array(copy) if batch.storage_array else copy
        kind, data, raw_nbytes = codec.encode(raw)
        message.tensors.append(pb.TensorPayload(record=record, codec=kind, data=data, raw_nbytes=raw_nbytes))
    return pb.ClientMessage(step=message)
