"""Run by test_setup_mindspore.py in a fresh process: the MindSpore set-up collector on real cells and optimizers.

A fresh process because MindSpore's CPU kernels fail to load after paddle's in one
process.  Prints one JSON object: each scenario's ``Setup`` (serialized, base64) and a few
measurements; the test decodes them and diffs them against torch twins built there.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time

os.environ.setdefault("GLOG_v", "3")  # MindSpore's warnings go to stderr in bulk otherwise

import mindspore
import numpy as np
from mindspore import nn, ops
from mindspore.experimental.optim import AdamW

from twinstep.runtime.setup import SetupCollector

mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
mindspore.set_seed(7)


class RMSNorm(nn.Cell):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = mindspore.Parameter(mindspore.Tensor(np.ones(size, np.float32)), name="weight")
        self.variance_epsilon = eps


class Rotary(nn.Cell):
    def __init__(self, base: float, dim: int = 16) -> None:
        super().__init__()
        self.inv_freq = mindspore.Tensor(1.0 / base ** (np.arange(0, dim, 2).astype(np.float32) / dim))


class Net(nn.Cell):
    """The twin of test_setup_mindspore._torch_net: the names torch gives, MindSpore's cells."""

    def __init__(self, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.fc = nn.Dense(8, 8)
        self.norm = nn.LayerNorm((8,), epsilon=norm_eps)
        self.rms = RMSNorm(8, 1e-6)
        self.act = nn.GELU(approximate=False)
        self.silu = nn.SiLU()
        self.drop = nn.Dropout(p=0.1)
        self.rotary_emb = Rotary(10000.0)


class Primitives(nn.Cell):
    """Activations and dropout as primitives and deprecated arguments, as older MindSpore code writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Dense(8, 8)
        self.act = ops.GeLU()
        self.fast = ops.FastGeLU()
        self.drop = nn.Dropout(keep_prob=0.9)
        self.raw_drop = ops.Dropout(keep_prob=0.8)
        self.gelu_default = nn.GELU()


def _adamw(net: Net, lr: float = 3e-4) -> AdamW:
    decay = [p for n, p in net.parameters_and_names() if n in ("emb.embedding_table", "fc.weight")]
    rest = [p for n, p in net.parameters_and_names() if n not in ("emb.embedding_table", "fc.weight")]
    return AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                 lr=lr, betas=(0.9, 0.95), eps=1e-7)


def _collect(model, opt) -> tuple[str, SetupCollector]:
    collector = SetupCollector(model, "mindspore", mindspore.__version__, "highest", 0, optimizer=opt)
    setup = collector.collect()
    return base64.b64encode(setup.SerializeToString()).decode(), collector


class _Broken:
    """An optimizer whose groups cannot be read."""

    @property
    def param_groups(self) -> list:
        raise RuntimeError("groups are gone")


def main() -> dict:
    out: dict = {"setups": {}}
    net = Net()
    opt = _adamw(net)
    started = time.perf_counter()
    out["setups"]["adamw"], collector = _collect(net, opt)
    out["collect_ms"] = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    unchanged = [collector.changed() for _ in range(200)]
    out["changed_us"] = (time.perf_counter() - started) / 200 * 1e6
    out["unchanged"] = all(c is None for c in unchanged)
    opt.param_groups[1]["eps"] = 1e-6  # a set-up change between steps
    changed = collector.changed()
    out["changed_epsilon"] = None if changed is None else sorted(
        {v.number for g in changed.groups for v in g.values if v.key == "epsilon"})
    collector.close()

    forgot_eps = Net(norm_eps=1e-7)  # nn.LayerNorm's default epsilon, where torch's is 1e-5
    out["setups"]["norm_eps_default"], _ = _collect(forgot_eps, _adamw(forgot_eps))
    adam_net = Net()
    adam = nn.Adam(adam_net.trainable_params(), learning_rate=nn.CosineDecayLR(0.0, 1e-3, 10), weight_decay=0.01,
                   loss_scale=2.0, beta2=0.98)
    out["setups"]["nn_adam"], _ = _collect(adam_net, adam)
    sgd_net = Net()
    fc = [sgd_net.fc.weight, sgd_net.fc.bias]
    rest = [p for p in sgd_net.trainable_params() if all(p is not q for q in fc)]
    momentum = nn.Momentum([{"params": fc, "weight_decay": 0.01, "lr": 0.05}, {"params": rest}], learning_rate=0.1,
                           momentum=0.9)
    out["setups"]["nn_momentum"], _ = _collect(sgd_net, momentum)
    awd_net = Net()
    out["setups"]["nn_adamweightdecay"], _ = _collect(awd_net, nn.AdamWeightDecay(awd_net.trainable_params(), 1e-3))
    prims = Primitives()
    out["setups"]["primitives"], _ = _collect(prims, nn.SGD(prims.trainable_params(), 0.1))
    stranger = mindspore.Parameter(mindspore.Tensor(np.ones(3, np.float32)), name="stranger")
    out["setups"]["stranger"], _ = _collect(Net(), AdamW([stranger], lr=1e-3))
    try:
        out["setups"]["broken"], _ = _collect(Net(), _Broken())
    except Exception as error:  # the collector must never raise: the test fails on this
        out["raised"] = f"{type(error).__name__}: {error}"
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.exit(0)
