"""`Pilot`: the helper that runs adaptive-batch training inside the user's own loop.

The user's loop stays a loop over micro-batches::

    for x, y in pilot.batches(epochs=10):
        pilot.backward(loss_fn(model(x), y))

With ``Pilot(oom_recovery=True)`` each micro-batch's forward and backward go inside
``with pilot.micro_step():``; a step that runs out of memory is then run again with half the micro-batch
(same global batch, same LR), as Composer does (:mod:`.replay`).

Between the last micro-batch of a step and the first of the next, the generator runs the step's end
(:mod:`.step_end`: gradient all-reduce when the model is not DDP-wrapped, non-finite check, clipping,
optimizer step, LR schedules, the record), the decision (:mod:`.driver`: rank 0 decides, every rank applies
the broadcast value), callbacks and checkpointing (:mod:`.state`). A decision made after step t is the size
of step t+1.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import torch
from typing_extensions import Unpack

from .. import distributed as bpdist
from .._validation import check_batch_size, check_positive_int
from .._wrappers import unwrap
from ..checkpoint import class_name, prune_checkpoints, save_checkpoint
from ..controllers.base import Controller
from ..controllers.boundary import needs_gradient_stats, validate_decision
from ..data.loader import AdaptiveDataLoader, MicroBatch
from ..logs import ProgressBar
from ..lr import AdaScaleLR, LRCoupling
from ..measure import DEFAULT_NOISE_EVERY, GradientNoiseProbe, StepMeter
from ..rng import gather_rng_states, restore_rng_states
from .config import PilotSettings, checked, merge_settings, resolve_world
from .driver import SizeDriver, observed_stats
from .replay import StepReplay, keep_finished_step
from .state import check_fit, checkpoint_file, find_checkpoint, keep_own_settings, load_parts, partly_loaded
from .step_end import Gradients, StepEnd, StepLog, decision_record, step_record

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
        **settings: The settings, by group (``data=DataConfig(num_workers=2)``; ``decisions``, ``lr``, ``data``,
            ``memory``, ``precision``, ``logs``, ``checkpoints``, ``stats``, ``distributed``) or each field as
            its own keyword (``num_workers=2``), not both: see :mod:`batchpilot.engine.config`.

    Raises:
        ValueError, TypeError: invalid arguments (all problems are reported at once).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: torch.utils.data.Dataset,
                 *, batch_size: int, controller: Controller | Callable[[int, int], int] | None = None,
                 **settings: Unpack[PilotSettings]) -> None:
        batch_size, self.config = checked(merge_settings(settings), batch_size=batch_size, controller=controller,
                                          optimizer=optimizer, model=model)
        dec, mem, prec, load = self.config.decisions, self.config.memory, self.config.precision, self.config.data
        self.model, self.optimizer = model, optimizer
        self._module, self._ddp_model = unwrap(model)  # the bare module (what checkpoints hold), the DDP wrapper
        self.rank, self.world_size = resolve_world(self.config.distributed, self._ddp_model)
        self.oom_recovery = mem.oom_recovery
        ddp = self._ddp_model is not None
        # Who sums the gradients over ranks: DDP inside the last backward, or the engine at the step's end
        # (without DDP, and under OOM recovery, where the ranks must agree on a replay before any reduction).
        engine_reduces = self.world_size > 1 and (not ddp or mem.oom_recovery)
        self._ddp_syncs = ddp and not engine_reduces
        if self._ddp_model is not None and engine_reduces:
            # Every micro-batch then runs under no_sync, whose forwards do no collective, except that DDP
            # broadcasts the buffers in a forward that follows a synced one, and starts as if one had run.
            # A rank that fails inside a forward would leave the ranks' collectives out of step; the engine
            # broadcasts the buffers itself at each step's end instead.
            self._ddp_model.require_forward_param_sync = False
        self._grads = Gradients(model, optimizer)  # re-read when a loop starts and after callbacks
        device = self.config.distributed.device
        self.device = torch.device(device) if device is not None else self._grads.params[0].device
        if self.device.type == "cuda" and self.device.index is not None and bpdist.is_distributed():
            # NCCL collectives (the decisions, the statistics, checkpoints) run on the *current* CUDA device:
            # make it this rank's, or every rank that skipped torch.cuda.set_device would talk on cuda:0.
            torch.cuda.set_device(self.device)
        if not ddp and self.world_size > 1:  # (after set_device: under NCCL the broadcast runs on this device)
            bpdist.broadcast_module(self._module)  # as DDP does when it is built: every rank starts from rank 0's
        self.loader = AdaptiveDataLoader(
            dataset, batch_size, max_micro_batch_size=mem.max_micro_batch_size, shuffle=load.shuffle, seed=load.seed,
            drop_last=load.drop_last, rank=self.rank, world_size=self.world_size, num_workers=load.num_workers,
            collate_fn=load.collate_fn, pin_memory=load.pin_memory, prefetch_factor=load.prefetch_factor,
        )
        self.num_samples = self.loader.sampler.num_samples
        self.driver = SizeDriver(  # the step counters and the decisions
            controller, batch_size=batch_size, num_samples=self.num_samples, min_batch_size=dec.min_batch_size,
            max_batch_size=dec.max_batch_size, decide_every=dec.decide_every, on_invalid=dec.on_invalid,
            loss_history=dec.loss_history, rank=self.rank, names=("controller", "batch_size"),
            world_size=self.world_size, label="controller",
        )
        self.controller = self.driver.controller
        lr_rule, base = self.config.lr.lr_rule, self.config.lr.base_batch_size or batch_size
        self.coupling = LRCoupling(optimizer, base, rule="none" if lr_rule == "adascale" else lr_rule,
                                   knee=self.config.lr.lr_knee)
        self._couple = lr_rule not in ("none", "adascale")  # "none" never changes the LR: skip the per-step work
        # AdaScale (Johnson et al. 2020): the LR gain comes from the gradient statistics of each step.
        self.adascale = AdaScaleLR(optimizer, base) if lr_rule == "adascale" else None
        self.lr_schedulers = list(self.config.lr.lr_schedulers)
        self.scaler = torch.amp.GradScaler(self.device.type) if prec.amp == "fp16" else None
        self._autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(prec.amp or "")
        self._lead = self.rank == 0
        self._log = StepLog(self.config.logs.log_path, self.config.logs.tensorboard_dir, self._lead)
        self._progress = self.config.logs.progress if self._lead else False
        self._callbacks: list[StepCallback] = []
        noise_every = self.config.stats.noise_every
        if noise_every is None and (needs_gradient_stats(self.controller) or self.adascale is not None):
            noise_every = DEFAULT_NOISE_EVERY
        self._noise = GradientNoiseProbe(
            self._grads.params, every=noise_every, ranks_are_small_batches=engine_reduces,
            population=self.num_samples,  # the sampler draws each epoch without replacement
        ) if noise_every else None
        if (self._noise is not None and self._ddp_syncs and self.world_size > 1
                and not self._noise.attach_ddp(self._ddp_model)):
            logger.info("the DDP model already has a communication hook: measured steps are split in two "
                        "to measure the gradient noise scale (see docs/statistics.md)")
        self._meter = StepMeter(system_every=self.config.stats.system_every, device=self.device)
        if self._lead:
            self._meter.warn_unmeasured(self.controller, on_gpu=self.device.type == "cuda")
        if self._noise is not None:
            self.loader.min_accumulation = self._noise.min_accumulation
        self._step_end = StepEnd(
            self._grads, scaler=self.scaler, adascale=self.adascale, grad_clip=prec.grad_clip,
            skip_nonfinite=prec.skip_nonfinite, noise=self._noise, lr_schedulers=self.lr_schedulers,
            engine_reduces=engine_reduces, ddp_model=self._ddp_model, module=self._module,
            world_size=self.world_size, rank=self.rank,
        )
        # A step run again (after running out of memory, or after the loop left it unfinished) draws what one
        # run once did (augmentation, dropout).
        self._replay = StepReplay(self._module, self.device, loader=self.loader, step_end=self._step_end,
                                  meter=self._meter, oom_recovery=mem.oom_recovery, world_size=self.world_size)
        self.loader.on_step_start = self._replay.snapshot
        self.skipped_steps = 0
        self._override: int | None = None  # a set_batch_size() made inside the step
        self._dropped_reported = self.loader.sampler.dropped_samples
        self.last_record: dict[str, Any] = {}
        self.last_decision: dict[str, Any] | None = None
        # Per-micro-batch bookkeeping between a yield and the matching backward().
        self._micro: MicroBatch | None = None
        self._backward_done = False
        self._in_micro_step = False
        self._step_open = False  # a step's first micro-batch was yielded and the step is not finished
        self._overhead_clean = False  # whether this step's time outside its micro-batches is a fair sample
        self._rewinds_seen = self.loader.rewinds

    # ------------------------------------------------------------------ properties
    @property
    def batch_size(self) -> int:
        """Global batch size of the next step (inside a step, a :meth:`set_batch_size` made in it; between
        steps, after a loop left a step unfinished, that step's own size: it runs again first)."""
        if self._micro is not None and self._override is not None:
            return self._override
        return self.loader.batch_size

    @property
    def step(self) -> int:
        """Optimizer steps taken (skipped ones included)."""
        return self.driver.step

    @property
    def samples_seen(self) -> int:
        """Samples consumed by the steps taken (the loader may have planned further ahead)."""
        return self.driver.samples_seen

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
        """The micro-batch being processed (its indices, sizes, position in the step), or ``None`` between steps."""
        return self._micro

    @property
    def oom_replays(self) -> int:
        """Steps run again after running out of memory."""
        return self._replay.replays

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
        global_batch_size = check_batch_size(batch_size)
        if self._micro is not None:  # inside a step: the step's end applies it in place of a decision
            self._override = global_batch_size
            return
        self._override = None  # between steps it replaces one made in a step the loop left unfinished
        current, dec = self.loader.batch_size, self.config.decisions
        new, note = validate_decision(global_batch_size, current=current, min_size=dec.min_batch_size,
                                      max_size=dec.max_batch_size, source="set_batch_size()")
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
        bar = ProgressBar(None if total is None else max(total - self.samples_seen, 0), self._progress)

        def done() -> bool:
            return (
                (epochs is not None and self.epoch >= epochs)
                or (max_steps is not None and self.step >= max_steps)
                or (max_samples is not None and self.samples_seen >= max_samples)
            )

        if self._couple and not self.coupling.is_scaled:
            self.coupling.scale(self.loader.next_step_size())
        self._refresh_params()
        self._grads.zero()  # nothing left over from before (e.g. an LR range test) adds to the first step
        self.driver.start_clock()
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
                    if self.oom_recovery and (self._replay.failed_size is not None or micro.is_last):
                        cap = self._replay.agreed_cap()
                        if cap is not None:
                            self._micro = None
                            self._replay.replay(micro.global_size, cap, self._event)
                            self.driver.start_clock()
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
                self._replay.discard(self._event)
                self._step_open = False
            if self.coupling.is_scaled:
                self.coupling.unscale()
            self._micro = None
            bar.close()
            self._log.flush()

    def _run_micro(self, micro: MicroBatch) -> Iterator[Any]:
        self._micro = micro
        self._step_open = True
        self._backward_done = False
        if micro.micro_index == 0 and self._noise is not None:
            self._noise.begin_step(micro.step)
        data = _to_device(micro.data, self.device)
        self._meter.begin_micro()
        if self._ddp_model is None and self._autocast is None:
            yield data  # the common case, without context managers
        else:
            with contextlib.ExitStack() as stack:
                if self._ddp_model is not None and not (micro.is_last and self._ddp_syncs):
                    stack.enter_context(self._ddp_model.no_sync())
                if self._autocast is not None:
                    stack.enter_context(torch.autocast(self.device.type, dtype=self._autocast))
                yield data
        if self._replay.failed_size is not None:
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
            if not self._replay.caught(exc, len(self._micro.indices)):  # a ghost micro-batch holds one sample
                raise
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
        mean = self.config.precision.loss_reduction == "mean"
        n = micro.size  # 0 for a ghost micro-batch
        per_sample = (n if mean else 1) if n else 0
        if per_sample:
            self._step_end.losses.append((loss.detach(), per_sample))
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
            to_mean = weight * (1 if mean else n)
            if self.scaler is not None:
                to_mean *= float(self.scaler.get_scale())
            # On one process DDP's all-reduce changes nothing: the last micro-batch's .grad is still its own.
            synced = self._ddp_syncs and micro.is_last and self.world_size > 1
            self._noise.after_backward(n, to_mean, synced=synced)

    # ------------------------------------------------------------------ between steps
    def _finish_step(self, micro: MicroBatch, bar: ProgressBar) -> None:
        global_batch_size = micro.global_size
        outcome = self._step_end.apply(global_batch_size, self._event)
        self._step_open = False
        if outcome.skipped:
            self.skipped_steps += 1
        if self._couple:
            self.coupling.unscale()
        self._step_end.step_schedulers(self.samples_seen + global_batch_size, outcome.skipped)
        # A skipped step's loss stays out of the controller's history; a non-finite one kept by
        # skip_nonfinite=False goes in.
        step_time = self.driver.end_step(global_batch_size, None if outcome.skipped else outcome.loss,
                                         finite_only=False)
        assert step_time is not None  # the clock runs from batches() on
        samples_per_s = global_batch_size / step_time if step_time > 0 else float("nan")
        # A step that started a data iterator, or refilled prefetching after a size change, is no sample of
        # the per-step overhead (its micro-batches still count).
        clean = self._overhead_clean and self.loader.rewinds == self._rewinds_seen
        self._overhead_clean, self._rewinds_seen = True, self.loader.rewinds
        outcome.stats.update(self._meter.end_step(self.step, outcome.loss, step_time, outcome.skipped, overhead=clean))
        record = step_record(step=self.step, samples_seen=self.samples_seen, position=self.loader.position(),
                             num_samples=self.num_samples, micro=micro, outcome=outcome, step_time=step_time,
                             samples_per_s=samples_per_s, skipped_steps=self.skipped_steps)
        self.last_record = record
        self._log.step(record)
        bar.update(global_batch_size, record)

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
        every = self.config.checkpoints.checkpoint_every
        if every is not None and self.step % every == 0:
            self.save_checkpoint()
        self.driver.start_clock()

    def _decide(self, record: dict[str, Any]) -> None:
        """The next step's size: a set_batch_size() made inside the step, else the controller when due."""
        current = self.loader.batch_size
        override, self._override = self._override, None
        stats = observed_stats(record, world_size=self.world_size, max_micro_batch_size=self.loader.max_micro_batch_size)
        decided = self.driver.next_size(current, epoch=record["epoch"], coverage=record["coverage"], stats=stats,
                                        override=override, on_failure=self._keep_finished_step)
        if decided is not None:
            self._log_decision(current, decided.global_batch_size, decided.source, decided.note, record)
            self.loader.set_batch_size(decided.global_batch_size)

    def _keep_finished_step(self, error: BaseException) -> None:
        """The controller failed after a finished step (every rank gets here, so the save's collectives match):
        with a ``checkpoint_dir``, save that step before the error stops the run, so nothing trained is lost.
        The checkpoint continues at the current size; a resumed run asks the controller again when next due."""
        if self.config.checkpoints.checkpoint_dir is not None:
            keep_finished_step(self.save_checkpoint, error, step=self.step, lead=self._lead,
                               resume_hint="load_checkpoint(checkpoint_dir)")

    def _log_decision(self, current: int, new: int, source: str, note: str | None, record: dict[str, Any]) -> None:
        if new != current or note is not None:
            reason = getattr(self.controller, "reason", None) if source != "user" else None
            self.last_decision = decision_record(step=self.step, samples_seen=self.samples_seen, old=current, new=new,
                                                 source=source, reason=reason, note=note, record=record)
            self._log.decision(self.last_decision)

    def _event(self, kind: str, data: dict[str, Any], warn: bool = True) -> None:
        self._log.event(self.step + 1, kind, data, warn)

    def _report_drops(self) -> None:
        dropped = self.loader.sampler.dropped_samples
        if dropped != self._dropped_reported:  # drop_last dropped an epoch's incomplete final batch
            self._event("dropped_last", {"samples": dropped - self._dropped_reported,
                                         "epoch": self.loader.sampler.epoch - 1}, warn=False)
            self._dropped_reported = dropped

    def _refresh_params(self) -> None:
        self._grads.refresh()
        if self._noise is not None:  # its small batches must cover the parameters of the step's norm
            self._noise.set_params(self._grads.params)

    def _rescale_lr(self) -> None:
        """Put in the LR factor of the next step's real size (in place of any factor in now)."""
        if self.coupling.is_scaled:
            self.coupling.unscale()
        self.coupling.scale(self.loader.next_step_size())

    # ------------------------------------------------------------------ state
    def _components(self) -> dict[str, Any]:
        """The stateful parts, by checkpoint key, in loading order (``None`` where a feature is off)."""
        return {"model": self._module, "optimizer": self.optimizer, "scaler": self.scaler, "coupling": self.coupling,
                "adascale": self.adascale, "loader": self.loader, "controller": self.controller,
                "stats_clip": self._step_end.stats_clip, "noise": self._noise, "meter": self._meter}

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
                "losses": list(self.driver.losses),
                "throughput": self.driver.samples_per_s,
                "world_size": self.world_size,
                "optimizer_class": class_name(self.optimizer),
                "lr_scheduler_classes": [class_name(s) for s in self.lr_schedulers],
                "override": self._override,  # a set_batch_size() made in a step the loop then left unfinished
            },
            **{key: None if obj is None else obj.state_dict() for key, obj in self._components().items()},
            "lr_schedulers": [s.state_dict() for s in self.lr_schedulers],
            "rng": gather_rng_states(self.world_size, self.device),
            "log_position": None if self._log.log is None else self._log.log.position(),
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
        components = self._components()
        check_fit(state, components=components, schedulers=self.lr_schedulers, loader=self.loader,
                  log=self._log.log, world_size=self.world_size)
        in_loop = self.coupling.is_scaled  # loaded between steps of batches() (from a callback)
        drop_last, micro = self.loader.sampler.drop_last, self.loader.max_micro_batch_size  # this Pilot's
        noise_every = None if self._noise is None else self._noise.every
        if in_loop:
            self.coupling.unscale()
        try:
            p = state["pilot"]
            self.driver.restore_counters(int(p["step"]), int(p["samples_seen"]), p["losses"], p["throughput"])
            self.skipped_steps, self._override = int(p["skipped_steps"]), p.get("override")
            load_parts(state, components, self.lr_schedulers)
            restore_rng_states(state["rng"], self.rank, self.world_size, self.device)
        except Exception as exc:  # the checks passed, so this is a damaged state: say what it did
            raise partly_loaded(exc) from exc
        if self._log.log is not None and state["log_position"] is not None:
            self._log.log.truncate(state["log_position"])  # before keep_own_settings logs what it changes
        keep_own_settings(self.loader, self._noise, drop_last=drop_last, max_micro_batch_size=micro,
                          noise_every=noise_every, min_batch_size=self.config.decisions.min_batch_size,
                          max_batch_size=self.config.decisions.max_batch_size,
                          log_clamp=lambda old, new, note: self._log_decision(old, new, "user", note, self.last_record))
        self._dropped_reported = self.loader.sampler.dropped_samples
        if self._log.tensorboard is not None:
            self._log.tensorboard.resume_after(self.samples_seen)
        if in_loop or self.coupling.is_scaled:
            # The loop goes on with the loaded position (or a state_dict() taken between steps holds a scaled
            # coupling): the factor of its next step's real size, which this Pilot's bounds may have changed.
            self._rescale_lr()

    def save_checkpoint(self, path: str | os.PathLike | None = None) -> Path | None:
        """Save :meth:`state_dict` atomically (rank 0 writes; every rank must call).

        ``path`` defaults to ``checkpoint_dir/step-<step>.pt``; a folder (one that exists, or a string ending in a
        separator; ``pathlib`` drops a trailing one) gets ``step-<step>.pt`` inside it, as :meth:`load_checkpoint`
        reads folders. Older files beyond ``keep_checkpoints`` in ``checkpoint_dir`` are removed. Returns the path
        on rank 0, ``None`` elsewhere."""
        if self._micro is not None:  # before the LR factor is touched: a caught error leaves the step as it was
            raise RuntimeError("save_checkpoint() was called in the middle of a step; call it between steps "
                               "(after the loop, or from a callback added with add_callback; a loop left with break "
                               "over a generator you keep ends only at gen.close()).")
        ckpt = self.config.checkpoints
        path = checkpoint_file(path, ckpt.checkpoint_dir, self.step)
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
            if ckpt.checkpoint_dir is not None and path.parent == ckpt.checkpoint_dir:
                prune_checkpoints(ckpt.checkpoint_dir, ckpt.keep_checkpoints, written)
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
        found = find_checkpoint(path, missing_ok)
        if found is None:
            return None
        self.load_state_dict(found[1])
        return found[0]

    def close(self) -> None:
        """Flush and close the log and TensorBoard writer, and stop the loader's worker processes.

        The Pilot stays usable: a later :meth:`batches` starts new workers and reopens the log (appending)."""
        self.loader.close()
        self._meter.close()  # NVML's nvmlShutdown, paired with its nvmlInit
        self._log.close()

    def __enter__(self) -> Pilot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
