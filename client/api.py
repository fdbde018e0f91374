"""``twinstep.attach``: the one call a training script makes.

The monitor runs on the training thread and does O(records) cheap work per
step; everything else happens in the stream client's background worker.  It
never raises into training except :class:`twinstep.Halted`, which the server
asks for (and, in lockstep, never blocks longer than ``lockstep_timeout``).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import weakref
from typing import Any, Sequence

from twinstep import environment, settings
from twinstep._version import PROTOCOL_VERSION, __version__
from twinstep.capture import CaptureConfig, Recorder, backend_for
from twinstep.capture.recorder import CaptureCost
from twinstep.capture.health import describe_error
from twinstep.errors import Halted
from twinstep.transport import ClientStats, Sender, StreamClient, StreamConfig
from twinstep.transport.security import ClientSecurity
from twinstep.transport.shared_memory import AVAILABLE as SHARED_MEMORY_AVAILABLE
from twinstep.transport.sidecar import SidecarClient
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

ENV_SERVER = "TWINSTEP_SERVER"
_DEFAULT_SHUTDOWN_TIMEOUT = 10.0


class Monitor:
    """A model attached to a comparison session; see :func:`attach`."""

    def __init__(
        self,
        model: Any,
        *,
        session: str,
        run: str,
        baseline: bool,
        reference: bool,
        precision: str,
        server: str,
        capture: CaptureConfig,
        rank: int,
        world_size: int,
        lockstep: int,
        lockstep_timeout: float,
        stream: StreamConfig,
        sender: str = "thread",
        start_step: int = 0,
    ) -> None:
        self.session = session
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self._capture = capture
        self._lockstep = lockstep
        self._lockstep_timeout = lockstep_timeout
        self._step = start_step
        self._closed = False
        self._halt_lock = threading.Lock()
        self._halt: tuple[int, str] | None = None  # (at_step, reason)
        self._backend = backend_for(model)
        framework_version = self._backend.framework_version()
        hello = pb.Hello(
            protocol_version=PROTOCOL_VERSION,
            session=session,
            run=run,
            baseline=baseline,
            framework=self._backend.framework,
            framework_version=framework_version,
            rank=rank,
            world_size=world_size,
            host=socket.gethostname(),
            pid=os.getpid(),
            client_version=__version__,
            capture=capture.capture,
            max_lead=lockstep,
            reference=reference,
            precision=precision if precision != "auto" else self._backend.float32_matmul_precision(),
            every=capture.every,
            include=capture.include,
            exclude=capture.exclude,
            start_step=start_step,
            environment=environment.describe_environment(self._backend.framework, framework_version),
            warnings=environment.attach_warnings(self._backend.framework, framework_version),
        )
        if sender == "auto":
            # Copies from an accelerator need pinned memory to stay asynchronous; shared memory is not pinned.
            sender = ("process" if capture.capture != "stats" and SHARED_MEMORY_AVAILABLE
                      and not self._backend.on_accelerator(model) else "thread")
        self._client: Sender
        if sender == "process" and capture.capture != "stats":
            sidecar = SidecarClient(hello, stream, self._on_command, lambda: self._step)
            self._client, host_memory = sidecar, sidecar  # its shared buffers are the pool's
        else:  # statistics are a few KB a step: a sender process would cost more than it saves
            self._client = StreamClient(hello, stream, self._on_command, lambda: self._step)
            host_memory = None
        # Free host buffers are capped like the outbox: together they hold at most twice its bound.
        self._recorder = Recorder(model, self._backend, capture, host_pool_bytes=stream.max_queue_bytes,
                                  host_memory=host_memory)
        self._client.add_manifest([], self._recorder.parameter_infos)
        self._client.start()
        self._recorder.set_active(self._captures(start_step), start_step)
        ref = weakref.ref(self)
        self._atexit = lambda: (m := ref()) is not None and m.close()
        atexit.register(self._atexit)

    # -- public API ------------------------------------------------------------

    @property
    def current_step(self) -> int:
        """Index of the step in progress (``start_step`` plus the number of completed ``step()`` calls)."""
        return self._step

    @property
    def capture_cost(self) -> CaptureCost:
        """What capture read so far: bytes read against bytes captured, and where statistics ran."""
        return self._recorder.cost

    @property
    def stats(self) -> ClientStats:
        """Counters: steps sent, drops by reason, connection state."""
        return self._client.stats

    def step(self, loss: Any = None) -> None:
        """End the current training step: send its records and move to the next.

        Call once per iteration after ``optimizer.step()`` and before the
        gradients are cleared.  Raises :class:`Halted` when the server has
        halted this run at this step.
        """
        if self._closed:
            return
        step = self._step
        health = self._recorder.health
        try:
            if self._captures(step):
                self._client.add_manifest(self._recorder.take_new_modules(), [])
                self._client.submit(self._recorder.finish_step(step, loss))
            else:
                self._recorder.discard_step()
        except Exception as error:
            health.record_step_failure(step, error)  # warned once per kind; the server is told below
            self._client.mark_missing(step, "capture_failed", describe_error(error))
            self._recorder.discard_step()
        changes = health.take_changes()
        if changes is not None:
            self._client.send_health(changes)
        self._step = step + 1
        self._recorder.set_active(self._captures(step + 1), step + 1)
        self._raise_if_halted(step)
        if self._lockstep:
            waited = self._client.wait_for_credit(step + 1, self._lockstep_timeout, lambda: self._halt is not None)
            if not waited:
                logger.warning(
                    "twinstep: lockstep wait for the other runs exceeded %.0f s at step %d; continuing without lockstep",
                    self._lockstep_timeout,
                    step,
                )
                self._lockstep = 0
            self._raise_if_halted(step)

    def close(self, timeout: float = _DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        """Flush what is queued (at most ``timeout`` seconds), detach the hooks, say goodbye."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        self._recorder.remove()
        changes = self._recorder.health.take_changes()
        if changes is not None:  # failures after the last step() (a trailing forward, say)
            self._client.send_health(changes)
        reason = "halted" if self._halt is not None else "finished"
        self._client.close(reason, self._step - 1, timeout)
        dropped = {k: v for k, v in self._client.stats.dropped.items() if v}
        if dropped:
            logger.warning("twinstep: run %r rank %d dropped steps: %s", self.run, self.rank, dropped)

    def detach(self) -> None:
        """Alias of :meth:`close`."""
        self.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------

    def _captures(self, step: int) -> bool:
        return step % self._capture.every == 0

    def _on_command(self, command: pb.Command) -> None:
        """Runs on the sender thread: remember a HALT for the training thread."""
        if command.kind != pb.Command.HALT:
            return
        with self._halt_lock:
            if self._halt is None:
                self._halt = (command.at_step, command.reason)
                logger.warning(
                    "twinstep: server halts run %r%s: %s",
                    self.run,
                    f" at step {command.at_step}" if command.at_step >= 0 else "",
                    command.reason,
                )

    def _raise_if_halted(self, step: int) -> None:
        halt = self._halt
        if halt is None:
            return
        at_step, reason = halt
        if at_step >= 0 and step < at_step:
            return
        if at_step >= 0 and step > at_step:
            logger.warning("twinstep: halt for step %d arrived late; halting at step %d", at_step, step)
        self.close()
        raise Halted(reason, step)


