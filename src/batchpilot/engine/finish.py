"""The end of one `Pilot` step, between its last micro-batch and the next step's first: the update, the
record and log line, the next size, callbacks and checkpoints, in that order."""

from __future__ import annotations

from typing import Any

from ..data.loader import MicroBatch
from ..logs import ProgressBar
from .preemption import stop_if_agreed
from .state import rescale_lr
from .step_end import step_record
from .tokens import token_record


def finish_step(pilot: Any, micro: MicroBatch, bar: ProgressBar) -> None:
    """End the step whose last micro-batch was ``micro`` (called by :meth:`Pilot.batches`)."""
    global_batch_size = micro.global_units  # samples, or tokens (batch_unit="tokens": engine/tokens.py)
    outcome = pilot._step_end.apply(global_batch_size, pilot._event)
    pilot._acc.step_open = False
    if outcome.skipped:
        pilot.skipped_steps += 1
    if pilot._couple:
        pilot.coupling.unscale()
    pilot._step_end.step_schedulers(pilot.driver.samples_seen + global_batch_size, outcome.skipped)
    # The controller's loss history leaves out a skipped step's loss, not a non-finite one a step was taken with.
    step_time = pilot.driver.end_step(global_batch_size, None if outcome.skipped else outcome.loss,
                                     finite_only=False)
    # A step that started a data iterator, or refilled prefetching after a size change, is no sample of
    # the per-step overhead (its micro-batches still count).
    clean = pilot._overhead_clean and pilot.loader.rewinds == pilot._rewinds_seen
    pilot._overhead_clean, pilot._rewinds_seen = True, pilot.loader.rewinds
    outcome.stats.update(pilot._meter.end_step(pilot.step, outcome.loss, step_time, outcome.skipped, overhead=clean))
    record = step_record(step=pilot.step, samples_seen=pilot.samples_seen, position=pilot.loader.position(),
                         num_samples=pilot.num_samples, micro=micro, outcome=outcome, step_time=step_time,
                         skipped_steps=pilot.skipped_steps)
    token_record(record, micro, pilot.driver.samples_seen, pilot.num_samples)  # (batch_unit="tokens")
    pilot.last_record = record
    pilot._log.step(record)
    bar.update(micro.global_size, record)

    pilot._acc.micro = None  # between steps from here on
    guard = pilot._guard
    if guard.check_step(pilot, global_batch_size, outcome.loss, outcome.skipped):
        stop_if_agreed(pilot, saved=False)  # a SIGTERM: save where the rollback went back to, and stop
        pilot.driver.start_clock()  # rolled back (engine/guard.py): at an earlier boundary, at the old size
        return
    size = pilot.loader.batch_size  # the size in force (an epoch's last step may have been smaller)
    guard.after_decision(pilot._decisions.after_step(record), size)
    pilot._ranks.after_step(pilot.step)  # rank_weights="auto": re-estimated every few steps (engine/rank_balance.py)
    if pilot._couple:
        pilot.coupling.scale(pilot.loader.next_step_size())
    groups = len(pilot.optimizer.param_groups)
    for fn in pilot._callbacks:
        fn(pilot, record)  # may set_batch_size() or load_checkpoint(): both re-apply the LR factor
    if pilot._callbacks:
        pilot._step_end.refresh_params()  # a callback may have unfrozen (or frozen) parameters
        if pilot._couple and len(pilot.optimizer.param_groups) != groups:
            rescale_lr(pilot.coupling, pilot.loader)  # a group added in a callback gets the factor at once
    guard.before_next_step(pilot, size)  # a snapshot before the first step at a size the controller changed to
    every = pilot.config.checkpoints.checkpoint_every
    saved = every is not None and pilot.step % every == 0
    if saved:
        pilot.save_checkpoint()
    stop_if_agreed(pilot, saved=saved)  # save_on_sigterm: every rank agreed in the step's loss all-reduce
    pilot.driver.start_clock()

