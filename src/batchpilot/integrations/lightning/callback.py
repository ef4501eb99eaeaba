"""`AdaptiveBatchSize`, the Lightning callback: what ``training_step`` reads from it, and hooks that delegate to
the loader (loader.py), a step's end (step.py), the trainer checks (checks.py) and the checkpoint (checkpoint.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from ..._validation import check_positive_int
from ...clipping import grad_norm
from ...controllers.boundary import needs_gradient_stats
from ...data.micro_batch import MicroBatch
from ...engine.driver import SizeDriver
from .._auto import auto_controller
from .._rank_shares import with_lead_share
from .._step_stats import StepStats, check_measurable
from .auto import resolve_auto, start_probes
from .checkpoint import StepStart
from .checks import check_batch_limit, check_fixed_accumulation, validate_at_epoch_end
from .loader import AdaptiveLoader, Fits
from .shares import FitShares
from .step import StepLosses, log_progress, mark_last_batch

__all__ = ["AdaptiveBatchSize"]

# What a training_step reads from the callback runs outside torch.compile: Lightning compiles training_step
# when given a compiled LightningModule, and dynamo would specialise on (or fail to trace) the sizes and
# weights, which change from one micro-batch to the next. Called from compiled code, these graph-break.
_eager = torch.compiler.disable


class AdaptiveBatchSize(Callback):
    """Drive the global batch size of a ``lightning.Trainer`` fit with any batchpilot controller.

    Args:
        controller: A batchpilot controller, a seed-003 callable ``(step, current_size) -> size``, or
            ``None`` (constant size, still with exact coverage and resumable data).
        batch_size: Global batch size of the first optimizer step (samples over all ranks), or ``"auto"``: the
            automatic mode (controller ``Auto()`` unless an ``Auto`` is given; at the start of the fit the start
            probes find the knee of the throughput curve and the LR there, see docs/integrations-lightning.md).
        min_batch_size, max_batch_size: Bounds every decision is clamped to.
        decide_every: Ask the controller after every ``decide_every``-th optimizer step.
        on_invalid: ``"raise"`` or ``"keep"`` for a controller that returns an unusable size.
        log: Log ``batch_size``, ``train_coverage``, ``samples_seen`` and a coverage-based ``epoch``
            (``samples_seen / len(dataset)``) after every optimizer step, and ``noise_scale`` when measured.
        noise_every: Measure the gradient noise scale (McCandlish et al. 2018) on every N-th step. Default:
            every 16th step when the controller reads gradient statistics (``NoiseScale``, ``Goodput``,
            ``VarianceRule``, ``ThresholdRules``), else never. The small batches are the micro-batches of a
            step and the ranks (no extra computation), so one process needs ``accumulate_grad_batches >= 2``;
            the statistics reach the controller in ``Observation.stats`` (``stats/*``, ``perf/*``).
        rank_weights: How each global batch is shared over the ranks: ``None`` (evenly), one positive weight per
            rank (shares proportional to them) or ``"auto"`` (from each rank's forward time per sample, re-estimated
            every 10 steps, agreed through rank 0; see docs/integrations-lightning.md). :meth:`weight` keeps the
            gradient the mean over the global batch whatever the shares.

    Raises:
        ValueError: invalid settings (all problems in one message); at the start of training, a controller
            that reads gradient statistics with one process and ``accumulate_grad_batches=1``, or fixed
            ``rank_weights`` of another length than the world size.
        TypeError: ``rank_weights`` is not ``None``, ``"auto"`` or a list of numbers.
    """

    def __init__(
        self,
        controller: Any = None,
        *,
        batch_size: int | str,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        decide_every: int = 1,
        on_invalid: str = "raise",
        log: bool = True,
        noise_every: int | None = None,
        rank_weights: str | Sequence[float] | None = None,
    ) -> None:
        controller, first_size = resolve_auto(controller, batch_size)  # "auto": Auto's min_size until the probes
        self.initial_batch_size: int = first_size
        self.driver = SizeDriver(  # validates now
            controller=controller, batch_size=first_size, min_batch_size=min_batch_size,
            max_batch_size=max_batch_size, decide_every=decide_every, on_invalid=on_invalid,
            num_samples=0, names=("controller", "batch_size"),
        )
        if noise_every is not None:
            check_positive_int(noise_every, "noise_every")
        self.noise_every = noise_every
        self._shares = FitShares(rank_weights)
        self._measure = noise_every is not None or needs_gradient_stats(self.driver.controller)
        self.stats: StepStats | None = None  # built at the start of training when measuring
        self._module: Any = None  # the LightningModule of the current fit
        self._stats_state: dict[str, Any] | None = None
        self._loader_state: dict[str, Any] | None = None  # a resumed data position for a loader built later
        self.log_progress = log
        self._fits = Fits()
        self._loader: AdaptiveLoader | None = None
        self._losses = StepLosses()
        self._inflight = 0  # samples of the step whose optimizer update ran but which is not counted yet
        self._step_start = StepStart()
        self.probing = False  # True while training_step runs for a start probe (batch_size="auto")
        self.probe_records: list[dict[str, Any]] = []  # the start probes' records (this fit's, when it probed)

    # ------------------------------------------------------------------ the loader
    def dataloader(
        self,
        dataset: Any,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
    ) -> AdaptiveLoader:
        """The training loader to return from ``train_dataloader()`` (or pass to ``fit``).

        Args: as for :class:`~batchpilot.AdaptiveDataLoader` (workers are persistent, so a size change is
        cheap). ``drop_last`` drops an epoch's final step when it is smaller than the decided size.
        """
        previous = self._loader
        self._loader = loader = AdaptiveLoader(
            self._fits,
            dataset,
            dict(shuffle=shuffle, seed=seed, drop_last=drop_last, num_workers=num_workers, collate_fn=collate_fn,
                 pin_memory=pin_memory, prefetch_factor=prefetch_factor),
            global_batch_size=self.initial_batch_size,
        )
        running = self._fits.running()
        reloaded = previous is not None and previous.built_for_this_fit() is not None and running
        resuming = previous is None or (running and self._fits.restored == self._fits.number)
        loader.continue_from(previous, reloaded=reloaded, resumed=self._loader_state if resuming else None)
        self.driver.num_samples = len(dataset)
        return self._loader

    # ------------------------------------------------------------------ what the training step may read
    @property
    @_eager
    def batch_size(self) -> int:
        """Global batch size of the next optimizer step."""
        return self.initial_batch_size if self._loader is None else self._loader.batch_size

    @property
    def probe(self) -> Any:
        """What the start probes found (``batch_size="auto"``: ``Auto``'s
        :class:`~batchpilot.controllers.auto.ProbeResult`, kept in checkpoints), or ``None``."""
        return getattr(self.driver.controller, "probe", None)

    @property
    @_eager
    def micro_batch(self) -> MicroBatch | None:
        """The micro-batch being trained (indices, sizes, ghost flag), or ``None`` outside training."""
        return None if self._loader is None else self._loader.current

    @property
    @_eager
    def local_batch_size(self) -> int:
        """Samples of this rank in the current micro-batch (0 for a ghost): the ``batch_size=`` for
        ``self.log`` so epoch-level means weight every sample once."""
        micro = self.micro_batch
        return 0 if micro is None else micro.size

    @property
    @_eager
    def loss_weight(self) -> float:
        """The factor :meth:`weight` multiplies by: ``n * world_size * accumulate_grad_batches / B``
        (Lightning divides by the accumulation, DDP averages over ranks); 0 for a ghost micro-batch."""
        micro = self.micro_batch
        if micro is None:
            return 1.0
        _, world_size, accumulation_steps = self._fits.placement()
        return micro.size * world_size * accumulation_steps / micro.global_size

    @_eager
    def weight(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss * loss_weight`` from ``training_step`` to make each optimizer step's gradient the
        mean over its global batch, whatever the split; ``loss`` is the micro-batch's mean loss (also what
        the controller's loss history records). Without it every micro-batch counts equally, which differs
        when shares are uneven (by one sample, or by ``rank_weights``) and for a ghost micro-batch at an epoch's end."""
        micro = self.micro_batch
        if micro is not None and micro.size:
            self._losses.record(loss)
        return loss * self.loss_weight

    @property
    def rank_weights(self) -> tuple[float, ...] | None:
        """The weights the next global batches are shared by over the ranks (``None``: evenly)."""
        loader = None if self._loader is None else self._loader.built_for_this_fit()
        return None if loader is None else loader.sampler.rank_weights

    @property
    @_eager
    def samples_seen(self) -> int:
        """Samples of completed optimizer steps, over all ranks."""
        return self.driver.samples_seen

    def lr_lambda(self, fn: Callable[[int], float]) -> Callable[[int], float]:
        """A ``LambdaLR`` multiplier on samples: ``fn(samples seen once the current step is done)``.

        Steps have no fixed size, so a schedule over steps has no fixed length; one over samples does.
        Use with ``interval="step"``::

            LambdaLR(optimizer, adaptive.lr_lambda(batchpilot.lr.warmup_cosine(2_000, epochs * len(train_set))))
        """
        return lambda _step: fn(self.driver.samples_seen + self._inflight)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._fits.trainer = trainer
        if stage == TrainerFn.FITTING:
            self._fits.number += 1
            self._step_start.loaded_rng = None  # set again by on_load_checkpoint when this fit resumes one

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._loader is None:
            raise RuntimeError(
                "AdaptiveBatchSize has no loader: return adaptive.dataloader(dataset) from train_dataloader() "
                "(or pass it to trainer.fit) so the callback can set the batch size."
            )
        self.driver.rank = trainer.global_rank  # only rank 0 asks the controller
        # A step a previous fit left unfinished (a stop inside it) runs again from its first micro-batch.
        self._losses.clear()
        self._inflight = 0
        self._step_start.end()
        self.driver.min_useful = trainer.world_size * trainer.accumulate_grad_batches
        self.driver.start_clock()
        check_batch_limit(trainer)
        validate_at_epoch_end(trainer)
        check_fixed_accumulation(trainer, self._loader.built_for_this_fit())
        self._shares.start(trainer, pl_module.device, self._loader.loader)  # rank_weights: this fit's loader and ranks
        if auto_controller(self.driver.controller) is not None:
            start_probes(self, trainer, pl_module)  # batch_size="auto": start at the knee with the found LR
            self.driver.start_clock()  # the probes' time is not the first step's
        self._measure_this_fit(trainer, pl_module)

    def _measure_this_fit(self, trainer: Any, pl_module: Any) -> None:
        """Build the gradient statistics at the first fit, and again when a later fit trains other parameters
        (another module): the estimate carries over, as the controller's state does."""
        params = [p for p in pl_module.parameters() if p.requires_grad]
        self._module = pl_module  # this fit's: the statistics re-read its trainable parameters at measured steps
        if self._measure and (self.stats is None or not self.stats.probe.measures(params)):
            check_measurable(trainer.world_size, trainer.accumulate_grad_batches,
                             manual=not pl_module.automatic_optimization)
            carried = self._stats_state if self.stats is None else self.stats.state_dict()
            self.stats = StepStats(params, world_size=trainer.world_size,
                                   accumulation_steps=trainer.accumulate_grad_batches, every=self.noise_every,
                                   params_of=lambda: [p for p in self._module.parameters() if p.requires_grad])
            if carried is not None:
                self.stats.load_state_dict(carried)
        if self.stats is not None:
            self.stats.attach(trainer.strategy.model)  # the DDP wrapper, when there is one

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        validate_at_epoch_end(trainer)  # (re)loading dataloaders recomputes Lightning's schedule
        check_fixed_accumulation(trainer, None if self._loader is None else self._loader.built_for_this_fit())

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        micro = self.micro_batch
        if micro is None or self._loader is None:
            return
        if micro.is_last and micro.offset + micro.global_size >= self._loader.loader.sampler.num_samples:
            mark_last_batch(trainer)  # this step completes the epoch: Lightning's own "last batch"
        if micro.micro_index == 0:
            self._step_start.begin(trainer, pl_module.device)
        self._shares.forward_starts(micro)  # rank_weights="auto": this rank's forward time per sample
        if self.stats is not None:
            if micro.micro_index == 0:
                self.stats.begin_step(self.driver.step, micro.global_size, self.driver.num_samples)
            self.stats.begin_micro()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        micro = self.micro_batch
        if micro is not None:
            self._shares.forward_ends(micro)

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        micro = self.micro_batch
        if micro is None or self.stats is None:
            return
        world_size, accumulation_steps = trainer.world_size, trainer.accumulate_grad_batches
        # weight() scaled the loss by n W A / B and Lightning divides by A: the .grad increment is W n / B
        # times the micro-batch's mean gradient; without weight() it is 1 / A times it.
        weighted = self._losses.recorded is not None
        to_mean = world_size * micro.size / micro.global_size if weighted else 1.0 / accumulation_steps
        if micro.size:
            self.stats.end_micro(micro.size)
        # fp16: .grad holds the scaled gradient
        self.stats.after_micro(micro.size, micro.is_last, to_mean, getattr(trainer.precision_plugin, "scaler", None))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        micro = self.micro_batch
        self._inflight = 0 if micro is None else micro.global_size  # LR schedulers step before batch end
        if self.stats is not None and self.stats.measuring:  # reduced over ranks and unscaled, not yet clipped
            norm = grad_norm(self.stats.probe.params)
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
                # A fused optimizer unscales inside its step, so Lightning left .grad scaled (fp16).
                norm /= float(scaler.get_scale())
            self.stats.reduced(norm)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        micro = self.micro_batch
        if micro is None or self._loader is None:
            return
        self._losses.add(micro, outputs, self._fits.placement()[2])
        if not micro.is_last:
            return
        step_loss = self._losses.mean()
        self.driver.end_step(micro.global_size, step_loss)
        self._inflight = 0
        stats = None if self.stats is None else self.stats.end_step(self.driver.step, step_loss)
        stats = with_lead_share(stats, self._loader.loader.sampler.rank_weights, trainer.world_size)
        # The step is counted: a checkpoint from here on is at a step boundary, with the position past it; also
        # one that ModelCheckpoint(save_on_exception=True) saves when the controller below fails.
        self._step_start.end()
        self._loader.step_counted()
        loader = self._loader.loader
        epoch, offset, _ = loader.position()
        num_samples = loader.sampler.num_samples
        decided = self.driver.decide(loader.batch_size, epoch=epoch, coverage=offset / num_samples, stats=stats)
        loader.set_batch_size(decided)
        self._shares.after_step(self.driver.step, loader)  # every rank, every step ("auto": a collective when due)
        if self.log_progress:
            log_progress(pl_module, micro, coverage=offset / num_samples, samples_seen=self.driver.samples_seen,
                         num_samples=num_samples, stats=stats)
        if loader.position()[0] > micro.epoch:
            mark_last_batch(trainer)  # the epoch is covered (marked already when the step began)
        elif loader.sampler.drop_last and num_samples - offset < decided:
            # Its tail will be dropped: the epoch is over, which Lightning learns only now, after the point
            # where it steps epoch-interval LR schedulers at an epoch's last batch; step them here.
            mark_last_batch(trainer)
            trainer.fit_loop.epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._loader is not None:
            self._loader.close()  # stop dataloader workers now, not at garbage collection

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)  # the fit is over: its workers stop too (the position is kept)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.driver.start_clock()  # validation time is not training throughput

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The driver's counters, the controller's state, the gradient statistics' and the data position.

        Lightning also saves the loader's own state, but restores it only when it resumes inside an epoch;
        from a checkpoint saved at an epoch's end (``ModelCheckpoint``'s default) it would replay the first
        epoch's order at the first size. The position kept here covers every case.
        """
        stats = self.stats.state_dict() if self.stats is not None else self._stats_state
        loader = self._loader_state if self._loader is None else self._loader.saved_state()
        return {"driver": self.driver.state_dict(), "stats": stats, "loader": loader,
                "rank_weights": self._shares.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (Lightning calls it when resuming from a checkpoint)."""
        self.driver.load_state_dict(state_dict["driver"])
        self._stats_state = state_dict.get("stats")
        if self.stats is not None and self._stats_state is not None:
            self.stats.load_state_dict(self._stats_state)
        self._loader_state = state_dict.get("loader")  # absent in checkpoints saved before it was kept here
        self._shares.load_state_dict(state_dict.get("rank_weights"))
        self._fits.restored = self._fits.number
        if self._loader_state is not None and self._loader is not None:
            self._loader.load_state_dict(self._loader_state)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Keep the checkpoint's generator states for the resumed fit's first step (absent in checkpoints of
        batchpilot versions before they were saved: the generators are left as they are)."""
        self._step_start.load(checkpoint)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Make the checkpoint's loop counters say where its data position, weights and optimizer are.

        Inside a step (a save from a micro-batch, an exception, a stop or a signal), the batch counters go
        back to the step's first micro-batch: the resumed fit runs the whole step again, its micro-batches
        in line with ``accumulate_grad_batches``. At the end of an epoch that Lightning cut short
        (``max_steps``, ``should_stop``) or after such a fit, the epoch is recorded as unfinished: the resumed
        fit continues it, where Lightning would start the next epoch while the data is inside this one.

        The checkpoint also gets every rank's generator states (torch's, numpy's, Python's; a collective, as
        Lightning's save is), torch's as of the step's start when the save falls inside a step. Lightning saves
        none: without them a resumed fit draws other dropout masks than the uninterrupted one.
        """
        self._step_start.save(trainer, pl_module.device, checkpoint)
