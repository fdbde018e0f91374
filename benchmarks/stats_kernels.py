"""Per-MB cost of per-tensor statistics variants against a memcpy, torch and paddle, in one run.

    python benchmarks/stats_kernels.py [--framework torch|paddle|both] [--reps 15] [--cold]

Single-threaded like the demo trainers (torch.set_num_threads(1), OMP_NUM_THREADS=1).
Variants run round-robin, so machine noise hits them alike; each figure is the
median over the repetitions.  --cold evicts the caches (reads 96 MB) before
every call, as for weights and gradients, which were last touched long ago;
without it the tensor sits in cache, as a module output just written does.
"chosen" is the backend's device_stats as shipped, with the one-pass kernel
(twinstep.runtime.kernels, loaded here before timing), "numpy passes" the same
without it (TWINSTEP_JIT=0: one numpy or framework pass per
reduction); "/mean" the same on a
large-mean tensor (1e4 + N(0, 1)), which takes the second, shifted pass;
"device" the no-sync accelerator path run on CPU.  The last table gives the
relative error of m2 on a large-mean tensor against float64, where naive
float32 formulas lose every digit.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from twinstep.runtime import kernels  # noqa: E402

SIZES = (1 << 10, 1 << 18, 1 << 20, 1 << 22)  # float32 elements: 4 KB .. 16 MB


_EVICT: list[np.ndarray] = []


def run(variants: dict[str, Callable[[Any], Any]], tensors: dict[str, Any], reps: int) -> dict[str, float]:
    """Median seconds per call of each variant, round-robin over repetitions."""
    for name, fn in variants.items():
        fn(tensors[name])
        fn(tensors[name])
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            x = tensors[name]
            for buffer in _EVICT:
                np.add.reduce(buffer)
            start = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


_KERNEL = kernels._LOADER  # the process's kernel loader, whichever one a variant swapped in last


def kernel_loaders() -> tuple[Any, Any]:
    """(loaded, off): the one-pass kernel ready, and a loader that never serves (the numpy passes)."""
    start = time.perf_counter()
    ready = _KERNEL.wait(120)
    print(f"one-pass kernel (numba): {'ready' if ready else 'FAILED: ' + _KERNEL.state} "
          f"in {time.perf_counter() - start:.1f} s")
    saved = os.environ.get(kernels.ENV_SWITCH)
    os.environ[kernels.ENV_SWITCH] = "0"
    off = kernels._Loader()
    if saved is None:
        del os.environ[kernels.ENV_SWITCH]
    else:
        os.environ[kernels.ENV_SWITCH] = saved
    return _KERNEL, off


def with_loader(loader: Any, stats_row: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def row(x: Any) -> Any:
        kernels._LOADER = loader
        return stats_row(x)

    return row


def report(
    framework: str, make: Callable[[np.ndarray], Any], variants: dict[str, Callable[[Any], Any]], reps: int
) -> None:
    rng = np.random.default_rng(0)
    print(f"\n{framework}: ms per MB (us per call), ratio to memcpy")
    print(f"{'variant':<16}" + "".join(f"{f'{n * 4 / 1e6:.3g} MB':>24}" for n in SIZES))
    results: dict[int, dict[str, float]] = {}
    for n in SIZES:
        normal = make(rng.normal(0.1, 1.0, n).astype(np.float32))
        large_mean = make((1e4 + rng.standard_normal(n)).astype(np.float32))
        tensors = {name: large_mean if name.endswith("/mean") else normal for name in variants}
        results[n] = run(variants, tensors, reps if n > 1 << 16 else 10 * reps)
    for name in variants:
        cells = []
        for n in SIZES:
            t, mb = results[n][name], n * 4 / 1e6
            cells.append(f"{1e3 * t / mb:8.3f} ({1e6 * t:7.0f}) x{t / results[n]['memcpy']:5.1f}")
        print(f"{name:<16}" + "".join(f"{c:>24}" for c in cells))


def m2_errors(rows: dict[str, Callable[[np.ndarray], float]]) -> None:
    x = (1e4 + np.random.default_rng(1).standard_normal(1 << 22)).astype(np.float32)
    wide = x.astype(np.float64)
    d = wide - math.fsum(wide) / wide.size
    exact = math.fsum(d * d) - math.fsum(d) ** 2 / wide.size
    print("\nm2 relative error, 1e4 + N(0, 1), 4M float32 elements (float64 reference)")
    for name, fn in rows.items():
        print(f"{name:<34}{abs(fn(x) - exact) / exact:10.2e}")


def torch_section(reps: int) -> None:
    import torch

    from twinstep.runtime.capture.torch import TorchBackend
    from twinstep.runtime.capture.torch.backend import _device_row

    torch.set_num_threads(1)
    backend = TorchBackend()
    loaded, off = kernel_loaders()

    buffers: dict[int, torch.Tensor] = {}

    def memcpy(x: torch.Tensor) -> None:
        out = buffers.get(x.numel())
        if out is None:
            out = buffers[x.numel()] = torch.empty_like(x)
        out.copy_(x)

    def naive(x: torch.Tensor) -> list[float]:  # eager counting and abs() temporaries
        return torch.stack([x.sum(), (x * x).sum(), x.min(), x.max(), x.abs().max(), torch.isnan(x).sum().float(),
                            torch.isinf(x).sum().float()]).tolist()

    def before(x: torch.Tensor) -> list[float]:  # the backend's first version: no m2
        total, sum_sq = x.sum().double(), (x * x).sum().double()
        lo, hi = torch.aminmax(x)
        bool(torch.isfinite(total))  # the old code branched on it
        return torch.stack([total, sum_sq, lo.double(), hi.double()]).tolist()

    def var_mean(x: torch.Tensor) -> list[float]:  # Welford: stable, one kernel
        v, m = torch.var_mean(x, correction=0)
        lo, hi = torch.aminmax(x)
        return torch.stack([v, m, lo, hi]).tolist()

    variants: dict[str, Callable[[Any], Any]] = {
        "memcpy": memcpy,
        "naive": naive,
        "before": before,
        "var_mean+aminmax": var_mean,
        "dot (drifts)": lambda x: float(torch.dot(x, x)),
        "chosen": with_loader(loaded, backend.device_stats),
        "chosen/mean": with_loader(loaded, backend.device_stats),
        "numpy passes": with_loader(off, backend.device_stats),
        "numpy/mean": with_loader(off, backend.device_stats),
        "device": lambda x: _device_row(x).tolist(),
    }
    report(f"torch {torch.__version__}", lambda a: torch.from_numpy(a), variants, reps)

    def naive_m2(a: np.ndarray) -> float:
        x = torch.from_numpy(a)
        return float((x * x).sum()) - float(x.sum()) ** 2 / a.size

    m2_errors({
        "torch naive (sum_sq - sum^2/n)": naive_m2,
        "torch var_mean * n": lambda a: float(torch.var_mean(torch.from_numpy(a), correction=0)[0]) * a.size,
        "torch chosen": lambda a: with_loader(loaded, backend.device_stats)(torch.from_numpy(a))[-1],
        "torch numpy passes": lambda a: with_loader(off, backend.device_stats)(torch.from_numpy(a))[-1],
        "torch device path": lambda a: float(_device_row(torch.from_numpy(a))[-1]),
    })


def paddle_section(reps: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import paddle

    from twinstep.runtime.capture.paddle import PaddleBackend
    from twinstep.runtime.capture.paddle.backend import _device_row

    paddle.set_device("cpu")
    backend = PaddleBackend()
    loaded, off = kernel_loaders()
    buffers: dict[int, Any] = {}

    def memcpy(x: Any) -> None:
        n = x.shape[0]
        if n not in buffers:
            buffers[n] = paddle.empty_like(x)
        paddle.assign(x, output=buffers[n])

    def before(x: Any) -> list[float]:  # the backend's first version: paddle ops, no m2
        total = paddle.sum(x).astype("float64")
        sum_sq = paddle.sum(x * x).astype("float64")
        lo, hi = paddle.min(x).astype("float64"), paddle.max(x).astype("float64")
        bool(paddle.isfinite(total))
        return paddle.stack([total, sum_sq, lo, hi, paddle.maximum(-lo, hi)]).numpy().tolist()

    variants: dict[str, Callable[[Any], Any]] = {
        "memcpy": memcpy,
        "before": before,
        "vector_norm": lambda x: paddle.linalg.vector_norm(x).item(),
        "var": lambda x: paddle.var(x, unbiased=False).item(),
        "chosen": with_loader(loaded, backend.device_stats),
        "chosen/mean": with_loader(loaded, backend.device_stats),
        "numpy passes": with_loader(off, backend.device_stats),
        "numpy/mean": with_loader(off, backend.device_stats),
        "device": lambda x: _device_row(x).numpy(),
    }
    report(f"paddle {paddle.__version__}", lambda a: paddle.to_tensor(a), variants, reps)

    def naive_m2(a: np.ndarray) -> float:
        x = paddle.to_tensor(a)
        return float(paddle.sum(x * x).item()) - float(paddle.sum(x).item()) ** 2 / a.size

    m2_errors({
        "paddle naive (sum_sq - sum^2/n)": naive_m2,
        "paddle var * n": lambda a: float(paddle.var(paddle.to_tensor(a), unbiased=False).item()) * a.size,
        "paddle chosen": lambda a: with_loader(loaded, backend.device_stats)(paddle.to_tensor(a))[-1],
        "paddle numpy passes": lambda a: with_loader(off, backend.device_stats)(paddle.to_tensor(a))[-1],
        "paddle device path": lambda a: float(_device_row(paddle.to_tensor(a)).numpy()[-1]),
    })


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "paddle", "both"), default="both")
    parser.add_argument("--reps", type=int, default=15, help="repetitions per variant (x10 for the smallest size)")
    parser.add_argument("--cold", action="store_true", help="evict the caches before every call")
    args = parser.parse_args()
    if args.cold:
        _EVICT.append(np.ones(24 << 20, dtype=np.float32))
    if args.framework in ("torch", "both"):
        torch_section(args.reps)
    if args.framework in ("paddle", "both"):
        paddle_section(args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
