"""Generalized advantage estimation (Schulman et al. 2016), torch only.

The function lives in :mod:`batchpilot.controllers.ppo_refine` (the online refinement of the PPO controller uses it,
and controllers may not import ``rl``); this module is its public home on the training side.
"""

from __future__ import annotations

from ..controllers.ppo_refine import gae

__all__ = ["gae"]
