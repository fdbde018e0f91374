"""The demo's training job with a capture fault injected on purpose: ``python -m tests.integration.jobs.faulty_capture``.

Takes the demo job's arguments plus one ``--fault``:

- ``spectrum``: the model also runs an FFT "spectrum" layer on its logits each step
  (a side computation, as a monitoring layer would).  Its output is complex, which
  twinstep cannot read: capture fails for that module on every step, the rest of
  the model is captured and compared as usual.
- ``stats-until=N``: every statistic raises until step N, then capture recovers (as
  a library missing a function, or a kernel not yet loaded, would): steps 0 to N-1
  are whole-step gaps.

Training itself is unchanged in both cases.
"""

from __future__ import annotations

import sys
from typing import Any

from twinstep.tools.demo import job


def _add_spectrum(framework: str) -> None:
    """Wrap the demo's build_model so the model holds a layer whose output is complex."""
    if framework == "torch":
        import torch

        from twinstep.tools.demo import model_torch as models

        class Spectrum(torch.nn.Module):
            def forward(self, x: Any) -> Any:
                return torch.fft.rfft(x, dim=-1)
    else:
        import paddle

        from twinstep.tools.demo import model_paddle as models

        class Spectrum(paddle.nn.Layer):  # type: ignore[no-redef]
            def forward(self, x: Any) -> Any:
                return paddle.fft.rfft(x, axis=-1)
    build = models.build_model

    def build_with_spectrum(cfg: Any, weights: Any) -> Any:
        model = build(cfg, weights)
        model.spectrum = Spectrum()
        forward = model.forward

        def forward_and_spectrum(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            model.spectrum(out.detach())  # looked at, not trained through
            return out

        model.forward = forward_and_spectrum
        return model

    models.build_model = build_with_spectrum


def _fail_stats_until(step: int) -> None:
    """Every statistic raises until the training reaches ``step``."""
    import twinstep.runtime.api
    from twinstep.wire import stats

    current = [0]
    step_method = twinstep.runtime.api.Monitor.step

    def counting_step(self: Any, loss: Any = None) -> None:
        step_method(self, loss)
        current[0] = self.current_step

    host_row = stats.host_row

    def failing_host_row(*args: Any, **kwargs: Any) -> Any:
        if current[0] < step:
            raise AttributeError("module 'numpy' has no attribute 'vecdot' (injected by the test)")
        return host_row(*args, **kwargs)

    twinstep.runtime.api.Monitor.step = counting_step
    stats.host_row = failing_host_row


def main(argv: list[str]) -> int:
    fault = next((a.split("=", 1)[1] for a in argv if a.startswith("--fault=")), None)
    rest = [a for a in argv if not a.startswith("--fault=")]
    framework = rest[rest.index("--framework") + 1]
    if fault == "spectrum":
        _add_spectrum(framework)
    elif fault and fault.startswith("stats-until="):
        _fail_stats_until(int(fault.split("=", 1)[1]))
    else:
        raise SystemExit(f"unknown --fault={fault!r}")
    return job.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
