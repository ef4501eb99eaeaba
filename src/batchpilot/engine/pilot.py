"""`Pilot`: the helper that runs adaptive-batch training inside the user's own loop.

The user's loop stays a loop over micro-batches::

    for x, y in pilot.batches(epochs=10):
        pilot.backward(loss_fn(model(x), y))

With ``Pilot(oom_recovery=True)`` each micro-batch's forward and backward go inside
``with pilot.micro_step():``; a step that runs out of memory is then run again with half the micro-batch
(same global batch, same LR), as Composer does.

Between the last micro-batch of a step and the first of the next, the generator runs the step's end:
gradient all-reduce (when the model is not DDP-wrapped), non-finite check, clipping, optimizer step, LR
coupling and schedules, logging, the controller's decision (rank 0 decides, every rank applies the
broadcast value), and checkpointing. A decision made after step t is the size of step t+1.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import math
import numbers
import os
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import distributed as bpdist
from .._extras import install_hint
from .._validation import (
    check_batch_size,
    check_bool,
    check_bounds,
    check_choice,
    check_positive_int,
    collect_problems,
)
from .._wrappers import unwrap
from ..checkpoint import (
    CheckpointError,
    checkpoint_path,
    class_name,
    fit_problems,
    load_checkpoint,
    load_latest_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from ..clipping import StatsClip, grad_norm
from ..controllers.base import (
    Controller,
    Observation,
    as_controller,
    check_controller,
    controller_name,
    needs_gradient_stats,
    validate_decision,
)
from ..data.loader import AdaptiveDataLoader, MicroBatch
from ..logs import AdjustmentLog, ProgressBar, TensorBoardSink
from ..lr import AdaScaleLR, LRCoupling, SampleLRSchedule, check_rule
from ..measure import DEFAULT_NOISE_EVERY, GradientNoiseProbe, StepMeter
from ..rng import gather_rng_states, restore_rng_states, set_torch_rng, torch_rng
from .replay import error_summary, is_out_of_memory, keep_finished_step
from .step_end import reduce_step_loss

logger = logging.getLogger("batchpilot")

StepCallback = Callable[["Pilot", dict], None]


class Pilot:
    """Adaptive global batch size for a user-written PyTorch training loop.

    Args:
        model: The model, optionally wrapped in ``DistributedDataParallel`` and/or ``torch.compile`` (in
            either order; checkpoints hold the bare module's weights).
        optimizer: Its optimizer.
        dataset: A map-style dataset with ``__len__``.
        batch_size: Global batch size of the first step.
        controller: A :class:`~batchpilot.controllers.Controller`, or any callable
            ``(step, current_size) -> size`` (seed 003's scheduler signature); ``None`` keeps the size.
        decide_every: Ask the controller after every ``decide_every``-th step.
        min_batch_size, max_batch_size: Bounds every decision is clamped to (logged when it happens).
        on_invalid: ``"raise"`` when a controller returns 0, a negative, NaN or a non-integer, or
            ``"keep"`` to keep the current size and log a warning.
        max_micro_batch_size: Most samples per forward/backward on one rank; larger shares are
            accumulated over several micro-batches (``None``: one micro-batch per step).
        lr_rule: How the learning rate follows the batch size: ``"none"``, ``"linear"`` (Goyal et al.
            2017), ``"sqrt"`` (Malladi et al. 2022), ``"linear-then-sqrt"`` (seed 002, knee ``lr_knee``),
            ``"adascale"`` (Johnson et al. 2020: the gain from measured gradient noise; sample-based
            schedules then run on AdaScale's scale-invariant progress) or a callable ``ratio -> factor``;
            applied on top of ``lr_schedulers``.
        base_batch_size: The batch size at which the optimizer's LR is right (default: ``batch_size``).
        lr_knee: Knee of ``"linear-then-sqrt"``.
        lr_schedulers: torch LR schedulers (stepped once per step; not ``ReduceLROnPlateau``) and/or
            :class:`~batchpilot.lr.SampleLRSchedule` (stepped with ``samples_seen``).
        shuffle, seed, drop_last: Data order (see :class:`~batchpilot.AdaptiveBatchSampler`).
        num_workers, collate_fn, pin_memory, prefetch_factor: Data loading (see
            :class:`~batchpilot.AdaptiveDataLoader`).
        amp: ``None``, ``"bf16"`` (autocast to bfloat16, CPU or CUDA) or ``"fp16"`` (autocast to float16 with a
            ``torch.amp.GradScaler`` on the model's device: meant for CUDA; on CPU it runs, but ``"bf16"`` is
            the faster choice there). A step whose scaled gradient overflows is skipped by the scaler.
        grad_clip: ``None``, a max global norm, or ``"stats"`` (:class:`~batchpilot.clipping.StatsClip`).
        skip_nonfinite: Skip the optimizer step when the loss or gradient norm is not finite.
        device: Where micro-batches are moved (default: the device of the model's first parameter).
        log_path: JSONL adjustment log (rank 0 writes it).
        tensorboard_dir: Also write step metrics to TensorBoard (needs ``batchpilot[tensorboard]``).
        progress: Show a progress bar (``None``: when stderr is a terminal).
        checkpoint_dir, checkpoint_every, keep_checkpoints: Save a checkpoint every N steps into the folder,
            keeping the newest ``keep_checkpoints``.
        loss_reduction: Whether the loss given to :meth:`backward` is the ``"mean"`` or the ``"sum"``
            over its micro-batch.
        loss_history: How many recent step losses an :class:`Observation` carries.
        noise_every: Measure the gradient noise scale (McCandlish et al. 2018) on every N-th step, from
            micro-batch gradients and, with several ranks, each rank's gradient (under DDP through a
            communication hook); on one process a step with one micro-batch is split in two. ``None``:
            every ``DEFAULT_NOISE_EVERY`` (16) steps when the controller reads gradient statistics (its
            ``required_stats``) or ``lr_rule="adascale"``, else never. Measured cost on a small CNN on CPU
            (``benchmarks/overhead.py``): about +4.5-5% per step at 16 (batch 32-128), +9% at 8, +18% at 4.
        system_every: Sample CPU/memory/GPU load every N steps (needs ``batchpilot[system]``; ``None``: off).
            The loss trend and the throughput model (time per micro-batch ``a + b*m``) are always on.
        oom_recovery: Recover from running out of memory: each micro-batch's forward and backward must run
            inside ``with pilot.micro_step():``; an out-of-memory error there is caught, the step's
            gradients are dropped, and the same step (same samples, same global batch and LR) runs again
            with micro-batches of at most half the size that failed; the bound then stays (it never grows
            back, and it is saved in checkpoints). With several ranks the ranks agree on it with one
            integer all-reduce per step, and a DDP model runs every micro-batch under ``no_sync`` and has
            its gradients all-reduced at the step's end (DDP's overlap of communication with the backward
            is lost; module buffers are broadcast from rank 0 after each step, as DDP does before a
            forward). See docs/concepts.md.
        rank, world_size: Override what ``torch.distributed`` reports (for tests).

    Raises:
        ValueError, TypeError: invalid arguments (all problems are reported at once).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: torch.utils.data.Dataset,
        *,
        batch_size: int,
        controller: Controller | Callable[[int, int], int] | None = None,
        decide_every: int = 1,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        on_invalid: str = "raise",
        max_micro_batch_size: int | None = None,
        lr_rule: str | Callable[[float], float] = "none",
        base_batch_size: int | None = None,
        lr_knee: int = 4096,
        lr_schedulers: Sequence[Any] = (),
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        amp: str | None = None,
        grad_clip: float | str | None = None,
        skip_nonfinite: bool = True,
        device: torch.device | str | None = None,
        log_path: str | os.PathLike | None = None,
        tensorboard_dir: str | os.PathLike | None = None,
        progress: bool | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 2,
        loss_reduction: str = "mean",
        loss_history: int = 50,
        noise_every: int | None = None,
        system_every: int | None = 100,
        oom_recovery: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        problems = collect_problems(
            batch_size=lambda: check_batch_size(batch_size),
            decide_every=lambda: check_positive_int(decide_every, "decide_every"),
            bounds=lambda: check_bounds(min_batch_size, max_batch_size, ("min_batch_size", "max_batch_size")),
            base_batch_size=lambda: base_batch_size is None or check_batch_size(base_batch_size, "base_batch_size"),
            on_invalid=lambda: check_choice(on_invalid, "on_invalid", ("raise", "keep")),
            amp=lambda: check_choice(amp, "amp", (None, "bf16", "fp16")),
            loss_reduction=lambda: check_choice(loss_reduction, "loss_reduction", ("mean", "sum")),
            loss_history=lambda: check_positive_int(loss_history, "loss_history"),
            noise_every=lambda: noise_every is None or check_positive_int(noise_every, "noise_every"),
            system_every=lambda: system_every is None or check_positive_int(system_every, "system_every"),
            keep_checkpoints=lambda: check_positive_int(keep_checkpoints, "keep_checkpoints"),
            checkpoint_every=lambda: checkpoint_every is None or check_positive_int(checkpoint_every, "checkpoint_every"),
            grad_clip=lambda: _check_grad_clip(grad_clip),
            controller=lambda: check_controller(controller),
            oom_recovery=lambda: check_bool(oom_recovery, "oom_recovery"),
            skip_nonfinite=lambda: check_bool(skip_nonfinite, "skip_nonfinite"),
            progress=lambda: progress is None or check_bool(progress, "progress"),
            lr_schedulers=lambda: _check_schedulers(lr_schedulers, optimizer),
            lr_rule=lambda: check_rule(lr_rule, "lr_rule", also=("adascale",)),  # the message names every rule
            lr_knee=lambda: check_positive_int(lr_knee, "lr_knee"),
        )
        if not problems and checkpoint_every is not None and checkpoint_dir is None:
            problems.append("checkpoint_every is set but checkpoint_dir is None; pass checkpoint_dir=... too.")
        if not problems:
            lo, hi = min_batch_size, max_batch_size
            if (lo is not None and batch_size < lo) or (hi is not None and batch_size > hi):
                problems.append(f"batch_size={batch_size} lies outside [min_batch_size={lo}, max_batch_size={hi}].")
        if problems:
            raise ValueError("invalid Pilot arguments:\n  - " + "\n  - ".join(problems))
        # Plain ints from here on (a numpy integer passes the checks but would be pickled into checkpoints,
        # which torch.load(weights_only=True) then refuses to read).
        batch_size, decide_every, loss_history, keep_checkpoints = (
            int(batch_size), int(decide_every), int(loss_history), int(keep_checkpoints))
        min_batch_size, max_batch_size, base_batch_size, noise_every, system_every, checkpoint_every = (
            None if v is None else int(v)
            for v in (min_batch_size, max_batch_size, base_batch_size, noise_every, system_every, checkpoint_every))
        if amp == "fp16" and any(p.dtype == torch.float16 for p in model.parameters() if p.requires_grad):
            raise ValueError("amp='fp16' needs float32 parameters (the GradScaler cannot unscale float16 gradients); "
                             "keep the model in float32 (autocast runs the float16 math), or use amp='bf16' or amp=None.")

        self.model = model
        self.optimizer = optimizer
        self.rank, self.world_size = bpdist.rank_and_world(rank, world_size)
        if self.world_size > 1 and not bpdist.is_distributed():
            raise ValueError(
                f"world_size={self.world_size} but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first (torchrun sets it up), or use world_size=1."
            )
        group = bpdist.rank_and_world()
        if self.world_size > 1 and (self.rank, self.world_size) != group:
            raise ValueError(
                f"rank={self.rank}, world_size={self.world_size} disagree with the process group (rank {group[0]} "
                f"of {group[1]}); leave them None to train over the group, or pass world_size=1 to train this "
                "rank on its own."
            )
        # The bare module (what checkpoints hold) and the DDP wrapper, through torch.compile in any order.
        self._module, self._ddp_model = unwrap(model)
        ddp = self._ddp_model is not None
        if ddp:  # a DDP model exists only with a process group
            ddp_size = bpdist.group_size(getattr(self._ddp_model, "process_group", None))
            if self.world_size == 1 and ddp_size > 1:
                raise ValueError(
                    f"world_size=1 trains this rank on its own, but the DDP model all-reduces every backward over "
                    f"{ddp_size} ranks (they would average weights while deciding sizes apart, and hang when their "
                    "step counts differ); pass the bare model (ddp_model.module) with world_size=1, or leave "
                    "world_size None to train over the group."
                )
            if ddp_size != self.world_size:
                raise ValueError(
                    f"the DDP model averages over a process group of {ddp_size} ranks, but the batch is shared over "
                    f"all {self.world_size}; batchpilot shares data, weights losses and decides over the default "
                    "group, so wrap the model with DDP over the default group (hybrid parallelism with a data-"
                    "parallel subgroup is not supported)."
                )
        self.oom_recovery = oom_recovery
        # Who sums the gradients over ranks: DDP inside the last backward, or the engine at the step's end
        # (without DDP, and under OOM recovery, where the ranks must agree on a replay before any reduction).
        self._engine_reduces = self.world_size > 1 and (not ddp or oom_recovery)
        self._ddp_syncs = ddp and not self._engine_reduces
        if self._ddp_model is not None and self._engine_reduces:
            # Every micro-batch then runs under no_sync, whose forwards do no collective, except that DDP
            # broadcasts the buffers in a forward that follows a synced one, and starts as if one had run.
            # A rank that fails inside a forward would leave the ranks' collectives out of step; the engine
            # broadcasts the buffers itself at each step's end instead.
            self._ddp_model.require_forward_param_sync = False
        # Every trainable parameter's gradient is reduced, measured and clipped, and dropped after each step:
        # also those the optimizer does not hold (yet: add_param_group later), whose .grad would else grow
        # from step to step. Re-read when a loop starts and after callbacks (progressive unfreezing).
        self._all_params = list(model.parameters())
        self._noise: GradientNoiseProbe | None = None  # built below; it measures the list re-read here
        self._refresh_params()
        if not self._params:
            raise ValueError("the model has no parameter with requires_grad=True: there is nothing to train.")
        if len(self._unheld) == len(self._params):
            raise ValueError(
                "the optimizer holds none of the model's trainable parameters, so training would change nothing; "
                "build it from this model's parameters, e.g. torch.optim.SGD(model.parameters(), ...)."
            )
        self.device = torch.device(device) if device is not None else self._params[0].device
        if self.device.type == "cuda" and self.device.index is not None and bpdist.is_distributed():
            # NCCL collectives (the decisions, the statistics, checkpoints) run on the *current* CUDA device:
            # make it this rank's, or every rank that skipped torch.cuda.set_device would talk on cuda:0.
            torch.cuda.set_device(self.device)
        if not ddp and self.world_size > 1:  # (after set_device: under NCCL the broadcast runs on this device)
            bpdist.broadcast_module(self._module)  # as DDP does when it is built: every rank starts from rank 0's
        self.loader = AdaptiveDataLoader(
            dataset,
            batch_size,
            max_micro_batch_size=max_micro_batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            rank=self.rank,
            world_size=self.world_size,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
        )
        self.num_samples = self.loader.sampler.num_samples
        self.controller = as_controller(controller)
        self.decide_every = decide_every
        self.min_batch_size, self.max_batch_size = min_batch_size, max_batch_size
        self.on_invalid = on_invalid
        adascale = lr_rule == "adascale"
        base = batch_size if base_batch_size is None else base_batch_size
        self.coupling = LRCoupling(optimizer, base, rule="none" if adascale else lr_rule,
                                   knee=lr_knee)
        self._couple = lr_rule not in ("none", "adascale")  # "none" never changes the LR: skip the per-step work
        # AdaScale (Johnson et al. 2020): the LR gain comes from the gradient statistics of each step.
        self.adascale = AdaScaleLR(optimizer, base) if adascale else None
        self.lr_schedulers = list(lr_schedulers)
        for scheduler in self.lr_schedulers:
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise TypeError(
                    "lr_schedulers holds a ReduceLROnPlateau, which steps on a metric, not once per step; "
                    "keep it out of the Pilot and call its step(metric) yourself, e.g. from a callback "
                    "(pilot.add_callback) after an evaluation."
                )
        self.amp = amp
        self.scaler = torch.amp.GradScaler(self.device.type) if amp == "fp16" else None
        self.grad_clip = grad_clip if grad_clip is None or isinstance(grad_clip, str) else float(grad_clip)
        self._stats_clip = StatsClip() if grad_clip == "stats" else None
        self.skip_nonfinite = skip_nonfinite
        self.loss_reduction = loss_reduction
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self._lead = self.rank == 0
        # TensorBoard first: without it installed, the ImportError leaves no log file opened behind.
        self._tb = TensorBoardSink(tensorboard_dir) if (tensorboard_dir is not None and self._lead) else None
        self._log = AdjustmentLog(log_path) if (log_path is not None and self._lead) else None
        self._progress_enabled = progress if self._lead else False
        self._callbacks: list[StepCallback] = []
        if noise_every is None and (needs_gradient_stats(self.controller) or self.adascale is not None):
            noise_every = DEFAULT_NOISE_EVERY
        self._noise = GradientNoiseProbe(
            self._params, every=noise_every, ranks_are_small_batches=self._engine_reduces,
            population=self.num_samples,  # the sampler draws each epoch without replacement
        ) if noise_every else None
        if (self._noise is not None and self._ddp_syncs and self.world_size > 1
                and not self._noise.attach_ddp(self._ddp_model)):
            logger.info("the DDP model already has a communication hook: measured steps are split in two "
                        "to measure the gradient noise scale (see docs/statistics.md)")
        self._meter = StepMeter(system_every=system_every, device=self.device)
        self._warn_if_system_stats_missing(system_every)
        if self._noise is not None:
            self.loader.min_accumulation = self._noise.min_accumulation

        # Counters of *consumed* data (the loader may have planned further ahead).
        self.step = 0
        self.samples_seen = 0
        self.skipped_steps = 0
        self._losses: collections.deque[float] = collections.deque(maxlen=loss_history)
        self._throughput: float | None = None
        self._override: int | None = None
        self._dropped_reported = self.loader.sampler.dropped_samples
        self.last_record: dict[str, Any] = {}
        self.last_decision: dict[str, Any] | None = None
        # Per-micro-batch bookkeeping between a yield and the matching backward().
        self._micro: MicroBatch | None = None
        self._backward_done = False
        self._micro_losses: list[tuple[torch.Tensor, int]] = []  # (detached loss, weight in samples)
        self._in_micro_step = False
        self._oom_size: int | None = None  # samples of the micro-batch that ran out of memory, this step
        self._step_open = False  # a step's first micro-batch was yielded and the step is not finished
        self._oom_error = ""
        self.oom_replays = 0  # steps run again after running out of memory
        self._step_rng: tuple[torch.Tensor, torch.Tensor | None] | None = None  # torch's RNG at the step's start
        self._step_buffers: list[torch.Tensor] = []  # the module's buffers at the step's start (oom_recovery)
        self._overhead_clean = False  # whether this step's time outside its micro-batches is a fair sample
        self._rewinds_seen = self.loader.rewinds
        # A step run again (after running out of memory, or after the loop left it unfinished) draws what one
        # run once did (augmentation, dropout).
        self.loader.on_step_start = self._snapshot_step
        self._step_clock = time.perf_counter()

    # ------------------------------------------------------------------ properties
    @property
    def batch_size(self) -> int:
        """Global batch size of the next step (inside a step, a :meth:`set_batch_size` made in it; between
        steps, after a loop left a step unfinished, that step's own size: it runs again first)."""
        if self._micro is not None and self._override is not None:
            return self._override
        return self.loader.batch_size

    @property
    def epoch(self) -> int:
        """Full passes over the data completed (during a step: before that step; between steps an epoch
        whose only rest is a tail ``drop_last`` drops counts as completed)."""
        return self._micro.epoch if self._micro is not None else self.loader.epochs_done()

    @property
    def coverage(self) -> float:
        """Fraction of the current pass consumed, in ``[0, 1)`` (during a step: before that step)."""
        if self._micro is not None:
            return self._micro.offset / self.num_samples
        epoch, offset, _ = self.loader.position()
        return 0.0 if self.loader.epochs_done() > epoch else offset / self.num_samples  # (a tail to drop: 0)

    @property
    def virtual_epoch(self) -> float:
        """``samples_seen / len(dataset)`` (seed 003's logged ``epoch``)."""
        return self.samples_seen / self.num_samples

    @property
    def micro_batch(self) -> MicroBatch | None:
        """The micro-batch being processed (its indices, sizes, position in the step), or ``None``
        between steps."""
        return self._micro

    def add_callback(self, fn: StepCallback) -> None:
        """Call ``fn(pilot, record)`` after every step (on every rank), e.g. to evaluate."""
        if not callable(fn):
            raise TypeError(f"add_callback() takes a function fn(pilot, record), got {fn!r}.")
        self._callbacks.append(fn)

    def set_batch_size(self, batch_size: int) -> None:
        """Use ``batch_size`` from the next step on (overrides the controller's next decision).

        Like a controller's decision it is clamped to ``[min_batch_size, max_batch_size]`` and logged.
        Under DDP every rank must call it with the same value (a callback runs on every rank; broadcast a
        value only rank 0 knows with ``batchpilot.distributed.broadcast_int``). A mismatch is detected at the
        end of the next step and stops every rank, as long as every rank takes that step: one that ends an
        epoch on one rank only (a ``drop_last`` tail) can leave the others waiting.
        """
        size = check_batch_size(batch_size)
        if self._micro is not None:  # inside a step: the step's end applies it in place of a decision
            self._override = size
            return
        self._override = None  # between steps it replaces one made in a step the loop left unfinished
        current = self.loader.batch_size
        new, note = validate_decision(size, current=current, min_size=self.min_batch_size,
                                      max_size=self.max_batch_size, source="set_batch_size()")
        self._log_decision(current, new, "user", note, self.last_record)
        self.loader.set_batch_size(new)
        if self.coupling.is_scaled:  # inside batches(): the next step's LR follows its size
            self._rescale_lr()

    # ------------------------------------------------------------------ the loop
    def batches(
        self, epochs: int | None = None, max_steps: int | None = None, max_samples: int | None = None
    ) -> Generator[Any, None, None]:
        """Yield micro-batches (moved to ``device``) until a stop condition holds.

        The limits are totals since the start of training, so the same call continues correctly after
        :meth:`load_checkpoint`: ``epochs`` full passes, ``max_steps`` optimizer steps, ``max_samples``
        samples. At least one is required; training stops at the first step boundary where one holds.

        Call :meth:`backward` exactly once per yielded micro-batch.
        """
        if epochs is None and max_steps is None and max_samples is None:
            raise ValueError("batches() needs a stop condition: pass epochs=, max_steps= or max_samples=.")
        for name, value in (("epochs", epochs), ("max_steps", max_steps), ("max_samples", max_samples)):
            if value is not None:
                check_positive_int(value, name, minimum=0)
        bounds = [b for b in (None if epochs is None else epochs * self.num_samples, max_samples) if b is not None]
        total = min(bounds) if bounds else None  # in samples (max_steps alone gives no sample count)
        bar = ProgressBar(None if total is None else max(total - self.samples_seen, 0), self._progress_enabled)

        def done() -> bool:
            return (
                (epochs is not None and self.epoch >= epochs)
                or (max_steps is not None and self.step >= max_steps)
                or (max_samples is not None and self.samples_seen >= max_samples)
            )

        if self._couple and not self.coupling.is_scaled:
            self.coupling.scale(self.loader.next_step_size())
        self._refresh_params()
        self._zero_grad()  # nothing left over from before (e.g. an LR range test) adds to the first step
        self._step_clock = time.perf_counter()
        try:
            while not done():
                micro_batches = iter(self.loader)  # a tail left to drop is dropped here (drop_last)
                self._overhead_clean = False  # the next step's time includes the iterator's start
                epoch_start = self.loader.position()[1] == 0
                self._report_drops()
                yielded = False
                for micro in micro_batches:
                    yielded = True
                    yield from self._run_micro(micro)
                    if self.oom_recovery and (self._oom_size is not None or micro.is_last):
                        cap = self._agreed_micro_cap()
                        if cap is not None:
                            self._replay_step(micro, cap)
                            continue
                    if micro.is_last:
                        self._finish_step(micro, bar)
                        if done():
                            return
                self._report_drops()
                if not yielded and epoch_start and self.loader.sampler.drop_last:
                    raise RuntimeError(
                        f"an epoch produced no step: batch_size={self.loader.batch_size} exceeds the dataset size "
                        f"{self.num_samples} with drop_last=True; lower the batch size or set drop_last=False."
                    )
        finally:
            if self._step_open:
                self._discard_open_step()
            if self.coupling.is_scaled:
                self.coupling.unscale()
            self._micro = None
            bar.close()
            if self._log is not None:
                self._log.flush()

    def _report_drops(self) -> None:
        dropped = self.loader.sampler.dropped_samples
        if dropped != self._dropped_reported:  # drop_last dropped an epoch's incomplete final batch
            self._event("dropped_last", {"samples": dropped - self._dropped_reported,
                                         "epoch": self.loader.sampler.epoch - 1}, warn=False)
            self._dropped_reported = dropped

    def _refresh_params(self) -> None:
        """The trainable parameters now, and those of them the optimizer does not hold (``requires_grad`` and
        the optimizer's param groups may change between steps)."""
        self._params = [p for p in self._all_params if p.requires_grad]
        held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        self._unheld = [p for p in self._params if id(p) not in held]
        if self._noise is not None:  # its small batches must cover the parameters of the step's norm
            self._noise.set_params(self._params)

    def _rescale_lr(self) -> None:
        """Put in the LR factor of the next step's real size (in place of any factor in now)."""
        if self.coupling.is_scaled:
            self.coupling.unscale()
        self.coupling.scale(self.loader.next_step_size())

    def _snapshot_step(self) -> None:
        """What a replayed step must start from again: torch's RNG (about a microsecond), and with
        ``oom_recovery`` the buffers the failed attempt's forwards may have moved (BatchNorm's running
        statistics; a clone per step, so only where a replay is expected)."""
        self._step_rng = torch_rng(self.device)
        if self.oom_recovery:
            self._step_buffers = [b.detach().clone() for b in self._module.buffers()]

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self._unheld:  # the optimizer's zero_grad misses trainable parameters it does not hold
            p.grad = None

    def _discard_open_step(self) -> None:
        """The loop was left inside a step (a ``break`` or an exception in the loop body, even right after
        the last micro-batch's backward, since the step runs when the loop asks for the next micro-batch):
        drop its partial gradients, rewind the data and torch's RNG to the step's start (with ``oom_recovery``
        the module's buffers too), so that the next :meth:`batches` (or a checkpoint saved now) runs the whole
        step again as if it had never started and counts nothing twice."""
        self._zero_grad()
        if self._step_rng is not None:
            set_torch_rng(self._step_rng, self.device)
            self._step_rng = None
        if self.oom_recovery:
            with torch.no_grad():
                for buffer, saved in zip(self._module.buffers(), self._step_buffers):
                    buffer.copy_(saved)
        self._micro_losses.clear()
        self._meter.discard_step()
        self._oom_size = None
        self._step_open = False
        self.loader.restart_step()
        self._event("interrupted_step", {"note": "the loop left a step unfinished; its gradients were dropped "
                                                 "and the next batches() runs it again"}, warn=False)

    def _run_micro(self, micro: MicroBatch) -> Iterator[Any]:
        self._micro = micro
        self._step_open = True
        self._backward_done = False
        if micro.micro_index == 0 and self._noise is not None:
            self._noise.begin_step(micro.step)
        data = _to_device(micro.data, self.device)
        self._meter.begin_micro()
        if self._ddp_model is None and not self.amp:
            yield data  # the common case, without context managers
        else:
            with contextlib.ExitStack() as stack:
                if self._ddp_model is not None and not (micro.is_last and self._ddp_syncs):
                    stack.enter_context(self._ddp_model.no_sync())
                if self.amp is not None:
                    dtype = torch.bfloat16 if self.amp == "bf16" else torch.float16
                    stack.enter_context(torch.autocast(self.device.type, dtype=dtype))
                yield data
        if self._oom_size is not None:
            return  # this step runs again (see micro_step)
        if not self._backward_done:
            raise RuntimeError(
                "pilot.backward(loss) was not called for the last micro-batch; call it exactly once per "
                "micro-batch yielded by pilot.batches()."
            )

    @contextlib.contextmanager
    def micro_step(self) -> Iterator[None]:
        """Wrap one micro-batch's forward and backward; with ``oom_recovery=True`` an out-of-memory error
        inside is caught and the step runs again with smaller micro-batches (Composer's scheme).

        Without ``oom_recovery`` the block changes nothing, so a loop can be written once for both::

            for x, y in pilot.batches(epochs=10):
                with pilot.micro_step():
                    pilot.backward(loss_fn(model(x), y))

        Pass the loss straight to :meth:`backward` (or run the forward and backward in a function): a
        ``loss = ...`` assigned in the block outlives a failed attempt and keeps its activations alive.

        Raises:
            RuntimeError: used outside :meth:`batches`. (When a micro-batch of one sample runs out of
                memory, there is nothing left to split: :meth:`batches` raises a RuntimeError saying so.)
        """
        if self._micro is None:
            raise RuntimeError("pilot.micro_step() was used outside a `for batch in pilot.batches(...)` loop.")
        self._in_micro_step = True
        try:
            yield
        except Exception as exc:
            if not (self.oom_recovery and is_out_of_memory(exc)):
                raise
            self._oom_size = len(self._micro.indices)  # a ghost micro-batch holds one borrowed sample
            self._oom_error = error_summary(exc)
        finally:
            self._in_micro_step = False

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` weighted so the step's gradient is the mean over the global batch.

        With ``loss_reduction="mean"`` a micro-batch of ``n`` samples in a global batch of ``B`` is weighted
        ``n / B`` (times the world size under DDP, which averages over ranks), so the accumulated gradient
        equals the gradient of the mean loss over all ``B`` samples, whatever the split.

        Raises:
            RuntimeError: called outside :meth:`batches` or twice for one micro-batch.
            ValueError: ``loss`` is not a scalar tensor.
        """
        micro = self._micro
        if micro is None:
            raise RuntimeError("pilot.backward() was called outside a `for batch in pilot.batches(...)` loop.")
        if self._backward_done:
            raise RuntimeError("pilot.backward() was called twice for one micro-batch; call it once per micro-batch.")
        if self.oom_recovery and not self._in_micro_step:
            raise RuntimeError(
                "Pilot(oom_recovery=True) needs each micro-batch's forward and backward inside "
                "`with pilot.micro_step():` (an out-of-memory error outside it cannot be recovered)."
            )
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(
                f"pilot.backward() needs a scalar loss tensor, got {type(loss).__name__} "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; reduce it with .mean() first."
            )
        n = micro.size  # 0 for a ghost micro-batch
        per_sample = (n if self.loss_reduction == "mean" else 1) if n else 0
        if per_sample:
            self._micro_losses.append((loss.detach(), per_sample))
        weight = per_sample / micro.global_size
        if self._ddp_syncs:
            weight *= self.world_size  # DDP divides the summed gradients by the world size
        scaled = loss if weight == 1.0 else loss * weight
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        self._backward_done = True
        if n:  # the micro-batch's time ends here: the noise probe's work below is not its cost
            self._meter.end_micro(n)
        if self._noise is not None and self._noise.measuring and n:
            # increment of .grad = weight * grad(loss); grad(loss) = g_j for a mean loss, n * g_j for a sum
            to_mean = weight * (1 if self.loss_reduction == "mean" else n)
            if self.scaler is not None:
                to_mean *= float(self.scaler.get_scale())
            # On one process DDP's all-reduce changes nothing: the last micro-batch's .grad is still its own.
            synced = self._ddp_syncs and micro.is_last and self.world_size > 1
            self._noise.after_backward(n, to_mean, synced=synced)

    # ------------------------------------------------------------------ out of memory
    def _agreed_micro_cap(self) -> int | None:
        """The micro-batch bound for running this step again, agreed over ranks, or ``None`` when no rank
        ran out of memory (every rank calls this once per step attempt: after its last micro-batch, or
        as soon as it ran out of memory)."""
        failed = self._oom_size
        no_oom = 2**62
        candidate = no_oom if failed is None else failed // 2
        cap = bpdist.all_reduce_min_int(candidate) if self.world_size > 1 else candidate
        if cap == no_oom:
            return None
        if cap < 1:
            self._oom_size = None
            raise RuntimeError(
                "out of memory with micro-batches of 1 sample (on at least one rank): the model does not fit "
                "even one sample; use a smaller model, mixed precision (amp='bf16' or 'fp16') or a device with "
                "more memory."
            )
        return cap

    def _replay_step(self, micro: MicroBatch, cap: int) -> None:
        """Drop the step's gradients and run it again from its first micro-batch, at most ``cap`` samples
        per micro-batch from now on."""
        old = self.loader.max_micro_batch_size
        error = self._oom_error if self._oom_size is not None else "another rank ran out of memory"
        self._oom_size, self._oom_error = None, ""
        self._zero_grad()
        if self._step_rng is not None:
            set_torch_rng(self._step_rng, self.device)
        with torch.no_grad():
            for buffer, saved in zip(self._module.buffers(), self._step_buffers):
                buffer.copy_(saved)
        self._micro_losses.clear()
        self._meter.discard_step()
        self._micro = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the failed attempt's cached blocks back before the retry
        self.loader.replay_step(cap)
        self.oom_replays += 1
        self._event("out_of_memory", {"global_batch_size": micro.global_size, "max_micro_batch_size": old,
                                      "new_max_micro_batch_size": cap, "error": error})
        self._step_clock = time.perf_counter()

    # ------------------------------------------------------------------ step end
    def _finish_step(self, micro: MicroBatch, bar: ProgressBar) -> None:
        size = micro.global_size
        if self._engine_reduces:
            bpdist.all_reduce_gradients(self._params)
            if self._ddp_model is not None and self._ddp_model.broadcast_buffers:
                bpdist.broadcast_buffers(self._module)  # what DDP does before a synced forward
        loss = reduce_step_loss(self._micro_losses, size, world_size=self.world_size, rank=self.rank)
        self._micro_losses.clear()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            if self._unheld:  # the GradScaler unscales only the optimizer's parameters
                inverse = 1.0 / self.scaler.get_scale()
                for p in self._unheld:
                    if p.grad is not None:
                        p.grad.mul_(inverse)
        measuring = self._noise is not None and self._noise.measuring
        # With a GradScaler and AdaScale the norm tells an overflowing step (skipped: no AdaScale progress).
        needs_norm = self.skip_nonfinite or self.grad_clip is not None or measuring or \
            (self.scaler is not None and self.adascale is not None)
        norm = grad_norm(self._params) if needs_norm else float("nan")
        stats = {}
        if self._noise is not None:
            stats = self._noise.end_step(size, norm * norm, bpdist.all_reduce_sum if self.world_size > 1 else None)
        finite = math.isfinite(loss) and (math.isfinite(norm) or not self.skip_nonfinite)
        lr = float(self.optimizer.param_groups[0]["lr"])  # a tensor LR would be the optimizer's own, changed later
        skipped = False
        # With a GradScaler, a non-finite gradient is the scaler's to skip (and lowers its scale); a non-finite
        # loss over finite gradients is skipped here, closing the scaler's iteration (unscale_ was called).
        if self.skip_nonfinite and not finite and (self.scaler is None or not math.isfinite(loss)):
            skipped = True
            self.skipped_steps += 1
            if self.scaler is not None:
                self.scaler.update()
            self._event("skipped_step", {"loss": loss, "grad_norm": norm})
        else:
            self._clip(norm)
            overflow = self.scaler is not None and needs_norm and not math.isfinite(norm)
            scaler_skipped = self._optimizer_step(size, stats, overflow)
            lr *= stats.get("lr/adascale_gain", 1.0)  # the LR the step used (AdaScale scales it inside)
            if scaler_skipped:
                assert self.scaler is not None  # only the GradScaler skips a step in there
                skipped = True
                self.skipped_steps += 1
                # Routine while the GradScaler finds its scale: logged, not warned.
                self._event("skipped_step", {"loss": loss, "grad_norm": norm, "reason": "fp16 overflow",
                                             "loss_scale": self.scaler.get_scale()}, warn=False)
        self._zero_grad()
        self._step_open = False

        self.step += 1
        self.samples_seen += size
        if self._couple:
            self.coupling.unscale()
        for scheduler in self.lr_schedulers:
            if isinstance(scheduler, SampleLRSchedule):  # a function of samples: it follows the data consumed
                scheduler.step(self.samples_seen if self.adascale is None else self.adascale.progress_samples)
            elif not skipped:  # a per-step scheduler counts updates: a skipped step made none (as accelerate)
                scheduler.step()

        now = time.perf_counter()
        step_time = now - self._step_clock
        rate = size / step_time if step_time > 0 else float("nan")
        self._throughput = rate if self._throughput is None else 0.9 * self._throughput + 0.1 * rate
        if not skipped:
            self._losses.append(loss)
        # A step that started a data iterator, or refilled prefetching after a size change, is no sample of
        # the per-step overhead (its micro-batches still count).
        clean = self._overhead_clean and self.loader.rewinds == self._rewinds_seen
        self._overhead_clean, self._rewinds_seen = True, self.loader.rewinds
        stats.update(self._meter.end_step(self.step, loss, step_time, skipped, overhead=clean))
        epoch, offset, _ = self.loader.position()
        record = {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "epoch": epoch,
            "coverage": offset / self.num_samples,
            "virtual_epoch": self.samples_seen / self.num_samples,
            "batch/global_size": size,
            "batch/local_size": micro.local_size,
            "batch/accumulation_steps": micro.accumulation_steps,
            "loss": loss,
            "lr": lr,
            "grad/norm": norm,
            "perf/step_time_s": step_time,
            "perf/samples_per_s": rate,
            "train/skipped_steps": self.skipped_steps,
            **stats,
        }
        self.last_record = record
        if self._log is not None:
            self._log.write("step", record)
        if self._tb is not None:
            self._tb.write(record)
        bar.update(size, record)

        self._micro = None  # between steps from here on
        self._decide(record)
        if self._couple:
            self.coupling.scale(self.loader.next_step_size())
        groups = len(self.optimizer.param_groups)
        for fn in self._callbacks:
            fn(self, record)  # may set_batch_size() or load_checkpoint(): both re-apply the LR factor
        if self._callbacks:
            self._refresh_params()  # a callback may have unfrozen (or frozen) parameters
            if self._couple and len(self.optimizer.param_groups) != groups:
                self._rescale_lr()  # a group added in a callback gets the factor from its first step
        if self.checkpoint_every is not None and self.step % self.checkpoint_every == 0:
            self.save_checkpoint()
        self._step_clock = time.perf_counter()

    def _optimizer_step(self, size: int, stats: dict[str, float], overflow: bool) -> bool:
        """Step the optimizer (through the GradScaler with fp16, with AdaScale's gain in the LR when on);
        return whether the scaler skipped the step (its scale fell: the scaled gradient overflowed)."""
        gain = None
        if self.adascale is not None and not overflow:  # an overflowing step is skipped: it makes no progress
            gain = self.adascale.gain_for(size, stats.get("stats/trace_cov"), stats.get("stats/grad_sq_norm"))
            self.adascale.scale(gain)
            stats["lr/adascale_gain"] = gain
        try:
            if self.scaler is None:
                self.optimizer.step()
                return False
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            return self.scaler.get_scale() < scale_before
        finally:
            if gain is not None and self.adascale is not None:
                self.adascale.unscale()

    def _clip(self, norm: float) -> None:
        if self.grad_clip is None:
            return
        if self._stats_clip is not None:
            threshold = self._stats_clip.threshold()
            self._stats_clip.observe(norm)
        else:
            threshold = float(self.grad_clip)
        if threshold is not None and math.isfinite(norm) and norm > threshold:
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, threshold / (norm + 1e-6))

    def _decide(self, record: dict[str, Any]) -> None:
        """The next step's size: a set_batch_size() made inside the step, else the controller when due. When
        the controller is due, rank 0's answer (its override, else its controller's) is broadcast."""
        current = self.loader.batch_size
        override, self._override = self._override, None
        due = self.controller is not None and self.step % self.decide_every == 0
        if override is None and not due:
            return
        source = "user" if override is not None else controller_name(self.controller)
        new, note = current, None
        if self._lead or not due:
            try:
                if override is not None:
                    new, note = validate_decision(override, current=current, min_size=self.min_batch_size,
                                                  max_size=self.max_batch_size, source="set_batch_size()")
                    note = note or "set_batch_size() override"
                else:
                    assert self.controller is not None  # due
                    new, note = validate_decision(
                        self.controller.decide(self._observation(current)),
                        current=current,
                        min_size=self.min_batch_size,
                        max_size=self.max_batch_size,
                        on_invalid=self.on_invalid,
                        source=source,
                    )
            except Exception as exc:
                if due and self.world_size > 1:
                    bpdist.broadcast_int(-1)  # tell the other ranks, so they fail too instead of hanging
                if due:
                    self._keep_finished_step(exc)
                raise
        if due and self.world_size > 1:
            new = bpdist.broadcast_int(new)
            if new < 1:
                error = RuntimeError("rank 0's controller failed (see rank 0's error); stopping this rank too.")
                self._keep_finished_step(error)
                raise error
        self._log_decision(current, new, source, note, record)
        self.loader.set_batch_size(new)

    def _keep_finished_step(self, error: Exception) -> None:
        """The controller failed after a finished step (every rank gets here, so the save's collectives match):
        with a ``checkpoint_dir``, save that step before the error stops the run, so nothing trained is lost.
        The checkpoint continues at the current size; a resumed run asks the controller again when next due."""
        if self.checkpoint_dir is not None:
            keep_finished_step(self.save_checkpoint, error, step=self.step, lead=self._lead,
                               resume_hint="load_checkpoint(checkpoint_dir)")

    def _log_decision(self, current: int, new: int, source: str, note: str | None, record: dict[str, Any]) -> None:
        if new == current and note is None:
            return
        decision = {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "old_size": current,
            "new_size": new,
            "controller": source,
            "reason": getattr(self.controller, "reason", None) if source != "user" else None,
            "note": note,
            "inputs": {k: record.get(k) for k in ("loss", "perf/samples_per_s", "epoch", "coverage", "grad/norm")},
        }
        self.last_decision = decision
        if self._log is not None:
            self._log.write("decision", decision)

    def _observation(self, current: int) -> Observation:
        epoch, offset, _ = self.loader.position()
        return Observation(
            step=self.step,
            samples_seen=self.samples_seen,
            epoch=epoch,
            coverage=offset / self.num_samples,
            batch_size=current,
            num_samples=self.num_samples,
            losses=tuple(self._losses),
            samples_per_s=self._throughput,
            stats={
                **{k: v for k, v in self.last_record.items() if k.startswith(("stats/", "grad/", "perf/", "system/"))},
                "dist/world_size": self.world_size,
                **({} if self.loader.max_micro_batch_size is None
                   else {"perf/max_micro_batch_size": self.loader.max_micro_batch_size}),
            },
        )

    def _event(self, kind: str, data: dict[str, Any], warn: bool = True) -> None:
        (logger.warning if warn else logger.info)("step %d: %s %s", self.step + 1, kind, data)
        if self._log is not None:
            self._log.write("event", {"step": self.step + 1, "event": kind, **data})

    # ------------------------------------------------------------------ state
    def _components(self) -> dict[str, Any]:
        """The stateful parts, by checkpoint key (``None`` where a feature is off)."""
        return {
            "model": self._module,  # without DDP / torch.compile wrappers
            "optimizer": self.optimizer,
            "scaler": self.scaler,
            "coupling": self.coupling,
            "adascale": self.adascale,
            "loader": self.loader,
            "controller": self.controller,
            "stats_clip": self._stats_clip,
            "noise": self._noise,
            "meter": self._meter,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: model, optimizer, scaler, schedulers, data position,
        controller, LR coupling, statistics, RNG states and the log position.

        Call it between steps. Under DDP every rank must call it (RNG states are gathered)."""
        if self._micro is not None:
            raise RuntimeError("state_dict() was called in the middle of a step; call it between steps.")
        return {
            "pilot": {
                "step": self.step,
                "samples_seen": self.samples_seen,
                "skipped_steps": self.skipped_steps,
                "losses": list(self._losses),
                "throughput": self._throughput,
                "world_size": self.world_size,
                "optimizer_class": class_name(self.optimizer),
                "lr_scheduler_classes": [class_name(s) for s in self.lr_schedulers],
                "override": self._override,  # a set_batch_size() made in a step the loop then left unfinished
            },
            **{key: None if obj is None else obj.state_dict() for key, obj in self._components().items()},
            "lr_schedulers": [s.state_dict() for s in self.lr_schedulers],
            "rng": gather_rng_states(self.world_size, self.device),
            "log_position": None if self._log is None else self._log.position(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (possibly saved under another world size).

        Under DDP every rank must call it (the ranks agree on whether the state fits).

        Raises:
            CheckpointError: the state was saved by another run: another model (names or shapes), optimizer
                class or parameter groups, dataset size, seed or shuffling, or other LR schedulers. All
                problems are listed, and nothing is loaded.
        """
        if self._micro is not None:
            raise RuntimeError("load_state_dict() was called in the middle of a step; call it between steps "
                               "(before the loop, after it, or from a callback added with add_callback; a loop left "
                               "with break over a generator you keep ends only at gen.close()).")
        shape = _state_shape_problem(state)
        if shape is not None:
            raise CheckpointError(shape)
        problems = fit_problems(state, model=self._module, optimizer=self.optimizer, sampler=self.loader.sampler)
        if self._log is not None and state["log_position"] is not None:
            problem = self._log.resume_problem(state["log_position"])
            if problem is not None:
                problems.append(problem)
        problems += self._scheduler_problems(state)
        problems += self._trial_load_problems(state)
        if self.world_size > 1 and bpdist.all_reduce_min_int(0 if problems else 1) == 0 and not problems:
            problems.append("another rank refused it (rank 0 checks the adjustment log; see its error)")
        if problems:
            raise CheckpointError("the checkpoint does not fit this Pilot (nothing was loaded):\n  - "
                                  + "\n  - ".join(problems))
        self._warn_about_features(state)
        in_loop = self.coupling.is_scaled  # loaded between steps of batches() (from a callback)
        drop_last, micro = self.loader.sampler.drop_last, self.loader.max_micro_batch_size  # this Pilot's
        noise_every = None if self._noise is None else self._noise.every
        if in_loop:
            self.coupling.unscale()
        try:
            p = state["pilot"]
            self.step, self.samples_seen = int(p["step"]), int(p["samples_seen"])
            self.skipped_steps = int(p["skipped_steps"])
            self._losses = collections.deque(p["losses"], maxlen=self._losses.maxlen)
            self._throughput = p["throughput"]
            self._override = p.get("override")
            for key, obj in self._components().items():
                if obj is not None and state.get(key) is not None:
                    obj.load_state_dict(state[key])
            for scheduler, s in zip(self.lr_schedulers, state["lr_schedulers"]):
                scheduler.load_state_dict(s)
            restore_rng_states(state["rng"], self.rank, self.world_size, self.device)
        except Exception as exc:  # the checks above passed, so this is a damaged state: say what it did
            raise CheckpointError(
                f"the checkpoint passed every check but failed while loading ({type(exc).__name__}: {exc}); this "
                "Pilot is now partly loaded: build it again and load an earlier checkpoint."
            ) from exc
        if self._log is not None and state["log_position"] is not None:
            self._log.truncate(state["log_position"])  # before _keep_own_settings logs what it changes
        self._keep_own_settings(drop_last, micro, noise_every)
        self._dropped_reported = self.loader.sampler.dropped_samples
        if self._tb is not None:
            self._tb.resume_after(self.samples_seen)
        if in_loop or self.coupling.is_scaled:
            # The loop goes on with the loaded position (or a state_dict() taken between steps holds a scaled
            # coupling): the factor of its next step's real size, which this Pilot's bounds may have changed.
            self._rescale_lr()

    def _scheduler_problems(self, state: dict[str, Any]) -> list[str]:
        """Why the checkpoint's LR scheduler states do not fit this Pilot's schedulers (empty: they do): another
        number or class (recorded since this check exists), or a state that does not load into a copy."""
        saved, here = state["lr_schedulers"], self.lr_schedulers
        if len(saved) != len(here):
            return [f"the checkpoint has {len(saved)} LR schedulers but this Pilot has {len(here)}; build the "
                    "Pilot with the same lr_schedulers."]
        classes = state["pilot"].get("lr_scheduler_classes")
        names = [class_name(s) for s in here]
        if classes is not None and list(classes) != names:
            return [f"the checkpoint's LR schedulers are {list(classes)}, this Pilot's {names}; build the Pilot "
                    "with the same lr_schedulers, in the same order."]
        problems = []
        for i, (scheduler, s) in enumerate(zip(here, saved)):
            # torch's schedulers take any dict (__dict__.update): the keys this scheduler saves must be there.
            missing = sorted(k for k in scheduler.state_dict() if k not in s)
            if missing:
                problems.append(f"LR scheduler {i} ({names[i]}): the checkpoint's state lacks {missing}; build the "
                                "Pilot with the schedulers of the run that saved it.")
                continue
            failure = self._trial_load(scheduler, s)
            if failure is not None:
                problems.append(f"LR scheduler {i} ({names[i]}) does not load its state ({failure})")
        return problems

    def _warn_if_system_stats_missing(self, system_every: int | None) -> None:
        """Warn when the controller reads system load (``system/*`` in its ``required_stats``) that this run
        will never measure: sampling is off, psutil is missing, or NVML is missing on a GPU."""
        on_gpu = self.device.type == "cuda"  # without one, rules on GPU load are skipped by design
        wanted = [k for k in getattr(self.controller, "required_stats", ())
                  if k.startswith("system/") and (on_gpu or not k.startswith("system/gpu"))]
        if not wanted or not self._lead:
            return
        name = controller_name(self.controller)
        monitor = self._meter.monitor
        if system_every is None:
            logger.warning("%s reads %s, but system_every=None switches load sampling off: its rules on load never "
                           "act; pass system_every=N (default 100).", name, ", ".join(wanted))
        elif monitor is None:
            logger.warning("%s reads %s, but psutil is not installed, so no load is measured and its rules on load "
                           "never act; install it with: %s", name, ", ".join(wanted), install_hint("system"))
        elif "system/gpu_util" in wanted and self.device.type == "cuda" and not monitor.has_nvml:
            logger.warning("%s reads system/gpu_util, but nvidia-ml-py is not installed, so GPU utilisation is not "
                           "measured; install it with: %s", name, install_hint("gpu"))

    def _warn_about_features(self, state: dict[str, Any]) -> None:
        """Warn when the checkpoint's run had a feature this Pilot lacks, or the other way round (fp16 loss
        scaling, AdaScale, statistics-based clipping): the resumed run then trains differently."""
        components = self._components()
        for key, what in (("scaler", "amp='fp16' (a GradScaler)"), ("adascale", "lr_rule='adascale'"),
                          ("stats_clip", "grad_clip='stats'")):
            saved, here = state.get(key) is not None, components[key] is not None
            if saved != here:
                logger.warning("the checkpoint was saved %s %s, this Pilot runs %s it; the resumed run trains "
                               "differently from the one that saved it", "with" if saved else "without", what,
                               "with" if here else "without")

    def _trial_load_problems(self, state: dict[str, Any]) -> list[str]:
        """Load the controller's and the LR rules' states into copies first: one saved by another controller
        (or AdaScale with another B0) is refused before the model or the position change."""
        problems, components = [], self._components()
        for key in ("controller", "coupling", "adascale"):
            obj = components[key]
            if obj is None or state.get(key) is None:
                continue
            failure = self._trial_load(obj, state[key])
            if failure is not None:
                problems.append(f"its {key} state does not load into this Pilot's {type(obj).__name__} ({failure})")
        return problems

    def _trial_load(self, obj: Any, state: Any) -> str | None:
        """Load ``state`` into a copy of ``obj``; ``"Type: message"`` if that fails, else ``None`` (also when
        ``obj`` cannot be copied: it is then loaded for real only). The copy shares the optimizer and the model
        (their states are not what is tried here; a bound method's owner may hold them), and it gets a copy of
        ``state``: some loaders pop keys from the dict they load (CyclicLR), and the real load needs it whole."""
        try:
            trial = copy.deepcopy(obj, {id(self.optimizer): self.optimizer, id(self._module): self._module})
        except Exception:
            return None
        try:
            trial.load_state_dict(copy.deepcopy(state))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _keep_own_settings(self, drop_last: bool, micro: int | None, noise_every: int | None) -> None:
        """After loading: ``drop_last`` and the batch size bounds are this Pilot's, the micro-batch bound the
        smaller of this Pilot's and the checkpoint's (which out-of-memory recovery may have lowered), and the
        noise-scale period the checkpoint's (its estimate's smoothing was built for it); a change is logged."""
        sampler, loader = self.loader.sampler, self.loader
        if self._noise is not None and noise_every is not None and self._noise.every != noise_every:
            logger.warning("this Pilot has noise_every=%d, but the checkpoint's run measured the noise scale every %d "
                           "steps; continuing with %d, so its estimate goes on as it was saved",
                           noise_every, self._noise.every, self._noise.every)
        size = loader.batch_size
        new, note = validate_decision(size, current=size, min_size=self.min_batch_size, max_size=self.max_batch_size,
                                      source="the checkpoint's batch size")
        if new != size:
            logger.warning("the checkpoint's batch size %d lies outside this Pilot's [min_batch_size=%s, "
                           "max_batch_size=%s]; continuing with %d", size, self.min_batch_size, self.max_batch_size,
                           new)
            self._log_decision(size, new, "user", note or "clamped to the bounds after loading", self.last_record)
            loader.set_batch_size(new)
        if sampler.drop_last != drop_last:
            logger.warning("the checkpoint was saved with drop_last=%s; continuing with this Pilot's drop_last=%s",
                           sampler.drop_last, drop_last)
            sampler.drop_last = drop_last
        saved = loader.max_micro_batch_size
        bounds = [b for b in (micro, saved) if b is not None]
        bound = min(bounds) if bounds else None
        if bound != saved:
            logger.warning("the checkpoint's max_micro_batch_size is %s; continuing with this Pilot's %s", saved, bound)
        elif bound != micro:
            logger.warning("max_micro_batch_size=%s, but the checkpoint's run had lowered it to %s (after running "
                           "out of memory); continuing with %s", micro, saved, bound)
        loader.max_micro_batch_size = bound

    def save_checkpoint(self, path: str | os.PathLike | None = None) -> Path | None:
        """Save :meth:`state_dict` atomically (rank 0 writes; every rank must call).

        ``path`` defaults to ``checkpoint_dir/step-<step>.pt``; a folder (one that exists, or a string ending in a
        separator; ``pathlib`` drops a trailing one) gets ``step-<step>.pt`` inside it, as :meth:`load_checkpoint` reads folders. Older files
        beyond ``keep_checkpoints`` in ``checkpoint_dir`` are removed. Returns the path on rank 0, ``None``
        elsewhere."""
        if self._micro is not None:  # before the LR factor is touched: a caught error leaves the step as it was
            raise RuntimeError("save_checkpoint() was called in the middle of a step; call it between steps "
                               "(after the loop, or from a callback added with add_callback; a loop left with break "
                               "over a generator you keep ends only at gen.close()).")
        if path is None:
            if self.checkpoint_dir is None:
                raise ValueError("save_checkpoint() needs a path, or a Pilot built with checkpoint_dir=...")
            path = checkpoint_path(self.checkpoint_dir, self.step)
        elif Path(path).is_dir() or str(path).endswith((os.sep, "/")):
            path = checkpoint_path(path, self.step)
        scaled = self.coupling.is_scaled
        if scaled:  # store the schedule's own LR: batches() re-applies the factor of the loaded batch size
            self.coupling.unscale()
        try:
            state = self.state_dict()
        finally:
            if scaled:
                self.coupling.scale(self.loader.next_step_size())
        written = None
        if self._lead:
            written = save_checkpoint(path, state)
            if self.checkpoint_dir is not None and Path(path).parent == self.checkpoint_dir:
                prune_checkpoints(self.checkpoint_dir, self.keep_checkpoints, written)
        if self.world_size > 1:
            bpdist.barrier()
        return written

    def load_checkpoint(self, path: str | os.PathLike, *, missing_ok: bool = False) -> Path | None:
        """Restore from a checkpoint file, or from the newest loadable one in a folder (under DDP every rank
        must call it, with a path every rank can read).

        Returns the file loaded, or ``None`` when ``missing_ok`` and the folder holds no checkpoint.

        Raises:
            CheckpointError: the file is missing (unless ``missing_ok``), truncated, corrupt or foreign; or the
                folder holds checkpoints but none loads (even with ``missing_ok``: that is no first start).
        """
        path = Path(path)
        if path.is_dir() or (missing_ok and not path.exists()):
            found = load_latest_checkpoint(path)  # the newest file that loads, read once; raises if none does
            if found is None:
                if missing_ok:
                    return None
                raise CheckpointError(f"no checkpoint in {str(path)!r} (no step-*.pt files); pass missing_ok=True "
                                      "to start from step 0 when there is none.")
            path, state = found
        else:
            state = load_checkpoint(path)
        self.load_state_dict(state)
        return path

    def close(self) -> None:
        """Flush and close the log and TensorBoard writer, and stop the loader's worker processes.

        The Pilot stays usable: a later :meth:`batches` starts new workers and reopens the log (appending)."""
        self.loader.close()
        self._meter.close()  # NVML's nvmlShutdown, paired with its nvmlInit
        if self._log is not None:
            self._log.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> Pilot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- helpers
_STATE_KEYS = ("pilot", "model", "optimizer", "loader", "lr_schedulers", "rng", "log_position")
_PILOT_KEYS = ("step", "samples_seen", "skipped_steps", "losses", "throughput")


def _state_shape_problem(state: Any) -> str | None:
    """Why ``state`` is not a :meth:`Pilot.state_dict` at all (``None``: it has the keys one has)."""
    if not isinstance(state, dict):
        return (f"a Pilot state is a dict from Pilot.state_dict(), got {type(state).__name__}; "
                "pass what Pilot.state_dict() returned (or use load_checkpoint(path)).")
    missing = [k for k in _STATE_KEYS if k not in state]
    pilot = state.get("pilot")
    missing += [f"pilot.{k}" for k in _PILOT_KEYS if isinstance(pilot, dict) and k not in pilot]
    if missing or not isinstance(pilot, dict):
        return (f"this is not a Pilot state (it lacks {', '.join(missing) or 'a pilot dict'}; keys: "
                f"{sorted(map(str, state))[:8]}); pass what Pilot.state_dict() returned, not a model's or "
                "optimizer's state_dict.")
    return None


def _check_schedulers(schedulers: Any, optimizer: torch.optim.Optimizer) -> None:
    """``lr_schedulers`` holds LR schedulers: objects with ``step()``, ``state_dict()`` and ``load_state_dict()``
    (torch's, batchpilot's sample schedules, or your own), stepped once per step."""
    if isinstance(schedulers, (str, bytes)) or not isinstance(schedulers, Sequence):
        raise TypeError(f"lr_schedulers must be a list of LR schedulers, got {schedulers!r}; wrap one in a list.")
    for i, s in enumerate(schedulers):
        lacks = [m for m in ("step", "state_dict", "load_state_dict") if not callable(getattr(s, m, None))]
        if lacks:
            raise TypeError(f"lr_schedulers[{i}] is {s!r}, which has no {', '.join(m + '()' for m in lacks)}: pass LR schedulers "
                            "(torch.optim.lr_scheduler or batchpilot.lr schedules) built on this Pilot's optimizer.")
        if getattr(s, "optimizer", optimizer) is not optimizer:
            raise ValueError(f"lr_schedulers[{i}] ({type(s).__name__}) was built on another optimizer than the Pilot's, "
                             "so it would schedule an optimizer that is not trained; build it on the optimizer you "
                             "pass to Pilot.")


def _check_grad_clip(value: Any) -> None:
    if value is None or (isinstance(value, str) and value == "stats"):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0 \
            or not math.isfinite(float(value)):
        raise ValueError(f"grad_clip must be None, a positive finite max-norm or 'stats'; got {value!r}.")


def _to_device(data: Any, device: torch.device) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True) if data.device != device else data
    if isinstance(data, dict):
        return {k: _to_device(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        moved = [_to_device(v, device) for v in data]
        if isinstance(data, tuple):
            return type(data)(*moved) if hasattr(data, "_fields") else type(data)(moved)  # namedtuples keep fields
        return moved
    return data
