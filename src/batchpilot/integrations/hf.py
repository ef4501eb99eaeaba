"""`AdaptiveBatchSizeTrainer`: a ``transformers.Trainer`` whose global batch size changes while it trains.

Seed 003's API, done exactly::

    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=partial(linear_increase_scheduler, interval=50, max_size=64, increment=4),
        model=model, args=TrainingArguments(..., per_device_train_batch_size=4, num_train_epochs=3),
        train_dataset=train_set, eval_dataset=eval_set, data_collator=collate_fn,
    )
    trainer.train()

Sizes are *global*: samples per optimizer step over all ranks. The first step has
``per_device_train_batch_size * world_size * gradient_accumulation_steps`` samples; after every step rank 0
asks the scheduler (or any batchpilot controller) for the next size and every rank applies the broadcast
value. Each rank runs exactly ``gradient_accumulation_steps`` micro-batches per step, so the per-device
micro-batch is ``size / (world_size * gradient_accumulation_steps)`` (shares differ by at most one sample).

How it fits the Trainer (transformers 5.x, accelerate 1.x):

- Data: a :class:`~batchpilot.AdaptiveDataLoader` (exact coverage; size changes rewind whatever workers and
  accelerate's one-batch look-ahead prefetched) fetches through ``accelerator.prepare``'s DataLoader, whose
  ``BatchSamplerShard`` is made a pass-through (our sampler already hands each rank its share).
- Loop length: ``len()`` is an upper bound; an epoch ends when the sampler has covered the data, and
  training ends after ``num_train_epochs`` passes (or ``max_steps`` steps).
- Loss: each micro-batch's mean loss is weighted by its share of the global batch, so the step's gradient
  is the mean over the B samples whatever the split.
- Memory: with ``max_micro_batch_size`` a micro-batch with more rows runs as several forward/backward passes
  inside ``training_step`` (all but the last under DDP's ``no_sync``), each weighted by its rows.
- LR: with ``max_steps=-1`` the schedule runs on samples (``num_train_epochs * len(train_dataset)`` long,
  ``warmup_steps`` counted in first-step batches); optional LR coupling ``lr_rule="sqrt"`` etc.
- Logs: ``train_coverage``, a coverage-based ``epoch``, ``batch_size`` and ``samples_seen``.
- Resume: ``batchpilot_state.json`` in each checkpoint folder; ``ignore_data_skip`` is forced on.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from .._extras import install_hint
from ._require import require

transformers = require("transformers", "hf", what="batchpilot.integrations.hf")
require("accelerate", "hf", what="batchpilot.integrations.hf")

import torch

if tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
    raise ImportError(  # transformers 5 disables PyTorch below 2.6 (Trainer becomes a placeholder)
        f"batchpilot.integrations.hf needs torch >= 2.6 (transformers 5 requires it); this is torch "
        f"{torch.__version__}. Upgrade torch, or use Pilot, which works with torch >= 2.3."
    )
if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(  # the trainer overrides Trainer internals of transformers 5 (get_batch_samples, ...)
        f"batchpilot.integrations.hf needs transformers >= 5.0, < 6; this is transformers {transformers.__version__}. "
        f"Upgrade it with: {install_hint('hf')}"
    )
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher
from transformers import Trainer
from transformers.optimization import get_scheduler
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    SaveStrategy,
    get_last_checkpoint,
    seed_worker,
)

from .._validation import check_bool, check_positive_int
from ..controllers.base import needs_gradient_stats
from ..data.loader import AdaptiveDataLoader
from ..engine import is_out_of_memory
from ..engine.driver import SizeDriver
from ._hf_callbacks import BatchpilotCallback, SampleProgressCallback
from ._hf_parts import (
    SampleLambdaLR,
    TrainLoader,
    check_arguments,
    is_hf_dataset,
    mask_labels,
    read_state,
    split_rows,
    sync_each_batch_problem,
    write_state,
)
from ._hf_run import HFRun, StepRecord
from ._step_stats import StepStats

__all__ = ["AdaptiveBatchSizeTrainer", "HFRun", "StepRecord"]

logger = logging.getLogger("batchpilot")


class AdaptiveBatchSizeTrainer(Trainer):
    """A ``transformers.Trainer`` that follows a batch-size scheduler or batchpilot controller.

    Args:
        batch_size_scheduler: A seed-003 callable ``(step, current_size) -> size``, any batchpilot
            controller (``decide(Observation) -> int``), or ``None`` (constant size). Sizes are global
            samples per optimizer step; ``step`` is the number of steps completed.
        *args, **kwargs: Everything ``transformers.Trainer`` takes (``model``, ``args``, ``train_dataset``,
            ``eval_dataset``, ``data_collator``, ``callbacks``, ...).
        min_batch_size, max_batch_size: Bounds every decision is clamped to.
        decide_every: Ask the scheduler after every ``decide_every``-th step.
        on_invalid: ``"raise"`` when the scheduler returns 0, a negative, NaN or a non-integer, or
            ``"keep"`` to keep the current size with a warning.
        lr_rule: ``"none"`` (default), ``"linear"``, ``"sqrt"``, ``"linear-then-sqrt"`` or a callable:
            the LR is multiplied by this function of ``B / B0`` (B0: the first step's size), on top of the
            LR schedule (see :mod:`batchpilot.lr`).
        lr_knee: Knee of ``"linear-then-sqrt"``.
        noise_every: Measure the gradient noise scale (McCandlish et al. 2018) on every N-th step. Default:
            every 16th step when the scheduler reads gradient statistics (``NoiseScale``, ``Goodput``,
            ``VarianceRule``, ``ThresholdRules``), else never. The small batches are the micro-batches of a
            step (or their passes) and the ranks, at no extra computation; on one process with
            ``gradient_accumulation_steps=1`` a measured step's micro-batch runs as two passes. The statistics
            reach the scheduler in ``Observation.stats`` (``stats/*``, ``perf/*``).
        max_micro_batch_size: Most rows per forward/backward on a device. A micro-batch (``size / (world_size x
            gradient_accumulation_steps)`` rows, growing with the batch) with more rows runs as several
            passes of at most this many, accumulated without DDP communication, so memory stays bounded
            while the scheduler grows the batch. Needs batches that are dicts or tuples of batch-first
            tensors. Exact for a loss that is a mean over samples or normalised by ``num_items_in_batch``.
        oom_recovery: One process only. When a forward/backward runs out of memory, drop the step's gradients,
            lower ``max_micro_batch_size`` to half the rows that failed (it never grows back, and is saved in
            checkpoints) and run the step again from its first micro-batch: the same samples, batch and LR.
            ``trainer.batchpilot.oom_replays`` counts the retries.

    Attributes:
        batchpilot: The :class:`HFRun` of the current (or last) ``train()`` call: ``batch_size`` (next
            step), ``samples_seen``, ``epoch``, ``coverage``, ``virtual_epoch``, ``last_step`` (a
            :class:`StepRecord`), ``driver.last_decision``, ``stats`` (the gradient statistics, or
            ``None``). ``None`` before training.

    Raises:
        ValueError: a training argument this trainer cannot honour (the message names it and the fix), or
            ``oom_recovery=True`` with several processes.
        TypeError: ``oom_recovery`` is not a bool.
    """

    def __init__(
        self,
        batch_size_scheduler: Any = None,
        *args: Any,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        decide_every: int = 1,
        on_invalid: str = "raise",
        lr_rule: str | Callable[[float], float] = "none",
        lr_knee: int = 4096,
        noise_every: int | None = None,
        max_micro_batch_size: int | None = None,
        oom_recovery: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(batch_size_scheduler, torch.nn.Module):  # Trainer's positional (model, args, ...) order
            raise TypeError(
                "the first argument of AdaptiveBatchSizeTrainer is batch_size_scheduler, but it got a torch.nn.Module "
                f"({type(batch_size_scheduler).__name__}); pass the model and the rest by keyword: "
                "AdaptiveBatchSizeTrainer(batch_size_scheduler=..., model=model, args=args, ...)."
            )
        super().__init__(*args, **kwargs)
        check_arguments(self)
        self.args.ignore_data_skip = True  # the sampler restores the position; Trainer's batch skipping cannot
        self._bp_options = dict(
            controller=batch_size_scheduler, min_batch_size=min_batch_size, max_batch_size=max_batch_size,
            decide_every=decide_every, on_invalid=on_invalid,
        )
        self._bp_lr = (lr_rule, lr_knee)
        self._bp_controller_start: dict[str, Any] | None = None
        driver = self._new_driver(num_samples=1)  # validate the settings now, not at train() time
        # Each train() that does not resume starts the controller afresh (a second call, hyperparameter_search)
        # from the state it had here; a resumed one loads the checkpoint's.
        self._bp_controller_start = None if driver.controller is None else copy.deepcopy(driver.controller.state_dict())
        if noise_every is not None:
            check_positive_int(noise_every, "noise_every")
        if max_micro_batch_size is not None:
            check_positive_int(max_micro_batch_size, "max_micro_batch_size")
        self._bp_max_micro = max_micro_batch_size
        check_bool(oom_recovery, "oom_recovery")
        if oom_recovery and self.data_parallel_size > 1:
            raise ValueError(
                f"oom_recovery=True needs one process (world size {self.data_parallel_size} here): under DDP a rank "
                "that runs out of memory inside Trainer's backward leaves the others waiting in DDP's all-reduce. "
                "Set max_micro_batch_size= to a size that fits, or use batchpilot.Pilot(oom_recovery=True), whose "
                "ranks agree on every retry."
            )
        self._bp_oom_recovery = oom_recovery
        self._bp_noise_every = noise_every
        self._bp_measure = noise_every is not None or needs_gradient_stats(driver.controller)
        problem = sync_each_batch_problem(self.args, self._bp_measure, self.data_parallel_size)
        if problem is not None:
            raise ValueError(problem)
        # One process, one micro-batch per step: a measured step's micro-batch runs as two passes, the two
        # small batches of the noise scale (as Pilot splits measured steps).
        self._bp_split_measured = self.data_parallel_size == 1 and self.args.gradient_accumulation_steps == 1
        from ..lr import lr_factor

        lr_factor(lr_rule, 1, 1, lr_knee)  # validates the rule
        self.batchpilot: HFRun | None = None
        self._bp_resume: str | None = None
        # (loss divisor, size, is_last) of each micro-batch of the step in flight, its inputs, and the next one
        self._bp_plan: list[tuple[float, int, bool]] = []
        self._bp_inputs: list[Any] = []
        self._bp_next = 0
        self._bp_failed_rows = 0
        self._bp_ghost = False  # the pass in flight is a ghost micro-batch's (compute_loss zeroes its loss)
        self._bp_grad_norm: float | None = None
        self._bp_seen_at_start = 0
        # Before the user's callbacks (Trainer(callbacks=[...]) added them already): theirs then see the step
        # counted, the coverage-based state.epoch and the next size. Trainer's own flow callback stays first.
        ours = BatchpilotCallback(self)
        callbacks = self.callback_handler.callbacks
        flow = [i for i, c in enumerate(callbacks) if type(c).__name__ == "DefaultFlowCallback"]
        callbacks.insert(flow[0] + 1 if flow else 0, ours)
        if self.pop_callback(ProgressCallback) is not None:
            self.add_callback(SampleProgressCallback(lambda: self.batchpilot))

    # ------------------------------------------------------------------ sizes
    @property
    def data_parallel_size(self) -> int:
        """Ranks that receive different data (the world size, without tensor/context parallel groups)."""
        return max(1, self.args.world_size)

    @property
    def initial_batch_size(self) -> int:
        """Global size of the first step: per-device batch x world size x gradient accumulation steps."""
        return self.args.per_device_train_batch_size * self.data_parallel_size * self.args.gradient_accumulation_steps

    def _new_driver(self, num_samples: int) -> SizeDriver:
        driver = SizeDriver(
            batch_size=self.initial_batch_size, num_samples=num_samples, rank=self.args.process_index,
            **self._bp_options,
        )
        if self._bp_controller_start is not None and driver.controller is not None:
            driver.controller.load_state_dict(copy.deepcopy(self._bp_controller_start))
        return driver

    # ------------------------------------------------------------------ training entry
    def train(self, resume_from_checkpoint: str | os.PathLike | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; a resumed run also restores the data position, sizes and controller."""
        if isinstance(resume_from_checkpoint, os.PathLike):  # Trainer takes a Path too: so must our state
            resume_from_checkpoint = os.fspath(resume_from_checkpoint)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        # A path, or None: False, None and "" mean no resume (True was resolved above).
        self._bp_resume = (resume_from_checkpoint or None) if isinstance(resume_from_checkpoint, str) else None
        try:
            return super().train(resume_from_checkpoint or None, *args, **kwargs)
        finally:
            self._bp_resume = None

    def get_train_dataloader(self) -> TrainLoader:
        """Build the run's adaptive loader (restored from the checkpoint when resuming)."""
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError(
                f"train_dataset of type {type(dataset).__name__} has no length; AdaptiveBatchSizeTrainer cuts "
                "global batches from a map-style dataset (with __len__ and __getitem__). Materialise it first."
            )
        collator = self.data_collator
        if is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        args = self.args
        workers = args.dataloader_num_workers
        extra: dict[str, Any] = {"in_order": True}  # micro-batches must arrive in the order they were planned
        if workers > 0:
            extra["worker_init_fn"] = functools.partial(seed_worker, num_workers=workers, rank=args.process_index)
            context = getattr(args, "dataloader_multiprocessing_context", None)  # transformers >= 5.x
            if context is not None:
                extra["multiprocessing_context"] = context
        loader = AdaptiveDataLoader(
            dataset,
            self.initial_batch_size,
            shuffle=getattr(args, "train_sampling_strategy", "random") != "sequential",
            seed=args.data_seed if args.data_seed is not None else args.seed,
            drop_last=args.dataloader_drop_last,
            rank=args.process_index,
            world_size=self.data_parallel_size,
            num_workers=workers,
            collate_fn=collator,
            pin_memory=args.dataloader_pin_memory and args.device.type != "cpu",
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
            persistent_workers=workers > 0,  # a size change then drains the queue instead of new processes
            accumulation_steps=args.gradient_accumulation_steps,
            wrap_loader=self._prepare_train_loader,
            dataloader_kwargs=extra,
        )
        epochs = args.num_train_epochs
        run = HFRun(
            loader,
            self._new_driver(len(dataset)),
            world_size=self.data_parallel_size,
            total_samples=None if args.max_steps > 0 else math.ceil(epochs * len(dataset)),
            lr_rule=self._bp_lr[0],
            lr_knee=self._bp_lr[1],
            max_micro_batch_size=self._bp_max_micro,
        )
        run.driver.min_useful = self.data_parallel_size * args.gradient_accumulation_steps
        if self._bp_measure:
            model = self.model
            if model is None:
                raise ValueError("AdaptiveBatchSizeTrainer has no model to train; pass model= (or model_init=).")
            def trainable() -> list[torch.nn.Parameter]:
                return [p for p in model.parameters() if p.requires_grad]

            run.stats = StepStats(trainable(), world_size=self.data_parallel_size,
                                accumulation_steps=args.gradient_accumulation_steps, every=self._bp_noise_every,
                                splits_measured_steps=self._bp_split_measured, params_of=trainable)
        if self._bp_resume is not None:
            run.load_state_dict(read_state(self._bp_resume))
        self.batchpilot = run
        return TrainLoader(loader, args.gradient_accumulation_steps)

    def _prepare_train_loader(self, dataloader: torch.utils.data.DataLoader) -> Any:
        """``accelerator.prepare`` (device placement, look-ahead), with the rank sharding made a pass-through."""
        even = self.accelerator.even_batches
        # Our sampler already gives every rank the same number of batches; accelerate < 1.14 refuses a batch
        # sampler without a fixed batch_size under even_batches=True, so prepare this loader without it.
        self.accelerator.even_batches = False
        try:
            prepared = self.accelerator.prepare(dataloader)
        finally:
            self.accelerator.even_batches = even
        if isinstance(prepared, DataLoaderDispatcher):
            raise ValueError(
                "accelerate dispatches batches from rank 0 (dispatch_batches=True), which cannot split batches of "
                "changing size; pass TrainingArguments(accelerator_config={'dispatch_batches': False})."
            )
        shard = getattr(prepared, "batch_sampler", None)
        if isinstance(shard, BatchSamplerShard):
            # The sampler already yields this rank's share; sharding again would drop 1 - 1/W of the data.
            shard.num_processes, shard.process_index = 1, 0
        return prepared

    def set_initial_training_values(self, args: Any, dataloader: Any, *rest: Any) -> tuple:
        """Loop bounds that never cut an epoch short: our epochs end by coverage, training by epochs/steps."""
        if not isinstance(dataloader, TrainLoader):
            return super().set_initial_training_values(args, dataloader, *rest)
        num_samples = dataloader.num_samples
        steps_bound = num_samples  # every step takes >= 1 sample
        if args.max_steps > 0:
            max_steps, epochs, train_samples = args.max_steps, sys.maxsize, args.max_steps * self.initial_batch_size
        else:
            train_samples = math.ceil(args.num_train_epochs * num_samples)
            max_steps, epochs = train_samples, math.ceil(args.num_train_epochs)  # an upper bound; stop by samples
        return (
            epochs, steps_bound, num_samples, train_samples, self.initial_batch_size,
            steps_bound * args.gradient_accumulation_steps, max_steps,
        )

    # ------------------------------------------------------------------ LR schedule
    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """With ``max_steps`` set, Trainer's schedule (the step count is exact). Otherwise the same schedule
        type in samples: ``num_train_epochs * len(train_dataset)`` long, stepped to ``samples_seen``."""
        run = self.batchpilot
        if self.lr_scheduler is not None or run is None or run.total_samples is None:
            return super().create_scheduler(num_training_steps, optimizer)
        optimizer = optimizer if optimizer is not None else self.optimizer
        if optimizer is None:
            raise ValueError("create_scheduler() needs an optimizer: call create_optimizer() first (Trainer does).")
        total = run.total_samples
        warmup = self.args.warmup_steps
        if warmup >= 1:
            warmup_samples = int(warmup) * self.initial_batch_size  # warm-up steps of the first step's size
        else:
            warmup_samples = math.ceil(total * (warmup or getattr(self.args, "warmup_ratio", 0) or 0))
        schedule = get_scheduler(
            self.args.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=warmup_samples,
            num_training_steps=total, scheduler_specific_kwargs=self.args.lr_scheduler_kwargs,
        )
        if isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):
            schedule = SampleLambdaLR(optimizer, schedule.lr_lambdas, run.lr_clock)
        elif not isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                f"lr_scheduler_type={self.args.lr_scheduler_type!r} builds a {type(schedule).__name__}, which "
                "cannot be driven by samples; use a warm-up/decay schedule (linear, cosine, constant, ...) or "
                "set max_steps."
            )
        self.lr_scheduler: Any = schedule
        self._created_lr_scheduler = True
        return schedule

    # ------------------------------------------------------------------ one step
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple:
        """Pull exactly one optimizer step's micro-batches; an empty list ends the epoch."""
        run = self.batchpilot
        if run is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._bp_finished(run):
            # Resumed from the last checkpoint of a finished run: Trainer counts epochs by steps and loops again.
            self.control.should_epoch_stop = self.control.should_training_stop = True
            return [], None
        micro = []
        for m in epoch_iterator:
            micro.append(m)
            if m.is_last:
                break
        if not micro:  # the sampler has covered the epoch
            self.control.should_epoch_stop = True
            if self._bp_finished(run):
                self.control.should_training_stop = True
            return [], None
        if len(micro) != num_batches or not micro[-1].is_last:
            raise RuntimeError(
                f"a step yielded {len(micro)} micro-batches but Trainer expects {num_batches}; "
                "the training loop and the loader disagree on gradient_accumulation_steps."
            )
        self._bp_plan = [(d, m.size, m.is_last) for d, m in zip(run.begin_step(micro), micro)]
        self._bp_next = 0
        if run.stats is not None:
            run.stats.attach(self.model_wrapped)  # DDP exists by now (Trainer wraps after on_train_begin)
            run.stats.begin_step(run.driver.step, micro[0].global_size, run.driver.num_samples)
        data = [m.data for m in micro]
        owns_scaling = self._loss_owns_scaling()
        if owns_scaling:  # a loss normalised by num_items_in_batch: ghosts' integer labels -100 add no loss
            data = [mask_labels(d) if m.ghost else d for d, m in zip(data, micro)]
        self._bp_inputs = data  # Trainer holds them for the step too; a replay after running out of memory reads them
        if not owns_scaling:
            return data, None  # the divisors weight each micro-batch (training_step)
        # Count the items without the ghosts, float labels too (compute_loss multiplies a ghost's loss by 0).
        counted = [mask_labels(d, floats=True) if m.ghost else d for d, m in zip(data, micro)]
        return data, self._get_num_items_in_batch(counted, device)

    def _bp_finished(self, run: HFRun) -> bool:
        """Training by epochs, all of them are done: every sample counted, or every epoch covered
        (``epochs_done()`` counts one whose tail ``drop_last`` will drop)."""
        return run.total_samples is not None and (
            run.samples_seen >= run.total_samples or run.loader.epochs_done() >= self.args.num_train_epochs)

    def _bp_active(self) -> tuple[HFRun, StepRecord]:
        """The run and its step in flight, inside a training step that batchpilot planned."""
        run = self.batchpilot
        if run is None or run.inflight is None:
            raise RuntimeError("internal error: a batchpilot training step ran outside a planned step")
        return run, run.inflight

    def _loss_owns_scaling(self) -> bool:
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # transformers >= 5.x added this switch
        if scaled is not None:
            return bool(scaled)
        return getattr(self, "compute_loss_func", None) is not None

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """``Trainer.training_step``, with the micro-batch weighted by its share of the global batch, cut into
        forward/backward passes of at most ``max_micro_batch_size`` rows, and (``oom_recovery``) run again
        with smaller passes, from the step's first micro-batch, when it runs out of memory."""
        run = self.batchpilot
        if run is None or self._bp_next >= len(self._bp_plan):
            return super().training_step(model, inputs, num_items_in_batch)  # not a step batchpilot planned
        current = self._bp_next
        first = current  # after running out of memory: the step again from its first micro-batch
        while True:
            error = None
            try:
                for k in range(first, current + 1):
                    loss = self._micro_passes(model, inputs if k == current else self._bp_inputs[k],
                                              num_items_in_batch, self._bp_plan[k])
                    if k < current:
                        run.add_loss(loss)  # a replayed micro-batch: Trainer already has its loss
            except Exception as exc:
                if not (self._bp_oom_recovery and is_out_of_memory(exc)):
                    raise
                error = (str(exc).splitlines() or [type(exc).__name__])[0]
            if error is None:
                break
            self._bp_replay_step(model, error)  # outside the except: the failed attempt's frames are gone
            first = 0
        self._bp_next = current + 1
        run.add_loss(loss)
        return loss

    def _micro_passes(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any,
                      plan: tuple[float, int, bool]) -> torch.Tensor:
        """Forward and backward of one micro-batch, in passes of at most ``run.max_micro_batch_size`` rows."""
        run, step = self._bp_active()
        size, last = plan[1], plan[2]
        divisor = None if self._loss_owns_scaling() else plan[0]
        stats = run.stats
        cap = run.max_micro_batch_size
        rows = split_rows(inputs, None)[0][1]
        if stats is not None and stats.measuring and self._bp_split_measured and rows >= 2:
            cap = min(cap or rows, -(-rows // 2))  # the step's only micro-batch: two passes, two small batches
        pieces = split_rows(inputs, cap)
        loss: torch.Tensor | None = None
        for i, (part, n) in enumerate(pieces):
            if divisor is not None:
                # Trainer divides the loss by this number: B / (W * m) weights the micro-batch's m rows by
                # their share of the global batch; a piece of n rows carries n / m of it.
                self.current_gradient_accumulation_steps = divisor * rows / n if len(pieces) > 1 else divisor
            if stats is not None:
                stats.begin_micro()
            # All pieces but the last accumulate without DDP's all-reduce (the last one does what Trainer set).
            sync = self.accelerator.no_sync(model) if i < len(pieces) - 1 else contextlib.nullcontext()
            self._bp_failed_rows = n
            self._bp_ghost = size == 0
            try:
                with sync:
                    piece_loss = super().training_step(model, part, num_items_in_batch)
            finally:
                self._bp_ghost = False
            if stats is not None:
                # Samples, not rows: a padding-free collator packs a micro-batch into one row (rows are samples
                # only where the micro-batch was split into passes). A ghost's borrowed row is no sample.
                own = (size if len(pieces) == 1 else n) if size else 0
                if own:
                    stats.end_micro(own)
                # Each pass is a small batch of the noise scale. Trainer divided its loss by B / (W n): the .grad
                # increment is W n / B times its mean gradient (fp16: .grad also holds the loss scale).
                to_mean = self.data_parallel_size * own / step.global_size
                stats.after_micro(own, last and i == len(pieces) - 1, to_mean, getattr(self.accelerator, "scaler", None))
            loss = piece_loss if loss is None else loss + piece_loss
        assert loss is not None  # split_rows returns at least one piece
        return loss

    def compute_loss(self, model: torch.nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """``Trainer.compute_loss``; a ghost micro-batch's loss (a borrowed row, run only so that every rank
        makes the same passes) is multiplied by 0, whatever the labels and the loss function."""
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if not self._bp_ghost:
            return result
        if return_outputs:
            loss, outputs = result
            return loss * 0.0, outputs
        return result * 0.0

    def _bp_replay_step(self, model: torch.nn.Module, error: str) -> None:
        """Drop the step's gradients and lower the pass bound to half the rows that failed."""
        run, _ = self._bp_active()
        failed = self._bp_failed_rows
        if failed <= 1:
            raise RuntimeError(
                f"a forward/backward of one row ran out of memory ({error}); there is nothing left to split. "
                "Use mixed precision (bf16=True / fp16=True), gradient checkpointing, a smaller model or more memory."
            )
        old, cap = run.max_micro_batch_size, failed // 2
        run.restart_step(cap)
        model.zero_grad(set_to_none=True)  # the optimizer's zero_grad is a no-op between accumulation steps
        if self.args.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the failed attempt's cached blocks back before the retry
        logger.warning("step %d ran out of memory with %d rows per forward/backward (%s); running it again with "
                       "at most %d (max_micro_batch_size was %s)", run.driver.step + 1, failed, error, cap, old)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        value = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._bp_grad_norm = float(value) if value is not None else None
        run = self.batchpilot
        if run is not None and run.stats is not None:
            run.stats.reduced(self._bp_grad_norm)  # the step's reduced gradient, before clipping
        return value

    # ------------------------------------------------------------------ logs and checkpoints
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add ``train_coverage``, ``batch_size`` and ``samples_seen`` to training logs (``epoch`` is the
        coverage-based one), and count train speed in real samples."""
        run = self.batchpilot
        if run is not None and "loss" in logs:
            logs["train_coverage"] = round(run.coverage, 6)
            logs["batch_size"] = run.last_step.global_size if run.last_step is not None else run.batch_size
            logs["samples_seen"] = run.samples_seen
            if run.coupling is not None:
                logs["lr_factor"] = run.step_lr_factor  # of the last step (logged learning_rate is unscaled)
            noise = None if run.stats is None else run.stats.stats.get("stats/noise_scale")
            if noise is not None:
                logs["noise_scale"] = round(noise, 3)  # B_simple (McCandlish et al. 2018), samples
        if run is not None and "train_runtime" in logs and logs["train_runtime"] > 0:
            seen = run.samples_seen - self._bp_seen_at_start
            logs["train_samples_per_second"] = round(seen / logs["train_runtime"], 3)
        super().log(logs, *args, **kwargs)

    def _bp_keep_finished_step(self, error: Exception) -> None:
        """The controller failed after a finished step (on every rank): unless ``save_strategy="no"``, save that
        step as a regular checkpoint before the error stops the run, so nothing trained is lost. The checkpoint
        continues at the current size; a run resumed from it asks the controller again when next due."""
        if self.args.save_strategy == SaveStrategy.NO:
            return
        try:
            self._save_checkpoint(self.model_wrapped, trial=None)
        except Exception as save_error:  # the controller's error is the one to report
            logger.error("the batch size controller failed at step %d and saving that step failed too: %s",
                         self.state.global_step, save_error)
            return
        if self.is_world_process_zero():
            folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            message = (f"batchpilot saved the finished step {self.state.global_step} to {folder} before stopping: fix "
                       "the controller and resume from it (train(resume_from_checkpoint=...)); nothing trained is lost.")
            logger.error("%s", message)
            if hasattr(error, "add_note"):  # Python >= 3.11: shown with the traceback
                error.add_note(message)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # Our state goes in first: a folder with trainer_state.json always has batchpilot_state.json too.
        if self.batchpilot is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            write_state(folder, self.batchpilot.state_dict())
        super()._save_checkpoint(model, trial)
