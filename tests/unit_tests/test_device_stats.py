"""The capture backends' device statistics against twinstep.wire.stats.of_array (float64).

Each backend has two implementations: the CPU path (a few vectorised passes,
branches on host values, which costs nothing on CPU) and the device path used
for accelerators (no host synchronisation).  Both run here on CPU tensors; the
CUDA tests at the end run only where CUDA exists.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from tests.unit_tests.test_stats import _exact_m2, _rng
from tests.conftest import use_kernels, use_numpy_path
from twinstep.runtime import _kernels_numba
from twinstep.wire import stats
from twinstep.v1 import twinstep_pb2 as pb

N_FIELDS = len(stats.DEVICE_FIELDS)
SUM, SUM_SQ, MIN, MAX, ABS_MAX, NAN, INF, M2 = range(N_FIELDS)


class _Torch:
    name = "torch"

    def __init__(self):
        import torch

        from twinstep.runtime.capture.torch import TorchBackend
        from twinstep.runtime.capture.torch.backend import _device_row

        self.torch = torch
        self.backend = TorchBackend()
        self._device_row = _device_row

    def make(self, array: np.ndarray, dtype: str):
        t = self.torch.from_numpy(np.ascontiguousarray(array))
        return t.to(getattr(self.torch, dtype))

    def transpose(self, tensor):
        return tensor.t()

    def exact_values(self, tensor) -> np.ndarray:
        """The tensor's values as float64 (exact for every dtype used here)."""
        return tensor.to(self.torch.float64).numpy()

    def device_path(self, tensor):
        """The accelerator implementation, run on a CPU tensor."""
        x = tensor
        if not x.is_floating_point():
            x = x.to(self.torch.float64)
        elif x.dtype in (self.torch.float16, self.torch.bfloat16):
            x = x.float()
        return self._device_row(x)

    def is_lazy(self, handle) -> bool:
        return isinstance(handle, self.torch.Tensor)


class _Paddle:
    name = "paddle"

    def __init__(self):
        import paddle

        from twinstep.runtime.capture.paddle import PaddleBackend
        from twinstep.runtime.capture.paddle.backend import _device_row

        self.paddle = paddle
        self.backend = PaddleBackend()
        self._device_row = _device_row

    def make(self, array: np.ndarray, dtype: str):
        source = np.ascontiguousarray(array)
        if dtype == "bool" or source.dtype == np.bool_:
            return self.paddle.to_tensor(source).astype(dtype)
        # astype from float64 rounds once, like torch's .to()
        return self.paddle.to_tensor(source.astype(np.float64)).astype(dtype)

    def transpose(self, tensor):
        return self.paddle.transpose(tensor, [1, 0])

    def exact_values(self, tensor) -> np.ndarray:
        return tensor.astype("float64").numpy()

    def device_path(self, tensor):
        name = str(tensor.dtype).rsplit(".", 1)[-1]
        x = tensor
        if name in ("float16", "bfloat16"):
            x = x.astype("float32")
        elif name not in ("float32", "float64"):
            x = x.astype("float64")
        return self._device_row(x)

    def is_lazy(self, handle) -> bool:
        return isinstance(handle, self.paddle.Tensor)


_FRAMEWORKS = {"torch": _Torch, "paddle": _Paddle}
_made: dict[str, object] = {}


def _framework(name: str):
    if name not in _made:
        pytest.importorskip(name)
        _made[name] = _FRAMEWORKS[name]()
    return _made[name]


@pytest.fixture(autouse=True)
def _numpy_path_unless_asked(monkeypatch):
    """Tests see the multi-pass numpy path unless they ask for the compiled kernels (``use_kernels``)."""
    use_numpy_path(monkeypatch)


@pytest.fixture(params=["torch", "paddle", "torch-kernel", "paddle-kernel"])
def fw(request, monkeypatch):
    """A backend; ``-kernel``: with the one-pass kernel loaded."""
    name, _, kernel = request.param.partition("-")
    if kernel:
        use_kernels(monkeypatch)
    return _framework(name)


