"""`HorovodSteps`: batchpilot's adaptive global batches in a Horovod training loop (seed 002's engine).

Horovod 0.28.1, its last release, does not build against torch >= 2.1 as released (it compiles its PyTorch
extension as C++14); built from source with C++17 it runs on torch 2.13 with gloo (docs/distributed.md,
"Horovod"). No batchpilot extra installs it.

::

    import horovod.torch as hvd
    from batchpilot.integrations.horovod import HorovodSteps

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    steps = HorovodSteps(optimizer, train_set, batch_size=64, controller=..., max_micro_batch_size=32)
    for micro in steps.batches(epochs=3):
        x, y = micro.data
        steps.weight(criterion(model(x), y)).backward()
        if micro.is_last:
            optimizer.step()              # Horovod's all-reduce ran in the last backward pass
            optimizer.zero_grad()
            steps.end_step()              # count the step; rank 0 decides the next size, broadcast

Each step's global batch is cut into one contiguous share per rank (in proportion to ``rank_weights``, or
evenly), each share into the same number of micro-batches on every rank; before a step's first micro-batch the
optimizer's ``backward_passes_per_step`` is set to that number, so Horovod all-reduces once per step, after the
last backward. :meth:`HorovodSteps.weight` scales micro-batch ``j``'s mean loss by ``n_j * size / B`` (Horovod
averages over ranks; ``n_j / B`` with ``op=hvd.Sum``), so the step's gradient is the mean over its ``B`` samples
whatever the shares (LB-BSP, arXiv 1806.02508).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch

from ..data.loader import AdaptiveDataLoader
from ..data.micro_batch import MicroBatch
from ..data.shares import checked_weights
from ..engine.driver import SizeDriver

__all__ = ["HorovodSteps"]


def _horovod() -> ModuleType:
    try:
        return importlib.import_module("horovod.torch")
    except ImportError as exc:
        raise ImportError(
            "batchpilot.integrations.horovod needs horovod with PyTorch support (horovod.torch), which does not "
            f"import here ({type(exc).__name__}: {exc}). horovod 0.28.1 does not build against torch >= 2.1 as "
            "released; see docs/distributed.md, section 'Horovod', for the build that works, or use DDP with "
            "batchpilot.Pilot (the same recipe, tested in CI)."
        ) from exc


class HorovodSteps:
    """Micro-batches of exactly the decided global batch for a Horovod loop, and the decisions between steps.

    Args:
        optimizer: The ``hvd.DistributedOptimizer`` (``op=hvd.Average``, its default, or ``hvd.Sum``).
        dataset: A map-style dataset.
        batch_size: Global batch size of the first step (samples over all ranks).
        controller: A batchpilot controller, a seed-003 callable ``(step, size) -> size`` or ``None``.
        max_micro_batch_size: Most samples per micro-batch on a rank: a larger share runs as more micro-batches
            (more backward passes per step).
        accumulation_steps: A fixed number of micro-batches per step instead (``None``: from the size).
        rank_weights: ``None`` (even shares) or one positive weight per rank (shares proportional to them).
            ``"auto"`` is not available here: its estimate is agreed over ``torch.distributed``.
        shuffle, seed, drop_last, collate_fn, num_workers: As for :class:`~batchpilot.AdaptiveDataLoader`.
        min_batch_size, max_batch_size, decide_every, on_invalid: As for ``Pilot``.

    Raises:
        ImportError: horovod.torch does not import.
        TypeError: ``optimizer`` is not a Horovod ``DistributedOptimizer``, or bad ``rank_weights`` types.
        ValueError: an invalid setting (the message names it and the fix).
    """

    def __init__(self, optimizer: Any, dataset: Any, *, batch_size: int, controller: Any = None,
                 max_micro_batch_size: int | None = None, accumulation_steps: int | None = None,
                 rank_weights: Sequence[float] | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 0,
                 min_batch_size: int | None = None, max_batch_size: int | None = None, decide_every: int = 1,
                 on_invalid: str = "raise") -> None:
        hvd = self._hvd = _horovod()
        if not hasattr(optimizer, "set_backward_passes_per_step"):
            raise TypeError(f"optimizer is a {type(optimizer).__name__}; HorovodSteps needs the optimizer wrapped by "
                            "hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters()), whose "
                            "backward_passes_per_step it sets to each step's micro-batches.")
        op = getattr(optimizer, "op", hvd.Average)
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError(f"the DistributedOptimizer reduces with op={op!r}; HorovodSteps weights the losses for "
                             "hvd.Average (the default) or hvd.Sum, which make the step's gradient the global mean.")
        self.optimizer = optimizer
        self.rank, self.world_size = int(hvd.rank()), int(hvd.size())
        if isinstance(rank_weights, str) and rank_weights == "auto":
            raise ValueError("rank_weights='auto' needs torch.distributed, where its estimate is agreed (Pilot, the HF "
                             "and Lightning integrations); under Horovod pass one weight per rank, e.g. [1.0, 2.0].")
        weights = checked_weights(rank_weights, self.world_size)
        self._ranks_averaged = op == hvd.Average
        self.loader = AdaptiveDataLoader(
            dataset, batch_size, max_micro_batch_size=max_micro_batch_size, accumulation_steps=accumulation_steps,
            shuffle=shuffle, seed=seed, drop_last=drop_last, rank=self.rank, world_size=self.world_size,
            num_workers=num_workers, collate_fn=collate_fn)
        self.loader.set_rank_weights(weights)
        # Rank 0 asks the controller; the answer is broadcast by Horovod (the driver itself broadcasts nothing).
        self.driver = SizeDriver(controller, batch_size=batch_size, num_samples=len(dataset), rank=self.rank,
                                 world_size=1, min_batch_size=min_batch_size, max_batch_size=max_batch_size,
                                 decide_every=decide_every, on_invalid=on_invalid, names=("controller", "batch_size"))
        self.driver.min_useful = self.world_size
        self.current: MicroBatch | None = None
        self._loss = torch.zeros((), dtype=torch.float64)  # sum of n_j * mean loss_j / B over this rank's step
        self._open = False  # the step's last micro-batch was yielded and end_step() not called yet

    # ------------------------------------------------------------------ the loop
    @property
    def batch_size(self) -> int:
        """Global batch size of the next step."""
        return self.loader.batch_size

    @property
    def step(self) -> int:
        """Optimizer steps counted so far."""
        return self.driver.step

    @property
    def samples_seen(self) -> int:
        """Samples of counted steps, over all ranks."""
        return self.driver.samples_seen

    def batches(self, epochs: float | None = None, max_steps: int | None = None) -> Iterator[MicroBatch]:
        """Yield micro-batches until ``epochs`` passes over the data (by samples) or ``max_steps`` steps are done.

        Raises:
            ValueError: neither bound is given.
            RuntimeError: a step's last micro-batch was not followed by :meth:`end_step`.
        """
        if epochs is None and max_steps is None:
            raise ValueError("pass epochs= or max_steps= to HorovodSteps.batches().")
        total = None if epochs is None else round(epochs * self.driver.num_samples)

        def done() -> bool:
            return (max_steps is not None and self.driver.step >= max_steps) or \
                (total is not None and self.driver.samples_seen >= total)

        while not done():
            if total is not None and 0 < total - self.driver.samples_seen < self.loader.batch_size:
                self.loader.set_batch_size(total - self.driver.samples_seen)  # the last step: what is left
            for micro in self.loader:
                if micro.micro_index == 0:
                    # Horovod all-reduces a parameter's gradient after this many backward passes: the step's last.
                    self.optimizer.set_backward_passes_per_step(micro.accumulation_steps)
                    self._loss.zero_()
                self.current = micro
                self._open = micro.is_last
                yield micro
                if self._open:
                    raise RuntimeError("call HorovodSteps.end_step() after the optimizer step of each step's last "
                                       "micro-batch (micro.is_last), before asking for the next micro-batch.")
                if micro.is_last and done():
                    return

    def weight(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (the micro-batch's mean loss) times its share of the global batch: ``n * size / B`` for
        ``hvd.Average`` (``n / B`` for ``hvd.Sum``); 0 for a ghost micro-batch (a borrowed sample, run so that every
        rank makes the same backward passes)."""
        micro = self.current
        if micro is None:
            raise RuntimeError("HorovodSteps.weight() was called outside batches().")
        share = micro.size / micro.global_size
        self._loss += loss.detach().to(torch.float64).cpu() * share
        return loss * (share * self.world_size if self._ranks_averaged else share)

    def end_step(self) -> int:
        """Count the step whose optimizer update just ran (its mean loss over all ranks, one all-reduce), let rank
        0's controller decide the next size and broadcast it; return it. Every rank calls this after every step.

        Raises:
            RuntimeError: called before a step's last micro-batch, or rank 0's controller failed.
        """
        micro = self.current
        if micro is None or not self._open:
            raise RuntimeError("HorovodSteps.end_step() is called once per step, after its last micro-batch "
                               "(micro.is_last) and the optimizer step.")
        hvd = self._hvd
        loss = float(hvd.allreduce(self._loss.reshape(1), op=hvd.Sum, name="batchpilot.loss")[0])
        self.driver.end_step(micro.global_size, loss)
        self._open = False
        epoch, offset, _ = self.loader.position()
        try:
            decided = self.driver.decide(self.loader.batch_size, epoch=epoch,
                                         coverage=offset / self.loader.sampler.num_samples)
        except Exception:
            self._broadcast(-1)  # the other ranks wait in the broadcast: they stop too
            raise
        decided = self._broadcast(decided)
        if decided < 1:
            raise RuntimeError("rank 0's batch size controller failed (see rank 0's error); stopping this rank too.")
        self.loader.set_batch_size(decided)
        return decided

    def _broadcast(self, value: int) -> int:
        hvd = self._hvd
        return int(hvd.broadcast(torch.tensor([value], dtype=torch.int64), root_rank=0, name="batchpilot.size")[0])

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The data position (with the next size) and the controller's state; save it with the model's."""
        return {"loader": self.loader.state_dict(), "driver": self.driver.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (on every rank)."""
        self.loader.load_state_dict(state["loader"])
        self.driver.load_state_dict(state["driver"])
