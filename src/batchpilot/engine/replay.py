"""Out-of-memory detection and the step snapshots a replay restores; saving the finished step when a
decision fails. Shared by `Pilot` and the framework integrations."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .. import distributed as bpdist
from ..rng import set_torch_rng

if TYPE_CHECKING:
    from ..data.loader import AdaptiveDataLoader, MicroBatch
    from ..measure import StepMeter
    from .step_end import StepEnd

logger = logging.getLogger("batchpilot")

# torch.OutOfMemoryError is torch >= 2.5; torch.cuda's is older (both are RuntimeErrors saying so).
_OOM_TYPES = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
                   if t is not None)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator running out of memory (``torch.OutOfMemoryError`` on CUDA, or a
    ``RuntimeError`` saying so from another backend or the CPU allocator)."""
    if isinstance(exc, _OOM_TYPES):
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message)


def error_summary(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none (for one-line logs)."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def keep_finished_step(save: Callable[[], object], error: BaseException, *, step: int, lead: bool,
                       resume_hint: str, what: str = "the controller") -> None:
    """After ``what`` failed between steps (on every rank, so the save's collectives match): save the finished
    ``step`` with ``save()`` (which returns where) and note on ``error`` where it went, so nothing trained is lost.
    A failing save is logged and the original error stays the one raised."""
    try:
        where = save()
    except Exception as save_error:  # the decision's error is the one to report
        logger.error("%s failed at step %d and saving that step failed too: %s", what, step, save_error)
        return
    if lead:
        message = (f"batchpilot saved the finished step {step} to {where} before stopping: fix {what} "
                   f"and resume from it ({resume_hint}); nothing trained is lost.")
        logger.error("%s", message)
        if hasattr(error, "add_note"):  # Python >= 3.11: shown with the traceback
            error.add_note(message)


class StepReplay:
    """Runs a step again from its start: with smaller micro-batches after running out of memory, or whole
    after the loop left it unfinished.

    A replayed step draws what its first run drew (augmentation, dropout): torch's RNG is taken back to the
    step's start (``loader.step_start_rng``: the loader keeps it before the step's first fetch, which may draw
    random numbers), and with ``oom_recovery`` so are the module's buffers that the failed attempt's forwards may
    have moved (BatchNorm's running statistics; a clone per step, so only where a replay is expected).
    """

    def __init__(self, module: torch.nn.Module, device: torch.device, *, loader: AdaptiveDataLoader,
                 step_end: StepEnd, meter: StepMeter, oom_recovery: bool, world_size: int) -> None:
        self.module, self.device, self.loader, self.step_end, self.meter = module, device, loader, step_end, meter
        self.oom_recovery, self.world_size = oom_recovery, world_size
        self.failed_micro_batch_size: int | None = None  # samples of the micro-batch that ran out of memory, this step
        self.error = ""
        self.replays = 0  # steps run again after running out of memory
        self._buffers: list[torch.Tensor] = []

    def snapshot(self) -> None:
        """A step's first micro-batch arrived: keep the module's buffers (with ``oom_recovery``)."""
        if self.oom_recovery:
            self._buffers = [b.detach().clone() for b in self.module.buffers()]

    def caught(self, exc: BaseException, micro_batch_size: int) -> bool:
        """Whether ``exc``, raised in a micro-batch of ``micro_batch_size`` samples, is an out-of-memory error to
        recover from (it is then recorded for :meth:`agreed_bound`)."""
        if not (self.oom_recovery and is_out_of_memory(exc)):
            return False
        self.failed_micro_batch_size, self.error = micro_batch_size, error_summary(exc)
        return True

    def agreed_bound(self) -> int | None:
        """The micro-batch bound for running this step again, agreed over ranks, or ``None`` when no rank
        ran out of memory (every rank calls this once per step attempt: after its last micro-batch, or
        as soon as it ran out of memory).

        Raises:
            RuntimeError: a micro-batch of one sample ran out of memory (on any rank).
        """
        failed = self.failed_micro_batch_size
        no_oom = 2**62
        candidate = no_oom if failed is None else failed // 2
        bound = bpdist.all_reduce_min_int(candidate) if self.world_size > 1 else candidate
        if bound == no_oom:
            return None
        if bound < 1:
            self.failed_micro_batch_size = None
            raise RuntimeError(
                "out of memory with micro-batches of 1 sample (on at least one rank): the model does not fit "
                "even one sample; use a smaller model, mixed precision (amp='bf16' or 'fp16') or a device with "
                "more memory."
            )
        return bound

    def after_micro(self, micro: MicroBatch, event: Callable[..., None]) -> bool:
        """After a micro-batch that ran out of memory, or the step's last: whether the step runs again (some rank
        ran out of memory; then it is set up to)."""
        if self.failed_micro_batch_size is None and not micro.is_last:
            return False
        bound = self.agreed_bound()
        if bound is None:
            return False
        self.replay(micro.global_size, bound, event)
        return True

    def replay(self, global_batch_size: int, max_micro_batch_size: int, event: Callable[..., None]) -> None:
        """Run the step again from its first micro-batch, with at most ``max_micro_batch_size`` samples per
        micro-batch from now on."""
        old = self.loader.max_micro_batch_size
        error = self.error if self.failed_micro_batch_size is not None else "another rank ran out of memory"
        self.failed_micro_batch_size, self.error = None, ""
        self._rewind()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the failed attempt's cached blocks back before the retry
        self.loader.replay_step(max_micro_batch_size)
        self.replays += 1
        event("out_of_memory", {"global_batch_size": global_batch_size, "max_micro_batch_size": old,
                                "new_max_micro_batch_size": max_micro_batch_size, "error": error})

    def discard(self, event: Callable[..., None]) -> None:
        """The loop was left inside a step (a ``break`` or an exception in the loop body, even right after
        the last micro-batch's backward, since the step runs when the loop asks for the next micro-batch):
        rewind it, so that the next loop (or a checkpoint saved now) runs the whole step again as if it had
        never started and counts nothing twice."""
        self._rewind()
        self.failed_micro_batch_size = None
        self.loader.restart_step()
        event("interrupted_step", {"note": "the loop left a step unfinished; its gradients were dropped "
                                           "and the next batches() runs it again"}, warn=False)

    def _rewind(self) -> None:
        """Drop the step's gradients, losses and timings; put torch's RNG and (with ``oom_recovery``) the
        buffers back to the step's start."""
        self.step_end.discard()
        rng = self.loader.step_start_rng
        if rng is not None:
            set_torch_rng(rng, self.device)
        if self.oom_recovery:
            with torch.no_grad():
                for buffer, saved in zip(self.module.buffers(), self._buffers):
                    buffer.copy_(saved)
        self.meter.discard_step()
