"""Policies and observations for the PPOController tests, and the worker of its 2-process gloo test."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from batchpilot.controllers.base import Observation
from batchpilot.controllers.ppo_features import FEATURES
from batchpilot.controllers.ppo_policy import PolicyMeta, PolicyMLP

WIDE = 5.0  # training ranges wide enough that no feature is out of distribution


def constant_policy(action: int, low: float = -WIDE, high: float = WIDE) -> tuple[PolicyMLP, PolicyMeta]:
    """A policy that always picks ``action`` (x0.5, x1, x2 = 0, 1, 2)."""
    net = PolicyMLP(len(FEATURES), 3, (4,))
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
        net.action_head.bias[action] = 10.0
    return net, meta(low, high, (4,))


def random_policy(seed: int = 0) -> tuple[PolicyMLP, PolicyMeta]:
    torch.manual_seed(seed)
    return PolicyMLP(len(FEATURES), 3, (16, 16)), meta(-WIDE, WIDE, (16, 16))


def meta(low: float, high: float, hidden: tuple[int, ...]) -> PolicyMeta:
    n = len(FEATURES)
    return PolicyMeta(FEATURES, (low,) * n, (high,) * n, (0.5, 1.0, 2.0), hidden, training={"note": "test policy"})


def observation(step: int, size: int = 256, *, noise: float | None = 1000.0, loss: float = 1.0,
                throughput: float = 5000.0, **extra: float) -> Observation:
    """A single-device observation with every stat the engine gives Goodput (and the system monitor's)."""
    stats = {"perf/micro_time_a_s": 2e-3, "perf/micro_time_b_s": 1e-4, "perf/step_overhead_s": 1e-3,
             "dist/world_size": 1.0, "system/cpu_util": 90.0, "system/mem_used_frac": 0.4, "stats/noise_count": 50.0,
             **extra}
    if noise is not None:
        stats["stats/noise_scale"] = noise
    losses = tuple(loss * (1.0 - 0.002 * i) for i in range(20))
    return Observation(step=step, samples_seen=step * size, epoch=0, coverage=0.1, batch_size=size,
                       num_samples=60_000, losses=losses, samples_per_s=throughput, stats=stats)


def dist_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Train a small model under a Pilot with PPOController on 2 gloo ranks; rank 1's policy would choose x0.5, rank
    0's x2: only rank 0 decides, so every rank must see rank 0's sizes."""
    import sys

    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    import batchpilot
    from batchpilot.controllers.ppo import PPOController

    sys.path.insert(0, str(Path(__file__).parent))
    from _dist_helpers import finish

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2000, 5, generator=g)
        y = (x[:, 0] > 0).long()
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        controller = PPOController(8, 64, policy=constant_policy(2 if rank == 0 else 0), interval=5)
        pilot = batchpilot.Pilot(model, opt, TensorDataset(x, y), batch_size=8, controller=controller, seed=1,
                                 noise_every=1, lr_rule="linear", base_batch_size=8, rollback=False)
        sizes = []
        for xb, yb in pilot.batches(max_steps=30):
            if pilot.micro_batch.micro_index == 0:
                sizes.append(pilot.micro_batch.global_size)
            pilot.backward(torch.nn.functional.cross_entropy(model(xb), yb))
        out = {"sizes": sizes, "decisions": controller.policy_decisions + controller.fallbacks,
               "reason": controller.reason}
        Path(out_dir, f"ppo{rank}.json").write_text(json.dumps(out))
        del pilot
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()
