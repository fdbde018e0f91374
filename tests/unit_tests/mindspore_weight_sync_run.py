"""Run by test_weight_sync_mindspore.py in a fresh process: weight sync into and out of MindSpore cells.

A fresh process because MindSpore's CPU kernels fail to load after paddle's,
which a shared pytest process cannot rule out.  A real server on a loopback
port, torch models on the other side; prints one JSON object of findings
(the test asserts on them).
"""

from __future__ import annotations

import json

import numpy as np
import torch  # before MindSpore: fine (only paddle before MindSpore clashes)

import mindspore
from mindspore import nn

import twinstep
from twinstep.server import ServerConfig, serve
from twinstep.server.config import SessionsConfig
from twinstep.runtime.weights import mindspore as ms_loader

mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
findings: dict = {}


class TorchNet(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(10, 8)
        self.fc = torch.nn.Linear(8, 8)  # square: a transpose here would go unnoticed by the shapes
        self.ln = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 3, bias=False)
        with torch.no_grad():  # the norm's defaults (ones, zeros) would hide a norm that was not loaded
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)

    def forward(self, ids):
        return self.head(self.ln(self.fc(self.embed(ids))))


class MsNet(nn.Cell):
    def __init__(self, head_out: int = 3, dtype: mindspore.dtype = mindspore.float32) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8, dtype=dtype)
        self.fc = nn.Dense(8, 8, dtype=dtype)
        self.ln = nn.LayerNorm((8,), epsilon=1e-5, dtype=dtype)
        self.head = nn.Dense(8, head_out, has_bias=False, dtype=dtype)

    def construct(self, ids):
        return self.head(self.ln(self.fc(self.embed(ids))))


def ms_values(cell: nn.Cell) -> dict[str, np.ndarray]:
    return {name: p.astype(mindspore.float32).asnumpy().copy() for name, p in cell.parameters_and_names()}


def torch_values(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: p.detach().float().numpy().copy() for name, p in module.named_parameters()}


#: MindSpore name -> torch name (what the server must match by itself, with no mapping rule).
TORCH_NAME = {"embed.embedding_table": "embed.weight", "fc.weight": "fc.weight", "fc.bias": "fc.bias",
              "ln.gamma": "ln.weight", "ln.beta": "ln.bias", "head.weight": "head.weight"}


def same(ms: dict[str, np.ndarray], tv: dict[str, np.ndarray]) -> bool:
    return ms.keys() == TORCH_NAME.keys() and all(np.array_equal(ms[n], tv[TORCH_NAME[n]]) for n in ms)