def attach(
    model: Any,
    *,
    session: str | None = None,
    run: str | None = None,
    baseline: bool | None = None,
    reference: bool | None = None,
    server: str | None = None,
    capture: str | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    every: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    lockstep: int | None = None,
    lockstep_timeout: float | None = None,
    max_queue_steps: int | None = None,
    max_queue_bytes: int | None = None,
    backward: bool | None = None,
    precision: str | None = None,
    sketch: bool | None = None,
    compression: str | None = None,
    sender: str | None = None,
    start_step: int | None = None,
    token: str | None = None,
    tls_ca: str | None = None,
    tls_client_cert: str | None = None,
    tls_client_key: str | None = None,
    insecure: bool | None = None,
    stats_workers: int | None = None,
    config: str | None = None,
) -> Monitor:
    """Attach twinstep to a ``torch.nn.Module`` or ``paddle.nn.Layer`` and start streaming.

    Every argument left out (None) comes from the environment variable
    ``TWINSTEP_<NAME>`` (``TWINSTEP_SESSION``, ``TWINSTEP_CAPTURE``, ...), else
    from the YAML config file (``config`` or ``$TWINSTEP_CONFIG``: its top-level
    keys, overridden by its ``runs: {RUN: ...}`` section), else the default
    given below (twinstep.settings).  A value that cannot be read is a
    ValueError naming the variable or the file and key.

    Args:
        session: comparison session name; both trainings use the same one.
        run: this training's name within the session (e.g. "torch", "paddle").
        baseline: True for the run the others are judged against.
        reference: True for a rerun of the baseline (determinism off, or another
            precision) that measures its own noise: candidates are then judged
            against multiples of each record's noise band.
        server: ``host:port``; defaults to ``$TWINSTEP_SERVER``.
        capture: "stats" (per-tensor statistics), "tensors" (plus lossless full
            tensors) or "lossy" (plus full tensors quantised within the error the
            server's tolerances allow: no verdict changes, fewer bytes).
        include, exclude: glob patterns over module names selecting what is hooked.
        every: capture every N-th step.
        rank, world_size: default to torchrun's RANK/WORLD_SIZE or
            paddle.distributed.launch's PADDLE_TRAINER_ID/PADDLE_TRAINERS_NUM.
        lockstep: if > 0, ``step()`` waits while this run leads the slowest
            other run by this many steps (opt-in: it slows the faster training).
        lockstep_timeout: longest single lockstep wait before giving up lockstep.
        max_queue_steps, max_queue_bytes: bound on data held while the server is
            behind or away; the oldest steps are dropped (and counted) beyond it.
        backward: record gradients with respect to module outputs.
        precision: arithmetic of this run's float32 matrix products, "fp32" or
            "tf32"; "auto" asks the framework (TF32 on GPUs unless disabled).
            Float32 records of a tf32 run are judged with looser tf32 tolerances.
        sketch: also send a count-sketch of every floating tensor (1 KiB each), from
            which the server estimates rel_l2 and cosine of whole tensors.
        compression: lossless compression of full tensors: "zstd", "none", or
            "auto" (zstd, except for a dtype it shrinks by under 10%, such as
            float32 activations: there the CPU is worth more than the bytes).
            Use "zstd" over slow links.
        sender: where full tensors are encoded and sent: "thread" (a thread of
            this process), "process" (a sender process reading the tensor copies
            from shared memory, so its work never holds this process's GIL), or
            "auto": "process" for capture "tensors" and "lossy" of a model on
            the CPU where shared memory exists (Linux), else "thread" (an
            accelerator's copies stay asynchronous only into the thread
            sender's pinned buffers).  Statistics always use a thread.
        start_step: the number of the first step this monitor records: a run
            resumed from a checkpoint, or attached after some steps, numbers its
            steps as the baseline does.  The server reports the steps before it
            as not compared.
        token: the session's (or the operator's) token, sent as 'authorization:
            Bearer TOKEN'; defaults to ``$TWINSTEP_TOKEN``.  A server that
            refuses it ends capture with one error log; training continues.
        tls_ca: PEM file of the CA, or the server's self-signed certificate, to
            trust; defaults to ``$TWINSTEP_TLS_CA`` (then the system's CAs).
        tls_client_cert, tls_client_key: PEM files for a server that asks for
            client certificates (mutual TLS); default to
            ``$TWINSTEP_TLS_CLIENT_CERT`` and ``$TWINSTEP_TLS_CLIENT_KEY``.
        insecure: plaintext to a server that is not on a loopback address
            (default ``$TWINSTEP_INSECURE``).  Without TLS settings a loopback
            server is reached in plaintext and any other one over TLS.
            An empty string for a file or token means none (the environment
            is not read).
        stats_workers: threads computing the statistics of CPU tensors while the
            training computes (they release the GIL: give them a free core); 0
            computes them in the hooks, on the training thread.  A tensor
            modified in place after its capture is detected and computed in its
            hook from then on; accelerator tensors keep their statistics on the
            device either way.
        config: YAML file of settings (default ``$TWINSTEP_CONFIG``); see
            docs/zero-code.md for its shape.

    Defaults: baseline and reference False, capture "stats", include ("*",),
    exclude (), every 1, lockstep 0, lockstep_timeout 300 s, max_queue_steps
    256, max_queue_bytes 1 GiB, backward True, precision "auto", sketch False,
    compression "auto", sender "auto", start_step 0, stats_workers 1.
    """
    given = {name: value for name, value in locals().items() if name not in ("model", "config")}
    return _attach(model, **settings.resolve(given, config=config).values)


