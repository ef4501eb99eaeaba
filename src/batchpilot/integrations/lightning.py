"""`AdaptiveBatchSize`: a Lightning callback whose controller sets the global batch size of every step.

::

    adaptive = AdaptiveBatchSize(LinearIncrease(start=32, increment=32, interval=100, max_size=512), batch_size=32)

    class Model(lightning.LightningModule):
        def train_dataloader(self):
            return adaptive.dataloader(train_set, num_workers=2)        # resumable, exact coverage
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss, batch_size=adaptive.local_batch_size)
            return adaptive.weight(loss)          # optional: the exact global-batch mean gradient

    lightning.Trainer(max_epochs=5, callbacks=[adaptive]).fit(Model())

Sizes are global (samples per optimizer step over all ranks); each rank gets its contiguous share, split
into ``accumulate_grad_batches`` micro-batches. Rank 0 decides after every optimizer step, every rank
applies the broadcast value, and the next step has exactly that size (the loader reports a length, an
upper bound of the epoch's batches, so Lightning does not read a batch ahead; the callback marks the
epoch's real last batch). The loader has ``state_dict``/``load_state_dict``, so a mid-epoch checkpoint
resumes with the same remaining samples and sizes; the controller is saved as the callback's state. A
checkpoint saved inside a step resumes from that step's first micro-batch, and one saved at the end of an
epoch that Lightning cut short (``max_steps``, a stop) resumes inside that epoch. Checkpoints also carry every
rank's generator states, which Lightning does not save, so dropout draws resume exactly too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ._require import require

require("lightning", "lightning", what="batchpilot.integrations.lightning")

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_warn

from .. import distributed as bpdist
from .._validation import check_positive_int
from ..clipping import grad_norm
from ..controllers.boundary import needs_gradient_stats
from ..data.loader import AdaptiveDataLoader, MicroBatch
from ..engine.driver import SizeDriver
from ..measure import read_scalars
from ..rng import gather_rng_states, restore_rng_states, set_torch_rng, torch_rng
from ._step_stats import StepStats, check_measurable

__all__ = ["AdaptiveBatchSize", "AdaptiveLoader"]

_COUNTERS = ("ready", "started", "processed", "completed")  # of a Lightning progress tracker
_RNG_KEY = "batchpilot_rng"  # the checkpoint's entry for every rank's generator states

# What a training_step reads from the callback runs outside torch.compile: Lightning compiles training_step
# when given a compiled LightningModule, and dynamo would specialise on (or fail to trace) the sizes and
# weights, which change from one micro-batch to the next. Called from compiled code, these graph-break.
_eager = torch.compiler.disable


class AdaptiveLoader:
    """The training loader :meth:`AdaptiveBatchSize.dataloader` returns (an iterable, not a DataLoader).

    Built on first use in each fit, once the callback knows the rank, the world size and
    ``accumulate_grad_batches``. Iterating yields the collated micro-batches of the rest of the current epoch.
    ``len()`` is an upper bound (every step takes at least one sample), which keeps Lightning from prefetching
    a batch whose size would then be stale. Lightning leaves non-DataLoader iterables alone under DDP (no
    DistributedSampler): the sampler hands each rank its share itself.
    """

    def __init__(self, callback: AdaptiveBatchSize, dataset: Any, options: dict[str, Any]) -> None:
        self._callback = callback
        self.dataset = dataset
        self._options = options
        self._loader: AdaptiveDataLoader | None = None
        self._fit = 0  # the callback's fit number when the loader was built
        self._pending_state: dict[str, Any] | None = None
        self._first_batch_size = callback.initial_batch_size  # of the first step, when there is no state to load
        self.current: MicroBatch | None = None
        # The position at the start of the step in flight (its first micro-batch was yielded, the callback has
        # not counted it yet): what a checkpoint saved inside the step must hold.
        self._step_start: dict[str, Any] | None = None

    @property
    def loader(self) -> AdaptiveDataLoader:
        """The underlying :class:`~batchpilot.AdaptiveDataLoader` (built on first access in each fit)."""
        if self._loader is not None and self._fit != self._callback._fit:  # built for an earlier fit
            self._pending_state = self._saved_state()
            self._loader.close()
            self._loader = None  # rebuilt: this fit may have another rank, world size or accumulation
        if self._loader is None:
            rank, world, accumulation = self._callback._placement()
            self._loader = AdaptiveDataLoader(
                self.dataset, self._first_batch_size, rank=rank, world_size=world,
                accumulation_steps=accumulation, **self._options,
            )
            self._fit = self._callback._fit
            if self._pending_state is not None:
                self._loader.load_state_dict(self._pending_state)
                self._pending_state = None
            self._step_start = None
        return self._loader

    def _built_for_this_fit(self) -> AdaptiveDataLoader | None:
        """The underlying loader if the fit now set up (or the last one) built it, else ``None``."""
        return self._loader if self._loader is not None and self._fit == self._callback._fit else None

    @property
    def batch_size(self) -> int:
        """Global size of the next step."""
        if self._pending_state is not None:
            return int(self._pending_state["batch_size"])
        return self._first_batch_size if self._loader is None else self._loader.batch_size

    def __len__(self) -> int:
        return len(self.dataset) * self._callback._placement()[2]

    def __iter__(self) -> Iterator[Any]:
        if self._callback._trainer is None:
            raise RuntimeError(
                "this loader's AdaptiveBatchSize callback is not in the Trainer, so nothing would set the batch "
                "size: pass callbacks=[adaptive] to the Trainer (the callback whose dataloader() made the loader)."
            )
        loader = self.loader
        if self._step_start is not None:  # the last loop stopped inside a step: that step runs again, whole
            loader.load_state_dict(self._step_start)
            self._step_start = None
        micro_batches = iter(loader)
        start = loader.state_dict()  # read before each step's first micro-batch is fetched
        for micro in micro_batches:
            if micro.micro_index == 0:
                self._step_start = start
            self.current = micro
            yield micro.data
            if micro.is_last:
                start = loader.state_dict()

    def _saved_state(self) -> dict[str, Any] | None:
        """What :meth:`state_dict` returns, without building the loader: ``None`` if never built nor loaded."""
        state = self._step_start or self._pending_state
        if state is None and self._loader is not None:
            state = self._loader.state_dict()
        return None if state is None else dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Position at the first unconsumed step and the next size (JSON-serialisable); inside a step, the
        position at its start."""
        return self._saved_state() or self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (possibly saved under another world size)."""
        self._step_start = None
        if self._built_for_this_fit() is not None:
            self.loader.load_state_dict(state)
        else:
            self._pending_state = dict(state)


class AdaptiveBatchSize(Callback):
    """Drive the global batch size of a ``lightning.Trainer`` fit with any batchpilot controller.

    Args:
        controller: A batchpilot controller, a seed-003 callable ``(step, current_size) -> size``, or
            ``None`` (constant size, still with exact coverage and resumable data).
        batch_size: Global batch size of the first optimizer step (samples over all ranks).
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

    Raises:
        ValueError: invalid settings (all problems in one message); at the start of training, a controller
            that reads gradient statistics with one process and ``accumulate_grad_batches=1``.
    """

    def __init__(
        self,
        controller: Any = None,
        *,
        batch_size: int,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        decide_every: int = 1,
        on_invalid: str = "raise",
        log: bool = True,
        noise_every: int | None = None,
    ) -> None:
        self.initial_batch_size = batch_size
        self._settings = dict(
            controller=controller, batch_size=batch_size, min_batch_size=min_batch_size,
            max_batch_size=max_batch_size, decide_every=decide_every, on_invalid=on_invalid,
        )
        self.driver = SizeDriver(num_samples=0, names=("controller", "batch_size"), **self._settings)  # validates now
        if noise_every is not None:
            check_positive_int(noise_every, "noise_every")
        self.noise_every = noise_every
        self._measure = noise_every is not None or needs_gradient_stats(self.driver.controller)
        self.stats: StepStats | None = None  # built at the start of training when measuring
        self._module: Any = None  # the LightningModule of the current fit
        self._stats_state: dict[str, Any] | None = None
        self._loader_state: dict[str, Any] | None = None  # a resumed data position for a loader built later
        self._fit = 0  # trainer.fit calls set up so far: a loader is built anew in each fit
        self._restored_fit = -1  # the fit whose set-up restored the callback's state (load_state_dict)
        self.log_progress = log
        self._trainer: Any = None
        self._loader: AdaptiveLoader | None = None
        # This step's micro-batch losses (detached tensors, read once the step ends: on a GPU a float() here
        # would wait for each forward before its backward is queued), their factor, and their samples.
        self._step_losses: list[tuple[torch.Tensor, float, int]] = []
        self._inflight = 0  # samples of the step whose optimizer update ran but which is not counted yet
        # Lightning's batch counters (over the fit, in the epoch) before the first micro-batch of the step in
        # flight; None between steps. A checkpoint saved inside a step goes back to them.
        self._step_counters: dict[str, int] | None = None
        self._raw_loss: torch.Tensor | None = None  # the current micro-batch's mean loss, recorded by weight()
        # torch's RNG at the start of the step in flight (a checkpoint saved inside the step keeps that), and
        # the generator states of a loaded checkpoint, restored when the resumed fit's first step starts.
        self._step_rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._loaded_rng: list[dict[str, Any]] | None = None

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
            self,
            dataset,
            dict(shuffle=shuffle, seed=seed, drop_last=drop_last, num_workers=num_workers, collate_fn=collate_fn,
                 pin_memory=pin_memory, prefetch_factor=prefetch_factor),
        )
        fitting = self._fitting()
        if previous is not None and previous._built_for_this_fit() is not None and fitting:
            # Reloaded during the fit (reload_dataloaders_every_n_epochs): the data position carries over.
            if len(dataset) != len(previous.dataset):
                raise ValueError(
                    f"the reloaded training dataset has {len(dataset)} samples, the previous one {len(previous.dataset)}: "
                    "the data position (which samples this epoch has covered) cannot carry over to another dataset "
                    "within a fit; reload the same dataset (reload_dataloaders_every_n_epochs), or train on the new "
                    "one in a later trainer.fit, which starts its first epoch."
                )
            loader.load_state_dict(previous.state_dict())
        elif self._loader_state is not None and (previous is None or (fitting and self._restored_fit == self._fit)):
            loader.load_state_dict(self._loader_state)  # resuming: the position restored with the callback's state
        elif previous is not None and (state := previous._saved_state()) is not None:
            # A later fit: on a dataset of the same length it continues where the last one left the data, on
            # another it starts that dataset's first epoch at the size decided last.
            if len(dataset) == len(previous.dataset):
                loader.load_state_dict(state)
            else:
                loader._first_batch_size = int(state["batch_size"])
        if previous is not None and previous._loader is not None:
            previous._loader.close()  # its workers stop now, not at a cyclic garbage collection
        self.driver.num_samples = len(dataset)
        return self._loader

    def _placement(self) -> tuple[int, int, int]:
        """(rank, world size, accumulate_grad_batches) from the trainer, else from torch.distributed."""
        if self._trainer is not None:
            return self._trainer.global_rank, self._trainer.world_size, self._trainer.accumulate_grad_batches
        rank, world = bpdist.rank_and_world()
        return rank, world, 1

    # ------------------------------------------------------------------ what the training step may read
    @property
    @_eager
    def batch_size(self) -> int:
        """Global batch size of the next optimizer step."""
        return self.initial_batch_size if self._loader is None else self._loader.batch_size

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
        _, world, accumulation = self._placement()
        return micro.size * world * accumulation / micro.global_size

    @_eager
    def weight(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss * loss_weight`` from ``training_step`` to make each optimizer step's gradient the
        mean over its global batch, whatever the split; ``loss`` is the micro-batch's mean loss (also what
        the controller's loss history records). Without it every micro-batch counts equally, which differs
        only when shares are uneven (by at most one sample) or for a ghost micro-batch at an epoch's end."""
        micro = self.micro_batch
        if micro is not None and micro.size:
            self._raw_loss = loss.detach()
        return loss * self.loss_weight

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
        self._trainer = trainer
        if stage == TrainerFn.FITTING:
            self._fit += 1
            self._loaded_rng = None  # set again by on_load_checkpoint when this fit resumes one

    def _fitting(self) -> bool:
        """Whether a ``trainer.fit`` with this callback is running (set up and not yet ended)."""
        state = None if self._trainer is None else self._trainer.state
        return state is not None and state.fn == TrainerFn.FITTING and state.status == TrainerStatus.RUNNING

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._loader is None:
            raise RuntimeError(
                "AdaptiveBatchSize has no loader: return adaptive.dataloader(dataset) from train_dataloader() "
                "(or pass it to trainer.fit) so the callback can set the batch size."
            )
        self.driver.rank = trainer.global_rank  # only rank 0 asks the controller
        # A step a previous fit left unfinished (a stop inside it) runs again from its first micro-batch.
        self._step_losses, self._raw_loss, self._inflight, self._step_counters = [], None, 0, None
        self.driver.min_useful = trainer.world_size * trainer.accumulate_grad_batches
        self.driver.start_clock()
        self._check_batch_limit(trainer)
        self._validate_at_epoch_end(trainer)
        self._check_fixed_accumulation(trainer)
        params = [p for p in pl_module.parameters() if p.requires_grad]
        self._module = pl_module  # this fit's: the statistics re-read its trainable parameters at measured steps
        if self._measure and (self.stats is None or not self.stats.probe.measures(params)):
            # Built at the first fit, and again when a later fit trains other parameters (another module): the
            # estimate carries over, as the controller's state does.
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
        self._validate_at_epoch_end(trainer)  # (re)loading dataloaders recomputes Lightning's schedule
        self._check_fixed_accumulation(trainer)

    def _check_fixed_accumulation(self, trainer: Any) -> None:
        """The loader splits each step into ``accumulate_grad_batches`` micro-batches when it is built, and the
        loss weights assume that split: a run must keep one value (GradientAccumulationScheduler changes it)."""
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        built = None if self._loader is None else self._loader._built_for_this_fit()
        if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks) or \
                (built is not None and built.accumulation_steps != trainer.accumulate_grad_batches):
            raise ValueError(
                "accumulate_grad_batches changes during the run (GradientAccumulationScheduler), but each step's "
                "split into micro-batches is fixed when the loader is built: keep one accumulate_grad_batches for "
                "the run (the controller is what changes the batch size)."
            )

    @staticmethod
    def _check_batch_limit(trainer: Any) -> None:
        """``limit_train_batches`` counts micro-batches: a fraction of an epoch's batches has no meaning when
        their number changes, and an int must end on a step boundary (else Lightning steps on a partial
        accumulation and the next epoch replays part of it)."""
        limit, accumulation = trainer.limit_train_batches, trainer.accumulate_grad_batches
        if isinstance(limit, float) and limit not in (0.0, 1.0):  # 0.0 skips training, 1.0 is every batch
            raise ValueError(
                f"limit_train_batches={limit} is a fraction of the epoch's batches, and their number changes with "
                "the batch size; pass an int (micro-batches per epoch, a multiple of accumulate_grad_batches) or "
                "bound the run with max_steps."
            )
        if isinstance(limit, int) and limit % accumulation and trainer.fast_dev_run:
            raise ValueError(
                f"fast_dev_run trains {limit} batch(es), which is not a multiple of accumulate_grad_batches="
                f"{accumulation}: the optimizer step would be cut short; use fast_dev_run={accumulation}."
            )
        if isinstance(limit, int) and limit % accumulation:
            raise ValueError(
                f"limit_train_batches={limit} is not a multiple of accumulate_grad_batches={accumulation}: the last "
                f"optimizer step of each epoch would be cut short; use a multiple, e.g. "
                f"{max(accumulation, limit - limit % accumulation)}."
            )

    @staticmethod
    def _validate_at_epoch_end(trainer: Any) -> None:
        """Make ``val_check_interval=1.0`` mean "at the epoch's last batch", as for a loader without length.

        Lightning turns a float interval into a batch count from ``len(train_dataloader)``, which for this
        loader is only an upper bound; an int interval (every k batches) and time intervals work as is.
        """
        interval = trainer.val_check_interval
        accumulation = trainer.accumulate_grad_batches
        if isinstance(interval, int) and not isinstance(interval, bool) and interval % accumulation:
            raise ValueError(
                f"val_check_interval={interval} is not a multiple of accumulate_grad_batches={accumulation}: a "
                "validation (and a checkpoint it triggers) would fall inside an optimizer step, and a run resumed "
                f"from there would be out of step with the data; use a multiple, e.g. "
                f"{max(accumulation, interval - interval % accumulation)}."
            )
        every_n = trainer.check_val_every_n_epoch
        if isinstance(interval, int) and not isinstance(interval, bool) and every_n is not None and \
                trainer.limit_val_batches > 0:
            raise ValueError(
                f"val_check_interval={interval} with check_val_every_n_epoch={every_n} validates at every "
                f"{interval}th batch counted from each epoch's start, and an epoch's number of batches changes with "
                f"the batch size: once an epoch has fewer than {interval} batches, it is never validated. Pass "
                f"check_val_every_n_epoch=None to validate every {interval} batches counted over the fit, or "
                "val_check_interval=1.0 to validate at each epoch's end."
            )
        if not isinstance(interval, float) or getattr(trainer, "_val_check_time_interval", None) is not None:
            return
        if interval != 1.0:
            raise ValueError(
                f"val_check_interval={interval} is a fraction of the epoch's batches, and their number changes with "
                "the batch size; validate every k batches (an int), by time, or at epoch ends (1.0)."
            )
        trainer.val_check_batch = float("inf")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        micro = self.micro_batch
        if micro is not None and self._loader is not None and micro.is_last and \
                micro.offset + micro.global_size >= self._loader.loader.sampler.num_samples:
            self._mark_last_batch(trainer)  # this step completes the epoch: Lightning's own "last batch"
        if micro is not None and micro.micro_index == 0:
            if self._loaded_rng is not None:  # the first step of a resumed fit draws as the saved run would have
                restore_rng_states(self._loaded_rng, trainer.global_rank, trainer.world_size, pl_module.device)
                self._loaded_rng = None
            self._step_rng = torch_rng(pl_module.device)
            progress = trainer.fit_loop.epoch_loop.batch_progress  # "ready" counts this micro-batch already
            self._step_counters = {"total": progress.total.ready - 1, "current": progress.current.ready - 1,
                                   "optimizer_steps": trainer.global_step}
        if micro is not None and self.stats is not None:
            if micro.micro_index == 0:
                self.stats.begin_step(self.driver.step, micro.global_size, self.driver.num_samples)
            self.stats.begin_micro()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        micro = self.micro_batch
        if micro is None or self.stats is None:
            return
        world, accumulation = trainer.world_size, trainer.accumulate_grad_batches
        # weight() scaled the loss by n W A / B and Lightning divides by A: the .grad increment is W n / B
        # times the micro-batch's mean gradient; without weight() it is 1 / A times it.
        to_mean = world * micro.size / micro.global_size if self._raw_loss is not None else 1.0 / accumulation
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
        if micro is None:
            return
        raw, factor, self._raw_loss = self._raw_loss, 1.0, None
        if raw is None:  # training_step did not call weight(): Lightning divided its loss by the accumulation
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):
                raw, factor = loss.detach(), float(self._placement()[2])
        if raw is not None and micro.size:
            self._step_losses.append((raw, factor, micro.size))
        if not micro.is_last:
            return
        values = read_scalars([r for r, _, _ in self._step_losses])  # one device-to-host copy
        totals = torch.tensor([sum(v * f * n for v, (_, f, n) in zip(values, self._step_losses)),
                               float(sum(n for _, _, n in self._step_losses))], dtype=torch.float64)
        self._step_losses = []
        totals = bpdist.all_reduce_sum(totals)
        step_loss = float(totals[0] / totals[1]) if totals[1] > 0 else None
        self.driver.end_step(micro.global_size, step_loss)
        self._inflight = 0
        stats = None if self.stats is None else self.stats.end_step(self.driver.step, step_loss)
        assert self._loader is not None  # the micro-batch came from it
        # The step is counted: a checkpoint from here on is at a step boundary, with the position past it; also
        # one that ModelCheckpoint(save_on_exception=True) saves when the controller below fails.
        self._step_counters = self._loader._step_start = None
        loader = self._loader.loader
        epoch, offset, _ = loader.position()
        new = self.driver.decide(loader.batch_size, epoch=epoch, coverage=offset / loader.sampler.num_samples,
                                 stats=stats)
        loader.set_batch_size(new)
        if self.log_progress:
            # The progress bar's total is len(loader), an upper bound: train_coverage is the real progress.
            shown = {"batch_size": float(micro.global_size), "train_coverage": offset / loader.sampler.num_samples}
            hidden = {
                "samples_seen": float(self.driver.samples_seen),
                "epoch": self.driver.samples_seen / loader.sampler.num_samples,
            }
            if stats and "stats/noise_scale" in stats:
                hidden["noise_scale"] = float(stats["stats/noise_scale"])
            for metrics, prog_bar in ((shown, True), (hidden, False)):
                pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=prog_bar,
                                   batch_size=max(micro.size, 1), rank_zero_only=True)
        if loader.position()[0] > micro.epoch:
            self._mark_last_batch(trainer)  # the epoch is covered (marked already when the step began)
        elif loader.sampler.drop_last and loader.sampler.num_samples - offset < new:
            # Its tail will be dropped: the epoch is over, which Lightning learns only now, after the point
            # where it steps epoch-interval LR schedulers at an epoch's last batch; step them here.
            self._mark_last_batch(trainer)
            trainer.fit_loop.epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._loader is not None and self._loader._loader is not None:
            self._loader._loader.close()  # stop dataloader workers now, not at garbage collection

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)  # the fit is over: its workers stop too (the position is kept)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.driver.start_clock()  # validation time is not training throughput

    @staticmethod
    def _mark_last_batch(trainer: Any) -> None:
        trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The driver's counters, the controller's state, the gradient statistics' and the data position.

        Lightning also saves the loader's own state, but restores it only when it resumes inside an epoch;
        from a checkpoint saved at an epoch's end (``ModelCheckpoint``'s default) it would replay the first
        epoch's order at the first size. The position kept here covers every case.
        """
        stats = self.stats.state_dict() if self.stats is not None else self._stats_state
        loader = self._loader_state if self._loader is None else self._loader._saved_state()
        return {"driver": self.driver.state_dict(), "stats": stats, "loader": loader}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (Lightning calls it when resuming from a checkpoint)."""
        self.driver.load_state_dict(state_dict["driver"])
        self._stats_state = state_dict.get("stats")
        if self.stats is not None and self._stats_state is not None:
            self.stats.load_state_dict(self._stats_state)
        self._loader_state = state_dict.get("loader")  # absent in checkpoints saved before it was kept here
        self._restored_fit = self._fit
        if self._loader_state is not None and self._loader is not None:
            self._loader.load_state_dict(self._loader_state)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Keep the checkpoint's generator states for the resumed fit's first step (absent in checkpoints of
        batchpilot versions before they were saved: the generators are left as they are)."""
        self._loaded_rng = checkpoint.get(_RNG_KEY)

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
        current = torch_rng(pl_module.device)
        if self._step_counters is not None and self._step_rng is not None:
            set_torch_rng(self._step_rng, pl_module.device)
        checkpoint[_RNG_KEY] = gather_rng_states(trainer.world_size, pl_module.device)
        set_torch_rng(current, pl_module.device)
        loop = checkpoint.get("loops", {}).get("fit_loop")
        if loop is None:
            return
        batches, epochs = loop["epoch_loop.batch_progress"], loop["epoch_progress"]
        if self._step_counters is not None:
            for part in ("total", "current"):
                batches[part].update(dict.fromkeys(_COUNTERS, self._step_counters[part]))
            batches["is_last_batch"] = False
            if trainer.global_step != self._step_counters["optimizer_steps"]:
                rank_zero_warn(
                    "this checkpoint is saved after the optimizer updated the weights for the step in flight but "
                    "before AdaptiveBatchSize counted that step (a callback listed before AdaptiveBatchSize, or a "
                    "signal handler, saved it): a fit resumed from it runs the step again. List checkpointing "
                    "callbacks after AdaptiveBatchSize in callbacks=[...]."
                )
        # The epoch loop has ended (processed counts it) before the data epoch did, and not at limit_train_batches.
        if epochs["total"]["processed"] == epochs["total"]["started"] > 0 and not batches["is_last_batch"] and \
                batches["current"]["ready"] < trainer.num_training_batches:
            for part in ("total", "current"):
                epochs[part]["processed"] = epochs[part]["completed"] = epochs[part]["started"] - 1
