"""Gradient noise (McCandlish et al. 2018): on a measured step every micro-batch whose gradient is visible
before any cross-rank reduction is a "small" batch; the step's final (reduced) gradient is the "big" one.
The increment of ``.grad`` by micro-batch ``j`` is ``(n_j / B) g_j`` (the engine's loss weighting), so
``|g_j|^2 = |increment|^2 (B / n_j)^2``. Under DDP the last micro-batch's backward already all-reduces,
so its local norm is read inside DDP's all-reduce by a communication hook (:meth:`GradientNoiseProbe.attach_ddp`);
without DDP all of them are small batches. With several ranks the small batches thus come for free
(each rank's gradient before the reduction; three scalars are all-reduced). Otherwise (one process, or
a DDP model that already has a communication hook) a step with a single micro-batch is split in two on
measured steps (:attr:`GradientNoiseProbe.split_every`), which keeps the estimate unbiased.

How often: the split costs a second forward/backward pass at half size on a measured step (+70-80% of that
step for a small CNN on CPU at batch 32-128, nothing at 512); a step that has its own small batches (several
micro-batches, or ranks) costs only the gradient snapshots and norms. With ``every=None`` (the engine's
default) the period adapts to the estimate (:class:`GradientNoiseProbe`): short while the relative standard
error of ``B_simple`` is above :data:`TARGET_RELATIVE_ERROR`, doubling while it is below half of it; split
steps are never measured more often than every :data:`MIN_SPLIT_PERIOD` steps. Whatever the period, old
measurements fade with a time constant of about 400 *steps* (EMA decay ``0.99 ** (steps / 4)``), see
docs/statistics.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from .._validation import check_positive_int
from ..clipping import sum_of_squares
from ..stats.noise_scale import NoiseScaleEstimator

logger = logging.getLogger("batchpilot")

DEFAULT_NOISE_EVERY = 16
"""A fixed measurement period for loops that cannot follow an adaptive one (the HF and Lightning integrations)."""

TARGET_RELATIVE_ERROR = math.log(2)
"""Adaptive period: the relative standard error of ``B_simple`` it allows, ``ln 2``: one standard error of
``ln B_simple`` within one doubling, the step in which controllers change the batch size. ``B_simple`` is itself
only a proxy for the critical batch (it equals ``B_noise`` only for a Hessian proportional to the identity:
McCandlish et al. 2018, Sec. 2.2), so a finer estimate buys little."""

DOUBLE_MARGIN = 0.8
"""Adaptive period: the period doubles only when the error predicted at twice the period is below this share of
the target, so that the ordinary scatter of the error around its steady state does not halve it right back."""

MIN_SPLIT_PERIOD = 16
"""Adaptive period: a step that must be split to be measured (+70-80% of a small step) is measured at most
every this many steps; a step with its own small batches (several micro-batches, or ranks) every step."""

MAX_PERIOD = 64
"""Adaptive period: the longest, so that a drift of the noise scale is noticed within a few hundred steps."""

DECAY_PER_STEP = 0.99 ** 0.25
"""The estimate's EMA decay per *step* between measurements: a time constant of about 400 steps."""


