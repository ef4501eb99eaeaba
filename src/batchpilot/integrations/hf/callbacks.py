"""batchpilot's part of Trainer's loop and logs.

- :class:`BatchpilotCallback`: batchpilot's part of each step, at the right moment of Trainer's loop:
  LR coupling around the scheduler, counting the step, the decision (rank 0, broadcast; a failing controller
  saves the finished step first), the stop after ``num_train_epochs`` passes, and stopping the dataloader
  workers at the end.
- :class:`SampleProgressCallback`: the training progress bar counted in samples.
- :func:`add_logs`: what a training log adds (coverage, global batch size, samples).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from .._auto import auto_controller
from .._rank_shares import with_lead_share
from .auto import start_probes
from .run import HFRun
from .step import StepPasses

logger = logging.getLogger("batchpilot")


class BatchpilotCallback(TrainerCallback):
    """Runs batchpilot's part of each step at the right moment of Trainer's loop.

    Args:
        trainer: The trainer (its ``batchpilot`` run and ``optimizer``).
        passes: Its :class:`StepPasses` (the step's gradient norm).
        keep_finished_step: Called with the controller's error to save the finished step before it stops the run.
    """

    def __init__(self, trainer: Any, passes: StepPasses, keep_finished_step: Callable[[Exception], None]) -> None:
        self.trainer = trainer
        self.passes = passes
        self.keep_finished_step = keep_finished_step

    def on_train_begin(self, args, state, control, **kwargs):
        trainer, run = self.trainer, self.trainer.batchpilot
        if run is None:
            return
        if run.driver.step != state.global_step:
            logger.warning(
                "batchpilot state says %d steps but the Trainer state says %d; continuing from the data position",
                run.driver.step, state.global_step,
            )
        if auto_controller(run.driver.controller) is not None:
            start_probes(trainer, run)  # batch_size_scheduler=Auto(): start at the knee with the found LR
        run.apply_size()  # a first step beyond num_train_epochs gets only the samples left
        run.start_coupling(trainer.optimizer)
        run.samples_at_start = run.samples_seen
        state.epoch = run.virtual_epoch
        run.driver.start_clock()

    def on_optimizer_step(self, args, state, control, **kwargs):
        run = self.trainer.batchpilot
        if run is not None:
            run.unscale_lr()  # the LR scheduler steps on the schedule's own LR

    def on_step_end(self, args, state, control, **kwargs):
        run = self.trainer.batchpilot
        if run is None:
            return
        loss = run.end_step()
        state.epoch = run.virtual_epoch  # logged as `epoch`: passes over the data by samples (seed 003)
        stats = {} if run.stats is None else run.stats.end_step(run.driver.step, loss, run.max_micro_batch_size)
        stats = with_lead_share(stats, run.rank_weights, run.world_size) or {}  # rank_weights: rank 0's share
        if self.passes.grad_norm is not None:
            stats["grad/norm"] = self.passes.grad_norm
        try:
            run.decide(stats)
        except Exception as error:  # every rank gets here (the others learn of rank 0's failure)
            self.keep_finished_step(error)
            raise
        if run.finished(args.num_train_epochs) and not control.should_training_stop:
            # num_train_epochs reached (all samples, or all but a tail drop_last drops): stop as Trainer does
            # at max_steps, with the final save/eval of a steps strategy.
            control.should_training_stop = True
            if args.save_strategy == "steps":
                control.should_save = True
            if args.eval_strategy == "steps" and state.global_step % state.eval_steps != 0 and \
                    args.eval_delay <= state.global_step:
                control.should_evaluate = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer.batchpilot is not None:
            self.trainer.batchpilot.loader.close()  # stop dataloader workers now, not at garbage collection

    def on_evaluate(self, args, state, control, **kwargs):
        if self.trainer.batchpilot is not None:
            self.trainer.batchpilot.driver.start_clock()  # evaluation time is not training throughput

    on_save = on_evaluate


class SampleProgressCallback(ProgressCallback):
    """The training bar counts samples towards ``num_train_epochs * len(train_dataset)``.

    Steps have no fixed size, so a bar in steps has no honest total; samples do. Evaluation bars and log
    printing are the parent's.
    """

    def __init__(self, run_getter: Callable[[], Any]) -> None:
        super().__init__()
        self._run = run_getter
        self._seen = 0

    def on_train_begin(self, args, state, control, **kwargs):
        run = self._run()
        if run is None or run.total_samples is None:  # max_steps is set: the step count is exact
            return super().on_train_begin(args, state, control, **kwargs)
        self._seen = run.samples_seen
        self.current_step = state.global_step
        if state.is_world_process_zero:
            self.training_bar = tqdm(
                total=run.total_samples, initial=self._seen, unit="samples", unit_scale=True, dynamic_ncols=True
            )

    def on_step_end(self, args, state, control, **kwargs):
        run = self._run()
        if run is None or run.total_samples is None:
            return super().on_step_end(args, state, control, **kwargs)
        if state.is_world_process_zero and self.training_bar is not None:
            self.training_bar.update(run.samples_seen - self._seen)
            self.training_bar.set_postfix(step=state.global_step, batch_size=run.batch_size, refresh=False)
        self._seen = run.samples_seen
        self.current_step = state.global_step


def add_logs(logs: dict[str, float], run: HFRun | None) -> None:
    """Add ``train_coverage``, ``batch_size`` and ``samples_seen`` (with tokens: ``tokens``, ``tokens_seen``) to a
    training log (``epoch`` is already the coverage-based one), and count train speed in real samples."""
    if run is not None and "loss" in logs:
        logs["train_coverage"] = round(run.coverage, 6)
        logs["batch_size"] = run.last_step.global_size if run.last_step is not None else run.batch_size
        logs["samples_seen"] = run.samples_seen
        if run.tokens_seen is not None:  # batch_unit="tokens": the last step's tokens and all so far
            last = run.last_step.global_tokens if run.last_step is not None else None
            logs["tokens"] = last if last is not None else run.batch_size
            logs["tokens_seen"] = run.tokens_seen
        if run.coupling is not None:
            logs["lr_factor"] = run.step_lr_factor  # of the last step (logged learning_rate is unscaled)
        noise = None if run.stats is None else run.stats.stats.get("stats/noise_scale")
        if noise is not None:
            logs["noise_scale"] = round(noise, 3)  # B_simple (McCandlish et al. 2018), samples
    if run is not None and "train_runtime" in logs and logs["train_runtime"] > 0:
        seen = run.samples_seen - run.samples_at_start
        logs["train_samples_per_second"] = round(seen / logs["train_runtime"], 3)
