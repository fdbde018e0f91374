"""Lossy (QUANT_ZSTD) vs lossless (ZSTD) tensor payloads on real training tensors, in one run.

    python benchmarks/compression.py [--hidden 256] [--steps 3] [--margin 0.1] [--dtypes float32,bfloat16]

Trains the demo transformer (the benchmarks' reference size: 4 layers, hidden 256,
seq 128, batch 8, CPU) for a few steps twice: a baseline and a candidate with
the GELU-tanh bug in layer 1, so pairs range from identical (layer 0) to
diverged.  On the last step it captures module outputs (activations), the
gradients of those outputs, parameter gradients and parameters, in float32 and
in bfloat16 (the model cast to bfloat16).  Each tensor is encoded losslessly
(what twinstep sends today) and lossily with the bound derived from the
default tolerances (``ToleranceConfig().for_record``) and its own RMS.  Per
dtype and kind it prints sizes, ratios, codec speeds and how far the lossy
stream moved each element-wise metric, against what the bound allows.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import zstandard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twinstep.wire import codec  # noqa: E402
from twinstep.tools.demo import spec  # noqa: E402
from twinstep.server.compare import metrics  # noqa: E402
from twinstep.server.compare.tolerance import ToleranceConfig  # noqa: E402

KINDS = ("forward", "backward", "grad", "param")
LABELS = {"forward": "activations", "backward": "output grads", "grad": "param grads", "param": "params"}


def capture(cfg: spec.ModelConfig, dtype: str, steps: int) -> list[tuple[str, str, object]]:
    """(phase, name, torch tensor) for every record of the last of ``steps`` training steps."""
    import torch

    from twinstep.tools.demo.job import LR, TorchTrainer

    trainer = TorchTrainer(cfg, LR, 1)
    if dtype == "bfloat16":
        trainer.inner.to(torch.bfloat16)  # in place: the optimizer keeps its parameters
    records: list[tuple[str, str, object]] = []
    last = [False]

    def hook(name: str):
        def forward_hook(module, args, output):
            if last[0] and isinstance(output, torch.Tensor) and output.is_floating_point():
                records.append(("forward", name, output.detach().clone()))
                if output.requires_grad:
                    output.register_hook(lambda g: records.append(("backward", name, g.detach().clone())))

        return forward_hook

    for name, module in trainer.inner.named_modules():
        module.register_forward_hook(hook(name or "model"))
    for step in range(steps):
        last[0] = step == steps - 1
        ids, tgt = spec.batch(step, 0, cfg)
        trainer.train_step(ids, tgt)
        if last[0]:
            for name, p in trainer.inner.named_parameters():
                records.append(("grad", name, p.grad.detach().clone()))
                records.append(("param", name, p.detach().clone()))
        trainer.zero_grad()
    return records


def storage(tensor) -> np.ndarray:
    import torch

    t = tensor.contiguous()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def exact(raw: np.ndarray) -> np.ndarray:
    if raw.dtype == np.uint16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw


@dataclass
class Tally:
    tensors: int = 0
    raw: int = 0
    lossless: int = 0
    shuffled: int = 0  # byte-shuffled lossless, for reference (not what twinstep sends)
    lossy: int = 0
    fallbacks: int = 0
    over: int = 0  # records over an element-wise tolerance (lossless verdict)
    flips_outside: int = 0
    flips_inside: int = 0
    times: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    max_err_over_bound: float = 0.0
    # max |metric(lossy) - metric(lossless)| / (margin * tolerance), per metric: the
    # share of the margin the lossy stream spent (at most 1 by construction).
    shift: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, other: "Tally") -> None:
        for name in ("tensors", "raw", "lossless", "shuffled", "lossy", "fallbacks", "over", "flips_outside",
                     "flips_inside"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for key, value in other.times.items():
            self.times[key] += value
        for key, value in other.shift.items():
            self.shift[key] = max(self.shift[key], value)
        self.max_err_over_bound = max(self.max_err_over_bound, other.max_err_over_bound)

    def row(self, dtype: str, label: str) -> str:
        mb = self.raw / 1e6

        def speeds(what: str) -> str:
            return f"{mb / self.times[what + '_lossless']:.0f}/{mb / self.times[what + '_lossy']:.0f}"

        return (f"{dtype:<9}{label:<13}{self.tensors:>4}{mb:>8.1f}{self.raw / self.lossless:>9.2f}"
                f"{self.raw / self.shuffled:>6.2f}{self.raw / self.lossy:>7.2f}{self.lossless / self.lossy:>6.2f}"
                f"{speeds('enc'):>14}{speeds('dec'):>14}{self.max_err_over_bound:>10.3f}"
                f"{self.shift['rel_l2']:>8.3f}{self.shift['cosine']:>8.3f}{self.over:>5}"
                f"{self.flips_outside:>4}/{self.flips_inside}")


def timed(tally: Tally, key: str, repeat: int, fn, *args, **kwargs):
    """fn(*args, **kwargs), adding its best time of ``repeat`` runs to tally.times[key]."""
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    tally.times[key] += best
    return out


def encode_both(tally: Tally, raw: np.ndarray, dtype: str, bound: float, repeat: int) -> np.ndarray:
    """Encode and decode losslessly and lossily; returns the lossy decoding (float32)."""
    kind, data, n = timed(tally, "enc_lossless", repeat, codec.encode, raw)
    timed(tally, "dec_lossless", repeat, codec.decode, kind, data, n, dtype, raw.shape)
    tally.lossless += len(data)
    planes = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, raw.itemsize).T.tobytes()
    tally.shuffled += len(zstandard.ZstdCompressor(level=codec.ZSTD_LEVEL).compress(planes))
    kind, data, n, step = timed(tally, "enc_lossy", repeat, codec.encode_quantized, raw, bound, dtype)
    decoded = timed(tally, "dec_lossy", repeat, codec.decode, kind, data, n, dtype, raw.shape,
                    quant_step=step, error_bound=bound)
    tally.lossy += len(data)
    tally.fallbacks += kind != codec.pb.QUANT_ZSTD
    tally.tensors += 1
    tally.raw += raw.nbytes
    x = exact(raw).astype(np.float64)
    finite = np.isfinite(x)
    if finite.any() and bound > 0:
        err = float(np.abs(decoded.astype(np.float64)[finite] - x[finite]).max())
        tally.max_err_over_bound = max(tally.max_err_over_bound, err / bound)
    return decoded


def run(dtype: str, cfg: spec.ModelConfig, steps: int, margin: float, repeat: int) -> dict[str, Tally]:
    base = capture(cfg, dtype, steps)
    cand = capture(spec.ModelConfig(**{**cfg.__dict__, "tanh_gelu_layers": (1,)}), dtype, steps)
    assert [(p, n) for p, n, _ in base] == [(p, n) for p, n, _ in cand], "records do not pair up"
    config = ToleranceConfig()
    tallies = {k: Tally() for k in KINDS}
    for (phase, name, ta), (_, _, tb) in zip(base, cand):
        tally = tallies[phase]
        tolerances = config.for_record(phase, name, dtype)
        decoded = []
        for tensor in (ta, tb):
            raw = storage(tensor)
            x = exact(raw).astype(np.float64)
            x = x[np.isfinite(x)]
            rms = math.sqrt(float(np.dot(x, x)) / max(x.size, 1))  # what the record's statistics give
            bound = codec.error_bound(rms, *codec.lossy_budget(tolerances, margin))  # as a lossy client does
            decoded.append(encode_both(tally, raw, dtype, bound, repeat))
        lossless = metrics.from_tensors(exact(storage(ta)), exact(storage(tb)))
        lossy = metrics.from_tensors(*decoded)
        tally.over += any(lossless[m] > tolerances[m] for m in ("rel_l2", "cosine", "max_abs"))
        for m in ("rel_l2", "cosine"):
            limit = tolerances[m]
            tally.shift[m] = max(tally.shift[m], abs(lossy[m] - lossless[m]) / (margin * limit))
            if (lossy[m] > limit) != (lossless[m] > limit):
                if abs(lossless[m] - limit) > margin * limit:
                    tally.flips_outside += 1
                else:
                    tally.flips_inside += 1
    return tallies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="training steps; tensors of the last one")
    parser.add_argument("--margin", type=float, default=codec.DEFAULT_MARGIN)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeat", type=int, default=1, help="time each codec call as the best of this many")
    args = parser.parse_args()
    cfg = spec.ModelConfig(vocab=512, hidden=args.hidden, heads=4, layers=args.layers, seq=args.seq, batch=args.batch)
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}; "
          f"tensors of step {args.steps - 1}, baseline + GELU-tanh candidate; margin {args.margin}; "
          f"zstd level {codec.ZSTD_LEVEL}; codec times best of {args.repeat}")
    print("n = payloads (baseline + candidate); ratio = raw bytes / payload bytes (lossless: zstd as sent today, "
          "shuf: byte-shuffled + zstd, lossy: QUANT_ZSTD); gain = lossless / lossy bytes;\n"
          "speeds in MB of raw tensor per second; err/bound = max element error / its bound; "
          "shift = max |metric(lossy) - metric(lossless)| / (margin * tol);\n"
          "over = records over an element-wise tolerance; flips = verdicts changed outside / inside the margin")
    print(f"{'dtype':<9}{'kind':<13}{'n':>4}{'raw MB':>8}{'lossless':>9}{'shuf':>6}{'lossy':>7}{'gain':>6}"
          f"{'enc MB/s':>14}{'dec MB/s':>14}{'err/bound':>10}{'rel_l2':>8}{'cosine':>8}{'over':>5}{'flips':>6}")
    print(f"{'':<62}{'lossless/lossy':>14}{'lossless/lossy':>14}{'':>10}{'shift':>8}{'shift':>8}{'':>5}{'out/in':>6}")
    for dtype in args.dtypes.split(","):
        tallies = run(dtype, cfg, args.steps, args.margin, args.repeat)
        total = Tally()
        for kind in KINDS:
            print(tallies[kind].row(dtype, LABELS[kind]), flush=True)
            total.add(tallies[kind])
        print(total.row(dtype, "all"), flush=True)
        if total.fallbacks:
            print(f"{dtype}: {total.fallbacks} of {total.tensors} payloads fell back to lossless")
    return 0


if __name__ == "__main__":
    sys.exit(main())
