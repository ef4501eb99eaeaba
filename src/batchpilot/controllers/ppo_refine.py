"""Torch-only PPO pieces: generalized advantage estimation, the clipped update, and the reward that online
refinement reads from the observation stream.

:func:`gae` is the one advantage estimator of the package: the online refinement of
:class:`~batchpilot.controllers.ppo.PPOController` uses it, and :mod:`batchpilot.rl.gae` re-exports it (it is
tested there against a naive loop and against stable-baselines3's ``RolloutBuffer``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ._adaptive import read_stat
from .base import Observation

__all__ = ["gae", "ppo_update", "refinement_reward"]


def _as_tensor(x: torch.Tensor | Sequence[float] | float, name: str) -> torch.Tensor:
    try:
        t: torch.Tensor = x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"gae: {name} must be numbers (a tensor or a list), got {type(x).__name__} ({exc}).") from None
    if t.is_complex():
        raise TypeError(f"gae: {name} must be real numbers, got dtype {t.dtype}.")
    if not torch.isfinite(t.to(torch.float64)).all():
        raise ValueError(f"gae: {name} holds NaN or inf; check the rollout that produced it.")
    return t


def gae(
    rewards: torch.Tensor | Sequence[float],
    values: torch.Tensor | Sequence[float],
    dones: torch.Tensor | Sequence[float],
    last_value: torch.Tensor | Sequence[float] | float,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, "High-dimensional continuous control using
    generalized advantage estimation", eq. 16): ``(advantages, returns)``.

    ``delta_t = r_t + gamma * V(s_{t+1}) * (1 - done_t) - V(s_t)`` and
    ``A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}``; ``returns = A + V`` (the TD(lambda) target).

    Args:
        rewards, values, dones: shape ``[T]`` or ``[T, N]`` (N parallel environments). ``dones[t]`` is 1 when the
            episode ended with the transition of step ``t`` (so ``s_{t+1}`` is not bootstrapped); stable-baselines3
            stores the same information as ``episode_starts[t + 1]``.
        last_value: ``V(s_T)``, the value after the last step: a number, or shape ``[N]``.
        gamma: discount in ``[0, 1]``; lam: GAE's lambda in ``[0, 1]``.

    Returns:
        Two float tensors of the rewards' shape (float64 unless ``rewards`` is another float type).

    Raises:
        TypeError, ValueError: an input is not numeric, holds NaN/inf, or the shapes do not match.
    """
    for name, factor in (("gamma", gamma), ("lam", lam)):
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0.0 <= float(factor) <= 1.0:
            raise ValueError(f"gae: {name} must be a number in [0, 1], got {factor!r}.")
    r = _as_tensor(rewards, "rewards")
    dtype = r.dtype if r.is_floating_point() else torch.float64
    r = r.to(dtype)
    v = _as_tensor(values, "values").to(dtype)
    d = _as_tensor(dones, "dones").to(dtype)
    last = _as_tensor(last_value, "last_value").to(dtype)
    if r.dim() not in (1, 2) or r.shape[0] == 0:
        raise ValueError(f"gae: rewards must have shape [T] or [T, N] with T >= 1, got {tuple(r.shape)}.")
    if v.shape != r.shape or d.shape != r.shape:
        raise ValueError(f"gae: rewards {tuple(r.shape)}, values {tuple(v.shape)} and dones {tuple(d.shape)} must "
                         "have the same shape.")
    if ((d != 0) & (d != 1)).any():
        raise ValueError("gae: dones must hold only 0/1 (or booleans).")
    if last.numel() != (1 if r.dim() == 1 else r.shape[1]):
        raise ValueError(f"gae: last_value has {last.numel()} entries; it needs one per environment "
                         f"({1 if r.dim() == 1 else r.shape[1]}).")
    last = last.reshape(r.shape[1:])
    advantages = torch.zeros_like(r)
    running = torch.zeros_like(last)
    next_value = last
    for t in range(r.shape[0] - 1, -1, -1):
        keep = 1.0 - d[t]
        delta = r[t] + gamma * next_value * keep - v[t]
        running = delta + gamma * lam * keep * running
        advantages[t] = running
        next_value = v[t]
    return advantages, advantages + v