def _attach(
    model: Any,
    *,
    session: str | None,
    run: str | None,
    baseline: bool,
    reference: bool,
    server: str | None,
    capture: str,
    include: Sequence[str],
    exclude: Sequence[str],
    every: int,
    rank: int | None,
    world_size: int | None,
    lockstep: int,
    lockstep_timeout: float,
    max_queue_steps: int,
    max_queue_bytes: int,
    backward: bool,
    precision: str,
    sketch: bool,
    compression: str,
    sender: str,
    start_step: int,
    token: str | None,
    tls_ca: str | None,
    tls_client_cert: str | None,
    tls_client_key: str | None,
    insecure: bool | None,
    stats_workers: int,
) -> Monitor:
    """``attach`` with every setting resolved (twinstep.settings): check them and start the monitor."""
    target = server
    if not target:
        raise ValueError(f"twinstep.attach needs server='host:port', the {ENV_SERVER} environment variable "
                         f"or server: in the config file ({settings.ENV_CONFIG})")
    if not session or not run:
        raise ValueError("twinstep.attach needs a non-empty session and run name: session=/run= arguments, "
                         "TWINSTEP_SESSION/TWINSTEP_RUN, or session:/run: in the config file "
                         f"({settings.ENV_CONFIG})")
    if lockstep < 0:
        raise ValueError("lockstep must be >= 0")
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    if precision not in ("auto", "fp32", "tf32"):
        raise ValueError(f"precision must be 'auto', 'fp32' or 'tf32', got {precision!r}")
    if sender not in ("auto", "thread", "process"):
        raise ValueError(f"sender must be 'auto', 'thread' or 'process', got {sender!r}")
    if sender == "process" and not SHARED_MEMORY_AVAILABLE:
        raise ValueError("sender='process' needs shared memory files (os.memfd_create, Linux)")
    security = ClientSecurity.resolve(token=token, tls_ca=tls_ca, tls_client_cert=tls_client_cert,
                                      tls_client_key=tls_client_key, insecure=insecure)
    resolved_rank = rank if rank is not None else 0  # the launcher's RANK/PADDLE_TRAINER_ID: twinstep.settings
    resolved_world = world_size if world_size is not None else 1
    if not 0 <= resolved_rank < resolved_world:
        raise ValueError(f"rank {resolved_rank} is outside world size {resolved_world}")
    return Monitor(
        model,
        session=session,
        run=run,
        baseline=baseline,
        reference=reference,
        precision=precision,
        server=target,
        capture=CaptureConfig(
            capture=capture, include=tuple(include), exclude=tuple(exclude), every=every, backward=backward,
            sketch=sketch, stats_workers=stats_workers,
        ),
        rank=resolved_rank,
        world_size=resolved_world,
        lockstep=lockstep,
        lockstep_timeout=lockstep_timeout,
        stream=StreamConfig(target=target, max_queue_steps=max_queue_steps, max_queue_bytes=max_queue_bytes,
                            compression=compression, **security.as_dict()),
        sender=sender,
        start_step=start_step,
    )
