"""The decision rule of :class:`~batchpilot.distributed.adaptive_compression.AdaptiveCompression`, without
``torch.distributed``: compression levels, their predicted bytes and codec costs, the step-time model and the choice.

A level is ``"none"`` (fp32 all-reduce), ``"fp16"`` / ``"bf16"`` (torch's cast-and-all-reduce hooks),
``"powersgd:R"`` (torch's PowerSGD, rank ``R``, Vogels et al. 2019) or ``"1bit"`` (sign + scale with error
feedback, Seide et al. 2014; Tang et al. 2021). The predicted step time of level ``L`` is

    T(L) = O + K(L) + m(L) * alpha + bytes(L) * c

with ``O`` the step time outside the gradient collectives (measured: step time minus the time the step's buckets
spent between their hook call and their result), ``K(L)`` the codec cost of ``L`` (a local timing of the same
tensor operations on tensors shaped like the real buckets), ``m(L)`` the collectives ``L`` makes per step, ``alpha``
the latency of one collective (measured: the decision's own one-integer broadcast) and ``c`` the seconds per byte
of the link (measured: the current level's collective time less its codec cost and latency, over its bytes).
"""

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["LEVEL_KINDS", "MESSAGES", "check_number", "choose_level", "codec_seconds", "level_bytes", "load_powersgd_state",
           "parse_level", "powersgd_factors", "powersgd_state_dict", "predict_step_seconds"]

#: The level kinds; a PowerSGD level carries its rank: ``"powersgd:4"``.
LEVEL_KINDS = ("none", "fp16", "bf16", "powersgd", "1bit")
#: Collectives per bucket: PowerSGD all-reduces the uncompressed tensors, then P, then Q; 1-bit exchanges its
#: chunks with ``all_to_all_single`` and gathers the averaged chunks back.
MESSAGES = {"none": 1, "fp16": 1, "bf16": 1, "powersgd": 3, "1bit": 2}


def check_number(name: str, value: Any, *, low: float, integer: bool = False, example: str) -> None:
    """Raise ``ValueError`` naming ``name``, the value and an example unless ``value`` is a finite number (an int
    when ``integer``) ``>= low``."""
    ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < low:
        kind = "an int" if integer else "a finite number"
        raise ValueError(f"{name} must be {kind} >= {low:g}, got {value!r}; e.g. {example}")


def parse_level(text: str) -> tuple[str, int]:
    """``(kind, rank)`` of a level name (``rank`` 0 except for PowerSGD, whose default rank is 1).

    Raises:
        ValueError: an unknown name or a rank that is not a whole number >= 1.
    """
    if not isinstance(text, str):
        raise TypeError(f"a compression level must be a string such as 'fp16' or 'powersgd:2', got {text!r}")
    kind, sep, rank = text.strip().lower().partition(":")
    if kind not in LEVEL_KINDS or (sep and kind != "powersgd"):
        raise ValueError(f"unknown compression level {text!r}; use none, fp16, bf16, powersgd:R (R >= 1) or 1bit")
    if kind != "powersgd":
        return kind, 0
    if not sep:
        return kind, 1
    if not rank.isdigit() or int(rank) < 1:
        raise ValueError(f"compression level {text!r}: the PowerSGD rank must be a whole number >= 1, e.g. 'powersgd:2'")
    return kind, int(rank)


def _powersgd_split(shape: torch.Size | Sequence[int], rank: int) -> tuple[int, int, int, bool]:
    """``(n, m, r, compressed)`` of one gradient under PowerSGD: viewed as ``n x m``, rank ``r = min(n, m, rank)``,
    compressed when ``(n + m) r`` is under half of ``n m`` (torch's ``min_compression_rate`` 2)."""
    n = int(shape[0]) if len(shape) else 1
    m = math.prod(int(s) for s in shape) // max(n, 1)
    r = min(n, m, rank)
    return n, m, r, (n + m) * r * 2 < n * m


def powersgd_factors(shapes: Sequence[Sequence[int]], rank: int) -> list[tuple[int, int, int]]:
    """``(position, Q numel, P numel)`` of the compressed gradients of a bucket, in the order torch's PowerSGD hook lays
    their factors out in memory: grouped by matrix shape, groups in order of first appearance."""
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for pos, shape in enumerate(shapes):
        n, m, r, compressed = _powersgd_split(shape, rank)
        if compressed:
            groups.setdefault((n, m), []).append((pos, m * r, n * r))
    return [item for group in groups.values() for item in group]


def level_bytes(kind: str, rank: int, shapes: Sequence[Sequence[int]], world_size: int) -> float:
    """Bytes a rank sends per step under a level, for fp32 gradients of ``shapes`` over ``world_size`` ranks (the
    unit of ``wire_bytes``): a ring all-reduce sends ``2 (N-1)/N`` of its input (Patarasuk & Yuan 2009), of ``4 n``
    bytes in fp32, ``2 n`` in fp16/bf16, ``4`` per value of PowerSGD's uncompressed tensors and of its factors
    (``(n + m) r`` per compressed ``n x m`` matrix); 1-bit sends ``2 (N-1)`` times a chunk of signs plus a 4-byte
    scale per parameter (:mod:`batchpilot.distributed.compression`)."""
    ring = 2.0 * (world_size - 1) / world_size
    sizes = [math.prod(int(s) for s in shape) for shape in shapes]
    if kind == "none":
        return ring * 4 * sum(sizes)
    if kind in ("fp16", "bf16"):
        return ring * 2 * sum(sizes)
    if kind == "1bit":
        return 2.0 * (world_size - 1) * sum(math.ceil(m / (8 * world_size)) + 4 for m in sizes)
    total = 0
    for shape in shapes:
        n, m, r, compressed = _powersgd_split(shape, rank)
        total += (n + m) * r if compressed else n * m
    return ring * 4 * total


