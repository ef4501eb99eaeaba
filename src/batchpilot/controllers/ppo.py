"""Seed 000's PPO policy as a controller: a pretrained torch MLP multiplies the batch by one of its actions' factors
at the decision steps its metadata sets (the shipped policy: x1/4 ... x4 every 10 steps, its reversals damped).

The policy was trained offline in the trace-driven simulator (:mod:`batchpilot.rl`, docs/ppo.md) and ships with
the package; running it needs torch only. It reads the same state vector the simulator gave it in training
(:func:`batchpilot.controllers.ppo_features.features`), and hands the decision to :class:`Goodput` whenever that
vector lies outside what it saw in training.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._validation import check_bool
from ._adaptive import check_interval, check_real, check_size_bounds, check_state, clamp, fmt, round_half_up
from .base import Controller, Observation
from .goodput import Goodput
from .ppo_features import FEATURES, features
from .ppo_policy import PolicyMeta, PolicyMLP, load_policy, weights_digest
from .ppo_refine import gae, ppo_update, refinement_reward

__all__ = ["MIN_STEP", "PPOController"]

MIN_STEP = 1 / 16
"""The smallest step on ``log2 B`` the damping of reversals goes down to (x1.04)."""


class PPOController:
    """Choose the global batch size with the shipped PPO policy (seed 000, DYNAMIX arXiv 2510.08522; PPO:
    Schulman et al. 2017), falling back to Goodput (Pollux) out of the training distribution.

    Its decision steps are ``first_interval``, then every ``interval`` steps after it (both from the policy's
    metadata unless given: the schedule it was trained on). At the first call of each new period it computes the
    feature vector, and:

    * **out of distribution** -- some feature lies outside its training range ``[low, high]`` (from the policy's
      metadata) widened by ``ood_margin`` x the range's width plus 0.05 on each side (so a flag that was always
      0 in training, "noise scale missing" say, must be 0 now): the ``fallback`` decides (default
      ``Goodput(min_size, max_size, interval=1)``, called only at these decision points) and :attr:`reason` names
      the feature, its value and its range;
    * otherwise the policy picks an action (the largest logit; with ``refine=True`` one drawn from its
      distribution, PPO being on-policy) and the size becomes ``round(B x factor)`` clamped to
      ``[min_size, max_size]``.

    **Online refinement** (``refine=True``, off by default): each policy decision's reward is read at the next
    one from the observation stream (:func:`~batchpilot.controllers.ppo_refine.refinement_reward`); every
    ``refine_every`` such transitions, advantages by GAE (gamma 0.99, lambda 0.95) and 4 epochs of the clipped PPO
    update with Adam at the small ``refine_lr`` adjust this controller's copy of the weights. A fallback decision
    ends the chain (the policy did not act). Bounded by design: one small update per ``refine_every x interval``
    steps.

    Args:
        min_size, max_size: Bounds of every decision.
        policy: ``None`` (the shipped policy), the path of a ``.pt`` written by ``batchpilot rl train``, or a
            ``(PolicyMLP, PolicyMeta)`` pair.
        interval: Steps between decisions (``None``: the policy's metadata's, the schedule it was trained on).
        first_interval: Steps before the first decision (``None``: the metadata's when ``interval`` is ``None``,
            else ``interval``).
        fallback: The controller used out of distribution (default: Goodput over the same bounds).
        refine: Refine the policy online (see above).
        refine_lr: Adam's learning rate of the refinement (small: 1e-5).
        refine_every: Transitions per refinement update (>= 2).
        ood_margin: Relative widening of each training range before a feature counts as out of distribution.
        seed: Seed of the action draws when refining.
        bisect: Damp reversals (``None``: the metadata's ``bisect``; the first shipped policy had none), by Rprop's
            step-size rule (Riedmiller & Braun 1993) on ``log2 B``: each change is capped at a step ``s`` (at first
            the largest action's), halved when the policy reverses its direction and grown by 1.2x (up to the
            largest action's) when it keeps it, never below ``MIN_STEP``. A policy that alternates between two
            sizes around the best one (as a policy trained where a change of size is free may) closes in on it.

    Attributes:
        reason: Why the last call decided what it did (the engine logs it).
        fallbacks, policy_decisions, updates: Decisions made by the fallback, by the policy, and refinement
            updates done.

    Raises:
        TypeError, ValueError: an argument is of the wrong type or out of range, or the policy was trained on
            other features than this batchpilot computes.
        FileNotFoundError: ``policy`` names a missing file.
    """

    required_stats: tuple[str, ...] = Goodput.required_stats
    """The ``obs.stats`` keys it reads (those of Goodput: noise scale and the step-time model)."""
    adaptive = True
    """It decides from measurements: a Pilot's rollback guard watches its changes by default."""
    recommended_lr_rule = "adascale"
    """The LR coupling ``Pilot(lr_rule=None)`` uses with it (as for Goodput, whose efficiency the features use)."""

    def __init__(
        self,
        min_size: int = 32,
        max_size: int = 4096,
        *,
        policy: str | Path | tuple[PolicyMLP, PolicyMeta] | None = None,
        interval: int | None = None,
        first_interval: int | None = None,
        fallback: Controller | None = None,
        refine: bool = False,
        refine_lr: float = 1e-5,
        refine_every: int = 16,
        ood_margin: float = 0.25,
        seed: int = 0,
        bisect: bool | None = None,
    ) -> None:
        self.min_size, self.max_size = check_size_bounds(min_size, max_size)
        self.refine = check_bool(refine, "refine")
        self.refine_lr = check_real(refine_lr, "refine_lr", low=0.0, hint=" A small Adam LR such as 1e-5.")
        self.refine_every = check_interval(refine_every, "refine_every")
        if self.refine_every < 2:
            raise ValueError(f"refine_every must be >= 2 transitions per update, got {refine_every}.")
        self.ood_margin = check_real(ood_margin, "ood_margin", low=0.0, low_inclusive=True,
                                     hint=" 0.25 = widen each training range by a quarter of its width.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}.")
        self.seed = seed
        if isinstance(policy, tuple):
            if len(policy) != 2 or not isinstance(policy[0], PolicyMLP) or not isinstance(policy[1], PolicyMeta):
                raise TypeError("policy as a tuple must be (PolicyMLP, PolicyMeta), e.g. load_policy(path).")
            net, self.meta = policy
            if net.obs_dim != len(self.meta.features) or net.action_head.out_features != len(self.meta.actions):
                raise ValueError(f"policy: the network takes {net.obs_dim} features and has "
                                 f"{net.action_head.out_features} actions; its metadata lists {len(self.meta.features)} "
                                 f"and {len(self.meta.actions)}.")
            self.policy = copy.deepcopy(net)  # refinement never changes the caller's network
        elif policy is None or isinstance(policy, (str, Path)):
            self.policy, self.meta = load_policy(policy)
        else:
            raise TypeError(f"policy must be None, a path or (PolicyMLP, PolicyMeta), got {type(policy).__name__}.")
        if tuple(self.meta.features) != FEATURES:
            raise ValueError(f"the policy was trained on features {list(self.meta.features)}, this batchpilot computes "
                             f"{list(FEATURES)}; retrain it with `batchpilot rl train` (docs/ppo.md).")
        if interval is None:
            first, every = self.meta.schedule
        else:
            first, every = interval, interval
        self.interval = check_interval(every)
        self.first_interval = check_interval(first if first_interval is None else first_interval, "first_interval")
        self.bisect = bool(self.meta.bisect) if bisect is None else check_bool(bisect, "bisect")
        self.fallback: Any = Goodput(self.min_size, self.max_size, interval=1) if fallback is None else fallback
        for method in ("decide", "state_dict", "load_state_dict"):
            if not callable(getattr(self.fallback, method, None)):
                raise TypeError(f"fallback must be a controller with {method}(), got {type(fallback).__name__}.")
        self.policy_source = "shipped" if policy is None else (str(policy) if not isinstance(policy, tuple) else "given")
        self._digest = weights_digest(self.policy)
        low, high = np.asarray(self.meta.feature_low), np.asarray(self.meta.feature_high)
        slack = self.ood_margin * (high - low) + 0.05
        self._low, self._high = low - slack, high + slack
        self.name = "PPOController"
        self.reason = "no decision yet"
        self._init_refinement()
        self._reset_counters()

    def _init_refinement(self) -> None:
        self._generator = torch.Generator().manual_seed(self.seed)
        self._optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.refine_lr) if self.refine else None
        self._buffer: list[dict[str, Any]] = []
        self._pending: dict[str, Any] | None = None  # the last policy decision, waiting for its reward

    def _reset_counters(self) -> None:
        self._period = 0
        self._step = self._max_step  # Rprop's step on log2 B
        self._direction = 0  # sign of the policy's last change of size
        self._b0: int | None = None
        self.fallbacks = self.policy_decisions = self.updates = 0

    def out_of_distribution(self, x: np.ndarray) -> str | None:
        """Why ``x`` (a feature vector) lies outside the widened training ranges, or ``None`` when it does not."""
        bad = np.flatnonzero((x < self._low) | (x > self._high))
        if bad.size == 0:
            return None
        i = int(bad[0])
        return (f"{FEATURES[i]}={fmt(float(x[i]))} outside its training range [{fmt(self.meta.feature_low[i])}, "
                f"{fmt(self.meta.feature_high[i])}]" + (f" (+{len(bad) - 1} more)" if bad.size > 1 else ""))

    def decide(self, obs: Observation) -> int:
        """Return the global batch size of step ``obs.step`` (see the class docstring)."""
        if not isinstance(obs, Observation):
            raise TypeError(f"PPOController.decide expects an Observation, got {type(obs).__name__}.")
        size = obs.batch_size
        if self._b0 is None:
            self._b0 = clamp(size, self.min_size, self.max_size)
        period = self.period(obs.step)
        if period <= self._period:
            self.reason = f"next decision at step {self.first_interval + self._period * self.interval}; kept {size}"
            return size
        self._period = period
        x = features(obs, self.min_size, self.max_size)
        why = self.out_of_distribution(x)
        if why is not None:
            self.fallbacks += 1
            self._pending = None  # the policy did not act: no transition to learn from
            decided = int(self.fallback.decide(obs))
            self.reason = f"step {obs.step}: out of distribution ({why}): {self.fallback_name} decided {decided} " \
                          f"({getattr(self.fallback, 'reason', '')})"
            return decided
        obs_t = torch.as_tensor(x).unsqueeze(0)
        with torch.no_grad():
            logits, value = self.policy(obs_t)
        if self.refine:
            self._record(obs, x, value)
            action = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=self._generator))
            log_prob = float(torch.log_softmax(logits[0], -1)[action])
            self._pending = {"obs": obs, "x": x, "action": action, "log_prob": log_prob, "value": float(value)}
        else:
            action = int(logits[0].argmax())
        factor = self.meta.actions[action]
        base = clamp(size, self.min_size, self.max_size)
        decided = clamp(round_half_up(base * factor), self.min_size, self.max_size)
        damped = ""
        if self.bisect and decided != base:
            decided, damped = self._damp(base, decided)
        self.policy_decisions += 1
        probs = ", ".join(f"x{fmt(a)}:{p:.2f}" for a, p in zip(self.meta.actions, torch.softmax(logits[0], -1).tolist()))
        self.reason = f"step {obs.step}: policy chose x{fmt(factor)} ({probs}) -> {decided}{damped}"
        return decided

    def _damp(self, base: int, proposed: int) -> tuple[int, str]:
        """Rprop's step rule on ``log2 B`` (see ``bisect``): the size to use instead of ``proposed`` and a note."""
        move = math.log2(proposed / base)
        direction = 1 if move > 0 else -1
        if self._direction:
            grow = 1.2 if direction == self._direction else 0.5
            self._step = min(max(self._step * grow, MIN_STEP), self._max_step)
        self._direction = direction
        if abs(move) <= self._step:
            return proposed, ""
        decided = clamp(round_half_up(base * 2 ** (direction * self._step)), self.min_size, self.max_size)
        return decided, f" (damped from {proposed}: step x{2 ** self._step:.2f})"

    @property
    def _max_step(self) -> float:
        return max(abs(math.log2(a)) for a in self.meta.actions)

    def period(self, step: int) -> int:
        """How many decision steps (``first_interval``, then every ``interval``) ``step`` has reached."""
        return 0 if step < self.first_interval else 1 + (step - self.first_interval) // self.interval

    @property
    def fallback_name(self) -> str:
        return getattr(self.fallback, "name", None) or type(self.fallback).__name__

    def _record(self, obs: Observation, x: np.ndarray, value: torch.Tensor) -> None:
        """Close the pending transition with its reward (read now), and update once the buffer is full."""
        if self._pending is None:
            return
        assert self._b0 is not None
        reward = refinement_reward(self._pending["obs"], obs, self._b0)
        self._buffer.append({k: self._pending[k] for k in ("x", "action", "log_prob", "value")} | {"reward": reward})
        if len(self._buffer) < self.refine_every:
            return
        assert self._optimizer is not None
        b = self._buffer
        adv, ret = gae([t["reward"] for t in b], [t["value"] for t in b], [0.0] * len(b), float(value))
        self.policy.train()
        ppo_update(self.policy, self._optimizer, torch.as_tensor(np.stack([t["x"] for t in b])),
                   torch.as_tensor([t["action"] for t in b]), torch.as_tensor([t["log_prob"] for t in b]), adv, ret)
        self.policy.eval()
        self.updates += 1
        self._buffer = []

    def state_dict(self) -> dict[str, Any]:
        """Period, ``B0``, counters, the fallback's state; with ``refine=True`` also the refined weights, Adam's
        state, the action RNG, the transitions waiting for an update and the pending decision."""
        state: dict[str, Any] = {
            "name": self.name, "period": self._period, "b0": self._b0, "policy_digest": self._digest,
            "refine": self.refine, "fallback": self.fallback.state_dict(),
            "counts": [self.fallbacks, self.policy_decisions, self.updates],
            "damping": [self._step, self._direction],
        }
        if self.refine:
            assert self._optimizer is not None
            pending = None if self._pending is None else {**self._pending, "obs": _obs_state(self._pending["obs"]),
                                                          "x": self._pending["x"].tolist()}
            state.update(
                weights={k: v.detach().clone() for k, v in self.policy.state_dict().items()},
                optimizer=self._optimizer.state_dict(), rng=self._generator.get_state(),
                buffer=[{**t, "x": t["x"].tolist()} for t in self._buffer], pending=pending,
            )
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, from a controller built with the same policy and ``refine``."""
        state = check_state(state, self.name, ("period", "b0", "policy_digest", "refine", "fallback", "counts"))
        if state["policy_digest"] != self._digest:
            raise ValueError(f"this state was saved with policy {state['policy_digest']}, this controller runs "
                             f"{self._digest}; build the PPOController with the same policy before loading its state.")
        if bool(state["refine"]) != self.refine:
            raise ValueError(f"this state was saved with refine={bool(state['refine'])}; build the PPOController with "
                             "the same refine setting before loading its state.")
        self._period = int(state["period"])
        self._b0 = None if state["b0"] is None else int(state["b0"])
        self.fallbacks, self.policy_decisions, self.updates = (int(c) for c in state["counts"])
        self._step, self._direction = (float(state["damping"][0]), int(state["damping"][1])) \
            if "damping" in state else (self._max_step, 0)
        self.fallback.load_state_dict(state["fallback"])
        if self.refine:
            assert self._optimizer is not None
            self.policy.load_state_dict(state["weights"])
            self._optimizer.load_state_dict(state["optimizer"])
            self._generator.set_state(state["rng"])
            self._buffer = [{**t, "x": np.asarray(t["x"], np.float32)} for t in state["buffer"]]
            p = state["pending"]
            self._pending = None if p is None else {**p, "obs": Observation(**p["obs"]),
                                                    "x": np.asarray(p["x"], np.float32)}
        self.reason = "state loaded"

    def __repr__(self) -> str:
        return (f"PPOController(min_size={self.min_size}, max_size={self.max_size}, policy={self.policy_source!r}, "
                f"interval={self.interval}, first_interval={self.first_interval}, bisect={self.bisect}, refine={self.refine})")


def _obs_state(obs: Observation) -> dict[str, Any]:
    """An Observation as plain data (for a state dict)."""
    return {"step": obs.step, "samples_seen": obs.samples_seen, "epoch": obs.epoch, "coverage": obs.coverage,
            "batch_size": obs.batch_size, "num_samples": obs.num_samples, "losses": tuple(obs.losses),
            "samples_per_s": obs.samples_per_s, "stats": dict(obs.stats)}