@pytest.fixture(params=["torch-cpu", "torch-kernel", "torch-device", "paddle-cpu", "paddle-kernel", "paddle-device"])
def impl(request, monkeypatch):
    """(framework, row function): each backend's implementations, on CPU tensors.

    ``cpu`` is the CPU path with numpy's passes, ``kernel`` the same with the
    one-pass kernel loaded, ``device`` the accelerator path.
    """
    name, path = request.param.split("-")
    framework = _framework(name)
    if path == "kernel":
        use_kernels(monkeypatch)
    if path in ("cpu", "kernel"):
        return framework, lambda t: _host(framework, framework.backend.device_stats(t))
    return framework, lambda t: _host(framework, framework.device_path(t))


def _host(fw, handle) -> np.ndarray:
    host = fw.backend.stats_to_host([handle])
    assert isinstance(host, np.ndarray)
    assert host.shape == (1, N_FIELDS)
    assert host.dtype == np.float64
    return host[0]


def _assert_matches_reference(row: np.ndarray, exact: np.ndarray, rtol: float, m2_rtol: float | None = None):
    """Counts and extrema exact; sums within rtol (sum relative to the sum of magnitudes); m2 within m2_rtol."""
    ref = stats.of_array(exact)
    got = dict(zip(stats.DEVICE_FIELDS, row.tolist()))
    assert got["nan_count"] == ref["nan_count"][0]
    assert got["inf_count"] == ref["inf_count"][0]
    for name in ("min", "max", "abs_max"):
        assert got[name] == ref[name][0], name
    finite = exact[np.isfinite(exact)]
    assert abs(got["sum"] - ref["sum"][0]) <= rtol * np.abs(finite).sum(), (got["sum"], ref["sum"][0])
    assert got["sum_sq"] == pytest.approx(ref["sum_sq"][0], rel=rtol, abs=1e-300)
    assert got["m2"] == pytest.approx(_exact_m2(exact), rel=m2_rtol or rtol, abs=1e-300), "m2"


# Backends may accumulate float32 (and widened float16/bfloat16) in float32 with a
# pairwise/cascade/row-wise reduction: far below 1e-6 relative at these sizes, while
# any mistake (wrong field, no widening, squares not summed) is off by far more.
# float64 tensors and integers (converted to float64) are summed in float64.
ACC_RTOL = {"float32": 1e-6, "float16": 1e-6, "bfloat16": 1e-6, "float64": 1e-12, "int64": 1e-12}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_random_floats(impl, dtype):
    fw, row_of = impl
    x = _rng().normal(0.5, 3.0, size=(64, 48))
    t = fw.make(x, dtype)
    _assert_matches_reference(row_of(t), fw.exact_values(t), ACC_RTOL[dtype])


@pytest.mark.parametrize("n", [1000, (1 << 15) + 1, 3 * 1024 * 41, 300_001])
def test_sizes_with_and_without_ragged_rows(impl, n):
    # Sums of squares run over 1024-element rows plus a ragged tail; from 32K elements
    # the framework's own sum (and torch's aminmax) replace numpy's.
    fw, row_of = impl
    t = fw.make(_rng().normal(-0.2, 1.5, size=n), "float32")
    _assert_matches_reference(row_of(t), fw.exact_values(t), 1e-6)


@pytest.mark.parametrize("dtype", ["int64", "int32", "int8", "uint8"])
def test_integers(impl, dtype):
    fw, row_of = impl
    x = _rng().integers(0 if dtype == "uint8" else -100, 100, size=(17, 9))
    row = row_of(fw.make(x, dtype))
    ref = stats.of_array(x)
    # small integers: sums exact in float64 up to the rounding of m2 + sum**2/n (device path)
    np.testing.assert_allclose(row[:M2], np.array([ref[f][0] for f in stats.DEVICE_FIELDS[:M2]]), rtol=1e-14)
    assert row[M2] == pytest.approx(_exact_m2(x), rel=1e-12)


