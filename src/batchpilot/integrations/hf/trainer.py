"""`AdaptiveBatchSizeTrainer`: the ``transformers.Trainer`` subclass, whose overrides delegate to the package's
modules (see :mod:`batchpilot.integrations.hf`)."""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import SaveStrategy

from ...controllers.auto import Auto
from ...controllers.boundary import needs_gradient_stats
from ...engine.driver import SizeDriver
from ...engine.replay import keep_finished_step
from ...lr import lr_factor
from .._rank_shares import RankShares
from .auto import check_auto, resolve_auto
from .callbacks import BatchpilotCallback, SampleProgressCallback, add_logs
from .checks import (
    check_arguments,
    check_rank_weights_setting,
    check_scheduler_argument,
    check_step_options,
    sync_each_batch_problem,
)
from .data import (
    TrainLoader,
    build_loader,
    check_train_dataset,
    is_hf_dataset,
    loop_bounds,
    next_step,
    prepare_unsharded,
)
from .run import HFRun
from .schedule import sample_schedule
from .state import checkpoint_folder, read_state, resolve_resume, write_state
from .step import StepPasses, loss_owns_scaling, step_stats
from .tokens import check_token_settings, count_auto_tokens, resolve_lengths

__all__ = ["AdaptiveBatchSizeTrainer"]

logger = logging.getLogger("batchpilot")


