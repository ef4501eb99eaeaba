"""Random-number-generator states, captured and restored for exact resume.

Covers the generators a training loop typically draws from: torch (CPU, and the CUDA device the process
trains on), numpy's global generator and Python's ``random``. States are stored as tensors, lists and numbers only, so a
checkpoint stays loadable with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger("batchpilot")


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's generator states; CUDA's only for ``device`` when it is a CUDA device (the stream this
    process draws from, restored into whatever device the resumed process trains on; a CPU run never
    initialises CUDA for it)."""
    np_state: Any = np.random.get_state()  # the legacy tuple (the default)
    return {
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state(device)] if device is not None and device.type == "cuda" else [],
        "cuda_device": True,  # "cuda" holds the training device's state only (older checkpoints: every device's)
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": random.getstate(),
    }


def torch_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's CPU generator state and ``device``'s CUDA one (what dropout draws from), cheap to take."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_torch_rng(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    """Restore a :func:`torch_rng` state."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def gather_rng_states(world_size: int, device: torch.device | None = None) -> list[dict[str, Any]]:
    """Every rank's states, in rank order (a collective under ``torch.distributed``); ``device``: the device
    this rank trains on."""
    state = rng_state(device)
    # torch.distributed itself, not batchpilot.distributed: this module sits below it (DESIGN.md's layers).
    if world_size == 1 or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [state]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, state)
    return gathered


def restore_rng_states(states: list[dict[str, Any]], rank: int, world_size: int,
                       device: torch.device | None = None) -> None:
    """Restore this rank's states (the CUDA one into ``device``, the device this rank trains on now); with
    another world size, warn and leave the generators as they are."""
    if len(states) != world_size:
        logger.warning(
            "checkpoint holds RNG states of %d ranks, this job has %d: RNG streams are not restored exactly",
            len(states), world_size,
        )
        return
    state = states[rank]
    torch.set_rng_state(state["torch"])
    if state.get("cuda_device"):
        if state["cuda"] and device is not None and device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"][0], device)
    elif state["cuda"] and torch.cuda.is_available():  # an older checkpoint: a state per device index
        # As many devices as this process sees (a job resumed with fewer visible GPUs must not fail).
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    random.setstate(_as_tuple(state["python"]))


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
