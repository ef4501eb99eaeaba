"""The training loader `AdaptiveBatchSize.dataloader` hands out: built anew in each fit for its rank, world size
and ``accumulate_grad_batches``, with the data position carried over (reloads, later fits, resumes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from ... import distributed as bpdist
from ...data.loader import AdaptiveDataLoader
from ...data.micro_batch import MicroBatch

__all__ = ["AdaptiveLoader", "Fits"]


class Fits:
    """The trainer a callback is set up in and the number of its fits so far: a loader is built anew in each fit."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.number = 0  # trainer.fit calls set up so far
        self.restored = -1  # the fit whose set-up restored the callback's state (load_state_dict)

    def placement(self) -> tuple[int, int, int]:
        """(rank, world size, accumulate_grad_batches) from the trainer, else from torch.distributed."""
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size, self.trainer.accumulate_grad_batches
        rank, world_size = bpdist.rank_and_world()
        return rank, world_size, 1

    def running(self) -> bool:
        """Whether a ``trainer.fit`` with this callback is running (set up and not yet ended)."""
        state = None if self.trainer is None else self.trainer.state
        return state is not None and state.fn == TrainerFn.FITTING and state.status == TrainerStatus.RUNNING


class AdaptiveLoader:
    """The training loader :meth:`AdaptiveBatchSize.dataloader` returns (an iterable, not a DataLoader).

    Built on first use in each fit, once the callback knows the rank, the world size and
    ``accumulate_grad_batches``. Iterating yields the collated micro-batches of the rest of the current epoch.
    ``len()`` is an upper bound (every step takes at least one sample), which keeps Lightning from prefetching
    a batch whose size would then be stale. Lightning leaves non-DataLoader iterables alone under DDP (no
    DistributedSampler): the sampler hands each rank its share itself.
    """

    def __init__(self, fits: Fits, dataset: Any, options: dict[str, Any], *, global_batch_size: int) -> None:
        self._fits = fits
        self.dataset = dataset
        self._options = options
        self._loader: AdaptiveDataLoader | None = None
        self._fit = 0  # the fit number when the loader was built
        self._pending_state: dict[str, Any] | None = None
        self._first_global_batch_size = global_batch_size  # of the first step, when there is no state to load
        self.current: MicroBatch | None = None
        # The position at the start of the step in flight (its first micro-batch was yielded, the callback has
        # not counted it yet): what a checkpoint saved inside the step must hold.
        self._step_start: dict[str, Any] | None = None

    @property
    def loader(self) -> AdaptiveDataLoader:
        """The underlying :class:`~batchpilot.AdaptiveDataLoader` (built on first access in each fit)."""
        if self._loader is not None and self._fit != self._fits.number:  # built for an earlier fit
            self._pending_state = self.saved_state()
            self._loader.close()
            self._loader = None  # rebuilt: this fit may have another rank, world size or accumulation
        if self._loader is None:
            rank, world_size, accumulation_steps = self._fits.placement()
            self._loader = AdaptiveDataLoader(
                self.dataset, self._first_global_batch_size, rank=rank, world_size=world_size,
                accumulation_steps=accumulation_steps, **self._options,
            )
            self._fit = self._fits.number
            if self._pending_state is not None:
                self._loader.load_state_dict(self._pending_state)
                self._pending_state = None
            self._step_start = None
        return self._loader

    def built_for_this_fit(self) -> AdaptiveDataLoader | None:
        """The underlying loader if the fit now set up (or the last one) built it, else ``None``."""
        return self._loader if self._loader is not None and self._fit == self._fits.number else None

    @property
    def batch_size(self) -> int:
        """Global batch size of the next step."""
        if self._pending_state is not None:
            return int(self._pending_state["batch_size"])
        return self._first_global_batch_size if self._loader is None else self._loader.batch_size

    def __len__(self) -> int:
        return len(self.dataset) * self._fits.placement()[2]

    def __iter__(self) -> Iterator[Any]:
        if self._fits.trainer is None:
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

    def step_counted(self) -> None:
        """The callback counted the step in flight: a checkpoint from now on holds the position past it."""
        self._step_start = None

    def saved_state(self) -> dict[str, Any] | None:
        """What :meth:`state_dict` returns, without building the loader: ``None`` if never built nor loaded."""
        state = self._step_start or self._pending_state
        if state is None and self._loader is not None:
            state = self._loader.state_dict()
        return None if state is None else dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Position at the first unconsumed step and the next size (JSON-serialisable); inside a step, the
        position at its start."""
        return self.saved_state() or self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (possibly saved under another world size)."""
        self._step_start = None
        if self.built_for_this_fit() is not None:
            self.loader.load_state_dict(state)
        else:
            self._pending_state = dict(state)

    def continue_from(self, previous: AdaptiveLoader | None, *, reloaded: bool,
                      resumed: dict[str, Any] | None) -> None:
        """Start where the data stands: ``previous``'s position when the fit reloads its loader (``reloaded``),
        else the ``resumed`` position restored with the callback's state, else where an earlier fit left it.

        Raises:
            ValueError: a reload within a fit returned a dataset of another length.
        """
        if reloaded and previous is not None:  # reload_dataloaders_every_n_epochs: the position carries over
            if len(self.dataset) != len(previous.dataset):
                raise ValueError(
                    f"the reloaded training dataset has {len(self.dataset)} samples, the previous one "
                    f"{len(previous.dataset)}: the data position (which samples this epoch has covered) cannot "
                    "carry over to another dataset within a fit; reload the same dataset "
                    "(reload_dataloaders_every_n_epochs), or train on the new one in a later trainer.fit, which "
                    "starts its first epoch."
                )
            self.load_state_dict(previous.state_dict())
        elif resumed is not None:
            self.load_state_dict(resumed)
        elif previous is not None and (state := previous.saved_state()) is not None:
            # A later fit: on a dataset of the same length it continues where the last one left the data, on
            # another it starts that dataset's first epoch at the size decided last.
            if len(self.dataset) == len(previous.dataset):
                self.load_state_dict(state)
            else:
                self._first_global_batch_size = int(state["batch_size"])
        if previous is not None:
            previous.close()  # its workers stop now, not at a cyclic garbage collection

    def close(self) -> None:
        """Stop the underlying loader's workers (the position is kept)."""
        if self._loader is not None:
            self._loader.close()