def codec_seconds(kind: str, rank: int, shapes: Sequence[Sequence[int]], world_size: int, repeats: int = 3) -> float:
    """Seconds of local tensor work one step of a level costs on this machine, timed on random tensors of the
    buckets' ``shapes`` (the fastest of ``repeats``): the casts of fp16/bf16; PowerSGD's error feedback and its
    products ``M Q``, ``M^T P``, ``P Q^T`` with two orthogonalisations; 1-bit's sign, scale, bit packing and
    error, twice (worker and server side). The collectives themselves are not timed."""
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(sum(math.prod(int(s) for s in shape) for shape in shapes), generator=gen)
    best = math.inf
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        _codec_work(kind, rank, shapes, flat, world_size)
        best = min(best, time.perf_counter() - start)
    return best


def _codec_work(kind: str, rank: int, shapes: Sequence[Sequence[int]], flat: torch.Tensor, world_size: int) -> None:
    if kind == "none":
        flat.clone().div_(world_size)
    elif kind in ("fp16", "bf16"):
        flat.copy_(flat.to(torch.float16 if kind == "fp16" else torch.bfloat16).div_(world_size))
    elif kind == "powersgd":
        copy = flat.clone()
        offset = 0
        for shape in shapes:
            n, m, r, compressed = _powersgd_split(shape, rank)
            if compressed:
                matrix = flat[offset : offset + n * m].view(n, m)
                q = torch.linalg.qr(torch.randn(m, r))[0]
                p = torch.linalg.qr(matrix @ q)[0]
                q = matrix.t() @ p
                matrix.copy_(p @ q.t())
            offset += n * m
        torch.sub(copy, flat)
    else:
        offset = 0
        for shape in shapes:  # per parameter, as the 1-bit hook cuts its chunks
            numel = math.prod(int(s) for s in shape)
            for _ in range(2):  # worker compression, then the server's on the averaged chunk
                x = flat[offset : offset + numel].clone()
                scale = x.norm() / math.sqrt(max(1, numel))
                bits = torch.nn.functional.pad((x >= 0).to(torch.uint8), (0, (-numel) % 8)).view(-1, 8)
                packed = (bits << torch.arange(7, -1, -1, dtype=torch.uint8)).sum(1, dtype=torch.uint8)
                unpacked = (packed.view(-1, 1) >> torch.arange(7, -1, -1, dtype=torch.uint8)) & 1
                signs = unpacked.reshape(-1)[:numel].to(x.dtype).mul_(2).sub_(1)
                x.sub_(signs * scale)
            offset += numel


def predict_step_seconds(
    other_s: float, codec_s: float, messages: float, nbytes: float, latency_s: float, seconds_per_byte: float
) -> float:
    """``T = O + K + m alpha + bytes c``: the step time of a level (see the module docstring)."""
    return other_s + codec_s + messages * latency_s + nbytes * seconds_per_byte


def choose_level(predicted: Sequence[float], current: int, tolerance: float, hysteresis: float) -> int:
    """The level to use next, from the predicted step times of the levels (ordered from the least to the most lossy).

    The target is the least lossy level predicted within ``1 + tolerance`` of the fastest: a gradient closer to the
    exact one is worth up to ``tolerance`` of step time. A less lossy target is taken at once; a more lossy one only
    when the current level is predicted more than ``1 + tolerance + hysteresis`` times the fastest, so that a level
    near the border is not left and re-entered at every decision (a Schmitt trigger).
    """
    best = min(predicted)
    target = next(i for i, t in enumerate(predicted) if t <= (1 + tolerance) * best)
    if target < current:
        return target
    if target > current and predicted[current] > (1 + tolerance + hysteresis) * best:
        return target
    return current


def powersgd_state_dict(state: Any, factors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A ``PowerSGDState``'s counters and random state, and the warm-start factors ``Q`` by parameter name (equal on
    every rank), in types ``torch.load(weights_only=True)`` reads."""
    name, keys, pos, has_gauss, cached = state.rng.get_state()
    return {"iter": state.iter, "numel": [state.total_numel_before_compression, state.total_numel_after_compression],
            "rng": [name, torch.as_tensor(keys.astype("int64")), int(pos), int(has_gauss), float(cached)],
            "q": {n: q.detach().cpu().clone() for n, q in factors.items()}}


def load_powersgd_state(state: Any, saved: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Restore :func:`powersgd_state_dict` into ``state`` (its per-bucket buffers emptied); return the factors."""
    import numpy as np

    name, keys, pos, has_gauss, cached = saved["rng"]
    state.rng.set_state((name, np.asarray(keys.tolist(), dtype=np.uint32), pos, has_gauss, cached))
    state.iter = int(saved["iter"])
    state.total_numel_before_compression, state.total_numel_after_compression = (int(n) for n in saved["numel"])
    state.p_memory_dict, state.q_memory_dict, state.error_dict = {}, {}, {}
    return {n: q.clone() for n, q in saved["q"].items()}
