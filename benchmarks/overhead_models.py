"""The real model classes that ``benchmarks/overhead.py --model`` trains, beside its demo transformer.

    hf-llama   transformers.LlamaForCausalLM                       (torch)
    hf-phi3    transformers.Phi3ForCausalLM                        (torch)
    pf-llama   paddleformers.transformers.llama LlamaForCausalLM    (paddle)
    pf-phi3    paddleformers.transformers.phi3 Phi3ForCausalLM      (paddle)
    ms-phi3    tests/ports/mindspore_phi3.py Phi3ForCausalLM        (MindSpore, PyNative)

Each is built from a config, with the library's own random initial weights (seeded),
so nothing is downloaded. The size is the benchmark's reference size: hidden 256 (or --hidden), 4
layers, 8 heads (no grouped-query attention), intermediate 4x hidden, seq 128,
batch 8; the vocabulary is 1024, small so that the LM head does not dominate the
step. Everything else is the library's default, as a user constructing the class
would get it (transformers picks SDPA attention, paddleformers eager), except:
untied input and output embeddings on both sides (paddleformers' Llama ties them by
default, transformers' does not), token ids 0/1/2 for pad/bos/eos (Phi3's defaults
lie outside a 1024 vocabulary), no KV cache, and paddleformers' fuse_rms_norm off
(its fused RMSNorm kernel has no CPU implementation).

No MindSpore model library builds a trainable model on this CPU (see
tests/ports/mindspore_phi3.py), so ms-phi3 is the test bed's hand-written port of
transformers' Phi3 (eager attention, nn.Dense, nn.Embedding) at this size, with
transformers' Phi3 defaults (RMSNorm epsilon 1e-5, rope theta 10000) and
MindSpore's own random initial weights; it trains as a MindSpore user does:
value_and_grad, then mindspore.experimental.optim.AdamW called with the gradients
(twinstep reads them there: attach(optimizer=...)).

Training: AdamW (lr 1e-3, weight decay 0.01 on every parameter), next-token
cross-entropy over all tokens computed from the logits, on random token batches
fixed by (seed, step), so every row of a table trains on the same data from the
same weights. Only numpy is imported here; a worker imports its one framework and
model library when it builds its trainer.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

MODELS = ("hf-llama", "hf-phi3", "pf-llama", "pf-phi3", "ms-phi3")
VOCAB = 1024
HEADS = 8
MLP_RATIO = 4
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
#: transformers' Phi3Config defaults, which hf-phi3 and pf-phi3 keep and ms-phi3 is built with.
PHI3_RMS_EPS = 1e-5
PHI3_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelSize:
    """Size of a real model and of its batches."""

    hidden: int = 256
    layers: int = 4
    heads: int = HEADS
    seq: int = 128
    batch: int = 8
    vocab: int = VOCAB
    seed: int = 0


def framework(model: str) -> str:
    """The framework a --model trains with."""
    return {"hf": "torch", "pf": "paddle", "ms": "mindspore"}[model.split("-", 1)[0]]


def describe(model: str, size: ModelSize) -> str:
    """The class and size of a --model, for the table's heading (its hidden size is in the table)."""
    lib = {"torch": "transformers", "paddle": "paddleformers",
           "mindspore": "MindSpore port (tests/ports/mindspore_phi3.py)"}[framework(model)]
    cls = "LlamaForCausalLM" if model.endswith("llama") else "Phi3ForCausalLM"
    return (f"{lib} {cls}, {size.layers} layers, {size.heads} heads, intermediate {MLP_RATIO}x hidden, "
            f"vocab {size.vocab}, seq {size.seq}, batch {size.batch}")


def config_kwargs(model: str, size: ModelSize) -> dict[str, Any]:
    """Config arguments, the same for both libraries but for paddleformers' CPU switch."""
    if size.hidden % size.heads:
        raise ValueError(f"hidden {size.hidden} is not divisible by {size.heads} heads")
    kwargs: dict[str, Any] = {
        "vocab_size": size.vocab,
        "hidden_size": size.hidden,
        "intermediate_size": MLP_RATIO * size.hidden,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.heads,
        "tie_word_embeddings": False,
        "use_cache": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if model.startswith("pf-"):
        kwargs["fuse_rms_norm"] = False  # no CPU kernel for paddleformers' fused RMSNorm
    return kwargs


def batch(step: int, size: ModelSize) -> tuple[np.ndarray, np.ndarray]:
    """Random next-token batch (input_ids, targets), int64 [batch, seq], fixed by (seed, step)."""
    rng = np.random.default_rng([size.seed, step])
    tokens = rng.integers(1, size.vocab, size=(size.batch, size.seq + 1), dtype=np.int64)
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


def _logits(out: Any) -> Any:
    """The logits of a causal LM's output: a ModelOutput (transformers) or a tuple (paddleformers)."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


class TorchModelTrainer:
    """A transformers causal LM and its AdamW; the same interface as twinstep.tools.demo.job's trainers."""

    def __init__(self, model: str, size: ModelSize, threads: int) -> None:
        import torch

        # paddleformers installs a `torchcodec` stand-in that breaks `import transformers`;
        # nothing here decodes media, so make that import fail softly instead.
        sys.modules["torchcodec"] = None  # type: ignore[assignment]
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        name = "Llama" if model.endswith("llama") else "Phi3"
        config = getattr(transformers, f"{name}Config")(**config_kwargs(model, size))
        torch.manual_seed(size.seed)
        self.inner = getattr(transformers, f"{name}ForCausalLM")(config)
        self.inner.train()
        self.opt = torch.optim.AdamW(self.inner.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                     weight_decay=WEIGHT_DECAY)

    def train_step(self, ids: np.ndarray, tgt: np.ndarray) -> Any:
        """Forward, next-token cross-entropy, backward and optimizer step; returns the loss tensor."""
        torch = self.torch
        logits = _logits(self.inner(input_ids=torch.from_numpy(ids)))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.from_numpy(tgt).reshape(-1))
        loss.backward()
        self.opt.step()
        return loss

    def zero_grad(self) -> None:
        self.opt.zero_grad()


