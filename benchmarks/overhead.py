"""Step-time overhead of twinstep's hooks, and of its peer msprobe's, measured in one run.

    python benchmarks/overhead.py [--model demo|hf-llama|hf-phi3|pf-llama|pf-phi3|ms-phi3 [...]]
                                  [--framework torch|paddle|both] [--hidden 256 [1024 ...]]
                                  [--threads N|all] [--steps 20] [--block 5] [--warmup 2]
                                  [--tensors] [--control] [--no-peer] [--sustained STEPS]
                                  [--server-nice N]

Every row trains the same model from the same initial weights on the same
batches, and only the tool watching it differs.  By default (``--model demo``)
the model is the demo transformer at the benchmarks' reference size (4 layers,
hidden 256 unless --hidden says otherwise, seq 128, batch 8, CPU), in torch and
paddle (``--framework``).  The demo is hand-written; what users train are
library classes, with other modules (RMSNorm, rotary embeddings, gated MLPs with a
third projection, Phi3's fused qkv and gate/up projections, a causal-LM wrapper
whose output is a ModelOutput or a tuple) and the library's own forward code
(attention dispatch, SDPA in transformers), so ``--model`` trains one of those
instead:

    hf-llama, hf-phi3   transformers' LlamaForCausalLM / Phi3ForCausalLM (torch)
    pf-llama, pf-phi3   paddleformers' LlamaForCausalLM / Phi3ForCausalLM (paddle)
    ms-phi3             the MindSpore port of transformers' Phi3 (MindSpore, PyNative;
                        tests/ports/mindspore_phi3.py: no MindSpore model library builds
                        here), trained with value_and_grad and experimental.optim.AdamW

built from a config with the library's random initial weights (nothing is
downloaded): 4 layers, hidden 256 (--hidden), 8 heads, intermediate 4x hidden,
seq 128, batch 8, a 1024-token vocabulary so that the LM head does not dominate,
AdamW and next-token cross-entropy on seeded random token batches.
benchmarks/overhead_models.py builds them and lists every setting.  A real
model runs in its own library's framework only; each row's process imports only
that framework and model library (MindSpore's thus never meets paddle's).
``--model`` takes several names, one table each, e.g. ``--model hf-phi3
pf-phi3 ms-phi3``.  Every row attaches twinstep to the model as
a user would: ``twinstep.attach(model, session=..., run=..., server=...)``
after building the model and its optimizer, ``mon.step(loss=loss)`` after
``optimizer.step()`` (MindSpore: attached with ``optimizer=opt``, where the
gradients arrive).

The training uses one thread (torch.set_num_threads, OpenMP for paddle,
mindspore.device_context.cpu.op_tuning.threads_num and OpenMP for MindSpore), so the
rows and the server do not fight over cores and the ratios stay readable on a
small machine; ``--threads N`` trains with N threads, ``--threads all`` with
every core, as a user's training would: then the training shares its cores
with twinstep's sender process and the server, and the ratio includes that.

The rows:

    unhooked            no tool
    twinstep stats      twinstep.attach(capture="stats")
    twinstep stats, numpy passes   the same without the compiled kernels
                        (TWINSTEP_JIT=0): what it saves, measured in the run
    twinstep stats, in hooks   statistics computed in the hooks, on the
                        training thread (stats_workers=0): what moving them
                        off the training thread saves, measured in the run
    twinstep idle steps  attached with every=1000000: hooks installed, no
                        step of the timed ones captured (what a step that is
                        not captured costs)
    twinstep tensors    twinstep.attach(capture="tensors")          (--tensors)
                        (encoded and sent by a sender process: sender="auto")
    twinstep tensors, thread   the same with sender="thread": encoded and
                        sent by a thread of the training process   (--tensors)
    twinstep lossy      twinstep.attach(capture="lossy")            (--tensors)
    unhooked again      no tool, in a second process: the noise floor  (--control)
    msprobe L0          msprobe statistics, level L0  (module hooks)   torch only
    msprobe mix         msprobe statistics, level mix (L0 + every torch API call,
                        the optimizer's included)                      torch only

Each row trains its own copy in its own process, so one tool's global patches
(msprobe's mix level wraps torch's functions for the whole process) cannot leak
into another row's timing.  The processes take turns, one block of steps each,
in an order that rotates every round, so machine noise lands on every row
alike; after its block, untimed, a twinstep row waits until the server has
acknowledged every step, so its background sending does not run into the
next row's block (how long that took is in its notes).  The twinstep server runs
in its own process, as in production.  A row's ratio is its median step time
over the unhooked row's; "rounds" is the range of that ratio over the rounds;
"cpu ratio" is the same for the CPU time per step of the training process and
of its twinstep sender process if it has one, which other jobs on the machine
disturb far less than wall time.
With ``--sustained STEPS`` the unhooked row and each tensor row then train
alone for STEPS steps back to back, with no pause for background work: a
tensor row whose sending cannot keep up with the training shows it there,
as dropped steps and a long wait for the outbox after the last step.
msprobe's dump directory is a temporary one: its size per step is reported,
then it is deleted.

The peer is PyPI's mindstudio-probe, pinned (with torch and paddle) by the
``bench`` extra; its declared dependencies install cleanly beside twinstep's:

    pip install -e ".[bench]"        # or: pip install mindstudio-probe==26.2.0

Without it the msprobe rows are skipped with a note.  Hidden 1024 steps take
seconds each on CPU: there use e.g. ``--steps 6 --block 2 --warmup 1``.
The transformers models need ``transformers`` (and torch), the paddleformers
ones ``paddleformers`` (and paddle); neither is in the ``bench`` extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twinstep.runtime import kernels  # noqa: E402
from twinstep.tools.demo import spec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead_models  # noqa: E402  (benchmarks/overhead_models.py: the --model classes)

PEER_PACKAGE = "mindstudio-probe"
PEER_VERSION = "26.2.0"
PEER_INSTALL = f'pip install -e ".[bench]"   (or: pip install {PEER_PACKAGE}=={PEER_VERSION})'
#: Targets for twinstep stats: (hidden, one training thread?) -> step-time ratio over unhooked
#: (docs/performance.md); TENSOR_TARGET is the target for every-module tensor capture.
TARGETS = {(256, True): 1.03, (256, False): 1.08, (1024, True): 1.01, (1024, False): 1.01}
TENSOR_TARGET = 1.15
# Longest wait for one worker to answer (a block of hidden-1024 paddle steps is minutes).
WORKER_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Row:
    """One way of running the training: which tool watches it, in which mode."""

    label: str
    tool: str  # "none", "twinstep" or "msprobe"
    mode: str = ""  # twinstep capture ("stats"/"tensors") or msprobe level ("L0"/"mix")
    sender: str = "auto"  # twinstep's sender: "auto" (a sender process for tensors), "thread", "process"


UNHOOKED = Row("unhooked", "none")
TWINSTEP_STATS = Row("twinstep stats", "twinstep", "stats")
# Without the compiled kernels (twinstep.runtime.kernels): numpy's and the framework's passes.
TWINSTEP_NUMPY = Row("twinstep stats, numpy passes", "twinstep", "stats-numpy")
# Statistics on the training thread, in the hooks (stats_workers=0).
TWINSTEP_INLINE = Row("twinstep stats, in hooks", "twinstep", "stats-inline")
# Attached, but the timed steps are not captured (every=1000000).
TWINSTEP_IDLE = Row("twinstep idle steps", "twinstep", "stats-idle")


def rows_for(framework: str, tensors: bool, peer: bool, control: bool = False) -> list[Row]:
    """The rows measured for one framework; msprobe's debugger used here is torch's."""
    rows = [UNHOOKED, TWINSTEP_STATS, TWINSTEP_INLINE, TWINSTEP_NUMPY, TWINSTEP_IDLE]
    if control:
        rows.insert(1, Row("unhooked again", "none"))
    if tensors:
        rows += [Row("twinstep tensors", "twinstep", "tensors"),
                 Row("twinstep tensors, thread", "twinstep", "tensors", sender="thread"),
                 Row("twinstep lossy", "twinstep", "lossy")]
    if peer and framework == "torch":
        rows += [Row("msprobe L0", "msprobe", "L0"), Row("msprobe mix", "msprobe", "mix")]
    return rows


def peer_installed() -> bool:
    """True when msprobe can be imported; checked without importing it (it patches torch on use)."""
    return importlib.util.find_spec("msprobe") is not None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dir_bytes(path: str) -> int:
    """Total size of the files under path (0 if it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


# -- worker process: one row ---------------------------------------------------------


class _Tool:
    """What a tool does around one training step; the unhooked row does nothing."""

    def begin(self) -> None:
        pass

    def end(self, loss: Any) -> None:
        pass

    def settle(self) -> None:
        """After a block, untimed: finish background work so it cannot run into the next row's block."""

    def dropped(self) -> int:
        return 0

    def helper_cpu(self) -> float:
        return 0.0

    def close(self) -> dict[str, Any]:
        return {}


class _Twinstep(_Tool):
    def __init__(self, model: Any, framework: str, mode: str, server: str, sender: str = "auto",
                 attach_options: dict[str, Any] | None = None) -> None:
        import twinstep

        capture, _, variant = mode.partition("-")
        # The kernels load in the background from the first statistics on; a long run's steady
        # state has it, so the timed steps do too.  How long the load took goes into the notes.
        if variant == "numpy":
            if kernels.state() != "off":
                raise RuntimeError(f"{kernels.ENV_SWITCH}=0 did not reach this worker")
            self.kernel = ""
        elif not kernels.wait(120):
            raise RuntimeError(f"twinstep's compiled kernels did not load: {kernels.state()}")
        else:
            self.kernel = f"kernels loaded in {kernels.load_seconds():.1f} s"
        options: dict[str, Any] = dict(attach_options or {})  # MindSpore: the optimizer, where gradients arrive
        if variant == "inline":
            options["stats_workers"] = 0
        elif variant == "idle":
            options["every"] = 1_000_000  # step 0 (untimed warm-up) is captured, no timed step is
        self.mon = twinstep.attach(model, session=f"bench-{framework}-{capture}-{time.time()}", run=framework,
                                   baseline=True, server=server, capture=capture, sender=sender, **options)

        self.drain_s = 0.0
        self.blocks = 0

    def end(self, loss: Any) -> None:
        self.mon.step(loss=loss)

    def settle(self) -> None:
        # The monitor has no public flush; a step leaves the outbox once the server acknowledges it.
        client = self.mon._client
        start = time.perf_counter()
        while client.pending_steps and time.perf_counter() - start < 120:
            time.sleep(0.005)
        self.drain_s += time.perf_counter() - start
        self.blocks += 1

    def dropped(self) -> int:
        return sum(self.mon.stats.dropped.values())

    def helper_cpu(self) -> float:
        """CPU seconds used so far by the sender process (sender="process"), which process_time misses."""
        proc = getattr(self.mon._client, "_proc", None)
        if proc is None:
            return 0.0
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> dict[str, Any]:
        self.mon.close()
        stats = self.mon.stats
        steps = max(stats.steps_sent, 1)
        return {"sent": stats.steps_sent, "dropped": sum(stats.dropped.values()),
                "drain_s_per_block": self.drain_s / max(self.blocks, 1),
                "tensor_bytes_per_step": stats.tensor_bytes / steps,
                "wire_bytes_per_step": stats.tensor_wire_bytes / steps, "kernel": self.kernel,
                "cost": self.mon.capture_cost}


class _Msprobe(_Tool):
    """msprobe's documented training-loop use: start(model) ... stop(); step() every step."""

    def __init__(self, model: Any, level: str, workdir: str) -> None:
        from msprobe.pytorch import PrecisionDebugger

        self.dump_path = os.path.join(workdir, "dump")
        config_path = os.path.join(workdir, "config.json")
        config = {
            "task": "statistics", "dump_path": self.dump_path, "rank": [], "step": [], "level": level,
            "async_dump": False,
            "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"},
        }
        with open(config_path, "w") as f:
            json.dump(config, f)
        self.debugger = PrecisionDebugger(config_path=config_path)
        self.model = model
        self.steps = 0

    def begin(self) -> None:
        self.debugger.start(self.model)

    def end(self, loss: Any) -> None:
        self.debugger.stop()
        self.debugger.step()
        self.steps += 1

    def close(self) -> dict[str, Any]:
        size = dir_bytes(self.dump_path)
        shutil.rmtree(self.dump_path, ignore_errors=True)
        return {"disk_bytes_per_step": size / max(self.steps, 1)}