def test_bool(impl):
    fw, row_of = impl
    x = np.array([[True, False, True], [True, True, False]])
    row = row_of(fw.make(x, "bool"))
    ref = stats.of_array(x.astype(np.float64))
    np.testing.assert_allclose(row, np.array([ref[f][0] for f in stats.DEVICE_FIELDS]), rtol=1e-15)
    assert row[SUM] == 4 and row[MAX] == 1 and row[MIN] == 0 and row[M2] == pytest.approx(4 / 3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_empty_tensor(fw, dtype):
    t = fw.make(np.zeros((0, 4)), dtype)
    row = _host(fw, fw.backend.device_stats(t))
    np.testing.assert_array_equal(row, np.zeros(N_FIELDS))


def test_scalar_single_element_and_constant_tensors(impl):
    fw, row_of = impl
    scalar = row_of(fw.make(np.array(3.0), "float32"))  # a loss
    np.testing.assert_array_equal(scalar, [3.0, 9.0, 3.0, 3.0, 3.0, 0, 0, 0])
    one = row_of(fw.make(np.array([-2.5]), "float32"))
    np.testing.assert_array_equal(one, [-2.5, 6.25, -2.5, -2.5, 2.5, 0, 0, 0])
    const = row_of(fw.make(np.full((40, 1000), 0.1), "float32"))
    assert const[M2] == 0.0
    assert const[SUM] == pytest.approx(40_000 * float(np.float32(0.1)), rel=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_nan_inf_counts_and_finite_moments(impl, dtype):
    fw, row_of = impl
    x = _rng().normal(0.0, 2.0, size=200)
    x[[5, 17, 99]] = np.nan
    x[[0, 150]] = np.inf
    x[77] = -np.inf
    t = fw.make(x, dtype)
    exact = fw.exact_values(t)
    ref = stats.of_array(exact)
    assert ref["nan_count"][0] == 3 and ref["inf_count"][0] == 3  # the reference itself is right
    row = row_of(t)
    _assert_matches_reference(row, exact, ACC_RTOL[dtype])
    assert np.all(np.isfinite(row))


def test_nan_in_a_large_mean_tensor_keeps_a_stable_m2(impl):
    fw, row_of = impl
    x = 1e4 + _rng().standard_normal(100_000)
    x[[10, 5000]] = [np.nan, -np.inf]
    t = fw.make(x, "float32")
    _assert_matches_reference(row_of(t), fw.exact_values(t), 1e-6, m2_rtol=1e-5)


def test_only_nonfinite(impl):
    fw, row_of = impl
    row = row_of(fw.make(np.array([np.nan, np.inf, np.nan, -np.inf]), "float32"))
    assert row[NAN] == 2 and row[INF] == 2
    np.testing.assert_array_equal(row[[SUM, SUM_SQ, MIN, MAX, ABS_MAX, M2]], np.zeros(6))


@pytest.mark.parametrize("n", [1_000_000, 1_000_003])
def test_large_mean_m2_is_stable(impl, n):
    # mean 1e4, std 1: float32 sum_sq/n - mean^2 keeps no correct digit of the variance
    # (asserted below), so m2 must come from a stable scheme.
    fw, row_of = impl
    x = (1e4 + _rng().standard_normal(n)).astype(np.float32)
    exact = x.astype(np.float64)
    row = row_of(fw.make(x, "float32"))
    m2 = _exact_m2(exact)
    assert abs(row[M2] - m2) / m2 < 1e-5
    assert abs(row[SUM_SQ] - exact @ exact) / (exact @ exact) < 1e-6
    assert abs(row[SUM] - exact.sum()) / exact.sum() < 1e-6
    assert row[MIN] == exact.min() and row[MAX] == exact.max() and row[ABS_MAX] == exact.max()
    assert row[NAN] == 0 and row[INF] == 0
    naive = float(np.float32((x * x).sum()) - np.float32(x.sum()) ** 2 / np.float32(n))
    assert abs(naive - m2) / m2 > 1e-2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_large_mean_half_precision(impl, dtype):
    fw, row_of = impl
    t = fw.make(200.0 + _rng().standard_normal(50_000), dtype)
    exact = fw.exact_values(t)
    _assert_matches_reference(row_of(t), exact, 1e-6, m2_rtol=1e-5)


def test_positive_data_near_the_shifted_pass_threshold(impl):
    # uniform(0, 1): sum_sq/m2 = 4, at the fast formula's limit; mean 0.5 with tiny spread
    # relative to it in between.  Both must meet the m2 budget.
    fw, row_of = impl
    for x in (_rng().uniform(0, 1, 400_000), 0.5 + 0.3 * _rng().uniform(0, 1, 400_000)):
        t = fw.make(x, "float32")
        _assert_matches_reference(row_of(t), fw.exact_values(t), 1e-6, m2_rtol=2e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sum_sq_does_not_overflow_for_finite_values(fw, dtype):
    x = np.array([3e19, -1.0, 2.0, -2e19])
    t = fw.make(x, dtype)
    exact = fw.exact_values(t)
    row = _host(fw, fw.backend.device_stats(t))
    assert row[SUM_SQ] == pytest.approx(stats.of_array(exact)["sum_sq"][0], rel=1e-12)
    assert row[M2] == pytest.approx(_exact_m2(exact), rel=1e-12)


def test_sum_sq_does_not_underflow_for_tiny_values(fw):
    # float32 squares of 1e-25 are 0: tiny gradients must not report rms 0.
    x = 1e-25 * _rng().normal(1.0, 1.0, size=100_000)
    t = fw.make(x, "float32")
    exact = fw.exact_values(t)
    _assert_matches_reference(_host(fw, fw.backend.device_stats(t)), exact, 1e-9)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_non_contiguous(impl, dtype):
    fw, row_of = impl
    x = _rng().normal(size=(30, 20)) * 10
    if dtype == "int64":
        x = np.round(x)
    base = fw.make(x, dtype)
    t = fw.transpose(base)
    assert tuple(t.shape) == (20, 30)
    exact = fw.exact_values(t)
    np.testing.assert_array_equal(exact, fw.exact_values(base).T)
    _assert_matches_reference(row_of(t), exact, ACC_RTOL[dtype])


def test_large_non_contiguous(impl):
    # A permuted dense tensor (read in memory order) and a sliced one (strided rows).
    fw, row_of = impl
    t = fw.transpose(fw.make(_rng().normal(0.1, 1.0, size=(300, 700)), "float32"))
    _assert_matches_reference(row_of(t), fw.exact_values(t), 1e-6)
    sliced = fw.make(_rng().normal(0.1, 1.0, size=(400, 600)), "float32")[:, 100:500]
    _assert_matches_reference(row_of(sliced), fw.exact_values(sliced), 1e-6)


def test_stats_to_host_stacks_in_order(fw):
    arrays = [np.array([1.0, 2.0]), np.array([-5.0]), np.zeros((0,)), np.array([np.nan, 4.0])]
    tensors = [fw.make(a, "float32") for a in arrays]
    # CPU rows and device-path rows mixed in one step, as a model split across devices would give.
    handles = [fw.backend.device_stats(t) if i % 2 else fw.device_path(t) if t.shape[0] else fw.backend.device_stats(t)
               for i, t in enumerate(tensors)]
    assert fw.is_lazy(handles[0]) and not fw.is_lazy(handles[1])
    host = fw.backend.stats_to_host(handles)
    assert host.shape == (4, N_FIELDS) and host.dtype == np.float64
    for i, a in enumerate(arrays):
        ref = stats.of_array(a)
        np.testing.assert_allclose(host[i], [ref[f][0] for f in stats.DEVICE_FIELDS], rtol=1e-7, err_msg=str(i))
    empty = fw.backend.stats_to_host([])
    assert empty.shape == (0, N_FIELDS) and empty.dtype == np.float64


def test_float16_widened(impl):
    # Values near the float16 maximum: squaring in float16 would overflow.
    fw, row_of = impl
    x = np.array([60000.0, -65504.0, 1.0, 300.0])
    t = fw.make(x, "float16")
    row = row_of(t)
    assert np.isfinite(row[SUM_SQ])
    _assert_matches_reference(row, fw.exact_values(t), ACC_RTOL["float16"])
    assert row[ABS_MAX] == 65504.0


def _peak_numpy_bytes(fn) -> int:
    """Largest numpy allocation outstanding while fn runs (numpy reports to tracemalloc)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_cpu_path_writes_no_full_size_temporary(fw):
    # "No extra copies on the training thread": computing the statistics of a 16 MB
    # float32 tensor allocates far less than its size (x*x would allocate 16 MB), and
    # a large-mean tensor only the one x - mean of the shifted pass.
    for mean in (0.0, 100.0):
        t = fw.make(mean + _rng().standard_normal(4_000_000), "float32")
        nbytes = 4 * 4_000_000
        fw.backend.device_stats(t)
        limit = nbytes // 16 if mean == 0.0 else nbytes + nbytes // 16
        assert _peak_numpy_bytes(lambda: fw.backend.device_stats(t)) <= limit, mean
        if fw.name == "torch":
            torch = fw.torch
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                fw.backend.device_stats(t)
            assert max((e.cpu_memory_usage for e in prof.events()), default=0) <= nbytes // 16


@pytest.mark.parametrize("name", ["torch", "paddle"])
def test_cpu_statistics_take_the_compiled_kernel_once_loaded(name, monkeypatch):
    fw = _framework(name)
    use_kernels(monkeypatch)
    real, sizes = _kernels_numba.moments, []
    monkeypatch.setattr(_kernels_numba, "moments", lambda a: sizes.append(a.size) or real(a))
    t = fw.make(_rng().normal(0.3, 2.0, size=(64, 4096)), "float32")
    _assert_matches_reference(_host(fw, fw.backend.device_stats(t)), fw.exact_values(t), 1e-6)
    _assert_matches_reference(_host(fw, fw.backend.device_stats(fw.transpose(t))), fw.exact_values(t), 1e-6)
    small = fw.make(_rng().normal(size=300), "float64")
    _assert_matches_reference(_host(fw, fw.backend.device_stats(small)), fw.exact_values(small), 1e-12)
    assert sizes == [64 * 4096, 64 * 4096, 300]  # a transposed tensor is read in memory order


# -- the recorder computes each tensor's statistics once per step -----------------------


def _wrapped(framework: str, in_place: bool):
    """root(x) = inner(x), optionally scaled in place after inner's hook has run."""
    if framework == "torch":
        torch = _framework("torch").torch

        class Wrapper(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = torch.nn.Linear(64, 64)

            def forward(self, x):
                y = self.inner(x)
                return y.mul_(2.0) if in_place else y

        torch.manual_seed(0)
        return Wrapper(), torch.randn(8, 64)
    paddle = _framework("paddle").paddle

    class PWrapper(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.inner = paddle.nn.Linear(64, 64)

        def forward(self, x):
            y = self.inner(x)
            return y.scale_(2.0) if in_place else y

    paddle.seed(0)
    return PWrapper(), paddle.randn([8, 64])


@pytest.mark.parametrize("framework", ["torch", "paddle"])
@pytest.mark.parametrize("in_place", [False, True])
def test_recorder_reuses_statistics_of_a_tensor_recorded_twice(framework, in_place):
    # The root returns its child's output (and autograd hands both the same gradient):
    # one pass each, unless the tensor was modified in place in between.
    from twinstep.runtime.capture import CaptureConfig, Recorder

    model, x = _wrapped(framework, in_place)
    fw = _framework(framework)
    backend = type(fw.backend)()
    recorder = Recorder(model, backend, CaptureConfig(parameters=False, inputs=False))
    calls = []
    compute = backend.device_stats
    backend.device_stats = lambda t: calls.append(t) or compute(t)
    (model(x) ** 2).mean().backward()
    batch = recorder.finish_step(0, None)
    ids = {m.name: m.id for m in recorder.take_new_modules()}
    rows = {(int(p), int(t)): r for p, t, r in zip(batch.phase, batch.target, batch.device_stats)}
    root_fwd, inner_fwd = rows[(pb.FORWARD, ids[""])], rows[(pb.FORWARD, ids["inner"])]
    root_bwd, inner_bwd = rows[(pb.BACKWARD, ids[""])], rows[(pb.BACKWARD, ids["inner"])]
    if in_place:  # y*2 in place: new values forward, and the gradient before it is twice the one after
        assert root_fwd[SUM_SQ] == pytest.approx(4 * inner_fwd[SUM_SQ], rel=1e-6)
        assert inner_bwd[SUM_SQ] == pytest.approx(4 * root_bwd[SUM_SQ], rel=1e-6)
        assert len(calls) == 4
        return
    np.testing.assert_array_equal(root_fwd, inner_fwd)
    np.testing.assert_array_equal(root_bwd, inner_bwd)
    # torch hands both gradient hooks one tensor object; paddle wraps the gradient anew for
    # each hook, recognised by buffer, shape, strides and dtype (the recorder holds the first
    # handle until the step ends, so its address cannot be reused meanwhile): one pass each.
    assert len(calls) == 2


# -- CUDA: statistics stay on the device, one copy per step ---------------------------


def _cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return _framework("torch")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_torch_cuda_matches_reference_without_sync(dtype):
    fw = _cuda_torch()
    torch = fw.torch
    x = 1e3 + _rng().normal(0.0, 2.0, size=300_000)
    x[[7, 9]] = [np.nan, np.inf]
    t = fw.make(x, dtype).cuda()
    handle = fw.backend.device_stats(t)
    assert isinstance(handle, torch.Tensor) and handle.is_cuda  # still on the device
    _assert_matches_reference(_host(fw, handle), fw.exact_values(t.cpu()), 1e-5)


def test_torch_cuda_step_leaves_in_one_copy():
    fw = _cuda_torch()
    torch = fw.torch
    tensors = [torch.randn(1000, device="cuda") + i for i in range(50)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        handles = [fw.backend.device_stats(t) for t in tensors]
        torch.cuda.synchronize()
    copies = [e for e in prof.events() if "Memcpy DtoH" in e.name or "memcpy" in e.name.lower() and "DtoH" in e.name]
    assert not copies  # device_stats never copies to the host
    host = fw.backend.stats_to_host(handles)
    for i, t in enumerate(tensors):
        ref = stats.of_array(t.cpu().double().numpy())
        assert host[i, SUM] == pytest.approx(ref["sum"][0], rel=1e-5, abs=1e-3)


def test_paddle_gpu_matches_reference():
    paddle = pytest.importorskip("paddle")
    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        pytest.skip("CUDA not available")
    fw = _framework("paddle")
    x = 1e3 + _rng().normal(0.0, 2.0, size=300_000)
    x[[7, 9]] = [np.nan, np.inf]
    t = fw.make(x, "float32").cuda()
    handle = fw.backend.device_stats(t)
    assert isinstance(handle, paddle.Tensor) and not handle.place.is_cpu_place()
    _assert_matches_reference(_host(fw, handle), fw.exact_values(t.cpu()), 1e-5)