class AdaptiveBatchSizeTrainer(Trainer):
    """A ``transformers.Trainer`` that follows a batch-size scheduler or batchpilot controller.

    Args:
        batch_size_scheduler: A seed-003 callable ``(step, current_size) -> size``, any batchpilot
            controller (``decide(Observation) -> int``), or ``None`` (constant size). Sizes are global
            samples per optimizer step; ``step`` is the number of steps completed.
            ``"auto"`` (or ``batchpilot.controllers.Auto(...)``) is the automatic mode: before Trainer's loop the
            start probes find the knee of the throughput curve and an LR there (LR range test) with the trainer's
            ``compute_loss``, the pre-probe state is restored and the run starts at the knee with that LR
            (``per_device_train_batch_size`` then sets no step's size); see docs/integrations-hf.md.
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
        max_micro_batch_size: Most rows per forward/backward on a device. A micro-batch (``global_batch_size / (world_size x
            gradient_accumulation_steps)`` rows, growing with the batch) with more rows runs as several
            passes of at most this many, accumulated without DDP communication, so memory stays bounded
            while the scheduler grows the batch. Needs batches that are dicts or tuples of batch-first
            tensors. Exact for a loss that is a mean over samples or normalised by ``num_items_in_batch``.
        oom_recovery: One process only. When a forward/backward runs out of memory, drop the step's gradients,
            lower ``max_micro_batch_size`` to half the rows that failed (it never grows back, and is saved in
            checkpoints) and run the step again from its first micro-batch: the same samples, batch and LR.
            ``trainer.batchpilot.oom_replays`` counts the retries.
        rank_weights: How each global batch is shared over the ranks: ``None`` (evenly), one positive weight per
            rank (shares proportional to them, e.g. ``[1, 2]``: rank 1 gets twice rank 0's samples) or ``"auto"``
            (weights from each rank's measured forward time per sample, re-estimated every 10 steps, smoothed, with
            hysteresis, agreed through rank 0: :class:`batchpilot.engine.rank_balance.RankBalancer`). The loss
            weighting keeps every step's gradient the mean over its global batch (LB-BSP, arXiv 1806.02508).
        batch_size: The first step's global batch size in ``batch_unit`` (default: Trainer's total train batch,
            ``per_device_train_batch_size x world_size x gradient_accumulation_steps`` samples). Required in tokens.
        batch_unit: ``"samples"`` (default) or ``"tokens"``: sizes (the scheduler's, the bounds, ``batch_size``) count
            tokens; each step takes the next samples of the epoch order while their tokens stay within the budget
            (at least one; never split or skipped), shares and micro-batches are balanced in tokens, and every
            micro-batch's loss is weighted by its tokens over the global batch's (docs/integrations-hf.md).
        lengths: With tokens: every sample's token count (a sequence), or the name of a dataset attribute or column
            holding it (a column of sequences gives their lengths), read once.
        max_micro_batch_tokens: With tokens: most tokens per forward/backward on a device; a micro-batch with more
            runs as several passes, balanced in tokens (a longer sample alone).

    Attributes:
        batchpilot: The :class:`HFRun` of the current (or last) ``train()`` call: ``batch_size`` (next
            step), ``samples_seen``, ``epoch``, ``coverage``, ``virtual_epoch``, ``last_step`` (a
            :class:`StepRecord`), ``driver.last_decision``, ``stats`` (the gradient statistics, or
            ``None``). ``None`` before training.

    Raises:
        ValueError: a training argument this trainer cannot honour (the message names it and the fix),
            ``oom_recovery=True`` with several processes, or ``rank_weights`` with a weight that is not positive and
            finite, of another length than the world size, an unknown string, or with per-rank loss normalisation.
        TypeError: ``oom_recovery`` is not a bool, a model was passed as ``batch_size_scheduler``, or
            ``rank_weights`` is not a list of numbers.
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
        rank_weights: str | Sequence[float] | None = None,
        batch_size: int | None = None,
        batch_unit: str = "samples",
        lengths: Any = None,
        max_micro_batch_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        batch_size_scheduler = resolve_auto(batch_size_scheduler)
        check_scheduler_argument(batch_size_scheduler)
        check_token_settings(batch_unit, lengths, max_micro_batch_tokens, batch_size,
                             isinstance(batch_size_scheduler, Auto))
        self._bp_batch_size, self._bp_unit = batch_size, (batch_unit, lengths, max_micro_batch_tokens)
        self._bp_lengths: tuple[Any, Any] | None = None  # (the dataset, its token counts), read once
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
        check_step_options(noise_every, max_micro_batch_size, oom_recovery, self.data_parallel_size)
        self._bp_max_micro_batch_size = max_micro_batch_size
        self._bp_noise_every = noise_every
        self._bp_measure = noise_every is not None or needs_gradient_stats(driver.controller)
        problem = sync_each_batch_problem(self.args, self._bp_measure, self.data_parallel_size)
        if problem is not None:
            raise ValueError(problem)
        lr_factor(lr_rule, 1, 1, lr_knee)  # validates the rule
        check_auto(batch_size_scheduler, lr_rule, self.data_parallel_size)
        self._bp_rank_weights = check_rank_weights_setting(rank_weights, self.args, self.data_parallel_size,
                                                           loss_owns_scaling(self))
        self.batchpilot: HFRun | None = None
        self._bp_resume: str | None = None
        self._bp_passes = StepPasses(
            self, super().training_step, oom_recovery=oom_recovery,
            split_measured=self.data_parallel_size == 1 and self.args.gradient_accumulation_steps == 1,
        )
        # Before the user's callbacks (Trainer(callbacks=[...]) added them already): theirs then see the step
        # counted, the coverage-based state.epoch and the next size. Trainer's own flow callback stays first.
        ours = BatchpilotCallback(self, self._bp_passes, self._bp_keep_finished_step)
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
        """Global size of the first step: ``batch_size=``, else per-device batch x world size x accumulation steps
        (or, for ``Auto`` with token budgets, its ``min_size``: where its probes start)."""
        if self._bp_batch_size is not None:
            return int(self._bp_batch_size)
        if self._bp_unit[0] == "tokens" and isinstance(self._bp_options["controller"], Auto):
            return self._bp_options["controller"].min_size
        return self.args.per_device_train_batch_size * self.data_parallel_size * self.args.gradient_accumulation_steps

    def _new_driver(self, num_samples: int) -> SizeDriver:
        driver = SizeDriver(
            batch_size=self.initial_batch_size, num_samples=num_samples, rank=self.args.process_index,
            **self._bp_options,
        )
        if self._bp_controller_start is not None and driver.controller is not None:
            driver.controller.load_state_dict(copy.deepcopy(self._bp_controller_start))
        return driver

    # ------------------------------------------------------------------ data and loop bounds
    def train(self, resume_from_checkpoint: str | os.PathLike | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; a resumed run also restores the data position, sizes and controller."""
        resume = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        self._bp_resume = resume if isinstance(resume, str) else None
        try:
            return super().train(resume, *args, **kwargs)
        finally:
            self._bp_resume = None

    def get_train_dataloader(self) -> TrainLoader:
        """Build the run's adaptive loader (restored from the checkpoint when resuming)."""
        dataset = self.train_dataset
        check_train_dataset(dataset)
        collator = self.data_collator
        if is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        args, world_size = self.args, self.data_parallel_size
        unit, lengths, max_tokens = self._bp_unit
        if self._bp_lengths is None or self._bp_lengths[0] is not self.train_dataset:  # read once per dataset
            self._bp_lengths = (self.train_dataset, resolve_lengths(self.train_dataset, lengths, unit))
        count_auto_tokens(self._bp_options["controller"], self._bp_lengths[1])  # Auto's default bounds in tokens
        loader = build_loader(dataset, collator, args, global_batch_size=self.initial_batch_size,
                              world_size=world_size, wrap_loader=self._prepare_train_loader, batch_unit=unit,
                              lengths=self._bp_lengths[1])
        plan = loader.sampler.token_plan  # batch_unit="tokens": the controller's unit is tokens
        run = HFRun(
            loader,
            self._new_driver(len(dataset) if plan is None else plan.total_tokens),
            world_size=world_size,
            total_samples=None if args.max_steps > 0 else math.ceil(args.num_train_epochs * len(dataset)),
            lr_rule=self._bp_lr[0],
            lr_knee=self._bp_lr[1],
            max_micro_batch_size=self._bp_max_micro_batch_size,
            max_micro_batch_tokens=max_tokens,
        )
        run.driver.min_useful = world_size * args.gradient_accumulation_steps
        run.shares = RankShares(self._bp_rank_weights, loader=loader, world_size=world_size, rank=args.process_index,
                                device=args.device, on_change=self._bp_weights_changed)
        if self._bp_measure:
            run.stats = step_stats(
                self.model, world_size=world_size, accumulation_steps=args.gradient_accumulation_steps,
                every=self._bp_noise_every, splits_measured_steps=self._bp_passes.split_measured,
            )
        if self._bp_resume is not None:
            run.load_state_dict(read_state(self._bp_resume))
        self.batchpilot = run
        return TrainLoader(loader, args.gradient_accumulation_steps)

    def _bp_weights_changed(self, old: Any, new: Any, rates: list[float | None]) -> None:
        if self.is_world_process_zero():
            logger.info("step %d: rank weights %s -> %s (samples per forward second: %s)", self.state.global_step,
                        old, new, [None if r is None else round(r, 1) for r in rates])

    def _prepare_train_loader(self, dataloader: torch.utils.data.DataLoader) -> Any:
        return prepare_unsharded(self.accelerator, dataloader)

    def set_initial_training_values(self, args: Any, dataloader: Any, *rest: Any) -> tuple:
        """Loop bounds that never cut an epoch short: our epochs end by coverage, training by epochs/steps."""
        if not isinstance(dataloader, TrainLoader):
            return super().set_initial_training_values(args, dataloader, *rest)
        return loop_bounds(args, dataloader.num_samples, self.initial_batch_size)

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """With ``max_steps`` set, Trainer's schedule (the step count is exact). Otherwise the same schedule
        type in samples: ``num_train_epochs * len(train_dataset)`` long, stepped to ``samples_seen``."""
        run = self.batchpilot
        total = None if run is None else run.total_units  # samples, or tokens with batch_unit="tokens"
        if self.lr_scheduler is not None or run is None or total is None:
            return super().create_scheduler(num_training_steps, optimizer)
        self.lr_scheduler: Any = sample_schedule(
            self.args, optimizer if optimizer is not None else self.optimizer, total_samples=total,
            initial_batch_size=self.initial_batch_size, clock=run.lr_clock,
        )
        self._created_lr_scheduler = True
        return self.lr_scheduler

    # ------------------------------------------------------------------ one step
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple:
        """Pull exactly one optimizer step's micro-batches; an empty list ends the epoch."""
        run = self.batchpilot
        if run is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        epochs = self.args.num_train_epochs
        if run.finished(epochs):
            # Resumed from the last checkpoint of a finished run: Trainer counts epochs by steps and loops again.
            self.control.should_epoch_stop = self.control.should_training_stop = True
            return [], None
        micro = next_step(epoch_iterator, num_batches)
        if not micro:  # the sampler has covered the epoch
            self.control.should_epoch_stop = True
            if run.finished(epochs):
                self.control.should_training_stop = True
            return [], None
        data, counted = self._bp_passes.begin(run, micro, self.model_wrapped)
        return data, None if counted is None else self._get_num_items_in_batch(counted, device)

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """``Trainer.training_step``, with the micro-batch weighted by its share of the global batch, cut into
        forward/backward passes of at most ``max_micro_batch_size`` rows, and (``oom_recovery``) run again
        with smaller passes, from the step's first micro-batch, when it runs out of memory."""
        run = self.batchpilot
        if run is None or not self._bp_passes.planned:
            return super().training_step(model, inputs, num_items_in_batch)  # not a step batchpilot planned
        return self._bp_passes.micro_batch(run, model, inputs, num_items_in_batch)

    def compute_loss(self, model: torch.nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """``Trainer.compute_loss``; a ghost micro-batch's loss (a borrowed row, run only so that every rank
        makes the same passes) is multiplied by 0, whatever the labels and the loss function."""
        timed = self._bp_passes.forward_starts()  # rank_weights="auto": this rank's forward time per sample
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if timed:
            self._bp_passes.forward_ends()
        if not self._bp_passes.ghost:
            return result
        if return_outputs:
            loss, outputs = result
            return loss * 0.0, outputs
        return result * 0.0

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        value = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._bp_passes.reduced(self.batchpilot, value)  # the step's reduced gradient, before clipping
        return value

    # ------------------------------------------------------------------ logs and checkpoints
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add ``train_coverage``, ``batch_size`` and ``samples_seen`` to training logs (``epoch`` is the
        coverage-based one), and count train speed in real samples."""
        add_logs(logs, self.batchpilot)
        super().log(logs, *args, **kwargs)

    def _bp_keep_finished_step(self, error: Exception) -> None:
        """The controller failed after a finished step (on every rank): unless ``save_strategy="no"``, save that
        step as a regular checkpoint before the error stops the run, so nothing trained is lost. The checkpoint
        continues at the current size; a run resumed from it asks the controller again when next due."""
        if self.args.save_strategy == SaveStrategy.NO:
            return

        def save() -> str:
            self._save_checkpoint(self.model_wrapped, trial=None)
            return checkpoint_folder(self.args.output_dir, self.state.global_step)

        keep_finished_step(save, error, step=self.state.global_step, lead=self.is_world_process_zero(),
                           resume_hint="train(resume_from_checkpoint=...)")

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # Our state goes in first: a folder with trainer_state.json always has batchpilot_state.json too.
        if self.batchpilot is not None and self.args.should_save:
            folder = checkpoint_folder(self._get_output_dir(trial=trial), self.state.global_step)
            write_state(folder, self.batchpilot.state_dict())
        super()._save_checkpoint(model, trial)