def _trainer(model: str, framework: str, cfg: Any, threads: int) -> tuple[Any, Callable[[int], Any]]:
    """One row's trainer (the model, its AdamW and loss) and its batch of a step, the same for every row."""
    if model == "demo":
        from twinstep.tools.demo.job import PaddleTrainer, TorchTrainer

        os.environ["OMP_NUM_THREADS"] = str(threads)  # paddle's OpenMP reads it on import
        trainer = (TorchTrainer if framework == "torch" else PaddleTrainer)(cfg, 1e-3, 1)
        if framework == "torch":
            trainer.torch.set_num_threads(threads)  # TorchTrainer sets one thread
        return trainer, lambda step: spec.batch(step, 0, cfg)
    return overhead_models.build(model, cfg, threads), lambda step: overhead_models.batch(step, cfg)


def _worker(conn: Connection, framework: str, cfg: Any, row: Row, server: str, workdir: str,
            model: str = "demo", threads: int = 1) -> None:
    """Train one copy under one row's tool, timing the blocks of steps the parent asks for."""
    log = os.open(os.path.join(workdir, "log.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)  # msprobe logs every start/stop: keep the table readable
    os.dup2(log, 2)
    try:
        trainer, batch = _trainer(model, framework, cfg, threads)
        tool: _Tool
        if row.tool == "twinstep":
            options = trainer.attach_options() if hasattr(trainer, "attach_options") else {}
            tool = _Twinstep(trainer.inner, framework, row.mode, server, row.sender, options)
        elif row.tool == "msprobe":
            tool = _Msprobe(trainer.inner, row.mode, workdir)
        else:
            tool = _Tool()
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        kind, payload = conn.recv()
        if kind in ("steps", "sustained"):
            times, cpu, losses = [], [], []
            dropped_before = tool.dropped()
            helper_before = tool.helper_cpu()
            for step in payload:
                ids, tgt = batch(step)
                start, start_cpu = time.perf_counter(), time.process_time()
                tool.begin()
                loss = trainer.train_step(ids, tgt)
                tool.end(loss)
                trainer.zero_grad()
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
                losses.append(float(loss.item()))
            if kind == "steps":
                tool.settle()
                # The sender process's share of the block, spread over its steps.
                helper = (tool.helper_cpu() - helper_before) / max(len(cpu), 1)
                conn.send(("times", (times, [c + helper for c in cpu], losses)))
            else:  # sustained: no pause for the background work; it runs into the next steps
                dropped = tool.dropped() - dropped_before
                start = time.perf_counter()
                tool.settle()
                conn.send(("times", (times, cpu, {"dropped": dropped, "drain_s": time.perf_counter() - start})))
        else:
            conn.send(("summary", tool.close()))
            return


# -- parent: interleave the rows -----------------------------------------------------


class Worker:
    """Parent-side handle on one row's process."""

    def __init__(self, ctx: Any, framework: str, cfg: Any, row: Row, server: str, tmp: str,
                 model: str = "demo", threads: int = 1) -> None:
        self.row = row
        self.workdir = tempfile.mkdtemp(prefix=row.label.replace(" ", "-") + "-", dir=tmp)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, framework, cfg, row, server, self.workdir, model, threads),
                                daemon=True)
        saved = os.environ.get(kernels.ENV_SWITCH)
        if row.mode == "stats-numpy":
            os.environ[kernels.ENV_SWITCH] = "0"  # read when the spawned interpreter imports twinstep
        try:
            self.proc.start()
        finally:
            if saved is None:
                os.environ.pop(kernels.ENV_SWITCH, None)
            else:
                os.environ[kernels.ENV_SWITCH] = saved
        child.close()
        self.times: list[float] = []  # wall seconds per timed step
        self.cpu: list[float] = []  # this process's CPU seconds (all its threads) per timed step
        self.losses: list[float] = []
        self.rounds: list[list[float]] = []

    def call(self, kind: str, payload: Any = None) -> Any:
        """Send one request and return the worker's answer."""
        self.conn.send((kind, payload))
        return self.receive()

    def receive(self) -> Any:
        """The worker's next answer; raises with its log when it failed or died."""
        if not self.conn.poll(WORKER_TIMEOUT_S):
            raise RuntimeError(f"{self.row.label}: no answer in {WORKER_TIMEOUT_S:.0f} s")
        try:
            answer, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.row.label}: worker died; its log:\n{self.log_tail()}") from None
        if answer == "error":
            raise RuntimeError(f"{self.row.label}: {value.strip().splitlines()[-1]}; its log:\n{self.log_tail()}")
        return value

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(os.path.join(self.workdir, "log.txt")) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


