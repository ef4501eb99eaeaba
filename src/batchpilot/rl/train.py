"""Train the PPO batch-size policy in the simulator with stable-baselines3 (the optional extra ``rl``).

Seed 000's settings: PPO (Schulman et al. 2017) with gamma 0.99 and GAE lambda 0.95 (Schulman et al. 2016),
4 epochs per update, the learning rate annealed on a cosine from ``learning_rate`` to 0 (Loshchilov & Hutter 2017),
on ``n_envs`` copies of :class:`batchpilot.sim.env.BatchSizeEnv` stepped in one process (``DummyVecEnv``: the
environment is cheap, the network tiny) over randomised shipped traces (perturbed) and random clusters of 1-64 devices. Everything is seeded: the
same arguments on the same machine give the same policy. ``batchpilot rl train`` runs this and writes the files
the package ships (docs/ppo.md).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._extras import install_hint
from ..controllers.ppo_policy import PolicyMeta, PolicyMLP
from .export import export_policy

__all__ = ["TrainResult", "cosine_schedule", "make_env_fns", "train_policy"]

def _require_sb3() -> Any:
    try:
        import stable_baselines3
    except ImportError as exc:
        raise ImportError(f"training the PPO policy needs stable-baselines3 and gymnasium: {install_hint('rl')}") \
            from exc
    return stable_baselines3


def cosine_schedule(initial: float, final: float = 0.0) -> Callable[[float], float]:
    """SB3 learning-rate schedule: ``progress_remaining`` 1 -> 0 maps to ``initial`` -> ``final`` on a half cosine
    (SGDR without restarts, Loshchilov & Hutter 2017)."""
    if not (initial > 0 and 0 <= final <= initial):
        raise ValueError(f"cosine_schedule needs initial > 0 and 0 <= final <= initial, got {initial}, {final}.")

    def lr(progress_remaining: float) -> float:
        done = min(max(1.0 - progress_remaining, 0.0), 1.0)
        return final + (initial - final) * 0.5 * (1.0 + math.cos(math.pi * done))

    return lr


def make_env_fns(n_envs: int, seed: int, *, traces: Sequence[Any] | None = None,
                 clusters: Sequence[str] | None = None, **env_kwargs: Any) -> list[Callable[[], Any]]:
    """``n_envs`` constructors of randomised :class:`~batchpilot.sim.env.BatchSizeEnv` (env ``i`` seeded
    ``seed * 1000 + i``) over ``traces`` (names, paths or traces; default: every shipped trace) and ``clusters``
    (spec texts; default: a random cluster per episode, :func:`batchpilot.sim.env.random_cluster`)."""
    from ..sim.env import BatchSizeEnv
    from ..sim.trace import load_trace, shipped_traces

    loaded = [load_trace(t) if isinstance(t, str) else t for t in (traces or shipped_traces())]
    if not loaded:
        raise ValueError("no traces to train on: pass traces=... or record them with `batchpilot trace`.")
    specs = list(clusters) if clusters else None

    def fn(i: int) -> Callable[[], Any]:
        return lambda: BatchSizeEnv(loaded, specs, randomise=True, seed=seed * 1000 + i, **env_kwargs)

    return [fn(i) for i in range(n_envs)]


@dataclass
class TrainResult:
    """What :func:`train_policy` returns: the exported policy and how training went."""

    policy: PolicyMLP
    meta: PolicyMeta
    seconds: float
    timesteps: int
    episode_rewards: list[float] = field(default_factory=list)
    model: Any = None  # the SB3 PPO (for comparisons in tests); not saved


def _callback_class() -> Any:
    from stable_baselines3.common.callbacks import BaseCallback

    class Watch(BaseCallback):
        """Tracks each feature's range over every observation of training, and prints progress."""

        def __init__(self, total: int, progress: Callable[[str], None] | None) -> None:
            super().__init__()
            self.total, self.progress = total, progress
            self.low: np.ndarray | None = None
            self.high: np.ndarray | None = None
            self.next_report = 0  # timesteps of the next progress line
            self.start = time.perf_counter()

        def _see(self, obs: Any) -> None:
            obs = np.asarray(obs, dtype=np.float64)
            obs = obs.reshape(-1, obs.shape[-1])
            lo, hi = obs.min(axis=0), obs.max(axis=0)
            self.low = lo if self.low is None else np.minimum(self.low, lo)
            self.high = hi if self.high is None else np.maximum(self.high, hi)

        def _on_training_start(self) -> None:
            self._see(self.model._last_obs)

        def _on_step(self) -> bool:
            self._see(self.locals["new_obs"])
            if self.progress is not None and self.num_timesteps >= self.next_report:
                self.next_report += max(self.total // 10, 1)
                done = min(self.num_timesteps / self.total, 1.0)
                elapsed = time.perf_counter() - self.start
                rewards = [e["r"] for e in self.model.ep_info_buffer or ()]
                mean = f"{np.mean(rewards):.3f}" if rewards else "n/a"
                eta = max(elapsed / max(done, 1e-9) - elapsed, 0.0)
                self.progress(f"  {self.num_timesteps:>8}/{self.total} steps  {elapsed:6.0f} s  mean episode reward "
                              f"{mean}  (about {eta:.0f} s left)")
            return True

    return Watch


def train_policy(
    timesteps: int = 200_000,
    seed: int = 0,
    n_envs: int = 8,
    *,
    env_fns: Sequence[Callable[[], Any]] | None = None,
    feature_names: Sequence[str] | None = None,
    actions: Sequence[float] | None = None,
    learning_rate: float = 3e-4,
    n_steps: int = 256,
    batch_size: int = 256,
    n_epochs: int = 4,
    gamma: float = 0.99,
    gae_lambda: float = 0.95,
    ent_coef: float = 0.01,
    net_arch: Sequence[int] = (64, 64),
    threads: int = 1,
    progress: Callable[[str], None] | None = None,
    env_kwargs: dict[str, Any] | None = None,
) -> TrainResult:
    """Train PPO and export it to a :class:`PolicyMLP` whose metadata records each feature's training range.

    Args:
        timesteps: Environment steps (decisions) in all.
        seed: Seeds PPO (torch, numpy) and the environments.
        n_envs: Parallel environments (one process).
        env_fns: Environment constructors (default :func:`make_env_fns` over the shipped traces); a custom
            environment needs ``feature_names`` and ``actions`` too.
        learning_rate: Start of the cosine schedule (it ends at 0).
        n_steps, batch_size, n_epochs, gamma, gae_lambda, ent_coef: PPO's (per environment rollout length,
            minibatch, epochs per update, discount, GAE lambda, entropy bonus).
        net_arch: Hidden widths of the policy and value networks (tanh).
        threads: ``torch.set_num_threads`` while training (restored after).
        progress: Called with a line of text about every 10% of training.
        env_kwargs: Passed to every ``BatchSizeEnv`` (``actions``, ``interval``, ``first_interval``, ``min_size``,
            ``max_size``, ...); the actions and the two intervals go in the policy's metadata.

    Raises:
        ImportError: stable-baselines3 or gymnasium is missing.
        ValueError: an argument is out of range.
    """
    _require_sb3()
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecMonitor

    for name, value, low in (("timesteps", timesteps, 1), ("n_envs", n_envs, 1), ("n_steps", n_steps, 2),
                             ("batch_size", batch_size, 2), ("n_epochs", n_epochs, 1), ("threads", threads, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"train_policy: {name} must be an int >= {low}, got {value!r}.")
    if env_fns is None:
        from ..controllers.ppo_features import FEATURES
        from ..sim.env import ACTIONS
        from ..sim.trace import shipped_traces

        env_fns = make_env_fns(n_envs, seed, **(env_kwargs or {}))
        feature_names = feature_names or FEATURES
        actions = actions or tuple((env_kwargs or {}).get("actions", ACTIONS))
        trained_on = f"BatchSizeEnv(randomise=True) over the shipped traces {shipped_traces()} and random clusters"
    else:
        trained_on = "the given env_fns"
    if feature_names is None or actions is None:
        raise ValueError("train_policy: with env_fns, pass feature_names and actions too (they go in the metadata).")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        env = VecMonitor(DummyVecEnv(list(env_fns)))
        env.seed(seed)
        model = PPO("MlpPolicy", env, learning_rate=cosine_schedule(learning_rate), n_steps=n_steps,
                    batch_size=batch_size, n_epochs=n_epochs, gamma=gamma, gae_lambda=gae_lambda, ent_coef=ent_coef,
                    policy_kwargs={"net_arch": list(net_arch), "activation_fn": torch.nn.Tanh}, seed=seed,
                    device="cpu", verbose=0)
        watch = _callback_class()(timesteps, progress)
        start = time.perf_counter()
        model.learn(total_timesteps=timesteps, callback=watch)
        seconds = time.perf_counter() - start
        rewards = [float(e["r"]) for e in model.ep_info_buffer or ()]
        env.close()
    finally:
        torch.set_num_threads(previous_threads)
    assert watch.low is not None and watch.high is not None
    training = {
        "algorithm": "PPO (stable-baselines3)", "environment": trained_on, "timesteps": timesteps, "seed": seed, "n_envs": n_envs,
        "learning_rate": f"cosine {learning_rate:g} -> 0", "n_steps": n_steps, "batch_size": batch_size,
        "n_epochs": n_epochs, "gamma": gamma, "gae_lambda": gae_lambda, "ent_coef": ent_coef,
        "net_arch": list(net_arch), "threads": threads, "seconds": round(seconds, 1),
        "env_kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in (env_kwargs or {}).items()
                       if isinstance(v, (int, float, str, bool, tuple))},
        "final_mean_episode_reward": float(np.mean(rewards)) if rewards else None,
    }
    policy, meta = export_policy(model, features=tuple(feature_names), feature_low=watch.low.tolist(),
                                 feature_high=watch.high.tolist(), actions=tuple(actions), training=training)
    interval = int((env_kwargs or {}).get("interval", 50))  # the schedule the policy was trained on
    first = (env_kwargs or {}).get("first_interval")
    meta = dataclasses.replace(meta, interval=interval, first_interval=None if first is None else int(first))
    return TrainResult(policy, meta, seconds, timesteps, rewards, model)
