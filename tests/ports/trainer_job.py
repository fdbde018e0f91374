"""A real library Trainer training the test bed's tiny Llama under twinstep's trainer callback.

    python -m tests.ports.trainer_job --framework torch --server HOST:PORT --weights /tmp/w.npz \\
        --session faithful=1e-3 --session bug=1e-3 --result-file /tmp/torch.json
    python -m tests.ports.trainer_job --framework paddle --server HOST:PORT --weights /tmp/w.npz \\
        --session faithful=1e-3 --session bug=1.1e-3 --result-file /tmp/paddle.json

``--framework torch`` runs ``transformers.Trainer`` on ``LlamaForCausalLM`` (the baseline)
with ``twinstep.integrations.transformers.TwinstepCallback``; ``--framework paddle``
runs ``paddleformers.trainer.Trainer`` on paddleformers' ``LlamaForCausalLM`` with
``twinstep.integrations.paddleformers.TwinstepCallback``.  The torch job draws the
initial weights (tests/ports/torch_job.TorchPort) and writes them to --weights; the
paddle job converts them (models.torch_to_paddle).  Each --session NAME=LR trains a
fresh model from those weights for --steps optimizer steps of --accumulation
micro-batches, with AdamW at learning rate LR (no weight decay, no clipping, a
constant schedule), on the same micro-batches in the same order (models.batch).
Both Trainers get labels that make them optimise the same next-token loss:
transformers shifts labels itself, paddleformers' criterion does not.  Saving and
reporting are off; the output directory is a temporary one.  --options passes more
``twinstep.attach`` options to the callback (JSON); --grad-scale makes the paddle job
scale its accumulated gradients as transformers' Trainer does (see _scale_gradients).
paddleformers 1.2 cannot accumulate on the CPU as it is (paddle.device.synchronize raises
there): the paddle job makes that call a no-op for the CPU (_synchronize_cpu_as_a_no_op).
The result file holds, per session, the loss the callback recorded and the loss the
trainer logged for each step, the steps taken and whether the server halted the run.
A trainer library that cannot be imported here ends the job with exit code 77 and the
reason on stderr (the test skips).  This process imports only its own framework.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import numpy as np

from . import models

IGNORE = -100  # both libraries' ignore_index
MODEL = "llama"
#: Exit code of a job whose trainer library cannot be imported in this environment.
CANNOT_IMPORT = 77


def micro_batches(count: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, next tokens) of each micro-batch, in training order: models.batch of 0, 1, ..."""
    return [models.batch(k, seed) for k in range(count)]