server = serve(port=0, config=ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5)))
try:
    # torch baseline -> MindSpore candidate, float32: every parameter, bit for bit, and the same outputs.
    base_model, cand_model = TorchNet(seed=0), MsNet()
    findings["differed_before"] = not same(ms_values(cand_model), torch_values(base_model))
    base = twinstep.attach(base_model, session="to-ms", run="torch", baseline=True, share_weights=True,
                           server=server.address)
    cand = twinstep.attach(cand_model, session="to-ms", run="mindspore", init_from_baseline=True, init_timeout=60,
                           server=server.address)
    findings["equal_after"] = same(ms_values(cand_model), torch_values(base_model))
    findings["loaded"] = {w.name: [list(w.sources), list(w.transposed)] for w in cand.weight_sync.loaded}
    findings["no_counterpart"] = list(cand.weight_sync.no_counterpart)
    findings["unused"] = list(cand.weight_sync.unused)
    ids = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
    t_out = base_model(torch.from_numpy(ids)).detach().numpy()
    m_out = cand_model(mindspore.Tensor(ids)).asnumpy()
    findings["output_diff"] = float(np.abs(t_out - m_out).max())
    base.close(), cand.close()

    # MindSpore baseline (share_weights) -> torch candidate.
    ms_base, torch_cand = MsNet(), TorchNet(seed=1)
    base = twinstep.attach(ms_base, session="from-ms", run="mindspore", baseline=True, share_weights=True,
                           server=server.address)
    cand = twinstep.attach(torch_cand, session="from-ms", run="torch", init_from_baseline=True, init_timeout=60,
                           server=server.address)
    findings["from_ms_equal"] = same(ms_values(ms_base), torch_values(torch_cand))
    findings["from_ms_loaded"] = sorted(w.name for w in cand.weight_sync.loaded)
    base.close(), cand.close()

    # bfloat16 torch baseline -> bfloat16 MindSpore candidate: bit for bit.  float32 -> bfloat16: cast.
    base_model, cand_model = TorchNet(seed=2).to(torch.bfloat16), MsNet(dtype=mindspore.bfloat16)
    base = twinstep.attach(base_model, session="bf16", run="torch", baseline=True, share_weights=True,
                           server=server.address)
    cand = twinstep.attach(cand_model, session="bf16", run="mindspore", init_from_baseline=True, init_timeout=60,
                           server=server.address)
    findings["bf16_dtypes"] = sorted({str(p.dtype) for p in cand_model.get_parameters()})
    findings["bf16_equal"] = same(ms_values(cand_model), torch_values(base_model))
    # nn.Embedding's dtype is its ids' (2.10): its table stays float32 and takes the bfloat16 values by a cast.
    findings["bf16_cast"] = [w.name for w in cand.weight_sync.loaded if w.dtype != w.candidate_dtype]
    base.close(), cand.close()

    # A bfloat16 MindSpore baseline shares its values' bits (numpy has no bfloat16) with a bfloat16 torch candidate.
    ms_base, torch_cand = MsNet(dtype=mindspore.bfloat16), TorchNet(seed=4).to(torch.bfloat16)
    base = twinstep.attach(ms_base, session="bf16-from-ms", run="mindspore", baseline=True, share_weights=True,
                           server=server.address)
    cand = twinstep.attach(torch_cand, session="bf16-from-ms", run="torch", init_from_baseline=True, init_timeout=60,
                           server=server.address)
    # Its float32 embedding table (nn.Embedding's dtype is its ids', above) reaches the bfloat16 torch
    # table by torch's cast (round to nearest); every bfloat16 parameter arrives bit for bit.
    shared, got = ms_values(ms_base), torch_values(torch_cand)
    as_bf16 = {n: torch.from_numpy(v).to(torch.bfloat16).float().numpy() for n, v in shared.items()}
    findings["bf16_from_ms_equal"] = same(as_bf16, got)
    findings["bf16_from_ms_exact"] = sorted(n for n, p in ms_base.parameters_and_names()
                                            if p.dtype == mindspore.bfloat16 and np.array_equal(shared[n], got[TORCH_NAME[n]]))
    base.close(), cand.close()

    # A shape no rule reconciles: refused whole, the cell untouched.
    base_model, cand_model = TorchNet(seed=3), MsNet(head_out=5)
    before = ms_values(cand_model)
    base = twinstep.attach(base_model, session="mismatch", run="torch", baseline=True, share_weights=True,
                           server=server.address)
    try:
        twinstep.attach(cand_model, session="mismatch", run="mindspore", init_from_baseline=True, init_timeout=60,
                        server=server.address)
        findings["mismatch_error"] = ""
    except twinstep.WeightSyncError as error:
        findings["mismatch_error"] = str(error)
    after = ms_values(cand_model)
    findings["mismatch_untouched"] = all(np.array_equal(before[n], after[n]) for n in before)
    base.close()
finally:
    server.stop(grace=0.5)

# The loader alone: a value of the wrong shape anywhere loads nothing (set_data itself would accept it).
cell = MsNet()
before = ms_values(cell)
params = list(cell.get_parameters())
values = [(p, np.full(tuple(p.shape), 7.0, np.float32), "float32") for p in params]
values[-1] = (params[-1], np.zeros((4, 2), np.float32), "float32")
try:
    ms_loader.load(values)
    findings["loader_error"] = ""
except ValueError as error:
    findings["loader_error"] = str(error)
after = ms_values(cell)
findings["loader_untouched"] = all(np.array_equal(before[n], after[n]) for n in before)
findings["loader_shapes_kept"] = [list(p.shape) for p in params] == [list(v.shape) for v in before.values()]
# A float64 value into a float32 parameter is cast by MindSpore, and the parameter stays float32.
ms_loader.load([(params[1], np.full(tuple(params[1].shape), 0.25, np.float64), "float64")])
findings["cast"] = [str(params[1].dtype), float(params[1].asnumpy()[0, 0])]
print(json.dumps(findings))
