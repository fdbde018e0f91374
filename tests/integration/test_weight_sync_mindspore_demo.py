"""Weight sync between real jobs: a torch demo baseline shares its weights, the MindSpore port starts from them.

The MindSpore candidate builds its model from another seed's random weights
(the demo job's --init-from-baseline): only twinstep's weight sync makes it
the baseline's, under MindSpore's own parameter names (gamma, beta,
embedding_table), so the pair is aligned from step 0.  Skips where MindSpore
is not installed or runs with numpy 2 (its 2.x wheels are built against numpy 1.x).
"""

from __future__ import annotations


import numpy as np

from tests.mindspore_env import skip_module_without_mindspore

skip_module_without_mindspore()

from twinstep.tools.demo import spec  # noqa: E402

STEPS = 4


def test_a_mindspore_port_from_its_own_random_weights_loads_the_torch_baselines_and_stays_aligned(server, jobs):
    cfg = spec.ModelConfig()
    own, baselines = spec.init_weights(spec.ModelConfig(seed=cfg.seed + 1)), spec.init_weights(cfg)
    assert not np.array_equal(own["embed.weight"], baselines["embed.weight"])  # the port's start differs
    torch_job = jobs("torch", server=server.address, session="ms-weights", baseline=True, steps=STEPS,
                     extra=["--share-weights"])
    ms_job = jobs("mindspore", server=server.address, session="ms-weights", steps=STEPS,
                  extra=["--init-from-baseline"])
    results = [job.wait() for job in (torch_job, ms_job)]
    assert all(r.returncode == 0 for r in results), "\n".join(r.output[-3000:] for r in results)

    report = server.report("ms-weights")
    assert report["status"] == "aligned", report["first_divergence"]
    assert report["steps_compared"] == STEPS
    assert report["unmatched"] == {"baseline": [], "candidate": []}
    sync = next(r for r in report["runs"] if r["name"] == "mindspore")["weight_sync"]
    assert sync["baseline_run"] == "torch" and sync["baseline_framework"] == "torch"
    assert not sync.get("no_counterpart") and not sync.get("unused")
    loaded = {w["name"]: w for w in sync["loaded"]}
    assert len(loaded) == len(baselines)  # every parameter of the model
    assert loaded["embed.embedding_table"]["sources"] == ["embed.weight"]
    assert loaded["layers.0.ln1.gamma"]["sources"] == ["layers.0.ln1.weight"]
    assert loaded["layers.1.ln2.beta"]["sources"] == ["layers.1.ln2.bias"]
    assert not any(any(w["transposed"]) for w in loaded.values())  # Dense is [out, in], as torch's Linear
    torch_losses, ms_losses = (r.result["losses"] for r in results)
    np.testing.assert_allclose(ms_losses, torch_losses, rtol=1e-5)