def torch_examples(batches: list[tuple[np.ndarray, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """transformers shifts labels by one inside the loss: labels are the input ids, the first one ignored.

    Ignoring position 0 (never a target after the shift) makes the Trainer's token count
    (num_items_in_batch counts labels != -100) equal to the tokens the loss sums over.
    """
    return [{"input_ids": ids[j], "labels": np.concatenate([[IGNORE], ids[j][1:]])}
            for ids, _ in batches for j in range(ids.shape[0])]


def paddle_examples(batches: list[tuple[np.ndarray, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """paddleformers' criterion does not shift: labels are the next tokens, the last position ignored (as above)."""
    return [{"input_ids": ids[j], "labels": np.concatenate([tgt[j][:-1], [IGNORE]])}
            for ids, tgt in batches for j in range(ids.shape[0])]


def common_arguments(output_dir: str, lr: float, steps: int, accumulation: int, seed: int) -> dict[str, Any]:
    """TrainingArguments both libraries take with the same meaning."""
    return dict(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=models.BATCH,
        gradient_accumulation_steps=accumulation, learning_rate=lr, weight_decay=0.0, adam_beta1=models.BETAS[0],
        adam_beta2=models.BETAS[1], adam_epsilon=models.EPS, max_grad_norm=0.0, lr_scheduler_type="constant",
        warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none", seed=seed, dataloader_num_workers=0,
        disable_tqdm=True,
    )


def import_trainer(framework: str) -> None:
    """Import the framework's Trainer first of all; exit with CANNOT_IMPORT and the reason if it cannot be."""
    try:
        if framework == "torch":
            sys.modules["torchcodec"] = None  # type: ignore[assignment]  # paddleformers' broken stand-in
            from transformers import Trainer  # noqa: F401  (imports its own dependencies: accelerate, datasets)
        else:
            from paddleformers.trainer import Trainer  # noqa: F401,F811
    except Exception as error:
        library = "transformers.Trainer" if framework == "torch" else "paddleformers.trainer.Trainer"
        print(f"cannot import {library} here: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        sys.exit(CANNOT_IMPORT)


def train_torch(args: argparse.Namespace, sessions: list[tuple[str, float]]) -> dict[str, Any]:
    import torch
    import transformers

    from tests.ports.torch_job import TorchPort
    from twinstep.integrations.transformers import TwinstepCallback

    spec = models.spec(MODEL)
    models.save_weights(args.weights, TorchPort(spec, args.seed).state(), {"model": spec.name, "seed": args.seed})

    class Examples(torch.utils.data.Dataset):
        def __init__(self, items: list[dict[str, np.ndarray]]) -> None:
            self.items = items

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {k: torch.from_numpy(np.asarray(v, dtype=np.int64)) for k, v in self.items[i].items()}

    data = Examples(torch_examples(micro_batches(args.steps * args.accumulation, args.seed)))
    results = {}
    for session, lr in sessions:
        model = TorchPort(spec, args.seed).model  # the same drawn weights every time
        callback = TwinstepCallback(session=session, run="torch", baseline=True, server=args.server, **args.options)
        losses = LossLog(transformers.TrainerCallback, callback)
        with tempfile.TemporaryDirectory() as out:
            training = transformers.TrainingArguments(
                **common_arguments(out, lr, args.steps, args.accumulation, args.seed), use_cpu=True, optim="adamw_torch",
                train_sampling_strategy="sequential", dataloader_pin_memory=False, eval_strategy="no")
            trainer = transformers.Trainer(model=model, args=training, train_dataset=data,
                                           callbacks=[callback, losses.callback])
            trainer.train()
        results[session] = _result(trainer.state, callback, losses)
    return results


def train_paddle(args: argparse.Namespace, sessions: list[tuple[str, float]]) -> dict[str, Any]:
    from tests.ports.paddle_job import PaddlePort, wait_for_weights

    spec = models.spec(MODEL)
    state = wait_for_weights(args.weights, {"model": spec.name, "seed": args.seed})
    import paddle
    from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments

    from twinstep.integrations.paddleformers import TwinstepCallback

    _synchronize_cpu_as_a_no_op(paddle)

    class Examples(paddle.io.Dataset):
        def __init__(self, items: list[dict[str, np.ndarray]]) -> None:
            self.items = items

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {k: np.asarray(v, dtype=np.int64) for k, v in self.items[i].items()}

    data = Examples(paddle_examples(micro_batches(args.steps * args.accumulation, args.seed)))
    results = {}
    for session, lr in sessions:
        model = PaddlePort(spec, args.seed, state).model
        callback = TwinstepCallback(session=session, run="paddle", server=args.server, **args.options)
        losses = LossLog(TrainerCallback, callback)
        callbacks = [callback, losses.callback]
        if args.grad_scale != 1.0:
            callbacks.append(_scale_gradients(paddle, TrainerCallback, args.grad_scale))
        with tempfile.TemporaryDirectory() as out:
            training = TrainingArguments(**common_arguments(out, lr, args.steps, args.accumulation, args.seed),
                                         device="cpu", dataloader_shuffle=False, amp_master_grad=False)
            trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
            trainer.train()
        results[session] = _result(trainer.state, callback, losses)
    return results


def _synchronize_cpu_as_a_no_op(paddle: Any) -> None:
    """paddleformers 1.2's Trainer calls ``paddle.device.synchronize()`` before it scales accumulated gradients,
    and paddle 3.x raises TypeError for the CPU there (GPUs and XPUs are fine).  CPU kernels are synchronous,
    so waiting for them is nothing: without this, no paddleformers training accumulates gradients on a CPU."""
    original = paddle.device.synchronize

    def synchronize(device: Any = None) -> None:
        place = paddle.framework._current_expected_place_() if device is None else device
        if isinstance(place, paddle.CPUPlace) or (isinstance(place, str) and place.startswith("cpu")):
            return None
        return original(device)

    paddle.device.synchronize = synchronize


class LossLog:
    """Per optimizer step: the loss twinstep's callback recorded (as a float: a sync, tests only) and the
    loss the trainer logged (logging_steps=1)."""

    def __init__(self, base: type, twinstep_callback: Any) -> None:
        self.recorded: list[float] = []
        self.logged: list[float] = []
        log = self

        class Recorder(base):  # type: ignore[misc, valid-type]
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
                loss = twinstep_callback.last_loss
                log.recorded.append(float(loss.item()) if loss is not None else float("nan"))
                return control

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> Any:
                if logs and "loss" in logs:
                    log.logged.append(float(logs["loss"]))
                return control

        self.callback = Recorder()


def _scale_gradients(paddle: Any, base: type, factor: float) -> Any:
    """A callback scaling the accumulated gradients before the optimizer step (paddleformers' on_optimizer_begin).

    transformers 5.3's Trainer with accelerate 1.15 steps on 1/N of the mean loss's gradient under N-step
    accumulation (accelerate's backward divides once more); a port reproducing that baseline scales its
    gradients the same way (the test passes --grad-scale 1/N).
    """

    class ScaleGradients(base):  # type: ignore[misc, valid-type]
        def on_optimizer_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
            with paddle.no_grad():  # as the trainer scales them itself
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.scale_(factor)
            return control

    return ScaleGradients()


def _result(state: Any, callback: Any, losses: LossLog) -> dict[str, Any]:
    return {"logged_losses": losses.logged, "recorded_losses": losses.recorded, "global_step": state.global_step,
            "halted": callback.halted is not None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.ports.trainer_job", description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("torch", "paddle"), required=True)
    p.add_argument("--server", required=True)
    p.add_argument("--weights", required=True, metavar="PATH", help="written by the torch job, read by the paddle job")
    p.add_argument("--session", action="append", required=True, metavar="NAME=LR",
                   help="train once into session NAME with learning rate LR (repeatable, in order)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per session")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--options", type=json.loads, default={}, metavar="JSON",
                   help="more twinstep.attach options for the callback, as a JSON object")
    p.add_argument("--grad-scale", type=float, default=1.0,
                   help="paddle: scale the accumulated gradients before each optimizer step")
    p.add_argument("--result-file", required=True, metavar="PATH")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import_trainer(args.framework)
    sessions = []
    for text in args.session:
        name, _, lr = text.partition("=")
        sessions.append((name, float(lr)))
    results = (train_torch if args.framework == "torch" else train_paddle)(args, sessions)
    with open(args.result_file, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