def measure(framework: str, cfg: Any, rows: list[Row], server: str, steps: int, block: int,
            warmup: int, tmp: str, sustained: int = 0, model: str = "demo",
            threads: int = 1) -> tuple[list[Worker], dict[Row, dict[str, Any]], list[str]]:
    """Run every row's process in turn, a block at a time; returns workers, summaries and notes."""
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no tool state is inherited
    workers: list[Worker] = []
    notes: list[str] = []
    for row in rows:
        workers.append(Worker(ctx, framework, cfg, row, server, tmp, model, threads))
    ready: list[Worker] = []
    for w in workers:
        try:
            w.receive()  # "ready", once the model and the tool are set up
            ready.append(w)
        except RuntimeError as e:
            if w.row is UNHOOKED:
                raise
            notes.append(f"row skipped: {e}")
            w.stop()
    warm = list(range(warmup))
    for w in ready:
        if warm:
            w.call("steps", warm)
    for r, first in enumerate(range(warmup, warmup + steps, block)):
        chunk = list(range(first, min(first + block, warmup + steps)))
        order = ready[r % len(ready):] + ready[:r % len(ready)]
        for w in order:
            times, cpu, losses = w.call("steps", chunk)
            w.times += times
            w.cpu += cpu
            w.losses += losses
            w.rounds.append(times)
    if sustained:
        notes += sustained_runs(ready, warmup + steps, sustained)
    summaries: dict[Row, dict[str, Any]] = {}
    for w in ready:
        summaries[w.row] = w.call("close")
        w.stop()
    return ready, summaries, notes


