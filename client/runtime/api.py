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
import time
import weakref
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from twinstep.runtime import environment, logs, settings
from twinstep._version import PROTOCOL_VERSION, __version__
from twinstep.runtime.capture import CaptureConfig, Recorder, backend_for, placement
from twinstep.runtime.capture.recorder import CaptureCost
from twinstep.runtime.capture.control import CaptureControl, module_lookup
from twinstep.runtime.capture.health import describe_error
from twinstep.runtime.capture.named import MAX_NAME, NamedRecords
from twinstep.runtime.batches import BatchSync, Interrupted, PublishStats
from twinstep.runtime.batches.autosync import mover
from twinstep.errors import BatchSyncError, Halted
from twinstep.runtime.setup import SetupCollector
from twinstep.runtime.transport import ClientStats, Sender, StreamClient, StreamConfig
from twinstep.runtime.transport.security import ClientSecurity
from twinstep.runtime.transport.ledger import not_sent_in_words
from twinstep.runtime.transport.shared_memory import AVAILABLE as SHARED_MEMORY_AVAILABLE
from twinstep.runtime.transport.sidecar import SidecarClient
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.runtime.weights import WeightPublisher, load_from_baseline

logger = logging.getLogger("twinstep")

_DEFAULT_SHUTDOWN_TIMEOUT = 10.0