class PaddleModelTrainer:
    """A paddleformers causal LM and its AdamW (paddle's nn.Linear weights are [in, out])."""

    def __init__(self, model: str, size: ModelSize, threads: int) -> None:
        import importlib

        # OpenMP reads this when paddle is imported.
        os.environ["OMP_NUM_THREADS"] = str(threads)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="No ccache found")
            import paddle

        paddle.set_device("cpu")
        self.paddle = paddle
        name, cls = ("llama", "Llama") if model.endswith("llama") else ("phi3", "Phi3")
        module = importlib.import_module(f"paddleformers.transformers.{name}.modeling")
        config = getattr(module, f"{cls}Config")(**config_kwargs(model, size))
        paddle.seed(size.seed)
        self.inner = getattr(module, f"{cls}ForCausalLM")(config)
        self.inner.train()
        self.opt = paddle.optimizer.AdamW(learning_rate=LR, parameters=self.inner.parameters(), beta1=BETAS[0],
                                          beta2=BETAS[1], epsilon=EPS, weight_decay=WEIGHT_DECAY)

    def train_step(self, ids: np.ndarray, tgt: np.ndarray) -> Any:
        paddle = self.paddle
        logits = _logits(self.inner(input_ids=paddle.to_tensor(ids)))
        loss = paddle.nn.functional.cross_entropy(logits.reshape([-1, logits.shape[-1]]),
                                                  paddle.to_tensor(tgt).reshape([-1]))
        loss.backward()
        self.opt.step()
        return loss

    def zero_grad(self) -> None:
        self.opt.clear_grad()


class MindSporeModelTrainer:
    """The MindSpore Phi3 port in PyNative mode and mindspore.experimental.optim.AdamW (torch's AdamW rule).

    MindSpore returns the gradients from value_and_grad and hands them to the optimizer
    call, so twinstep is attached with the optimizer (``attach_options``).
    """

    def __init__(self, model: str, size: ModelSize, threads: int) -> None:
        # Read when MindSpore loads: OpenMP threads, and errors only (its warnings print whole tensors).
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ.setdefault("GLOG_v", "3")
        import mindspore
        from mindspore.device_context.cpu.op_tuning import threads_num
        from mindspore.experimental.optim import AdamW

        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if repo not in sys.path:
            sys.path.insert(0, repo)
        from tests.ports import mindspore_phi3

        mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
        threads_num(threads)  # MindSpore's CPU kernels use their own thread pool, not OpenMP's
        mindspore.set_seed(size.seed)
        self.ms = mindspore
        kwargs = config_kwargs(model, size)
        self.inner = mindspore_phi3.Phi3ForCausalLM(mindspore_phi3.Phi3Size(
            vocab=kwargs["vocab_size"], hidden=kwargs["hidden_size"], layers=kwargs["num_hidden_layers"],
            heads=kwargs["num_attention_heads"], kv_heads=kwargs["num_key_value_heads"],
            intermediate=kwargs["intermediate_size"], rms_eps=PHI3_RMS_EPS, rope_theta=PHI3_ROPE_THETA,
            pad_id=kwargs["pad_token_id"]))
        self.inner.set_train(True)
        self.opt = AdamW(self.inner.trainable_params(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        self._grad_fn = mindspore.value_and_grad(self._loss, None, self.opt.parameters)
        self._last = self.opt.parameters[-1]

    def attach_options(self) -> dict[str, Any]:
        """What twinstep.attach needs besides the model: the optimizer, where the gradients arrive."""
        return {"optimizer": self.opt}

    def _loss(self, ids: Any, tgt: Any) -> Any:
        logits = self.inner(input_ids=ids)
        return self.ms.ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    def train_step(self, ids: np.ndarray, tgt: np.ndarray) -> Any:
        """Forward, next-token cross-entropy, gradients, AdamW step; waits for the update to finish,
        as torch and paddle on the CPU do (PyNative may queue operators)."""
        loss, grads = self._grad_fn(self.ms.Tensor(ids), self.ms.Tensor(tgt))
        self.opt(grads)
        # PyNative queues operators and runs them in order: reading the last parameter the optimizer
        # updates waits for the step (mindspore.runtime.synchronize is for Ascend and GPU; on the CPU it
        # only logs an error).
        self._last.asnumpy()
        return loss

    def zero_grad(self) -> None:
        pass  # gradients are values returned by value_and_grad, never accumulated on the parameters


def build(model: str, size: ModelSize,
          threads: int) -> TorchModelTrainer | PaddleModelTrainer | MindSporeModelTrainer:
    """The trainer of one --model; imports that model's framework and library only."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    if framework(model) == "torch":
        return TorchModelTrainer(model, size, threads)
    if framework(model) == "mindspore":
        return MindSporeModelTrainer(model, size, threads)
    return PaddleModelTrainer(model, size, threads)
