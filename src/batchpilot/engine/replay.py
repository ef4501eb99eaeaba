"""Out-of-memory detection and the step snapshots a replay restores; saving the finished step when a
decision fails. Shared by `Pilot` and the framework integrations."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

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
