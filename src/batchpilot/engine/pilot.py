"""`Pilot`: adaptive-batch training inside the user's own loop, a loop over micro-batches::

    for x, y in pilot.batches(epochs=10):
        pilot.backward(loss_fn(model(x), y))

Between the last micro-batch of a step and the first of the next, the generator ends the step: the update
(:mod:`.step_end`), the next size (:mod:`.driver`), callbacks and checkpoints (:mod:`.state`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch
from typing_extensions import Unpack

from .._validation import check_batch_size
from .._wrappers import unwrap
from ..controllers.base import Controller
from ..controllers.boundary import needs_gradient_stats
from ..data.loader import AdaptiveDataLoader, MicroBatch
from ..logs import ProgressBar
from ..measure import StepMeter, engine_probe
from .accumulate import Accumulation
from .compression_setup import setup_compression
from .config import checked, merge_settings, stop_samples
from .decisions import Decisions
from .driver import SizeDriver
from .finish import finish_step
from .guard import RollbackGuard
from .pilot_view import PilotView
from .placement import data_parallel_wrapper, engine_reduces_gradients, resolve_world, training_device
from .preemption import Preemption
from .probes import adopt_anchor, lr_config, resolve_auto, run_probes
from .rank_balance import PilotRankWeights
from .replay import StepReplay
from .settings import PilotSettings
from .state import PilotState, find_checkpoint, rescale_lr
from .step_end import Gradients, StepEnd, StepLog, lr_rules
from .tokens import setup_tokens


class Pilot(PilotView):
    """Adaptive global batch size for a user-written PyTorch training loop.

    Args:
        model: The model, optionally wrapped in ``DistributedDataParallel`` and/or ``torch.compile`` (in
            either order; checkpoints hold the bare module's weights).
        optimizer: Its optimizer.
        dataset: A map-style dataset with ``__len__``.
        batch_size: Global batch size of the first step, or ``"auto"``: the automatic mode (docs/auto.md), whose
            controller is :class:`~batchpilot.controllers.Auto` and whose start probes find the size and the LR.
        controller: A :class:`~batchpilot.controllers.Controller`, or any callable
            ``(step, current_size) -> size`` (seed 003's scheduler signature); ``None`` keeps the size.
        **settings: The settings, by group (``data=DataConfig(num_workers=2)``; ``decisions``, ``lr``, ``data``,
            ``memory``, ``precision``, ``logs``, ``checkpoints``, ``stats``, ``distributed``) or each field as
            its own keyword (``num_workers=2``), not both: see :mod:`batchpilot.engine.config`.

    Raises:
        ValueError, TypeError: invalid arguments (all problems are reported at once).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: torch.utils.data.Dataset,
                 *, batch_size: int | str, controller: Controller | Callable[[int, int], int] | None = None,
                 **settings: Unpack[PilotSettings]) -> None:
        batch_size, controller, config, self._auto = resolve_auto(batch_size, controller, merge_settings(settings))
        batch_size, self.config = checked(config, batch_size=batch_size, controller=controller, optimizer=optimizer,
                                          model=model)
        cfg, mem, prec = self.config, self.config.memory, self.config.precision
        self.model, self.optimizer = model, optimizer
        self._module, self._ddp_model = unwrap(model)  # the bare module (what checkpoints hold), the DDP wrapper
        self._ddp_model = data_parallel_wrapper(self._module, self._ddp_model, cfg)  # FSDP2: engine/sharded.py
        self.rank, self.world_size = resolve_world(cfg.distributed, self._ddp_model)
        self.oom_recovery = mem.oom_recovery
        engine_reduces = engine_reduces_gradients(self._ddp_model, self.world_size, mem.oom_recovery)
        ddp_syncs = self._ddp_model is not None and not engine_reduces
        self._grads = Gradients(model, optimizer)  # re-read when a loop starts and after callbacks
        self.device = training_device(cfg.distributed.device, self._module, first_param=self._grads.params[0],
                                      broadcast=self._ddp_model is None and self.world_size > 1)
        self.loader = AdaptiveDataLoader(  # it keeps torch's RNG at each step's start, for a step run again
            dataset, batch_size, max_micro_batch_size=mem.max_micro_batch_size,
            max_micro_batch_tokens=mem.max_micro_batch_tokens, rank=self.rank,
            world_size=self.world_size, rng_device=self.device, **vars(cfg.data))
        self.num_samples = self.loader.sampler.num_samples
        self.driver = SizeDriver(  # the step counters, and the decisions
            controller, batch_size=batch_size, num_samples=self.num_samples, **cfg.decisions.driver_settings(),
            rank=self.rank, names=("controller", "batch_size"), world_size=self.world_size, label="controller")
        self.controller = self.driver.controller
        # Undoes a change of size that breaks training (engine/guard.py).
        self._guard = RollbackGuard.from_config(cfg.decisions, self.driver, rank=self.rank, world_size=self.world_size)
        self.coupling, self.adascale, self._couple = lr_rules(optimizer, lr_config(cfg.lr), batch_size)
        self.lr_schedulers = list(cfg.lr.lr_schedulers)
        self.scaler = torch.amp.GradScaler(self.device.type) if prec.amp == "fp16" else None
        self._lead = self.rank == 0
        self._log = StepLog(cfg.logs.log_path, cfg.logs.tensorboard_dir, self._lead,
                            dropped=self.loader.sampler.dropped_samples)
        self._callbacks: list[Callable[[Pilot, dict], None]] = []
        self._noise = engine_probe(  # the gradient noise scale, for the controller or AdaScale
            self._grads.params, cfg.stats.noise_every, needed=needs_gradient_stats(self.controller)
            or self.adascale is not None, ranks_are_small_batches=engine_reduces, population=self.num_samples,
            ddp_model=self._ddp_model if ddp_syncs and self.world_size > 1 else None)
        self._meter = StepMeter(system_every=cfg.stats.system_every, device=self.device)
        if self._lead:
            self._meter.warn_unmeasured(self.controller, on_gpu=self.device.type == "cuda")
        self.loader.split_every = None if self._noise is None else self._noise.split_every
        self._step_end = StepEnd(
            self._grads, scaler=self.scaler, adascale=self.adascale, grad_clip=prec.grad_clip,
            skip_nonfinite=prec.skip_nonfinite, noise=self._noise, lr_schedulers=self.lr_schedulers,
            engine_reduces=engine_reduces, ddp_model=self._ddp_model, module=self._module,
            world_size=self.world_size, rank=self.rank)
        self._preemption = self._step_end.preemption = Preemption(cfg.checkpoints.save_on_sigterm)
        # A step run again (after running out of memory, or after the loop left it unfinished) draws what its
        # first run drew (augmentation, dropout).
        self._replay = StepReplay(self._module, self.device, loader=self.loader, step_end=self._step_end,
                                  meter=self._meter, oom_recovery=mem.oom_recovery, world_size=self.world_size)
        self._acc = Accumulation(  # the micro-batch between its yield and the step's end, and its backward
            device=self.device, ddp_model=self._ddp_model, ddp_syncs=ddp_syncs, world_size=self.world_size,
            precision=prec, meter=self._meter, step_end=self._step_end, replay=self._replay)
        self._state = PilotState(
            module=self._module, optimizer=optimizer, coupling=self.coupling, loader=self.loader, driver=self.driver,
            step_end=self._step_end, meter=self._meter, log=self._log, config=cfg, rank=self.rank,
            world_size=self.world_size, device=self.device,
            log_clamp=lambda saved, bounded, note: self._decisions.record(saved, bounded, "user", note,
                                                                          self.last_record))
        self._state.parts["guard"] = self._guard  # its rollbacks, back-off and open watch window are state too
        self._state.parts["compression"] = setup_compression(self)  # its hook's state (engine/compression_setup.py)
        self._decisions = Decisions(self.driver, self.loader, log=self._log.decision,
                                    on_failure=lambda error: self._state.keep_finished_step(error, self.state_dict))
        self.skipped_steps = 0
        self.last_record: dict[str, Any] = {}
        self._overhead_clean = False  # whether this step's time outside its micro-batches is a fair sample
        self._rewinds_seen = self.loader.rewinds
        self.probing = False  # the micro-batches yielded now belong to the automatic mode's start probes
        self._ranks = PilotRankWeights.attach(self)  # rank_weights (engine/rank_balance.py)
        setup_tokens(self)  # batch_unit="tokens": the controller, LR coupling and noise scale count tokens
        self.preempted = False  # save_on_sigterm: a SIGTERM stopped batches() after a checkpoint (it stays stopped)

    def add_callback(self, fn: Callable[[Pilot, dict], None]) -> None:
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
        if self._acc.micro is not None:  # inside a step: the step's end applies it in place of a decision
            self._decisions.override = global_batch_size
            return
        self._decisions.set_between_steps(global_batch_size, self.last_record)
        if self.coupling.is_scaled:  # inside batches(): the next step's LR follows its size
            rescale_lr(self.coupling, self.loader)

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
        total = stop_samples(epochs, max_steps, max_samples, self.num_samples)
        bar = ProgressBar(None if total is None else max(total - self.samples_seen, 0),
                          self.config.logs.progress if self._lead else False)

        def done() -> bool:
            return (
                (epochs is not None and self.epoch >= epochs)
                or (max_steps is not None and self.step >= max_steps)
                or (max_samples is not None and self.samples_seen >= max_samples)
                or self.preempted
            )

        if self._auto and not done():
            yield from run_probes(self)  # the automatic mode's start probes, once per run (engine/probes.py)
        if self._couple and not self.coupling.is_scaled:
            self.coupling.scale(self.loader.next_step_size())
        self._step_end.refresh_params()
        self._grads.zero()  # nothing left over from before (e.g. an LR range test) adds to the first step
        self.driver.start_clock()
        self._preemption.install()  # save_on_sigterm (engine/preemption.py)
        try:
            while not done():
                micro_batches = iter(self.loader)  # a tail left to drop is dropped here (drop_last)
                self._overhead_clean = False  # the next step's time includes the iterator's start
                epoch_start = self.loader.position()[1] == 0
                self._log.report_drops(self.loader.sampler, self.step + 1)
                yielded = False
                for micro in micro_batches:
                    yielded = True
                    yield from self._acc.run(micro)
                    if self.oom_recovery and self._replay.after_micro(micro, self._event):
                        self._acc.micro = None  # the step runs again, with smaller micro-batches
                        self.driver.start_clock()
                        continue
                    if micro.is_last:
                        self._finish_step(micro, bar)
                        if done():
                            return
                self._log.report_drops(self.loader.sampler, self.step + 1)
                if not yielded and epoch_start and self.loader.sampler.drop_last:
                    raise RuntimeError(
                        f"an epoch produced no step: batch_size={self.loader.batch_size} exceeds the dataset size "
                        f"{self.num_samples} with drop_last=True; lower the batch size or set drop_last=False."
                    )
        finally:
            if self._acc.step_open:
                self._replay.discard(self._event)
                self._acc.step_open = False
            if self.coupling.is_scaled:
                self.coupling.unscale()
            self._acc.micro = None
            bar.close()
            self._log.flush()
            self._preemption.restore(preempted=self.preempted)

    def micro_step(self) -> contextlib.AbstractContextManager[None]:
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
        return self._acc.micro_step()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` weighted so the step's gradient is the mean over the global batch.

        With ``loss_reduction="mean"`` a micro-batch of ``n`` samples in a global batch of ``B`` is weighted
        ``n / B`` (times the world size under DDP, which averages over ranks), so the accumulated gradient
        equals the gradient of the mean loss over all ``B`` samples, whatever the split. With
        ``batch_unit="tokens"``, ``n`` and ``B`` count tokens: pass a loss summed (``"sum"``) or averaged (``"mean"``)
        over the micro-batch's tokens, and the step's gradient is that of the mean loss per token (docs/tokens.md).

        Raises:
            RuntimeError: called outside :meth:`batches` or twice for one micro-batch.
            ValueError: ``loss`` is not a scalar tensor.
        """
        self._acc.backward(loss)

    # ------------------------------------------------------------------ between steps
    def _finish_step(self, micro: MicroBatch, bar: ProgressBar) -> None:
        finish_step(self, micro, bar)

    def _event(self, kind: str, data: dict[str, Any], warn: bool = True) -> None:
        self._log.event(self.step + 1, kind, data, warn)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: model, optimizer, scaler, schedulers, data position,
        controller, LR coupling, statistics, RNG states and the log position.

        Call it between steps. Under DDP every rank must call it (RNG states are gathered)."""
        self._between_steps("state_dict()")
        return self._state.state_dict(skipped_steps=self.skipped_steps, override=self._decisions.override)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (possibly saved under another world size; see docs/checkpointing.md for
        the settings a resumed run may change). Under DDP every rank must call it (the ranks agree on whether
        the state fits).

        Raises:
            CheckpointError: the state was saved by another run: another model (names or shapes), optimizer
                class or parameter groups, dataset size, seed or shuffling, or other LR schedulers. All
                problems are listed, and nothing is loaded.
        """
        self._between_steps("load_state_dict()")
        if self._auto:
            adopt_anchor(self, state)  # the LR rules' anchor: the knee the state's probes found
        self.skipped_steps, self._decisions.override = self._state.load_state_dict(state)
        self._log.dropped = self.loader.sampler.dropped_samples

    def save_checkpoint(self, path: str | os.PathLike | None = None) -> Path | None:
        """Save :meth:`state_dict` atomically (rank 0 writes; every rank must call).

        ``path`` defaults to ``checkpoint_dir/step-<step>.pt``; a folder (one that exists, or a string ending in a
        separator; ``pathlib`` drops a trailing one) gets ``step-<step>.pt`` inside it, as :meth:`load_checkpoint`
        reads folders. Older files beyond ``keep_checkpoints`` in ``checkpoint_dir`` are removed. Returns the path
        on rank 0, ``None`` elsewhere."""
        self._between_steps("save_checkpoint()")  # before the LR factor is touched: the step stays as it was
        return self._state.save(path, self.state_dict)

    def load_checkpoint(self, path: str | os.PathLike, *, missing_ok: bool = False) -> Path | None:
        """Restore from a checkpoint file, or from the newest loadable one in a folder (under DDP every rank
        must call it, with a path every rank can read).

        Returns the file loaded, or ``None`` when ``missing_ok`` and the folder holds no checkpoint.

        Raises:
            CheckpointError: the file is missing (unless ``missing_ok``), truncated, corrupt or foreign; or the
                folder holds checkpoints but none loads (even with ``missing_ok``: that is no first start).
        """
        found = find_checkpoint(path, missing_ok)
        if found is not None:
            self.load_state_dict(found[1])
        return None if found is None else found[0]

    def _between_steps(self, what: str) -> None:
        if self._acc.micro is not None:
            raise RuntimeError(f"{what} was called in the middle of a step; call it between steps (before the loop, "
                               "after it, or from a callback added with add_callback; a loop left with break over a "
                               "generator you keep ends only at gen.close()).")

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

