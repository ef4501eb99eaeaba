"""The shared state round-trip harness applied to the stateful classes not covered by their own modules'
tests (sampler, schedules and LR classes use it in test_sampler.py, test_schedules.py, test_lr.py)."""

from __future__ import annotations

import torch
from harness import assert_state_roundtrip
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.clipping import StatsClip

SIZES = [5, 17, 3, 40, 9, 1, 26]


def _loader() -> batchpilot.AdaptiveDataLoader:
    return batchpilot.AdaptiveDataLoader(TensorDataset(torch.arange(90)), 6, max_micro_batch_size=7, seed=4)


def _loader_step(loader: batchpilot.AdaptiveDataLoader, step: int) -> list[list[int]]:
    """Consume one step (starting a new epoch's loop when needed); then set the next size."""
    micro_batches = []
    while True:
        it = getattr(loader, "_bp_iter", None)
        if it is None:
            it = loader._bp_iter = iter(loader)
        try:
            micro = next(it)
        except StopIteration:
            loader._bp_iter = None
            continue
        micro_batches.append(micro.indices.tolist())
        if micro.is_last:
            loader.set_batch_size(SIZES[step % len(SIZES)])
            return micro_batches


def test_adaptive_data_loader_state_roundtrip():
    assert_state_roundtrip(
        _loader,
        _loader_step,
        lambda loader, step: [_loader_step(loader, s) for s in range(step, step + 12)],
        steps=(0, 1, 4, 9, 10),
    )


def test_stats_clip_state_roundtrip():
    def advance(clip: StatsClip, step: int) -> None:
        clip.observe(1.0 + (step * 7919 % 13) / 10)

    def observe(clip: StatsClip, step: int) -> list:
        out = []
        for s in range(step, step + 15):
            out.append(clip.threshold())
            advance(clip, s)
        return out

    assert_state_roundtrip(lambda: StatsClip(z=2.0, window=8, warmup=3), advance, observe, steps=(0, 2, 5, 20))


def test_stats_clip_refuses_settings_that_would_never_clip_or_are_no_numbers():
    import pytest

    for kwargs, error, says in [({"window": 5, "warmup": 8}, ValueError, "warmup=8 is larger than its window=5"),
                                ({"z": "3"}, ValueError, "a finite z > 0"), ({"z": float("inf")}, ValueError, "finite z"),
                                ({"window": float("inf")}, TypeError, "window must be an int"),
                                ({"warmup": 1}, ValueError, "warmup must be >= 2")]:
        with pytest.raises(error, match=says):
            StatsClip(**kwargs)


def _pilot() -> batchpilot.Pilot:
    torch.manual_seed(0)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    # No dropout here: A and B share the process-wide RNG, so their futures would interleave draws. RNG
    # restoration is checked across real processes in test_resume.py.
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return batchpilot.Pilot(
        model, opt, TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4,
        controller=lambda step, size: SIZES[step % len(SIZES)], max_micro_batch_size=8, lr_rule="sqrt",
        grad_clip="stats",
    )


def _pilot_steps(pilot: batchpilot.Pilot, until: int) -> list[int]:
    sizes = []
    for x, y in pilot.batches(max_steps=until):
        if pilot.micro_batch.micro_index == 0:
            sizes.append(pilot.micro_batch.global_size)
        pilot.backward(torch.nn.functional.cross_entropy(pilot.model(x), y))
    return sizes


def test_pilot_state_roundtrip_through_torch_save():
    def observe(pilot: batchpilot.Pilot, step: int):
        sizes = _pilot_steps(pilot, step + 10)
        return sizes, [p.detach().clone() for p in pilot.model.parameters()]

    assert_state_roundtrip(
        _pilot,
        lambda pilot, step: _pilot_steps(pilot, step + 1),
        observe,
        steps=(0, 1, 6, 13),
        json_roundtrip=False,
        torch_roundtrip=True,
        # Like every torch state_dict, the model and optimizer entries alias live tensors (a checkpoint
        # serialises them at once); copying every weight on each save would double peak memory.
        check_snapshot=False,
    )