def sustained_runs(workers: list[Worker], first: int, steps: int) -> list[str]:
    """Unhooked, then each tensor-capturing row, alone for ``steps`` steps in a row with no pause between them.

    The interleaved table lets a row's background work finish between its blocks;
    here it must keep up with the training or fall behind: steps dropped, and the
    time the outbox took to empty after the last step, say which.
    """
    plain = next(w for w in workers if w.row is UNHOOKED)
    chosen = [w for w in workers if w.row.mode in ("tensors", "lossy")]
    if not chosen:
        return []
    chunk = list(range(first, first + steps))
    base_times, _, _ = plain.call("sustained", chunk)
    base = statistics.median(base_times)
    lines = [f"sustained, {steps} steps in a row per row, alone (unhooked median {1000 * base:.1f} ms):"]
    for w in chosen:
        times, _, info = w.call("sustained", chunk)
        lines.append(f"  {w.row.label}: {statistics.median(times) / base:.3f}x, dropped {info['dropped']} of {steps} "
                     f"steps, outbox empty {1000 * info['drain_s']:.0f} ms after the last step")
    return lines


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def report(framework: str, hidden: int, workers: list[Worker], summaries: dict[Row, dict[str, Any]],
           threads: int = 1) -> None:
    """Print one table: per row, median step time, ratios to unhooked and to twinstep stats.

    Wall time is what a user waits; CPU time (training thread plus the tool's
    background threads and sender process, not the server) barely moves when other jobs
    share the cores, so on a busy machine its ratio is the steadier one.
    """
    by_row = {w.row: w for w in workers}
    plain = by_row[UNHOOKED]
    base = statistics.median(plain.times)
    base_cpu = statistics.median(plain.cpu)
    ours = statistics.median(by_row[TWINSTEP_STATS].times) if TWINSTEP_STATS in by_row else None
    print(f"{'hidden':>6}  {'framework':<10}{'row':<30}{'median ms':>10}{'ratio':>8}{'rounds':>12}{'cpu ratio':>11}"
          f"{'vs twinstep':>13}  notes")
    for w in workers:
        med = statistics.median(w.times)
        per_round = [statistics.median(a) / statistics.median(b) for a, b in zip(w.rounds, plain.rounds)]
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}"
        vs = f"{med / ours:.2f}x" if ours else "-"
        summary = summaries.get(w.row, {})
        if "disk_bytes_per_step" in summary:
            note = f"dump {fmt_bytes(summary['disk_bytes_per_step'])}/step"
        elif "sent" in summary:
            note = (f"sent {summary['sent']}, dropped {summary['dropped']}, "
                    f"outbox drained {1000 * summary['drain_s_per_block']:.0f} ms after a block")
            if summary.get("tensor_bytes_per_step"):
                note += (f"; tensors {fmt_bytes(summary['tensor_bytes_per_step'])}/step, "
                         f"{fmt_bytes(summary['wire_bytes_per_step'])}/step on the wire")
            if summary.get("kernel"):
                note += f"; {summary['kernel']}"
            cost = summary.get("cost")
            if cost is not None and cost.steps:
                passes = max(cost.offloaded + cost.inline, 1)
                note += (f"; read {fmt_bytes(cost.bytes_read / cost.steps)} of "
                         f"{fmt_bytes(cost.bytes_captured / cost.steps)} captured/step, "
                         f"{100 * cost.offloaded / passes:.0f}% of passes off-thread, boundary wait "
                         f"{1000 * cost.boundary_seconds / cost.steps:.1f} ms/step")
        else:
            note = ""
        if w.losses and plain.losses and abs(w.losses[-1] - plain.losses[-1]) > 1e-4 * max(1.0, abs(plain.losses[-1])):
            note += f"; loss differs from unhooked ({w.losses[-1]:.6f} vs {plain.losses[-1]:.6f})"
        print(f"{hidden:>6}  {framework:<10}{w.row.label:<30}{1000 * med:>10.1f}{med / base:>7.3f}x{spread:>12}"
              f"{statistics.median(w.cpu) / base_cpu:>10.3f}x{vs:>13}  {note}", flush=True)
    target = TARGETS.get((hidden, threads == 1))
    if TWINSTEP_STATS in by_row and target is not None:
        ratio = statistics.median(by_row[TWINSTEP_STATS].times) / base
        cpu_ratio = statistics.median(by_row[TWINSTEP_STATS].cpu) / base_cpu
        print(f"        twinstep stats target at hidden {hidden}, {threads} training thread(s): <= {target:.2f}x; "
              f"measured {ratio:.3f}x wall, {cpu_ratio:.3f}x cpu")
    for row in [r for r in by_row if r.mode in ("tensors", "lossy")]:
        ratio = statistics.median(by_row[row].times) / base
        print(f"        {row.label} target (every module, every step): <= {TENSOR_TARGET:.2f}x; "
              f"measured {ratio:.3f}x wall")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("demo",) + overhead_models.MODELS, default=["demo"], nargs="+",
                        help="what to train: the demo transformer, or a transformers (hf-), paddleformers (pf-) "
                             "or MindSpore (ms-) causal LM built from a config (see benchmarks/overhead_models.py); "
                             "several: one table each, in turn")
    parser.add_argument("--framework", choices=("torch", "paddle", "both"), default=None,
                        help="demo: both by default; a real model trains in its own library's framework")
    parser.add_argument("--threads", default="1", metavar="N|all",
                        help="threads the training uses (torch.set_num_threads, OpenMP for paddle, "
                             "op_tuning.threads_num for MindSpore); all: every core of this machine")
    parser.add_argument("--hidden", type=int, nargs="+", default=[256], help="one table per size, e.g. 256 1024")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--block", type=int, default=5, help="steps a row runs before the next row's turn")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row first")
    parser.add_argument("--tensors", action="store_true", help="add a twinstep tensors row")
    parser.add_argument("--no-peer", action="store_true", help="skip the msprobe rows")
    parser.add_argument("--server-nice", type=int, default=0, metavar="N",
                        help="run the server at niceness N: a server sharing cores with a training yields to it")
    parser.add_argument("--sustained", type=int, default=0, metavar="STEPS",
                        help="then run unhooked and each tensor row alone for STEPS steps without pauses")
    parser.add_argument("--control", action="store_true",
                        help="add a second unhooked row: the noise floor between two processes")
    args = parser.parse_args()
    if args.steps < 1 or args.block < 1 or args.warmup < 0:
        parser.error("--steps and --block must be >= 1, --warmup >= 0")
    if args.threads == "all":
        threads = len(os.sched_getaffinity(0))
    elif args.threads.isdigit() and int(args.threads) >= 1:
        threads = int(args.threads)
    else:
        parser.error("--threads takes a number >= 1 or 'all'")
    plan: list[tuple[str, tuple[str, ...]]] = []  # (model, the frameworks it trains with), in the given order
    for model in dict.fromkeys(args.model):
        if model == "demo":
            framework = args.framework or "both"
            plan.append((model, ("torch", "paddle") if framework == "both" else (framework,)))
            continue
        plan.append((model, (overhead_models.framework(model),)))
        if args.framework not in (None, "both", plan[-1][1][0]):
            parser.error(f"--model {model} trains with {plan[-1][1][0]}, not {args.framework}")
    peer = not args.no_peer and peer_installed()
    port = free_port()
    nice = ["nice", "-n", str(args.server_nice)] if args.server_nice else []
    server = subprocess.Popen(nice + [sys.executable, "-m", "twinstep", "serve", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = tempfile.mkdtemp(prefix="twinstep-overhead-")
    try:
        time.sleep(1.5)
        if not args.no_peer and not peer and any("torch" in frameworks for _, frameworks in plan):
            print(f"msprobe rows skipped: {PEER_PACKAGE} is not installed; install it with: {PEER_INSTALL}")
        for model, frameworks in plan:
            if model == "demo":
                what = f"model: {args.layers} layers, seq {args.seq}, batch {args.batch}"
            else:
                what = "model: " + overhead_models.describe(model, overhead_models.ModelSize(
                    layers=args.layers, seq=args.seq, batch=args.batch))
            print(f"{what}, CPU, {threads} thread{'s' if threads > 1 else ''}; {args.steps} timed "
                  f"steps per row after {args.warmup} warm-up, blocks of {args.block}, median step time"
                  + (f"; server at niceness {args.server_nice}" if args.server_nice else ""))
            for hidden in args.hidden:
                cfg: Any
                if model == "demo":
                    cfg = spec.ModelConfig(vocab=512, hidden=hidden, heads=4, layers=args.layers, seq=args.seq,
                                           batch=args.batch)
                else:
                    cfg = overhead_models.ModelSize(hidden=hidden, layers=args.layers, seq=args.seq,
                                                    batch=args.batch)
                for framework in frameworks:
                    rows = rows_for(framework, args.tensors, peer, args.control)
                    workers, summaries, notes = measure(framework, cfg, rows, f"127.0.0.1:{port}", args.steps,
                                                        args.block, args.warmup, tmp, args.sustained, model,
                                                        threads)
                    report(framework, hidden, workers, summaries, threads)
                    for note in notes:
                        print(f"        {note}")
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
