"""GAE (Schulman et al. 2016): the torch function against a naive per-step loop and against stable-baselines3's
RolloutBuffer on the same data; its argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchpilot.controllers.ppo_refine import gae
from batchpilot.rl.gae import gae as rl_gae


def naive_gae(rewards, values, dones, last_value, gamma, lam):
    """A_t = sum_k (gamma lam)^k delta_{t+k}, cut at the first episode end: one explicit sum per step."""
    T = len(rewards)
    out = []
    for t in range(T):
        total, factor = 0.0, 1.0
        for k in range(t, T):
            next_value = last_value if k == T - 1 else values[k + 1]
            delta = rewards[k] + gamma * next_value * (1 - dones[k]) - values[k]
            total += factor * delta
            if dones[k]:
                break
            factor *= gamma * lam
        out.append(total)
    return np.array(out)


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.9, 1.0), (1.0, 0.0), (0.5, 0.7)])
def test_gae_matches_a_naive_sum_over_steps(gamma, lam):
    rng = np.random.default_rng(0)
    T = 40
    rewards, values = rng.normal(size=T), rng.normal(size=T)
    dones = (rng.random(T) < 0.15).astype(float)
    adv, ret = gae(rewards.tolist(), values.tolist(), dones.tolist(), 0.7, gamma, lam)
    expected = naive_gae(rewards, values, dones, 0.7, gamma, lam)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ret.numpy(), expected + values, rtol=1e-12, atol=1e-12)
    assert rl_gae is gae


def test_gae_of_one_step_is_the_td_error():
    adv, ret = gae([1.0], [0.5], [0.0], 2.0, gamma=0.9, lam=0.95)
    assert adv.item() == pytest.approx(1.0 + 0.9 * 2.0 - 0.5)
    adv, _ = gae([1.0], [0.5], [1.0], 2.0, gamma=0.9, lam=0.95)  # terminal: no bootstrap
    assert adv.item() == pytest.approx(0.5)


def test_gae_matches_stable_baselines3_rollout_buffer():
    pytest.importorskip("stable_baselines3")
    from gymnasium import spaces
    from stable_baselines3.common.buffers import RolloutBuffer

    T, N = 64, 3
    rng = np.random.default_rng(1)
    buf = RolloutBuffer(T, spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(3), device="cpu",
                        gae_lambda=0.95, gamma=0.99, n_envs=N)
    rewards = rng.normal(size=(T, N)).astype(np.float32)
    values = rng.normal(size=(T, N)).astype(np.float32)
    dones = rng.random((T, N)) < 0.1  # dones[t]: the episode ended with step t
    episode_starts = np.vstack([np.ones((1, N), bool), dones[:-1]])  # SB3: a new episode starts at step t + 1
    for t in range(T):
        buf.add(np.zeros((N, 2), np.float32), np.zeros((N, 1)), rewards[t], episode_starts[t],
                torch.as_tensor(values[t]), torch.zeros(N))
    last_values = rng.normal(size=N).astype(np.float32)
    buf.compute_returns_and_advantage(torch.as_tensor(last_values), dones[-1])
    adv, ret = gae(torch.as_tensor(rewards), torch.as_tensor(values), torch.as_tensor(dones), torch.as_tensor(last_values))
    np.testing.assert_allclose(adv.numpy(), buf.advantages, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret.numpy(), buf.returns, rtol=1e-5, atol=1e-5)
    assert adv.dtype == torch.float32  # keeps the rewards' float type


def test_gae_refuses_bad_input_with_the_value_named():
    with pytest.raises(ValueError, match="same shape"):
        gae([1.0, 2.0], [0.0], [0, 0], 0.0)
    with pytest.raises(ValueError, match="gamma"):
        gae([1.0], [0.0], [0], 0.0, gamma=1.5)
    with pytest.raises(ValueError, match="NaN"):
        gae([float("nan")], [0.0], [0], 0.0)
    with pytest.raises(ValueError, match="0/1"):
        gae([1.0], [0.0], [0.5], 0.0)
    with pytest.raises(ValueError, match="one per environment"):
        gae([[1.0, 2.0]], [[0.0, 0.0]], [[0, 0]], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="T >= 1"):
        gae([], [], [], 0.0)
    with pytest.raises(TypeError, match="rewards"):
        gae("abc", [0.0], [0], 0.0)


def test_importing_batchpilot_rl_needs_neither_stable_baselines3_nor_gymnasium():
    import subprocess
    import sys

    code = ("import sys, batchpilot.rl; bad = [m for m in sys.modules if m.startswith(('stable_baselines3', "
            "'gymnasium'))]; assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
