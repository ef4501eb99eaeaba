"""A `Pilot` whose batch sizes count tokens (``batch_unit="tokens"``; the data side is :mod:`batchpilot.data.tokens`).

Everything that decides or follows the size then works in tokens: the controller's :class:`~batchpilot.Observation`
(``batch_size``, ``samples_seen``, ``num_samples`` and ``samples_per_s`` are tokens, tokens seen, the dataset's
tokens and tokens per second), ``min_batch_size`` / ``max_batch_size``, the LR coupling's ``base_batch_size``, the
sample-based LR schedules (stepped with tokens seen), AdaScale's scale and the gradient noise scale (``B_small`` and
``B_big`` are the tokens of the small and the global batch, so ``B_noise`` is in tokens, McCandlish et al. 2018's
unit for language models). The data position, ``pilot.samples_seen``, ``max_samples=`` and ``epochs=`` still count
samples; ``pilot.tokens_seen`` counts tokens.
"""

from __future__ import annotations

from typing import Any

from ..data.loader import AdaptiveDataLoader, MicroBatch


def setup_tokens(pilot: Any) -> None:
    """Point a new Pilot's counters at tokens when its loader counts them (nothing otherwise).

    With ``batch_size="auto"`` the :class:`~batchpilot.controllers.Auto` bounds left at their defaults become token
    counts (:meth:`~batchpilot.controllers.Auto.count_tokens`) and the first step's budget is its ``min_size``: the
    start probes then sweep token budgets.
    """
    plan = pilot.loader.sampler.token_plan
    if plan is None:
        return
    if pilot._auto and pilot.controller.probe is None:  # (an Auto that has probed counts tokens already)
        pilot.controller.count_tokens(plan.total_tokens / pilot.num_samples)
        pilot.loader.set_batch_size(pilot.controller.min_size)
    pilot.driver.num_samples = plan.total_tokens  # what Observation.num_samples holds: the dataset's tokens
    if pilot._noise is not None:
        pilot._noise.population = plan.total_tokens  # the finite-population correction, in tokens


def micro_bound(loader: AdaptiveDataLoader) -> int | None:
    """The micro-batch bound a controller observes (``perf/max_micro_batch_size``) in the batch's unit: samples, or
    in tokens ``max_micro_batch_tokens`` (with a sample bound only, e.g. after running out of memory, that many
    samples of the dataset's mean length)."""
    plan = loader.sampler.token_plan
    if plan is None or loader.max_micro_batch_tokens is not None:
        return loader.max_micro_batch_size if plan is None else loader.max_micro_batch_tokens
    if loader.max_micro_batch_size is None:
        return None
    return max(1, round(loader.max_micro_batch_size * plan.total_tokens / loader.sampler.num_samples))


def token_record(record: dict[str, Any], micro: MicroBatch, tokens_seen: int, num_samples: int) -> None:
    """Add a step's tokens to its ``record`` (the step's last micro-batch: ``micro``): ``tokens`` (the global batch's),
    ``tokens_seen``, ``batch/local_tokens`` and ``perf/tokens_per_s``; ``samples_seen`` and ``virtual_epoch`` count
    the step's samples (nothing changes for a batch counted in samples)."""
    if micro.global_tokens is None:
        return
    samples_seen = micro.samples_seen + micro.global_size
    seconds = record.get("perf/step_time_s") or 0.0
    record.update({"samples_seen": samples_seen, "virtual_epoch": samples_seen / num_samples,
                   "tokens": micro.global_tokens, "tokens_seen": tokens_seen, "batch/local_tokens": micro.local_tokens,
                   "perf/tokens_per_s": micro.global_tokens / seconds if seconds > 0 else float("nan")})