class GradientNoiseProbe:
    """Measures micro-batch gradient norms on every ``every``-th step and feeds a noise-scale estimator.

    The adaptive period (``every=None``): steps whose index is a multiple of the period :attr:`every` are
    measured; one that needs a split (:attr:`split_every`) only on multiples of ``max(every,
    MIN_SPLIT_PERIOD)``. After each measurement the period halves (down to 1) while the estimate's relative
    standard error (:attr:`NoiseScaleEstimator.relative_error`) exceeds ``target_error`` or cannot be told
    yet, and doubles (up to :data:`MAX_PERIOD`) while it is below half of it. Each measurement gets the EMA
    weight of the steps since the previous one (decay ``DECAY_PER_STEP ** steps``), so the estimate is an
    average over time whatever the period. It stays unbiased: whether a step is measured is decided before
    its samples are drawn, from earlier measurements only; a measurement is never dropped or reweighted for
    its value; and splitting changes only how the step's samples are grouped, not which they are.

    Args:
        params: The trained parameters.
        every: Measure on steps whose index is a multiple of ``every``; ``None``: the adaptive period above.
        ema_decay: Smoothing of the estimator per measurement with a fixed period (see
            :class:`~batchpilot.stats.NoiseScaleEstimator`); default ``0.99 ** (every / 4)``, a time
            constant of about 400 steps. Not with ``every=None``.
        target_error: The adaptive period's target relative error (default :data:`TARGET_RELATIVE_ERROR`).
        ranks_are_small_batches: Every rank's gradient is visible before the engine reduces it (several
            ranks, no DDP): the ranks are the small batches, so a measured step is never split.
        population: The dataset's size: steps are drawn from it without replacement, and the estimate is
            corrected for that (see :func:`~batchpilot.stats.two_batch_estimates`); ``None``: no correction.
            :attr:`population` may be set between steps (a dataset reloaded with another size).
    """

    def __init__(self, params: list[torch.nn.Parameter], every: int | None = DEFAULT_NOISE_EVERY,
                 ema_decay: float | None = None, ranks_are_small_batches: bool = False,
                 population: int | None = None, target_error: float = TARGET_RELATIVE_ERROR) -> None:
        self.params = params
        self.population = population  # checked by the property
        self.adaptive = every is None
        if self.adaptive and ema_decay is not None:
            raise ValueError(f"ema_decay={ema_decay!r} needs a fixed period: with every=None each measurement's "
                             "decay follows the steps since the previous one; pass every=N or leave ema_decay out.")
        if isinstance(target_error, bool) or not isinstance(target_error, (int, float)) or not target_error > 0:
            raise ValueError(f"target_error must be a relative error > 0, got {target_error!r}; e.g. 0.15.")
        self.target_error = float(target_error)
        self.every: int = 1 if every is None else check_positive_int(every, "every")
        self._split = not ranks_are_small_batches
        if ema_decay is None:
            ema_decay = 0.99 ** (self.every / 4)
        self.estimator = NoiseScaleEstimator(ema_decay=ema_decay)
        self.measuring = False
        self._step = 0  # the step in flight
        self._last_update: int | None = None  # the step of the last measurement that updated the estimate
        self._values: dict[str, float] = {}  # values(), rebuilt when the estimate changes
        self._prev: list[torch.Tensor] | None = None
        self._have_prev = False  # _prev holds the gradient after this step's previous measured micro-batch
        self._sq_norms: list[float | torch.Tensor] = []
        self._sizes: list[int] = []
        self._index = {id(p): i for i, p in enumerate(params)}
        # Last micro-batch's local |increment|^2, seen by the DDP hook (a device tensor on a GPU).
        self._hook_sq: float | torch.Tensor | None = None
        # Measurements cost a full-precision all-reduce (a compression hook, see attach_comm_hook): the adaptive
        # period then measures no more often than a split step (MIN_SPLIT_PERIOD).
        self.costly = False
        self.seconds = 0.0  # time spent measuring, for the overhead report
        self.reads_every_backward = False  # FSDP2: every backward of a measured step reduces (read_local_sq)

    @property
    def population(self) -> int | None:
        """The dataset's size the estimate is corrected for (``None``: no correction); settable between steps
        to ``None`` or an int >= 1 (else ``TypeError``/``ValueError``)."""
        return self._population

    @population.setter
    def population(self, value: int | None) -> None:
        self._population = None if value is None else check_positive_int(value, "population")

    @property
    def split_every(self) -> int | Callable[[int], bool] | None:
        """Which steps to split into at least two micro-batches, whose gradients are then the small batches:
        every ``split_every``-th step (a fixed period), :meth:`splits` (the adaptive period: it asks the
        probe's current period), or ``None`` (never; the ranks are the small batches)."""
        if not self._split:
            return None
        return self.splits if self.adaptive else self.every

    def splits(self, step: int, costly: bool = False) -> bool:
        """Whether step ``step`` must be split to be measured, at the current period (ask between steps);
        ``costly``: whether a step whose measurement costs as much as a split (see :attr:`costly`) is measured."""
        if not (self._split or costly):
            return False
        period = max(self.every, MIN_SPLIT_PERIOD) if self.adaptive else self.every
        return step % period == 0

    def set_params(self, params: list[torch.nn.Parameter]) -> None:
        """Measure ``params`` from the next step on (call between steps, when the trainable set changed: the
        small batches' norms must cover the same parameters as the step's norm). The estimates carry over."""
        if self.measures(params):
            return
        self.params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        self._prev, self._have_prev = None, False

    def measures(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether the probe measures exactly ``params``, in this order."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def attach_ddp(self, ddp_model: Any) -> bool:
        """Read each rank's gradient inside DDP's own all-reduce (a communication hook), so that under DDP
        the ranks are the small batches for free and no measured step is split.

        The hook adds the squared norm of the rank-local gradient increment (the bucket before the
        reduction) on measured steps, then averages over ranks exactly as DDP's default does, or through the
        compression hook :func:`attach_comm_hook` set (in full precision on measured steps). DDP allows one hook
        per model, so the hook reads the model's current probe: a later probe on the same model (a second
        ``train()`` or ``fit()``) takes the hook over. Returns ``False`` (and the probe keeps splitting) if
        the model already has another communication hook.
        """
        attach = getattr(ddp_model, "attach_noise_probe", None)
        if attach is not None:  # FSDP2 (engine/sharded.py): each micro-batch's gradient is read in its reduce-scatter
            attach(self)
            self._split, self.reads_every_backward, self.costly = False, True, True  # (costly: no no_sync then)
            return True
        if not getattr(ddp_model, "_batchpilot_hooked", False):
            try:
                _register_dispatcher(ddp_model)
            except RuntimeError:  # a hook is registered already: DDP allows one
                return False
        ddp_model._batchpilot_probe = self
        self._split = False
        # A measured step is sent in full precision: with a compression hook it costs what a split step costs.
        self.costly = getattr(ddp_model, "_batchpilot_comm", None) is not None
        return True

    def _read_bucket(self, bucket: Any) -> None:
        """On a measured step, add the squared norm of this rank's gradient increment in ``bucket``."""
        if self.measuring:
            start = time.perf_counter()
            prev = self._prev if self._have_prev else None
            index = [self._index.get(id(p)) for p in bucket.parameters()]
            increment = [g if prev is None or i is None else g - prev[i] for g, i in zip(bucket.gradients(), index)]
            sq = sum_of_squares(increment, lazy=True)  # on a GPU a device tensor: no sync inside backward
            self.read_local_sq(sq)
            self.seconds += time.perf_counter() - start

    def read_local_sq(self, sq: float | torch.Tensor) -> None:
        """Add a squared norm of this rank's gradient in this backward, read before the reduction (DDP, FSDP2)."""
        self._hook_sq = sq if self._hook_sq is None else self._hook_sq + sq

    def begin_step(self, step_index: int, small_batches: bool = False) -> None:
        """Step ``step_index`` starts; ``small_batches``: it has its own small batches (two or more micro-batches
        on this rank, equally on every rank), so the adaptive period may measure it without a split."""
        self._step = step_index
        if self.adaptive:
            free = (small_batches or not self._split) and not self.costly
            self.measuring = step_index % self.every == 0 if free else self.splits(step_index, costly=self.costly)
        else:
            self.measuring = step_index % self.every == 0
        self._sq_norms, self._sizes = [], []
        self._hook_sq, self._have_prev = None, False

    def after_backward(self, micro_batch_size: int, to_mean: float, synced: bool, last: bool = False) -> None:
        """Record the gradient norm of a micro-batch of ``micro_batch_size`` samples.

        Args:
            micro_batch_size: Samples in the micro-batch.
            to_mean: The factor between this backward's ``.grad`` increment and the micro-batch's mean
                gradient (the engine's loss weight, times the AMP loss scale, times ``micro_batch_size`` for a
                summed loss): ``increment = to_mean * g_j``.
            synced: This backward already reduced the gradients over ranks (DDP's last micro-batch);
                its local norm is the one the DDP hook saw (:meth:`attach_ddp`), if any.
            last: The step's last micro-batch on this rank (its gradient need not be kept for a next one).
        """
        if synced or self.reads_every_backward:
            sq, self._hook_sq = self._hook_sq, None
            if self.measuring and micro_batch_size and sq is not None:
                self._sq_norms.append(sq / to_mean**2)
                self._sizes.append(micro_batch_size)
            return
        if not self.measuring or micro_batch_size == 0:
            return
        start = time.perf_counter()
        grads = self._grads()
        # The first measured micro-batch's increment is the gradient itself: no snapshot to subtract.
        increment = torch._foreach_sub(grads, self._prev) if self._have_prev and self._prev is not None else grads
        sq = sum_of_squares(increment, lazy=True)  # on a GPU a device tensor: read once, at the step's end
        if not last:  # the next micro-batch's increment is taken against this gradient
            if self._prev is None or len(self._prev) != len(grads):
                self._prev = [g.detach().clone() for g in grads]
            else:
                torch._foreach_copy_(self._prev, grads)
            self._have_prev = True
        self._sq_norms.append(sq / to_mean**2)
        self._sizes.append(micro_batch_size)
        self.seconds += time.perf_counter() - start

    def end_step(
        self, global_batch_size: int, grad_sq_norm: float, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> dict[str, float]:
        """Update the estimator with the step's reduced gradient; return the current estimates.

        ``reduce`` sums a small tensor over ranks (every rank must call this on a measured step): the
        small-batch norms of all ranks then enter one estimate, identical everywhere.
        """
        if self.measuring:
            sq_sum = float(sum(self._sq_norms))  # one device-to-host copy on a GPU
            totals = [float(len(self._sizes)), sum(1.0 / n for n in self._sizes), sq_sum]
            if reduce is not None:
                totals = reduce(torch.tensor(totals, dtype=torch.float64)).tolist()
            k, inverse_sizes, sq_sum = totals
            if k > 0 and math.isfinite(sq_sum) and math.isfinite(grad_sq_norm):
                b_small = k / inverse_sizes  # harmonic mean of the small batch sizes
                # A step longer than the dataset repeats samples: no correction for it (never in the engine).
                population = self.population if self.population and global_batch_size <= self.population else None
                if global_batch_size > b_small:
                    self._update(b_small, sq_sum / k, global_batch_size, grad_sq_norm, population)
        self.measuring = False
        return self.values()

    def _update(self, b_small: float, sq_small: float, b_big: int, sq_big: float, population: int | None) -> None:
        decay = None
        if self.adaptive:  # the weight of the steps since the previous measurement (the first: its own step)
            gap = 1 if self._last_update is None else max(self._step - self._last_update, 1)
            decay = DECAY_PER_STEP**gap
        self.estimator.update(b_small, sq_small, b_big, sq_big, population=population, decay=decay)
        self._last_update = self._step
        if self.adaptive:
            self.every = self.next_period()
        self._values = {}

    def next_period(self) -> int:
        """The adaptive period after the latest measurement, in ``[1, MAX_PERIOD]``: halved while the relative
        error is above the target (or cannot be told yet); doubled when the error at twice the period, once the
        EMA has settled there, would stay below ``DOUBLE_MARGIN`` times the target (the same spread of single
        estimates over the steady-state effective count ``(1 + d) / (1 - d)``, ``d = DECAY_PER_STEP ** period``);
        else kept."""
        est = self.estimator
        error = est.relative_error
        if error is None or error > self.target_error:
            return max(self.every // 2, 1)
        doubled = self.every * 2
        if doubled > MAX_PERIOD:
            return self.every
        gap = max(doubled, MIN_SPLIT_PERIOD) if self._split or self.costly else doubled  # a split's shortest period
        d = DECAY_PER_STEP**gap
        later = est.relative_error_at((1 + d) / (1 - d))
        return doubled if later is not None and later <= DOUBLE_MARGIN * self.target_error else self.every

    def values(self) -> dict[str, float]:
        """The estimates under their logged names (a new dict each call)."""
        if not self._values and self.estimator.count:
            out = self.estimator.metrics()
            if "stats/trace_cov" in out:
                out["stats/grad_variance"] = out["stats/trace_cov"]  # seed 002's sigma_t^2, from micro-batches
            out["stats/noise_count"] = self.estimator.count  # measured steps behind the estimate
            if self.adaptive:
                out["stats/noise_period"] = float(self.every)
                error = self.estimator.relative_error
                if error is not None:
                    out["stats/noise_scale_error"] = error
            self._values = out
        return dict(self._values)

    def _grads(self) -> list[torch.Tensor]:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2 on one rank: local shards

    def state_dict(self) -> dict[str, Any]:
        return {"every": int(self.every), "estimator": self.estimator.state_dict(), "adaptive": self.adaptive,
                "last_update": self._last_update}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, the checkpoint's kind of period (fixed or adaptive)
        included (``ValueError``/``TypeError`` for a period that is not an int >= 1, or an invalid estimator
        state; nothing is changed then). States saved before the adaptive period have a fixed one."""
        every = check_positive_int(state["every"], "the checkpoint's noise_every")
        last = state.get("last_update")
        last = None if last is None else check_positive_int(last, "the checkpoint's last noise update", minimum=0)
        self.estimator.load_state_dict(state["estimator"])
        self.every, self.adaptive, self._last_update = every, bool(state.get("adaptive", False)), last
        self._values = {}


def _register_dispatcher(ddp_model: Any) -> None:
    """Register batchpilot's one communication hook on ``ddp_model`` (DDP allows one): it lets the model's noise
    probe (``ddp_model._batchpilot_probe``) read the local bucket, then reduces through the compression hook set by
    :func:`attach_comm_hook` (``ddp_model._batchpilot_comm``) or, without one, as DDP's default does. On a step
    the probe measures, the reduction is in full precision: a hook state with a ``full_precision`` attribute is
    told so (its step counter and buffers go on), any other hook is bypassed for DDP's default all-reduce. The
    statistics thus read the same gradients as without compression.

    Raises:
        RuntimeError: the model has another communication hook (DDP's own error).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # no annotations: DDP checks them
        probe = getattr(ddp_model, "_batchpilot_probe", None)
        measuring = probe is not None and probe.measuring
        if measuring:
            probe._read_bucket(bucket)
        comm = getattr(ddp_model, "_batchpilot_comm", None)
        if comm is None:
            return allreduce_hook(state, bucket)
        comm_state, comm_hook = comm
        if hasattr(comm_state, "full_precision"):
            comm_state.full_precision = measuring
        elif measuring:
            return allreduce_hook(state, bucket)
        return comm_hook(comm_state, bucket)

    ddp_model.register_comm_hook(ddp_model.process_group, hook)  # DDP's own group, not always WORLD
    ddp_model._batchpilot_hooked = True


def attach_comm_hook(ddp_model: Any, state: Any, hook: Callable[[Any, Any], Any]) -> None:
    """Reduce ``ddp_model``'s gradients through ``hook(state, bucket)`` (a DDP communication hook), behind the
    noise probe's reading of the local gradient (:func:`_register_dispatcher`); a probe attached to the model
    then measures no more often than a split step (:attr:`GradientNoiseProbe.costly`).

    Raises:
        RuntimeError: the model has a communication hook that is not batchpilot's.
    """
    if not getattr(ddp_model, "_batchpilot_hooked", False):
        _register_dispatcher(ddp_model)
    ddp_model._batchpilot_comm = (state, hook)
    probe = getattr(ddp_model, "_batchpilot_probe", None)
    if probe is not None:
        probe.costly = True


def engine_probe(params: list[torch.nn.Parameter], every: int | None, *, needed: bool, ranks_are_small_batches: bool,
                 population: int, ddp_model: Any = None) -> GradientNoiseProbe | None:
    """The engine's probe, measuring every ``every`` steps (``None``: the adaptive period when ``needed``, else
    no probe), hooked into ``ddp_model``'s all-reduce when one is given (:meth:`attach_ddp
    <GradientNoiseProbe.attach_ddp>`); ``population``: the dataset's size (epochs draw without replacement)."""
    if every is None and not needed:
        return None
    probe = GradientNoiseProbe(params, every=every, ranks_are_small_batches=ranks_are_small_batches,
                               population=population)
    if ddp_model is not None and not probe.attach_ddp(ddp_model):
        logger.info("the DDP model already has a communication hook: measured steps are split in two "
                    "to measure the gradient noise scale (see docs/statistics.md)")
    return probe


