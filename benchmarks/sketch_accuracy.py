"""Count-sketch estimates vs exact full-tensor metrics on real tensors, and the sketch's cost.

    python benchmarks/sketch_accuracy.py [--steps 3] [--buckets 64,128,256,512,1024] [--sizes-mb 0.25,4,64]

Accuracy: the demo transformer (the benchmarks' reference size: 4 layers, hidden 256,
seq 128, batch 8) trains in torch (baseline), in its faithful paddle port and
in a paddle port with the tanh GELU in layers.1.mlp.act, side by side from the
same weights and data.  Every module output, output gradient, parameter
gradient and parameter (after the optimizer step) is captured as a full host
copy and sketched on the device by the real capture sketchers (float32-rounded,
as on the wire).  For every torch/paddle record pair, rel_l2 and the cosine gap
from ``twinstep.server.compare.metrics.from_tensors`` are compared with the
sketch estimates (exact norms from the statistics, as the server has them).

Cost: median time per call of the sketch, of ``backend.device_stats`` and of a
device copy, on float32 tensors of a few sizes, interleaved so machine noise
hits all three alike.  Shards: a 4096x1024 float32 shard keyed by its indices in
the logical tensor, as a dim-0 shard (one contiguous range: the offset path), as
a last-dim shard (element by element from the cached table, and hashed on the
device), and transposed ([in, out] split on in); ``--shards-only`` runs just these.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import warnings
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from twinstep.wire import sketch as sketch_def  # noqa: E402
from twinstep.tools.demo import spec  # noqa: E402
from twinstep.server.compare import layout  # noqa: E402
from twinstep.server.compare import sketch as estimate  # noqa: E402
from twinstep.server.compare.metrics import from_tensors  # noqa: E402
from twinstep.server.compare.tolerance import ToleranceConfig  # noqa: E402

#: Exact rel_l2 below this is within a few times the sketch's float32 floor:
#: such records are reported by absolute error, not relative error.
RESOLVED = 1e-5


def frameworks():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No ccache found")
        from twinstep.runtime.capture.paddle import PaddleBackend
        from twinstep.runtime.capture.paddle.sketch import PaddleSketcher
    from twinstep.runtime.capture.torch import TorchBackend
    from twinstep.runtime.capture.torch.sketch import TorchSketcher

    return {"torch": (TorchBackend(), TorchSketcher), "paddle": (PaddleBackend(), PaddleSketcher)}


class Capture:
    """Full host copies and device sketches of every record of one training job."""

    def __init__(self, framework: str, trainer, bucket_counts: list[int], fw: dict) -> None:
        self.framework = framework
        self.trainer = trainer
        self.backend, sketcher_type = fw[framework]
        self.sketchers = {b: sketcher_type(sketch_def.SketchSpec(buckets=b)) for b in bucket_counts}
        self.records: dict[tuple[str, str, int], tuple[np.ndarray, dict[int, np.ndarray]]] = {}
        for name, module in self.backend.named_modules(trainer.inner):
            self.backend.add_output_hook(module, self._forward_hook(name))

    def _forward_hook(self, name: str):
        def hook(module, inputs, output) -> None:
            for slot, tensor in enumerate(self.backend.output_tensors(output)):
                self.add(("forward", name, slot), tensor, False)
                self.backend.add_grad_hook(tensor, lambda g, s=slot: self.add(("backward", name, s), g, False))
        return hook

    def add(self, key: tuple[str, str, int], tensor, transpose: bool) -> None:
        full = self.backend.to_numpy(tensor)
        # float32, as on the wire (twinstep.v1.Sketches.values)
        sketches = {b: sk.to_host([sk.sketch(tensor, transpose=transpose)])[0].astype(np.float32)
                    for b, sk in self.sketchers.items()}
        self.records[key] = (full.T if transpose else full, sketches)

    def step(self, step: int, cfg: spec.ModelConfig) -> dict:
        self.records = {}
        ids, tgt = spec.batch(step, 0, cfg)
        self.trainer.train_step(ids, tgt)
        for name, param, _owner, owner_type in self.backend.named_parameters(self.trainer.inner):
            transpose = layout.is_in_out(self.framework, owner_type, name)
            grad = self.backend.grad(param)
            if grad is not None:
                self.add(("grad", name, 0), grad, transpose)
            self.add(("param", name, 0), param, transpose)
        self.trainer.zero_grad()
        return self.records


def compare(base: dict, cand: dict, rows: list[dict], pair: str) -> None:
    tolerances = ToleranceConfig()
    for key, (a, sa) in base.items():
        if key not in cand:
            continue
        b, sb = cand[key]
        if a.shape != b.shape or a.size < 2:
            continue
        exact = from_tensors(a, b)
        a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        tol = tolerances.for_record(key[0], key[1], "float32")
        row = {"pair": pair, "key": key, "numel": a.size, "rel_l2": exact["rel_l2"], "cosine": exact["cosine"],
               "tol_rel_l2": tol["rel_l2"], "tol_cosine": tol["cosine"], "est": {}}
        for buckets in sa:
            e = estimate.from_sketches(sa[buckets], sb[buckets], np.dot(a64, a64), np.dot(b64, b64))
            row["est"][buckets] = (float(e["rel_l2"][0]), float(e["cosine"][0]))
        rows.append(row)


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def report_accuracy(rows: list[dict], bucket_counts: list[int]) -> None:
    resolved = [r for r in rows if r["rel_l2"] >= RESOLVED]
    floor = [r for r in rows if r["rel_l2"] < RESOLVED]
    print(f"\n{len(rows)} record pairs: {len(resolved)} with exact rel_l2 >= {RESOLVED:g}, "
          f"{len(floor)} below (float32 rounding level)")
    print("resolved records: relative error |estimate/exact - 1|; z std = std((estimate/exact - 1)/model std)")
    print(f"{'buckets':>8} | {'rel_l2: median':>14}{'p95':>8}{'max':>8}{'model':>8}{'z std':>7} |"
          f" {'cos gap: median':>15}{'p95':>8}{'max':>8}{'model':>8}{'z std':>7} | {'below: max |est-exact|':>22}")
    for b in bucket_counts:
        exact_r = np.array([r["rel_l2"] for r in resolved])
        est_r = np.array([r["est"][b][0] for r in resolved])
        exact_c = np.array([r["cosine"] for r in resolved])
        est_c = np.array([r["est"][b][1] for r in resolved])
        err_r = est_r / exact_r - 1
        keep = exact_c > 0
        err_c = est_c[keep] / exact_c[keep] - 1
        sr, sc = float(estimate.relative_std("rel_l2", b)), float(estimate.relative_std("cosine", b))
        floor_err = np.array([abs(r["est"][b][0] - r["rel_l2"]) for r in floor] or [0.0])
        print(f"{b:>8} | {pct(abs(err_r), 50):>14.3f}{pct(abs(err_r), 95):>8.3f}{np.abs(err_r).max():>8.3f}{sr:>8.3f}"
              f"{np.std(err_r) / sr:>7.2f} | {pct(abs(err_c), 50):>15.3f}{pct(abs(err_c), 95):>8.3f}"
              f"{np.abs(err_c).max():>8.3f}{sc:>8.3f}{np.std(err_c) / sc:>7.2f} | {floor_err.max():>22.2e}")
    b0 = sketch_def.DEFAULT_BUCKETS
    if b0 in bucket_counts:
        tiny = [r for r in rows if r["rel_l2"] < 1e-6]
        if tiny:
            print(f"  {len(tiny)} records with exact rel_l2 < 1e-6: max |estimate - exact| at {b0} buckets "
                  f"{max(abs(r['est'][b0][0] - r['rel_l2']) for r in tiny):.2e}")
        sr = float(estimate.relative_std("rel_l2", b0))
        worst = sorted(resolved, key=lambda r: -abs(r["est"][b0][0] / r["rel_l2"] - 1))[:3]
        for r in worst:
            print(f"  worst at {b0} buckets: {r['pair']} {r['key']} numel {r['numel']}: exact {r['rel_l2']:.3e}, "
                  f"estimate {r['est'][b0][0]:.3e} (z {(r['est'][b0][0] / r['rel_l2'] - 1) / sr:+.1f})")
    print("verdicts vs the float32 tolerances (rel_l2 and cosine of every record): significantly above /"
          " significantly below / undecided, and how many of each are wrong")
    for b in bucket_counts:
        counts = {"above": [0, 0], "below": [0, 0], "undecided": [0, 0]}  # [total, wrong or truly above]
        for r in rows:
            for metric, idx in (("rel_l2", 0), ("cosine", 1)):
                est_value, tol = r["est"][b][idx], r[f"tol_{metric}"]
                truly_above = r[metric] > tol
                if estimate.significantly_above(metric, est_value, tol, b):
                    verdict, wrong = "above", not truly_above
                elif estimate.significantly_below(metric, est_value, tol, b):
                    verdict, wrong = "below", truly_above
                else:
                    verdict, wrong = "undecided", truly_above
                counts[verdict][0] += 1
                counts[verdict][1] += wrong
        print(f"  {b:>5} buckets: above {counts['above'][0]} ({counts['above'][1]} wrong), below {counts['below'][0]}"
              f" ({counts['below'][1]} wrong), undecided {counts['undecided'][0]} ({counts['undecided'][1]} truly above)")
    for pair in sorted({r["pair"] for r in rows}):
        sel = [r for r in rows if r["pair"] == pair]
        print(f"  {pair}: exact rel_l2 median {np.median([r['rel_l2'] for r in sel]):.2e}, "
              f"max {max(r['rel_l2'] for r in sel):.2e}; exact cosine gap max {max(r['cosine'] for r in sel):.2e}")


def time_calls(fns: dict, reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm up: builds and uploads the sketch plan
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def report_cost(fw: dict, sizes_mb: list[float], reps: int) -> None:
    import paddle
    import torch

    torch.set_num_threads(1)
    print("\ncost per call, median ms (ms/MB); float32 [1024, n/1024] tensors on CPU, 1 thread; sketch = 256 buckets;"
          " sketch(T) = transpose=True (a copy first); first sketch = plan build + upload")
    print(f"{'framework':<9}{'MB':>7}{'numel':>11} | {'sketch':>16}{'sketch(T)':>16}{'device_stats':>16}{'memcpy':>16} | {'first sketch':>12}")
    for framework in ("torch", "paddle"):
        backend, sketcher_type = fw[framework]
        for mb in sizes_mb:
            n = int(mb * 2**20 / 4)
            rows, cols = 1024, max(n // 1024, 1)
            data = np.random.default_rng(0).normal(size=(rows, cols)).astype(np.float32)
            # CPU ops are synchronous: no device sync needed around the timings.
            x = torch.from_numpy(data) if framework == "torch" else paddle.to_tensor(data)
            copy = x.clone
            sk = sketcher_type(sketch_def.SketchSpec())
            start = time.perf_counter()
            sk.sketch(x)
            first = 1000 * (time.perf_counter() - start)
            t = time_calls({"sketch": lambda: sk.sketch(x), "sketch(T)": lambda: sk.sketch(x, transpose=True),
                            "device_stats": lambda: backend.device_stats(x), "memcpy": copy}, reps)
            real_mb = data.nbytes / 2**20
            cells = "".join(f"{t[k]:>8.3f} ({t[k] / real_mb:.3f})".rjust(16) for k in ("sketch", "sketch(T)", "device_stats", "memcpy"))
            print(f"{framework:<9}{real_mb:>7.2f}{data.size:>11} | {cells} | {first:>12.1f}")


def report_shard_cost(fw: dict, reps: int) -> None:
    """A 4096x1024 float32 shard of a logical tensor, by the way it was cut."""
    import paddle
    import torch

    torch.set_num_threads(1)
    rows, cols = 4096, 1024
    data = np.random.default_rng(0).normal(size=(rows, cols)).astype(np.float32)
    print(f"\nshard cost per call, median ms; a [{rows}, {cols}] float32 shard on CPU, 1 thread, 256 buckets; "
          "first = table build + upload; table = cached device bytes")
    cases = {  # name: (block, transpose, hashed)
        "whole tensor": (None, False, False),
        "dim-0 shard of [8192, 1024]": (((2 * rows, cols), (rows, 0)), False, False),
        "last-dim shard of [4096, 2048]": (((rows, 2 * cols), (0, cols)), False, False),
        "  same, hashed on the device": (((rows, 2 * cols), (0, cols)), False, True),
        "[in, out] split on in, of [8192, 1024]": (((2 * rows, cols), (rows, 0)), True, False),
    }
    print(f"{'framework':<9} {'cut':<40}{'ms':>9}{'x whole':>9}{'first ms':>10}{'table MiB':>11}")
    for framework in ("torch", "paddle"):
        sketcher_type = fw[framework][1]
        x = torch.from_numpy(data) if framework == "torch" else paddle.to_tensor(data)
        calls, first, table = {}, {}, {}
        for name, (block, transpose, hashed) in cases.items():
            sk = sketcher_type(sketch_def.SketchSpec(), **({"max_table_elements": 0} if hashed else {}))
            start = time.perf_counter()
            sk.sketch(x, transpose=transpose, block=block)
            first[name] = 1000 * (time.perf_counter() - start)
            table[name] = sum(entry.owned for entry in sk._plans.values()) / 2**20
            calls[name] = functools.partial(sk.sketch, x, transpose=transpose, block=block)
        ms = time_calls(calls, reps)  # interleaved: machine noise hits every cut alike
        for name in cases:
            print(f"{framework:<9} {name:<40}{ms[name]:>9.2f}{ms[name] / ms['whole tensor']:>9.1f}"
                  f"{first[name]:>10.1f}{table[name]:>11.2f}")


def plan_seconds(numel: int, spec: sketch_def.SketchSpec) -> float:
    start = time.perf_counter()
    sketch_def.plan(numel, spec)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--buckets", default="64,128,256,512,1024")
    parser.add_argument("--sizes-mb", default="0.25,4,64")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--shards-only", action="store_true", help="only the cost of sketching shards")
    args = parser.parse_args()
    bucket_counts = [int(b) for b in args.buckets.split(",")]
    fw = frameworks()
    if args.shards_only:
        report_shard_cost(fw, args.reps)
        return 0
    from twinstep.tools.demo.job import LR, PaddleTrainer, TorchTrainer

    cfg = spec.ModelConfig(vocab=512, hidden=args.hidden, heads=4, layers=args.layers, seq=args.seq, batch=args.batch)
    buggy = replace(cfg, tanh_gelu_layers=(1,))
    runs = {
        "torch": Capture("torch", TorchTrainer(cfg, LR, 1), bucket_counts, fw),
        "paddle": Capture("paddle", PaddleTrainer(cfg, LR, 1), bucket_counts, fw),
        "paddle-gelu_tanh": Capture("paddle", PaddleTrainer(buggy, LR, 1), bucket_counts, fw),
    }
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}; "
          f"{args.steps} AdamW steps; torch baseline vs paddle port, faithful and with tanh GELU in layers.1.mlp.act")
    rows: list[dict] = []
    start = time.perf_counter()
    for step in range(args.steps):
        base = runs["torch"].step(step, cfg)
        for name in ("paddle", "paddle-gelu_tanh"):
            compare(base, runs[name].step(step, cfg), rows, f"torch vs {name}")
    print(f"captured and compared in {time.perf_counter() - start:.1f}s; record sizes "
          f"{min(r['numel'] for r in rows)}..{max(r['numel'] for r in rows)} elements")
    report_accuracy(rows, bucket_counts)
    tables = {name: cap.sketchers[sketch_def.DEFAULT_BUCKETS].cached_bytes() for name, cap in runs.items()
              if sketch_def.DEFAULT_BUCKETS in cap.sketchers}
    print("\ncached device tables at 256 buckets for this model: "
          + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in tables.items()))
    default = sketch_def.SketchSpec()
    cells = 2 * default.buckets * default.block
    print(f"  shared per device: torch {(8 * (default.direct_max + cells) + 4 * default.group) / 2**10:.0f} KiB"
          f" + {4 * default.chunk_blocks * default.block / 2**20:.0f} MiB float32 scratch,"
          f" paddle {(4 * (default.direct_max + cells) + 4 * default.group) / 2**10:.0f} KiB")
    for n in (10**6, 10**8):
        p = sketch_def.plan(n, default)
        print(f"  per {n:.0e}-element tensor size: torch {(4 * (p.order.size + p.bag_offsets.size) + 8 * p.direct.size) / 2**20:.2f} MiB,"
              f" paddle {4 * (p.bag_of_block.size + p.direct.size) / 2**20:.2f} MiB (plan build {plan_seconds(n, default):.2f} s)")
    report_cost(fw, [float(s) for s in args.sizes_mb.split(",")], args.reps)
    report_shard_cost(fw, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
