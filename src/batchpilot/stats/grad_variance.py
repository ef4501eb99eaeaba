"""Per-sample gradient variance ``sigma_t^2`` (seed 002): ``sigma_t^2 = (1/n) sum_i |g_i - g_mean|^2``.

``g_i`` is the gradient of sample ``i``'s loss with respect to the trainable parameters and ``g_mean`` their
mean over the batch; the squared norm sums over every parameter coordinate, so ``sigma_t^2`` is the sum of
the per-coordinate (population, ``1/n``) variances. It is the in-batch estimate of ``tr(Sigma)``, the
numerator of the gradient noise scale (McCandlish et al. 2018), with expectation ``(n - 1)/n tr(Sigma)``.

Two ways to get it:

* :func:`per_sample_grad_variance`: exact, from per-sample gradients computed with ``torch.func``
  (``functional_call`` + ``vmap`` + ``grad``; the recipe of the torch.func "per-sample gradients"
  tutorial). It costs several forward/backward passes of the batch (3-9x on the MNIST-1D CNN, see
  benchmarks/estimators.py) and ``chunk_size x parameters`` memory, so measure it every few hundred
  steps, not every step. Models that couple the samples of a
  batch (BatchNorm in train mode) have no per-sample gradients and raise :class:`PerSampleGradError`.
* :func:`micro_batch_grad_variance`: an unbiased estimate from the gradients of ``k >= 2`` micro-batches
  (free in an accumulating loop, or from the ranks under DDP), for any model.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from .._wrappers import unwrap
from .noise_scale import _check_sq_norm

__all__ = ["PerSampleGradError", "micro_batch_grad_variance", "per_sample_grad_variance"]


class PerSampleGradError(RuntimeError):
    """``torch.func`` cannot compute per-sample gradients of this model (or they are not defined)."""


def _fallback_hint() -> str:
    return (
        "Use batchpilot.stats.micro_batch_grad_variance (works for any model), or measure with the model in "
        "eval() mode / with GroupNorm or LayerNorm instead of BatchNorm."
    )


def per_sample_grad_variance(
    model: nn.Module,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    targets: torch.Tensor,
    *,
    chunk_size: int | None = None,
    randomness: str = "different",
) -> float:
    """Exact ``sigma_t^2 = (1/n) sum_i |g_i - g_mean|^2`` over per-sample gradients (seed 002).

    Each ``g_i`` is ``grad loss_fn(model(x_i[None]), y_i[None])`` over the parameters with
    ``requires_grad=True``, evaluated with ``torch.func.vmap`` (no Python loop over samples). The model
    and its ``.grad`` fields are not modified. Chunks are combined with the pairwise update of Chan,
    Golub & LeVeque (1979), so the result does not suffer from the cancellation of
    ``mean |g_i|^2 - |g_mean|^2``.

    Args:
        model: The model (DDP and ``torch.compile`` wrappers are unwrapped). Its current train/eval mode is used.
        loss_fn: ``loss_fn(outputs, targets) -> scalar``, the mean (or sum) loss of a batch; it is called on
            batches of one sample.
        inputs: Batched input tensor, or a tuple of them (positional arguments of ``model``), with the
            samples along dim 0.
        targets: Batched targets, ``n`` along dim 0.
        chunk_size: Samples per vmap call (bounds the memory to ``chunk_size x num_parameters``);
            ``None``: the whole batch at once.
        randomness: ``torch.func.vmap``'s randomness mode for dropout and the like: ``"different"``
            (default: every sample draws its own mask, as in training), ``"same"`` or ``"error"``.

    Returns:
        ``sigma_t^2`` as a Python float (accumulated in float64).

    Raises:
        ValueError: fewer than two samples, mismatched lengths, a bad ``chunk_size``, or no trainable
            parameters.
        PerSampleGradError: BatchNorm in train mode (samples are coupled, per-sample gradients are not
            defined), or ``torch.func`` failed on the model; the message names the fallback.
    """
    model, _ = unwrap(model)  # the bare module: torch.func runs it eagerly
    xs = inputs if isinstance(inputs, tuple) else (inputs,)
    n = int(xs[0].shape[0])
    if n < 2:
        raise ValueError(f"per_sample_grad_variance needs a batch of at least 2 samples, got {n}.")
    for i, x in enumerate((*xs, targets)):
        if x.shape[0] != n:
            raise ValueError(f"all inputs and targets need {n} samples along dim 0; argument {i} has {x.shape[0]}.")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}.")
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            raise PerSampleGradError(
                f"{type(module).__name__} {name!r} is in train mode: it mixes the samples of a batch, so "
                f"per-sample gradients are not defined. {_fallback_hint()}"
            )
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("the model has no parameter with requires_grad=True: no gradient to measure.")
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def sample_loss(p: dict[str, torch.Tensor], x: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor:
        # x: one sample per input (no batch dim under vmap); give the model a batch of one.
        out = functional_call(model, (p, frozen, buffers), tuple(t.unsqueeze(0) for t in x))
        return loss_fn(out, y.unsqueeze(0))

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0), randomness=randomness)
    step = n if chunk_size is None else chunk_size
    count, mean, m2 = 0, None, 0.0  # running mean (float64, flat) and sum of squared deviations
    for start in range(0, n, step):
        stop = min(start + step, n)
        try:
            grads = per_sample(params, tuple(x[start:stop] for x in xs), targets[start:stop])
        except (RuntimeError, ValueError) as err:  # e.g. a batch_norm call in training mode on one sample
            raise PerSampleGradError(
                f"torch.func could not compute per-sample gradients of {type(model).__name__}: {err}. {_fallback_hint()}"
            ) from err
        # flat: (c, P) per-sample gradients of this chunk, P = trainable parameter count.
        flat = torch.cat([g.reshape(stop - start, -1) for g in grads.values()], dim=1).double()
        c = stop - start
        chunk_mean = flat.mean(0)
        chunk_m2 = float(((flat - chunk_mean) ** 2).sum())
        if mean is None:
            count, mean, m2 = c, chunk_mean, chunk_m2
        else:
            delta = chunk_mean - mean
            total = count + c
            m2 += chunk_m2 + float(delta.dot(delta)) * count * c / total
            mean = mean + delta * (c / total)
            count = total
    return m2 / n


def _flatten(g: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    if isinstance(g, torch.Tensor):
        return g.detach().reshape(-1).double()
    return torch.cat([t.detach().reshape(-1).double() for t in g])


def micro_batch_grad_variance(
    micro: Sequence[float] | Sequence[torch.Tensor] | Sequence[Sequence[torch.Tensor]],
    sizes: Sequence[int],
    sq_norm_mean: float | None = None,
) -> float:
    """Estimate ``sigma_t^2`` of the whole batch from the mean gradients of its ``k`` micro-batches.

    With micro-batch mean gradients ``g_j`` of ``n_j`` samples (``N = sum n_j``, ``g = sum n_j g_j / N``),
    the micro-batch means scatter around ``g`` with variance ``sigma^2 / n_j`` (up to the finite-population
    factor), so scaling the spread of the means by the sizes recovers the per-sample variance::

        sigma_t^2 ~ (N - 1) / (N (k - 1)) * sum_j n_j |g_j - g|^2

    Unbiased for the batch's ``sigma_t^2`` when the batch is split into micro-batches of these sizes at
    random (sampling without replacement; averaged over all splits it equals the exact value), and, as
    an estimate of ``tr(Sigma)``, it agrees with the noise scale's two-batch estimate (exactly up to
    ``(N-1)/N`` for micro-batches of equal size, in expectation otherwise). With ``n_j = 1`` it
    *is* the exact value. It uses only ``k`` gradients, so it is much noisier than the exact
    :func:`per_sample_grad_variance` when ``k`` is small: smooth it over steps.

    Args:
        micro: Either the ``k`` micro-batch mean gradients (each a tensor or a list of per-parameter
            tensors; exact arithmetic in float64), or their squared norms ``|g_j|^2`` as floats, in
            which case ``sq_norm_mean`` is required and the sum is evaluated as
            ``sum_j n_j |g_j|^2 - N |g|^2`` (clamped at 0: it can cancel when the variance is tiny).
        sizes: ``n_j``; micro-batches of size 0 are left out.
        sq_norm_mean: ``|g|^2``, the squared norm of the size-weighted mean (only with float ``micro``).

    Raises:
        ValueError: lengths differ, fewer than two non-empty micro-batches, or ``sq_norm_mean`` given
            with tensors / missing with floats.
    """
    if len(micro) != len(sizes):
        raise ValueError(f"micro has {len(micro)} entries but sizes has {len(sizes)}; pass one size per micro-batch.")
    for j, nj in enumerate(sizes):
        if isinstance(nj, bool) or not isinstance(nj, numbers.Integral) or nj < 0:
            raise ValueError(f"sizes[{j}] must be an int >= 0, got {nj!r}.")
    keep = [j for j, nj in enumerate(sizes) if nj > 0]
    k, total = len(keep), sum(int(sizes[j]) for j in keep)
    if k < 2:
        raise ValueError(f"need at least two non-empty micro-batches, got sizes={list(sizes)}.")
    scalar = all(isinstance(micro[j], numbers.Real) and not isinstance(micro[j], bool) for j in keep)
    if scalar:
        if sq_norm_mean is None or not math.isfinite(sq_norm_mean) or sq_norm_mean < 0:
            raise ValueError(
                f"with squared norms as `micro`, sq_norm_mean (|g|^2 of the whole batch) must be a finite number >= 0; "
                f"got {sq_norm_mean!r}."
            )
        squares = [_check_sq_norm(micro[j], f"micro[{j}]") for j in keep]
        spread = sum(int(sizes[j]) * sq for j, sq in zip(keep, squares)) - total * float(sq_norm_mean)
        spread = max(spread, 0.0)
    else:
        if sq_norm_mean is not None:
            raise ValueError("sq_norm_mean is only used with squared norms; with gradients it is computed exactly.")
        flats = [_flatten(micro[j]) for j in keep]  # type: ignore[arg-type]
        weights = torch.tensor([float(sizes[j]) for j in keep], dtype=torch.float64)
        stacked = torch.stack(flats)  # (k, P)
        mean = (weights[:, None] * stacked).sum(0) / total
        spread = float((weights * ((stacked - mean) ** 2).sum(1)).sum())
    return (total - 1) / (total * (k - 1)) * spread
