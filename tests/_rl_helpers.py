"""A trivial environment PPO must learn (tests of batchpilot.rl): the observation says which action pays."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class PickTheSign(gym.Env):
    """Observation: 3 numbers in [-1, 1]; reward 1 for action ``0`` when the first is below -1/3, ``2`` above 1/3,
    ``1`` otherwise, else 0. Ten steps per episode: a perfect policy scores 10, a random one about 3.3."""

    metadata: dict = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = gym.spaces.Discrete(3)
        self._obs = np.zeros(3, np.float32)
        self._t = 0

    def _draw(self) -> np.ndarray:
        self._obs = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        return self._obs

    @staticmethod
    def best(obs: np.ndarray) -> int:
        return 0 if obs[0] < -1 / 3 else (2 if obs[0] > 1 / 3 else 1)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return self._draw(), {}

    def step(self, action):
        reward = float(int(action) == self.best(self._obs))
        self._t += 1
        return self._draw(), reward, self._t >= 10, False, {}