class Monitor:
    """A model attached to a comparison session; see :func:`attach`."""

    def __init__(self, model: Any, chosen: settings.AttachSettings, *, capture: CaptureConfig, stream: StreamConfig,
                 optimizer: Any | None = None) -> None:
        identity, weights, batches = chosen.identity, chosen.weights, chosen.batches
        session, run, rank, baseline = identity.session or "", identity.run or "", identity.rank, identity.baseline
        server, start_step = stream.target, chosen.capture.start_step
        self.settings = chosen
        """Every setting this monitor runs with, by group (twinstep.runtime.settings.AttachSettings)."""
        self.session = session
        self.run = run
        self.rank = rank
        self.world_size = identity.world_size
        self.optimizer = optimizer
        """The training's optimizer given to attach (None: not given); its set-up is sent (docs/preflight.md)."""
        self._capture = capture
        self._lockstep = chosen.pacing.lockstep
        self._lockstep_timeout = chosen.pacing.lockstep_timeout
        self._step = start_step
        self._closed = False
        self._halt_lock = threading.Lock()
        self._halt: tuple[int, str] | None = None  # (at_step, reason)
        self._control = CaptureControl(run, rank, lambda: self._step)
        """Zoom windows the server sent (live capture control, twinstep.runtime.capture.control)."""
        self._bundle_about = {"session": session, "run": run, "baseline": baseline, "reference": identity.reference,
                              "rank": rank, "world_size": identity.world_size}
        self._bundle_dir = chosen.reproduce.bundle_dir
        self._bundles_armed: list = []  # twinstep.tools.reproduce.capture.BundleCapture of the step in progress
        self._bundles_done: list = []
        self._ops_armed: list = []  # twinstep.runtime.capture.ops.OpsCapture of the step in progress (zoom --ops)
        self._backend = backend_for(model)
        self._find_module = module_lookup(self._backend, model)
        framework_version = self._backend.framework_version()
        # Weight sync (docs/weight-sync.md), before any hook and before the Hello, which says what was loaded.
        self.weight_sync: pb.WeightSync | None = None
        """What init_from_baseline loaded from the baseline's initial parameters (None: not asked for)."""
        if weights.init_from_baseline:  # raises WeightSyncError, the model untouched, when they cannot all be loaded
            self.weight_sync = load_from_baseline(model, self._backend, session=session, run=run, target=server,
                                                  security=stream.security, timeout=weights.init_timeout,
                                                  compress=stream.compression == "zstd")
        self._weights: WeightPublisher | None = None
        if weights.share_weights and baseline and rank == 0:  # every rank of a data-parallel run holds the same values
            try:
                self._weights = WeightPublisher(model, self._backend, session=session, run=run, target=server,
                                                security=stream.security, compress=stream.compression == "zstd")
            except Exception as error:  # the training comes first; the server tells waiting candidates
                logger.warning("twinstep: cannot copy the initial weights to share them (%s); training continues "
                               "without sharing them", describe_error(error))
        hello = pb.Hello(
            protocol_version=PROTOCOL_VERSION,
            session=session,
            run=run,
            baseline=baseline,
            framework=self._backend.framework,
            framework_version=framework_version,
            rank=rank,
            world_size=identity.world_size,
            host=socket.gethostname(),
            pid=os.getpid(),
            client_version=__version__,
            capture=capture.capture,
            max_lead=chosen.pacing.lockstep,
            reference=identity.reference,
            precision=(identity.precision if identity.precision != "auto"
                       else self._backend.float32_matmul_precision()),
            every=capture.every,
            include=capture.include,
            exclude=capture.exclude,
            start_step=start_step,
            environment=environment.describe_environment(self._backend.framework, framework_version),
            warnings=environment.attach_warnings(self._backend.framework, framework_version),
            share_weights=self._weights is not None,
        )
        if self.weight_sync is not None:
            hello.weight_sync.CopyFrom(self.weight_sync)
        # This rank's place in a parallel layout (docs/layouts.md): declared in the settings, else found.
        found = placement.find_layout(self._backend, model, rank=rank, world_size=identity.world_size,
                                      settings=chosen.layout)
        self.layout: pb.MeshPlace | None = found.to_proto() if found is not None else None
        """This rank's place in its training's parallel layout, as sent in the Hello (None: whole, not sent)."""
        if self.layout is not None:
            hello.layout.CopyFrom(self.layout)
            logger.info("twinstep: rank %d of a parallel layout %s", rank, found.text())
        elif chosen.layout.tensor_parallel_split:
            logger.warning("twinstep: tensor_parallel_split is ignored: no parallel layout was found or declared "
                           "(declare tensor_parallel, and data_parallel or pipeline_parallel where used)")
        sender = chosen.transport.sender
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
                                  host_memory=host_memory, layout=found,
                                  splits=placement.parse_splits(chosen.layout.tensor_parallel_split))
        self._client.add_manifest([], self._recorder.parameter_infos)
        # MindSpore hands gradients to the optimizer, not to the parameters: follow the optimizer's calls.
        self._optimizer_watch = self._backend.watch_optimizer(optimizer) if optimizer is not None else None
        if optimizer is None and capture.parameters and self._backend.framework == "mindspore":
            logger.warning("twinstep: MindSpore keeps gradients off the parameters; pass optimizer= to attach to "
                           "capture parameter gradients (without it, the grad phase is not recorded)")
        # The training set-up (docs/preflight.md): sent before any step, and again when it changes.
        self._setup = SetupCollector(model, self._backend.framework, framework_version, hello.precision, rank,
                                     optimizer=optimizer)
        self._send_setup(self._setup.collect)
        self._client.start()
        self._recorder.set_active(self._captures(start_step), start_step)
        self._baseline = baseline
        self._named = NamedRecords()
        self._batches = BatchSync(target=server, security=stream.security, session=session, run=run, rank=rank,
                                  baseline=baseline, framework=self._backend.framework, timeout=batches.batch_timeout)
        if batches.publish_batches or batches.sync_batches:
            self._batches.hook_model(model, lambda: self._step, self._fetch_batch)
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
        self._send_setup(self._setup.changed)  # a clip call seen in this step goes out before its records
        health = self._recorder.health
        try:
            if self._captures(step):
                self._client.add_manifest(self._recorder.take_new_modules(), [])
                batch = self._named.merge_into(self._recorder.finish_step(step, loss), self._backend)
                self._client.submit(self._finish_ops(batch))
            else:
                self._recorder.discard_step()
                self._named.discard()
                self._finish_ops(None)
        except Exception as error:
            health.record_step_failure(step, error)  # warned once per kind; the server is told below
            self._client.mark_missing(step, "capture_failed", describe_error(error))
            self._recorder.discard_step()
            self._named.discard()
            self._finish_ops(None)
        changes = health.take_changes()
        if changes is not None:
            self._client.send_health(changes)
        self._step = step + 1
        self._batches.new_step()
        self._finish_bundles()
        self._begin_step(step + 1)
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

    def set_optimizer(self, optimizer: Any, lr_scheduler: Any = None) -> None:
        """The training's optimizer (and LR scheduler), when it exists only after ``attach``: its set-up is sent.

        For trainers that build the optimizer inside ``train()`` (the trainer callbacks
        call it); a script passes ``attach(optimizer=...)`` instead.  Never raises.
        """
        if self._closed:
            return
        self.optimizer = optimizer
        self._setup.optimizer = optimizer
        if lr_scheduler is not None:
            self._setup.scheduler = lr_scheduler
        self._send_setup(self._setup.collect)

    def record(self, name: str, value: Any) -> None:
        """Record a named value of the step in progress: compared with the baseline's value of that name.

        For what no hook sees: a batch's input ids and labels, a tokenizer's
        output, the learning rate, a gradient norm, a metric.  ``value`` is a
        number, a numpy array, a torch or paddle tensor, or a (nested) list of
        numbers; its dtype is kept (integers and booleans compare exactly,
        value by value).  Call it anywhere in the step, before ``step()``:
        where it is called places it in the step (before the model's first
        call, after the forward, after the backward), so the report's first
        divergence is the value that starts one.  A name recorded twice in a
        step gives two records (call 0 and 1).  Never raises for a value it
        cannot carry: that is counted (the report's capture health) and warned
        once.  Steps that are not captured (``every``) record nothing.
        """
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            raise ValueError(f"a record's name is text of 1 to {MAX_NAME} characters, got {name!r}")
        if self._closed or not self._captures(self._step):
            return
        try:
            self._named.add(name, value, self._recorder.last_phase())
        except Exception as error:
            self._recorder.health.record_failure(pb.RECORD, name, self._step, error)

    def publish_batch(self, batch: Any) -> None:
        """Baseline: publish this step's inputs for candidates that sync batches (``baseline_batch()``).

        ``batch``: a tensor or array, or a dict, list or tuple of them (and of plain
        numbers and text), nested.  It is copied here and sent in the background;
        call it once per step, before ``step()``.  Never raises for a batch it
        cannot send: that is counted (``batch_stats``) and warned once.
        """
        if not self._baseline:
            raise ValueError("publish_batch is the baseline's (attach(baseline=True)); a candidate takes the "
                             "baseline's batch with baseline_batch()")
        if self._closed:
            return
        try:
            self._batches.publish(self._step, batch)
        except Exception as error:
            stats = self._batches.publish_stats
            logger.warning("twinstep: cannot publish the batch of step %d (%s); training continues, candidates "
                           "syncing batches will not get it", self._step, describe_error(error))
            if stats is not None:
                stats.dropped["unsupported"] = stats.dropped.get("unsupported", 0) + 1

    def baseline_batch(self, timeout: float | None = None, device: Any = None) -> Any:
        """Candidate: the batch the baseline published for this step and rank, as this framework's tensors.

        Same structure, dtypes and shapes as the baseline's (int64 stays int64); tensors on the
        CPU, or moved to ``device`` ("cuda:0", "gpu:0", a torch device or paddle place).
        Waits for the baseline to publish it, at most ``timeout`` seconds (default: attach's
        ``batch_timeout``), then raises :class:`twinstep.BatchSyncError` saying why; raises
        :class:`twinstep.Halted` if the server halts the run meanwhile.
        """
        if self._baseline:
            raise ValueError("baseline_batch is a candidate's: the baseline publishes its batches (publish_batch)")
        if self._closed:
            raise BatchSyncError("twinstep: the monitor is closed; no batch can be fetched")
        return self._fetch_batch(mover(self._backend.framework, device), timeout)

    @property
    def batch_stats(self) -> dict[str, Any]:
        """Batch sync counters: published and dropped (baseline), fetched and seconds waited (candidate)."""
        stats: PublishStats | None = self._batches.publish_stats
        return {"published": stats.published if stats else 0, "dropped": dict(stats.dropped) if stats else {},
                "fetched": self._batches.fetched, "waited_seconds": self._batches.waited_seconds}

    def close(self, timeout: float = _DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        """Flush what is queued (at most ``timeout`` seconds), detach the hooks, say goodbye."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        stats = self._client.stats
        if self._weights is not None:  # the upload of the initial weights, if it is still going
            # Not for long to a server the stream has never reached (the same address): close ends at once.
            unreached = stats.failed_before_reached and not stats.reached
            self._weights.close(min(timeout, 1.0) if unreached else timeout)
        self._batches.close(timeout)
        self._finish_bundles()
        self._finish_ops(None)  # an armed capture gives the module its forward back
        self._wait_for_bundles(timeout / 2)  # a bundle asked with a halt is written before the process ends
        self._recorder.remove()
        self._setup.close()
        if self._optimizer_watch is not None:
            self._optimizer_watch.remove()
        changes = self._recorder.health.take_changes()
        if changes is not None:  # failures after the last step() (a trailing forward, say)
            self._client.send_health(changes)
        reason = "halted" if self._halt is not None else "finished"
        self._client.close(reason, self._step - 1, timeout)
        # A server that refused the run was reached: the refusal was logged, and its drops are said so.
        reached = stats.reached or bool(stats.rejected)
        not_sent = not_sent_in_words(stats.dropped, reached=reached)
        if not reached:
            logger.warning("twinstep: run %r rank %d never reached the comparison server at %s%s", self.run, self.rank,
                           self.settings.connection.server, f": {not_sent}" if not_sent else "")
        elif not_sent:
            logger.warning("twinstep: run %r rank %d: %s", self.run, self.rank, not_sent)

    def detach(self) -> None:
        """Alias of :meth:`close`."""
        self.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------

    def _captures(self, step: int) -> bool:
        return step % self._capture.every == 0 or self._control.captures(step)

    @property
    def bundles(self) -> list[str]:
        """Reproducer bundles this monitor wrote (paths), when the server asked for them."""
        return [str(b.path) for b in self._bundles_done if b.path is not None]

    def _send_setup(self, collect: Any) -> None:
        """Send the set-up ``collect()`` returns (None: unchanged); a failure is a warning, never the training's."""
        try:
            setup = collect()
            if setup is not None:
                self._client.send_setup(setup)
        except Exception as error:
            logger.warning("twinstep: could not describe the training set-up (%s); training continues, the "
                           "preflight diff will be missing or stale", describe_error(error))

    def _begin_step(self, step: int) -> None:
        """Apply the zoom windows that reach the step starting now, and arm the bundles due in it."""
        try:
            self._recorder.set_zoom(self._control.plan(step))
            for spec in self._control.bundles_due(step):
                from twinstep.tools.reproduce.capture import BundleCapture  # only a run asked for a bundle loads it

                capture = BundleCapture(self._backend.framework, self._find_module(spec.bundle_module), spec, step,
                                        self._bundle_about, Path(self._bundle_dir))
                capture.arm()
                self._bundles_armed.append(capture)
            for spec in self._control.ops_due(step):
                from twinstep.runtime.capture.ops import OpsCapture  # only a run asked for operations loads it

                ops = OpsCapture(self._backend, self._find_module(spec.ops_module), spec.ops_module, spec, step)
                ops.arm()
                self._ops_armed.append(ops)
        except Exception as error:  # live capture control must never break the training
            logger.warning("twinstep: could not apply the server's capture change at step %d: %s", step,
                           describe_error(error))

    def _finish_ops(self, batch: Any) -> Any:
        """The step's operation capture (at most one goes out per step), carried by its batch."""
        armed, self._ops_armed = self._ops_armed, []
        for capture in armed:
            try:
                trace = capture.finish()
                if batch is not None and not batch.ops:
                    batch.ops = trace
            except Exception as error:  # never break the training
                logger.warning("twinstep: could not capture the operations asked for: %s", describe_error(error))
        return batch

    def _finish_bundles(self) -> None:
        """The step ended: the armed bundles are written, off the training thread."""
        armed, self._bundles_armed = self._bundles_armed, []
        for capture in armed:
            try:
                capture.finish()
                self._bundles_done.append(capture)
            except Exception as error:
                logger.warning("twinstep: could not write a reproducer bundle: %s", describe_error(error))

    def _wait_for_bundles(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for capture in self._bundles_done:
            if capture.writer is not None:
                capture.writer.join(max(deadline - time.monotonic(), 0.0))

    def _fetch_batch(self, to_device: Any = None, timeout: float | None = None) -> Any:
        """The baseline's batch of the current step; a halt for this step during the wait raises Halted."""
        step = self._step

        def halting() -> bool:
            halt = self._halt
            return halt is not None and (halt[0] < 0 or halt[0] <= step)

        try:
            return self._batches.fetch(step, timeout, halting, to_device)
        except Interrupted:
            self._raise_if_halted(step)
            raise  # unreachable: interrupted only by a halt at or before this step

    def _on_command(self, command: pb.Command) -> None:
        """Runs on the sender thread: remember a HALT for the training thread, hand a ZOOM to live capture control."""
        if command.kind == pb.Command.ZOOM:
            try:
                self._control.add(command.zoom)
            except Exception as error:  # the stream and the training go on without it
                logger.warning("twinstep: ignoring a capture change from the server: %s", describe_error(error))
            return
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
    # BEGIN generated: attach keywords
    # identity: which run of which comparison session this process is
    session: str | None = None,
    run: str | None = None,
    baseline: bool | None = None,
    reference: bool | None = None,
    precision: Literal["auto", "fp32", "tf32"] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    # connection: how this process reaches the comparison server (docs/security.md)
    server: str | None = None,
    token: str | None = None,
    tls_ca: str | None = None,
    tls_client_cert: str | None = None,
    tls_client_key: str | None = None,
    insecure: bool | None = None,
    # capture: what is recorded, and at which steps
    capture: Literal["stats", "tensors", "lossy"] | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    every: int | None = None,
    start_step: int | None = None,
    backward: bool | None = None,
    sketch: bool | None = None,
    stats_workers: int | None = None,
    # transport: how steps travel to the server, and what is held while it is behind or away
    sender: Literal["auto", "thread", "process"] | None = None,
    compression: Literal["auto", "zstd", "none"] | None = None,
    max_queue_steps: int | None = None,
    max_queue_bytes: int | str | None = None,
    # pacing: whether a faster run waits for the others
    lockstep: int | None = None,
    lockstep_timeout: float | None = None,
    # weights: starting candidates from the baseline's initial parameters (docs/weight-sync.md)
    share_weights: bool | None = None,
    init_from_baseline: bool | None = None,
    init_timeout: float | None = None,
    # batches: feeding candidates the baseline's inputs (docs/records-and-batches.md)
    publish_batches: bool | None = None,
    sync_batches: bool | None = None,
    batch_timeout: float | None = None,
    # reproduce: what the server may ask this process to write (docs/zoom-and-reproduce.md)
    bundle_dir: str | None = None,
    # layout: where this rank sits in its training's parallel layout (docs/layouts.md)
    layout_detect: bool | None = None,
    tensor_parallel: int | None = None,
    data_parallel: int | None = None,
    pipeline_parallel: int | None = None,
    tensor_parallel_rank: int | None = None,
    data_parallel_rank: int | None = None,
    pipeline_parallel_rank: int | None = None,
    tensor_parallel_split: Mapping[str, str] | None = None,
    # END generated: attach keywords
    optimizer: Any | None = None,
    config: str | None = None,
) -> Monitor:
    """Attach twinstep to a ``torch.nn.Module``, ``paddle.nn.Layer`` or ``mindspore.nn.Cell`` and start streaming.

    Every setting left out (None) comes from its environment variable
    ``TWINSTEP_<NAME>`` (``TWINSTEP_SESSION``, ``TWINSTEP_CAPTURE``, ...), else
    from the YAML config file (``config`` or ``$TWINSTEP_CONFIG``: its top-level
    keys, overridden by its ``runs: {RUN: ...}`` section), else its default.
    The settings are defined, in groups, in twinstep.runtime.settings; their
    table is in docs/attach.md.  A value that cannot be read is a ValueError
    naming the argument, the variable, or the file and key.

    Args:
        session: Comparison session name; every run of a comparison names the same one. Required.
        run: This training's name within the session (e.g. torch, paddle). Required.
        baseline: This run is the one the others are judged against. Default: false.
        reference: This run is a rerun of the baseline (determinism off, or another precision) that
            measures its own noise: candidates are then judged against multiples of each record's
            noise band (docs/three-way.md). Default: false.
        precision: Arithmetic of this run's float32 matrix products: fp32, tf32, or auto, which asks
            the framework (TF32 on GPUs unless disabled). Float32 records of a tf32 run are judged
            with looser tf32 tolerances. Default: auto.
        rank: This process's rank within its run. Without TWINSTEP_RANK: torchrun's RANK or
            paddle.distributed.launch's PADDLE_TRAINER_ID. Default: 0.
        world_size: Processes (ranks) of this run. Without TWINSTEP_WORLD_SIZE: WORLD_SIZE or
            PADDLE_TRAINERS_NUM. Default: 1.
        server: Address of the comparison server, host:port (gRPC's unix:PATH too). Required.
        token: The session's (or the operator's) token, sent as 'authorization: Bearer TOKEN'. A
            server that refuses it ends capture with one error log; training continues. An empty
            argument means none. Default: none.
        tls_ca: PEM file of the CA, or of the server's self-signed certificate, to trust (none: the
            system's CAs). Default: none.
        tls_client_cert: PEM client certificate, for a server that asks for one (mutual TLS); with
            tls_client_key. Default: none.
        tls_client_key: Its PEM private key. Default: none.
        insecure: Plaintext to a server that is not on a loopback address. Without TLS settings a
            loopback server is reached in plaintext and any other one over TLS. Default: false.
        capture: What is sent of each tensor: stats (statistics), tensors (plus the full tensor,
            lossless) or lossy (plus the full tensor quantised within the error the server's
            tolerances allow: no verdict changes, fewer bytes). Default: stats.
        include: Glob patterns over module names selecting what is hooked ('' is the whole model).
            Default: *.
        exclude: Glob patterns over module names to leave out. Default: none.
        every: Capture every N-th step; a step that is not captured runs with no hook attached.
            Default: 1.
        start_step: The number of the first step recorded: a run resumed from a checkpoint, or
            attached after some steps, numbers its steps as the baseline does. The server reports
            the steps before it as not compared. Default: 0.
        backward: Record gradients with respect to module outputs. Default: true.
        sketch: Also send a count-sketch of every floating tensor (1 KiB each), from which the
            server estimates rel_l2 and cosine of whole tensors. Default: false.
        stats_workers: Threads computing the statistics of CPU tensors while the training computes
            (they release the GIL: give them a free core); 0 computes them in the hooks, on the
            training thread. Default: 1.
        sender: Where full tensors are encoded and sent: thread (a thread of this process), process
            (a sender process reading the tensor copies from shared memory, so its work never holds
            this process's GIL) or auto (process for tensors and lossy capture of a model on the CPU
            where shared memory exists, else thread). Statistics always use a thread. Default: auto.
        compression: Lossless compression of full tensors: zstd, none, or auto (zstd, except for a
            dtype it shrinks by under 10%, such as float32 activations). Use zstd over slow links.
            Default: auto.
        max_queue_steps: Steps held while the server is behind or away; the oldest are dropped (and
            counted) beyond it. Default: 256.
        max_queue_bytes: Bytes held while the server is behind or away; the oldest steps are dropped
            (and counted) beyond it. Default: 1GiB.
        lockstep: If N > 0, step() waits while this run leads the slowest other run by N steps
            (opt-in: it slows the faster training). Default: 0.
        lockstep_timeout: Longest single lockstep wait, in seconds; past it the run warns and gives
            up lockstep. Default: 300.
        share_weights: Baseline: copy the initial parameters at attach and upload them to the server
            (in the background; rank 0 only) for candidates that attach with init_from_baseline.
            Costs one host copy of the model until the upload is done. Default: false.
        init_from_baseline: Candidate (or reference): before the first step, load the baseline's
            initial parameters, converted by the server to this run's names, layouts and fused
            modules; all or nothing (a WeightSyncError, the model untouched, when they cannot be
            loaded). Default: false.
        init_timeout: Longest wait for the baseline's weights, in seconds. Default: 300.
        publish_batches: Baseline: publish the inputs of the model's first call in every step, for
            candidates that sync batches. Default: false.
        sync_batches: Candidate: call the model, on its first call of every step, with the inputs
            the baseline published for that step and rank (waiting up to batch_timeout; a
            BatchSyncError past it). Default: false.
        batch_timeout: Longest wait for the baseline's batch of a step, in seconds. Default: 300.
        bundle_dir: The folder reproducer bundles are written to when the server asks for them (a
            halt with the server's halt.bundle, or twinstep zoom --bundle). Default:
            twinstep-bundles.
        layout_detect: Find this rank's place in its training's parallel layout, and what each
            record holds of its logical tensor: torch's DTensors and tensor-parallel API,
            DistributedDataParallel (a process group larger than the tensor-parallel one),
            Megatron-core, paddle's fleet. Off: the records are sent as whole tensors, unless the
            sizes below declare a layout. Default: true.
        tensor_parallel: Declares the tensor-parallel size (0: not declared). Declaring any size
            replaces detection: the ranks are derived from the global rank, tensor fastest, then
            data, then pipeline (Megatron's order), unless given. Default: 0.
        data_parallel: Declares the data-parallel size (0: the world size divided by the tensor and
            pipeline sizes, when one of those is declared). Default: 0.
        pipeline_parallel: Declares the pipeline-parallel size (0: not declared). Default: 0.
        tensor_parallel_rank: This process's tensor-parallel rank (none: derived from its rank).
            Default: none.
        data_parallel_rank: This process's data-parallel rank (none: derived from its rank).
            Default: none.
        pipeline_parallel_rank: This process's pipeline stage (none: derived from its rank).
            Default: none.
        tensor_parallel_split: For layers twinstep cannot see through: glob patterns over module
            names, each with the dimension along which tensor parallelism splits the module's
            outputs (DIM, e.g. -1), its input (input=DIM) or both (-1,input=-1); a pattern over
            parameter names takes the parameter's split dimension. Each rank holds block
            tensor_parallel_rank of tensor_parallel along it. Default: none.
        optimizer: the training's optimizer (a ``torch.optim.Optimizer`` or a
            ``paddle.optimizer.Optimizer``), an argument only (it cannot come from
            the environment or a file).  Its class and hyper-parameters per
            parameter group go into the run's set-up, which the server diffs
            against the baseline's before the first step (docs/preflight.md).
            A ``mindspore.nn.Optimizer`` is required to capture a MindSpore
            model's parameter gradients: MindSpore passes them to the optimizer
            call, not to the parameters (docs/mindspore.md).
        config: YAML file of settings (default ``$TWINSTEP_CONFIG``); see
            docs/zero-code.md for its shape.
    """
    given = {name: value for name, value in locals().items() if name not in settings.ARGUMENT_ONLY}
    return start(model, settings.resolve(given, config=config).settings, optimizer=optimizer)


def start(model: Any, chosen: settings.AttachSettings, *, optimizer: Any | None = None) -> Monitor:
    """``attach`` with every setting resolved (twinstep.runtime.settings): check them and start the monitor."""
    chosen.check()
    logs.install()  # twinstep's lines in its own words and format, once each (twinstep.runtime.logs)
    connection, capture = chosen.connection, chosen.capture
    if chosen.transport.sender == "process" and not SHARED_MEMORY_AVAILABLE:
        raise ValueError("sender='process' needs shared memory files (os.memfd_create, Linux)")
    # Resolved already: an empty value means none, and the environment is not read again.
    security = ClientSecurity.resolve(token=connection.token or "", tls_ca=connection.tls_ca or "",
                                      tls_client_cert=connection.tls_client_cert or "",
                                      tls_client_key=connection.tls_client_key or "", insecure=connection.insecure)
    return Monitor(
        model,
        chosen,
        capture=CaptureConfig(
            capture=capture.capture, include=capture.include, exclude=capture.exclude, every=capture.every,
            backward=capture.backward, sketch=capture.sketch, stats_workers=capture.stats_workers,
        ),
        stream=StreamConfig(target=connection.server or "", max_queue_steps=chosen.transport.max_queue_steps,
                            max_queue_bytes=chosen.transport.max_queue_bytes,
                            compression=chosen.transport.compression, **security.as_dict()),
        optimizer=optimizer,
    )
