"""Save on SIGTERM (``save_on_sigterm=True``): a planned stop (a preemption, torchrun's restart after a
membership change) loses no step.

AdaptDL's approach: the signal handler only sets a flag. At the end of the current step every rank agrees on
it at no extra cost: the flag rides on the float64 all-reduce the step end already makes for the step's loss
(:func:`~batchpilot.engine.step_end.reduce_step_totals`), so a signal that reached any one rank stops them all,
at the same step. Then every rank saves a checkpoint (rank 0 writes, through :meth:`Pilot.save_checkpoint`),
``pilot.preempted`` becomes True and :meth:`Pilot.batches` ends; later calls of it return at once.

Python runs signal handlers in the main thread only: a ``Pilot`` looping in another thread (Ray Train's
workers, say) cannot install one and trains without it, with a warning. On Windows another process cannot send
SIGTERM (it terminates the process outright); only a ``signal.raise_signal(SIGTERM)`` inside it is caught.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

logger = logging.getLogger("batchpilot")

Handler = Any  # what signal.getsignal returns: a callable, SIG_DFL, SIG_IGN or None


class Preemption:
    """The SIGTERM flag of one `Pilot` and what the step end does with it.

    Args:
        enabled: ``save_on_sigterm``; when False nothing is installed and the flag never rises.

    Attributes:
        requested: SIGTERM reached this process (since the handler was installed).
        agreed: Some rank had ``requested`` at the last step end: every rank stops after that step.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.requested = False
        self.agreed = False
        self._previous: Handler = None
        self._installed = False
        self._warned = False

    def install(self) -> None:
        """Handle SIGTERM from now on (called when :meth:`Pilot.batches` starts). The handler sets
        :attr:`requested` and then calls the handler it replaced when that is a Python function (so a handler of
        the user's still runs); :meth:`restore` puts that one back."""
        if not self.enabled or self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            if not self._warned:
                self._warned = True
                logger.warning("save_on_sigterm=True needs the main thread (Python delivers signals to it only); "
                               "this Pilot trains in thread %r, so a SIGTERM is not caught and saves nothing.",
                               threading.current_thread().name)
            return
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def restore(self, *, preempted: bool) -> None:
        """Put the previous SIGTERM handler back (when :meth:`Pilot.batches` ends). A SIGTERM that came too late
        for the last step's end (the loop ended for another reason) is raised again for the restored default
        handler, so the process still does what it was asked to: it terminates. (A Python handler had it already.)"""
        if not self._installed:
            return
        previous = signal.SIG_DFL if self._previous is None else self._previous
        signal.signal(signal.SIGTERM, previous)
        self._installed = False
        late, self.requested = self.requested and not preempted, False
        if late and previous == signal.SIG_DFL:
            logger.warning("SIGTERM arrived after the last step's end (the loop had ended): terminating now.")
            signal.raise_signal(signal.SIGTERM)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # nothing else here: the step end acts on it, between two steps
        if callable(self._previous):
            self._previous(signum, frame)


def stop_if_agreed(pilot: Any, *, saved: bool) -> None:
    """After a step's end (its decision, callbacks and periodic checkpoint): if the ranks agreed on a SIGTERM,
    save a checkpoint (unless ``saved``: this step's periodic one is written) and stop the loop
    (``pilot.preempted``). Every rank calls this after every step."""
    preemption = pilot._preemption
    if not preemption.agreed or pilot.preempted:
        return
    path = None if saved else pilot.save_checkpoint()
    pilot.preempted = True
    if pilot.rank == 0:
        logger.warning("SIGTERM: stopped after step %d with a checkpoint%s; resume with load_checkpoint(checkpoint_dir).",
                       pilot.step, "" if path is None else f" ({path})")
