"""One optimizer step of the Hugging Face integration: its micro-batches' forward/backward passes, each weighted
by its share of the global batch, and (``oom_recovery``) the step run again in smaller passes after running out
of memory."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...engine.replay import error_summary, is_out_of_memory
from .._step_stats import StepStats
from .data import mask_labels, split_rows
from .run import HFRun, StepRecord
from .tokens import token_pieces

logger = logging.getLogger("batchpilot")


def loss_owns_scaling(trainer: Any) -> bool:
    """Whether the loss is normalised by ``num_items_in_batch`` (Trainer counts the items; no divisors then)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)  # transformers >= 5.x added this switch
    if scaled is not None:
        return bool(scaled)
    return getattr(trainer, "compute_loss_func", None) is not None


def step_stats(model: torch.nn.Module | None, *, world_size: int, accumulation_steps: int, every: int | None,
               splits_measured_steps: bool) -> StepStats:
    """The gradient statistics of ``model``'s trainable parameters (re-read at each measured step).

    Raises:
        ValueError: no model to train.
    """
    if model is None:
        raise ValueError("AdaptiveBatchSizeTrainer has no model to train; pass model= (or model_init=).")

    def trainable() -> list[torch.nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    return StepStats(trainable(), world_size=world_size, accumulation_steps=accumulation_steps, every=every,
                     splits_measured_steps=splits_measured_steps, params_of=trainable)


class StepPasses:
    """The forward/backward passes of the optimizer step in flight, one ``training_step`` call per micro-batch.

    Args:
        trainer: The trainer (its ``args``, ``accelerator``, ``data_parallel_size``; the loss divisor goes to its
            ``current_gradient_accumulation_steps``, which ``Trainer.training_step`` divides the loss by).
        train_pass: ``Trainer.training_step``: one forward/backward.
        oom_recovery: Run a step that ran out of memory again, from its first micro-batch, in smaller passes.
        split_measured: One process, one micro-batch per step: a measured step's micro-batch runs as two
            passes, the two small batches of the noise scale (as Pilot splits measured steps).

    Attributes:
        ghost: The pass in flight is a ghost micro-batch's (``compute_loss`` multiplies its loss by 0).
        grad_norm: The last step's reduced gradient norm before clipping (``None`` when Trainer does not clip).
    """

    def __init__(self, trainer: Any, train_pass: Callable[..., torch.Tensor], *, oom_recovery: bool,
                 split_measured: bool) -> None:
        self.trainer = trainer
        self._train_pass = train_pass
        self.oom_recovery = oom_recovery
        self.split_measured = split_measured
        # (loss divisor, micro-batch size, is_last, its rows' tokens or None) of each micro-batch of the step in
        # flight (sizes in the batch unit: samples, or tokens), its inputs, the next
        self._plan: list[tuple[float, int, bool, Any]] = []
        self._inputs: list[Any] = []
        self._next = 0
        self._failed_rows = 0
        self.ghost = False
        self.grad_norm: float | None = None
        # The pass in flight when rank_weights="auto" times its forward: (the run's shares, samples, step's first?)
        self._timed: tuple[Any, int, bool] | None = None

    @property
    def planned(self) -> bool:
        """Whether the next ``training_step`` is a micro-batch of the step in flight."""
        return self._next < len(self._plan)

    def begin(self, run: HFRun, micro: list[Any], model_wrapped: Any) -> tuple[list[Any], list[Any] | None]:
        """Plan the step made of ``micro``: its inputs for Trainer, and (a loss normalised by
        ``num_items_in_batch``) the inputs whose items Trainer counts, ghosts' labels masked; else ``None``."""
        lengths = run.lengths  # batch_unit="tokens": each row's tokens weight its pass
        self._plan = [(d, m.units, m.is_last, None if lengths is None or m.ghost else lengths[m.indices])
                      for d, m in zip(run.begin_step(micro), micro)]
        self._next = 0
        if run.stats is not None:
            run.stats.attach(model_wrapped)  # DDP exists by now (Trainer wraps after on_train_begin)
            run.stats.begin_step(run.driver.step, micro[0].global_units, run.driver.num_samples)
        data = [m.data for m in micro]
        owns_scaling = loss_owns_scaling(self.trainer)
        if owns_scaling:  # a loss normalised by num_items_in_batch: ghosts' integer labels -100 add no loss
            data = [mask_labels(d) if m.ghost else d for d, m in zip(data, micro)]
        self._inputs = data  # Trainer holds them for the step too; a replay after running out of memory reads them
        if not owns_scaling:
            return data, None  # the divisors weight each micro-batch (micro_batch)
        # Count the items without the ghosts, float labels too (compute_loss multiplies a ghost's loss by 0).
        return data, [mask_labels(d, floats=True) if m.ghost else d for d, m in zip(data, micro)]

    def micro_batch(self, run: HFRun, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any) -> torch.Tensor:
        """The next micro-batch's forward/backward passes; after running out of memory (``oom_recovery``) the
        step again from its first micro-batch, in smaller passes. Returns its weighted loss."""
        current = self._next
        first = current  # after running out of memory: the step again from its first micro-batch
        while True:
            error = None
            try:
                for k in range(first, current + 1):
                    loss = self._passes(run, model, inputs if k == current else self._inputs[k],
                                        num_items_in_batch, self._plan[k], first=k == 0)
                    if k < current:
                        run.add_loss(loss)  # a replayed micro-batch: Trainer already has its loss
            except Exception as exc:
                if not (self.oom_recovery and is_out_of_memory(exc)):
                    raise
                error = error_summary(exc)
            if error is None:
                break
            self._replay(run, model, error)  # outside the except: the failed attempt's frames are gone
            first = 0
        self._next = current + 1
        run.add_loss(loss)
        return loss

    def _passes(self, run: HFRun, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any,
                plan: tuple[float, int, bool, Any], *, first: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch, in passes of at most ``run.max_micro_batch_size`` rows
        (and ``run.max_micro_batch_tokens`` tokens; ``first``: the step's first micro-batch)."""
        step = _active(run)
        trainer = self.trainer
        micro_batch_size, last, row_tokens = plan[1], plan[2], plan[3]
        divisor = None if loss_owns_scaling(trainer) else plan[0]
        stats = run.stats
        max_rows = run.max_micro_batch_size
        rows = split_rows(inputs, None)[0][1]
        if stats is not None and stats.measuring and self.split_measured and rows >= 2:
            max_rows = min(max_rows or rows, -(-rows // 2))  # the step's only micro-batch: two passes, two small ones
        if row_tokens is None:
            pieces = split_rows(inputs, max_rows)
            units = [n for _, n in pieces]  # a piece's share of the micro-batch, in rows
        else:  # batch_unit="tokens": passes balanced in tokens, each weighted by its tokens
            pieces = split_rows(inputs, None, token_pieces(row_tokens, max_rows, run.max_micro_batch_tokens))
            cumulative = np.concatenate([[0], np.cumsum(row_tokens)])
            units = np.diff(cumulative[np.cumsum([0] + [n for _, n in pieces])]).tolist()
        total = sum(units)
        loss: torch.Tensor | None = None
        for i, (part, n) in enumerate(pieces):
            if divisor is not None:
                # Trainer divides the loss by this number: B / (W * m) weights the micro-batch's m rows (tokens) by
                # their share of the global batch; a piece of n of them carries n / m of it.
                trainer.current_gradient_accumulation_steps = divisor * total / units[i] if len(pieces) > 1 \
                    else divisor
            if stats is not None:
                stats.begin_micro()
            # All pieces but the last accumulate without DDP's all-reduce (the last one does what Trainer set).
            sync = trainer.accelerator.no_sync(model) if i < len(pieces) - 1 else contextlib.nullcontext()
            self._failed_rows = n
            self.ghost = micro_batch_size == 0
            # Samples (tokens), not rows: a padding-free collator packs a micro-batch into one row (rows are samples
            # only where the micro-batch was split into passes). A ghost's borrowed row is no sample.
            own = (micro_batch_size if len(pieces) == 1 else units[i]) if micro_batch_size else 0
            if run.shares is not None and run.shares.timed:
                self._timed = (run.shares, own, first and i == 0)  # compute_loss times the forward
            try:
                with sync:
                    piece_loss = self._train_pass(model, part, num_items_in_batch)
            finally:
                self.ghost = False
                self._timed = None
            if stats is not None:
                if own:
                    stats.end_micro(own)
                # Each pass is a small batch of the noise scale. Trainer divided its loss by B / (W n): the .grad
                # increment is W n / B times its mean gradient (fp16: .grad also holds the loss scale).
                to_mean = trainer.data_parallel_size * own / step.global_units
                stats.after_micro(own, last and i == len(pieces) - 1, to_mean,
                                  getattr(trainer.accelerator, "scaler", None))
            loss = piece_loss if loss is None else loss + piece_loss
        assert loss is not None  # split_rows returns at least one piece
        return loss

    def forward_starts(self) -> bool:
        """``compute_loss`` starts a planned pass's forward: time it for ``rank_weights="auto"`` (the forward
        only: under DDP the last backward also waits for the slowest rank in the all-reduce). Returns whether
        :meth:`forward_ends` must be called."""
        if self._timed is None:
            return False
        shares, _, first = self._timed
        shares.forward_starts(first)
        return True

    def forward_ends(self) -> None:
        """The forward timed by :meth:`forward_starts` returned its loss."""
        if self._timed is not None:
            shares, samples, _ = self._timed
            shares.forward_ends(samples)

    def _replay(self, run: HFRun, model: torch.nn.Module, error: str) -> None:
        """Drop the step's gradients and lower the pass bound to half the rows that failed."""
        _active(run)
        failed = self._failed_rows
        if failed <= 1:
            raise RuntimeError(
                f"a forward/backward of one row ran out of memory ({error}); there is nothing left to split. "
                "Use mixed precision (bf16=True / fp16=True), gradient checkpointing, a smaller model or more memory."
            )
        old, max_rows = run.max_micro_batch_size, failed // 2
        run.restart_step(max_rows)
        model.zero_grad(set_to_none=True)  # the optimizer's zero_grad is a no-op between accumulation steps
        if self.trainer.args.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the failed attempt's cached blocks back before the retry
        logger.warning("step %d ran out of memory with %d rows per forward/backward (%s); running it again with "
                       "at most %d (max_micro_batch_size was %s)", run.driver.step + 1, failed, error, max_rows, old)

    def reduced(self, run: HFRun | None, grad_norm: Any) -> None:
        """Trainer computed the step's reduced gradient norm (before clipping): keep it, and feed the statistics."""
        self.grad_norm = float(grad_norm) if grad_norm is not None else None
        if run is not None and run.stats is not None:
            run.stats.reduced(self.grad_norm)


def _active(run: HFRun) -> StepRecord:
    """The step in flight, inside a training step that batchpilot planned."""
    if run.inflight is None:
        raise RuntimeError("internal error: a batchpilot training step ran outside a planned step")
    return run.inflight