def ppo_update(
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    obs: torch.Tensor,
    actions: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    *,
    epochs: int = 4,
    clip: float = 0.2,
    vf_coef: float = 0.5,
    ent_coef: float = 0.0,
    max_grad_norm: float = 0.5,
) -> dict[str, float]:
    """``epochs`` full-batch steps of PPO's clipped objective (Schulman et al. 2017, "Proximal policy optimization
    algorithms", eq. 7) plus ``vf_coef`` x the value error minus ``ent_coef`` x the entropy, as stable-baselines3
    weighs them; advantages are normalised per batch; gradients clipped to ``max_grad_norm``.

    ``policy(obs)`` must return ``(logits, value)`` (:class:`~batchpilot.controllers.ppo_policy.PolicyMLP`).
    Returns the last epoch's ``{"policy_loss", "value_loss", "entropy", "clip_fraction"}``.
    """
    adv = advantages.to(torch.float32)
    if adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ret = returns.to(torch.float32)
    out: dict[str, float] = {}
    for _ in range(epochs):
        logits, value = policy(obs)
        dist = torch.distributions.Categorical(logits=logits)
        log_prob = dist.log_prob(actions)
        ratio = torch.exp(log_prob - old_log_probs)
        surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv)
        policy_loss = -surrogate.mean()
        value_loss = torch.nn.functional.mse_loss(value, ret)
        entropy = dist.entropy().mean()
        loss = policy_loss + vf_coef * value_loss - ent_coef * entropy
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
        optimizer.step()
        out = {"policy_loss": policy_loss.item(), "value_loss": value_loss.item(), "entropy": entropy.item(),
               "clip_fraction": float(((ratio - 1.0).abs() > clip).float().mean())}
    return out


UTIL_KEYS = ("system/gpu_util", "system/cpu_util")


def refinement_reward(
    before: Observation, after: Observation, base_size: int, weights: tuple[float, float, float] = (0.6, 0.3, 0.1),
) -> float:
    """The reward of the decision taken at ``before``, read at ``after`` (the next decision), from real measurements
    only; seed 000's three terms with the same weights as in simulation:

    * progress ("accuracy gain"): the relative fall of the mean training loss, ``(L_before - L_after) / L_before``
      over ``obs.losses`` (0 when either is unknown): real training has no accuracy between evaluations;
    * time saved: ``log(goodput_after / goodput_before)``, goodput = ``samples_per_s x E(B)`` with Pollux's
      statistical efficiency ``E(B) = (phi + B0) / (phi + B)`` (``phi`` = ``stats/noise_scale``,
      ``B0`` = ``base_size``): positive when the decision made progress per second faster (0 when unmeasured);
    * utilisation: ``system/gpu_util`` (else ``system/cpu_util``) of ``after`` in ``[0, 1]`` (0 when unmeasured).

    Each term is clipped to ``[-1, 1]`` so a glitch in a measurement cannot dominate an update.
    """
    def loss_of(o: Observation) -> float | None:
        finite = [v for v in o.losses if math.isfinite(v)]
        return sum(finite[-5:]) / len(finite[-5:]) if finite else None

    def goodput(o: Observation) -> float | None:
        phi = read_stat(o, "stats/noise_scale")
        if o.samples_per_s is None or not math.isfinite(o.samples_per_s) or o.samples_per_s <= 0 or phi is None \
                or phi <= 0:
            return None
        return o.samples_per_s * (phi + base_size) / (phi + o.batch_size)

    l0, l1 = loss_of(before), loss_of(after)
    progress = (l0 - l1) / abs(l0) if l0 is not None and l1 is not None and l0 != 0 else 0.0
    g0, g1 = goodput(before), goodput(after)
    saved = math.log(g1 / g0) if g0 is not None and g1 is not None else 0.0
    util = 0.0
    for key in UTIL_KEYS:
        u = read_stat(after, key)
        if u is not None:
            util = u / 100.0
            break
    terms = [max(-1.0, min(1.0, x)) for x in (progress, saved, util)]
    return sum(w * x for w, x in zip(weights, terms))
