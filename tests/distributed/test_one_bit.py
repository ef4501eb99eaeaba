"""The 1-bit hook (batchpilot.distributed.compression) on 2 real gloo ranks against a reference implementation
written here, step by step, in plain Python and torch: bit exact, for several steps, whatever DDP's buckets."""

from __future__ import annotations

import math
from pathlib import Path

import _one_bit_workers as w
import pytest
import torch
import torch.multiprocessing as mp

from batchpilot.distributed.compression import OneBitState, pack_signs, resharded, unpack_signs

WORLD = 2


# ---------------------------------------------------------------------------------------------- the reference
def _signs_times(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale * sign(values)`` with sign(0) = +1 and sign(NaN) = -1, element by element in Python."""
    s = float(scale)
    return torch.tensor([s if v >= 0 else -s for v in values.tolist()], dtype=torch.float32)


def reference(grads: list[list[list[torch.Tensor]]], warmup: int) -> tuple[list, list, list]:
    """What every rank's reduced gradient should be at each step (``grads[step][rank][param]``), and the final
    worker and server errors by rank: the two-phase compressed all-reduce of 1-bit Adam's backend (Tang et al.
    2021), per parameter: pad to a multiple of 8N, chunk d to rank d, scale = RMS of the chunk's real values,
    error feedback on both sides; a step with a non-finite result keeps the errors it started with."""
    numels = [math.prod(s) for s in w.SHAPES]
    chunks = [math.ceil(m / (8 * WORLD)) * 8 for m in numels]
    worker = [[torch.zeros(m) for m in numels] for _ in range(WORLD)]
    server = [[torch.zeros(c) for c in chunks] for _ in range(WORLD)]
    outputs = []
    for t, by_rank in enumerate(grads):
        if t < warmup:  # DDP's default: every rank divides by N, then a sum
            outputs.append([by_rank[0][i] / WORLD + by_rank[1][i] / WORLD for i in range(len(numels))])
            continue
        new_worker = [[None] * len(numels) for _ in range(WORLD)]
        new_server = [[None] * len(numels) for _ in range(WORLD)]
        out = []
        for i, (m, c) in enumerate(zip(numels, chunks)):
            real = [max(min(m - d * c, c), 0) for d in range(WORLD)]
            sent = {}  # (from rank, to rank) -> decoded chunk
            for r in range(WORLD):
                x = by_rank[r][i].reshape(-1) + worker[r][i]
                padded = torch.cat([x, torch.zeros(WORLD * c - m)])
                decoded = []
                for d in range(WORLD):
                    seg = padded[d * c:(d + 1) * c]
                    scale = torch.sqrt(seg.pow(2).sum() / max(real[d], 1))
                    sent[r, d] = _signs_times(seg, scale)
                    decoded.append(sent[r, d])
                new_worker[r][i] = (padded - torch.cat(decoded))[:m]
            parts = []
            for d in range(WORLD):
                total = sent[0, d]
                for r in range(1, WORLD):
                    total = total + sent[r, d]
                mean = total / WORLD
                mean[real[d]:] = 0.0
                y = mean + server[d][i]
                scale = torch.sqrt(y.pow(2).sum() / max(real[d], 1))
                back = _signs_times(y, scale)
                error = y - back
                error[real[d]:] = 0.0
                new_server[d][i] = error
                parts.append(back)
            out.append(torch.cat(parts)[:m].view(w.SHAPES[i]))
        outputs.append(out)
        if all(torch.isfinite(o).all() for o in out):
            worker, server = new_worker, new_server
    return outputs, worker, server


# ---------------------------------------------------------------------------------------------- the hook
def run_hook(tmp_path: Path, steps: int, warmup: int, bucket_cap_mb: float, nonfinite_step: int = -1) -> list[dict]:
    mp.spawn(w.hook_steps, args=(WORLD, str(tmp_path / "init"), str(tmp_path), steps, warmup, bucket_cap_mb,
                                 nonfinite_step), nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def fed_gradients(steps: int, nonfinite_step: int = -1) -> list[list[list[torch.Tensor]]]:
    grads = [[w.fixed_gradients(t, r) for r in range(WORLD)] for t in range(steps)]
    if 0 <= nonfinite_step < steps:
        grads[nonfinite_step][1][0].view(-1)[3] = float("nan")
    return grads


@pytest.mark.distributed
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 1e-6])  # one bucket; one bucket per parameter
def test_hook_is_bit_exact_against_the_reference(tmp_path, bucket_cap_mb):
    steps, warmup = 6, 2
    ranks = run_hook(tmp_path, steps, warmup, bucket_cap_mb)
    expected, worker, server = reference(fed_gradients(steps), warmup)
    for r, got in enumerate(ranks):
        assert got["step"] == steps and got["compressed_steps"] == steps - warmup
        for t in range(steps):
            for a, b in zip(got["reduced"][t], expected[t]):
                assert torch.equal(a, b), (r, t)
    # Every rank's error buffers, gathered into the state (rows by rank, parameters in the module's order).
    for state in (ranks[0]["state"], ranks[1]["state"]):
        assert state["world_size"] == WORLD and state["names"] == [f"ps.{i}" for i in range(len(w.SHAPES))]
        for r in range(WORLD):
            assert torch.equal(state["worker_error"][r], torch.cat(worker[r]))
            assert torch.equal(state["server_error"][r], torch.cat(server[r]))
    # Bytes: per compressed step one all-to-all and one all-gather of a row of T/8 signs + 4 bytes per parameter.
    numels = [math.prod(s) for s in w.SHAPES]
    width = sum(math.ceil(m / (8 * WORLD)) * 8 for m in numels)
    row = width // 8 + 4 * len(numels)
    full = 2 * (WORLD - 1) / WORLD * 4 * sum(numels)
    assert ranks[0]["wire_bytes"] == pytest.approx(warmup * full + (steps - warmup) * 2 * (WORLD - 1) * row)
    assert ranks[0]["full_bytes"] == pytest.approx(steps * full)


@pytest.mark.distributed
def test_a_nonfinite_step_keeps_the_error_buffers(tmp_path):
    steps, warmup, bad = 5, 1, 2
    ranks = run_hook(tmp_path, steps, warmup, 25.0, nonfinite_step=bad)
    expected, worker, server = reference(fed_gradients(steps, bad), warmup)
    assert not torch.isfinite(ranks[0]["reduced"][bad][0]).all()  # the step is seen as non-finite (and skipped)
    for got in ranks:
        for t in range(steps):
            for a, b in zip(got["reduced"][t], expected[t]):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        for r in range(WORLD):
            assert torch.equal(got["state"]["worker_error"][r], torch.cat(worker[r]))


# ---------------------------------------------------------------------------------------------- pieces
def test_pack_and_unpack_signs_round_trip():
    bits = torch.rand(3, 64, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = pack_signs(bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    assert torch.equal(unpack_signs(packed), bits)
    assert pack_signs(torch.tensor([True] + [False] * 7)).item() == 128  # first value in the highest bit


def test_reshard_keeps_the_residual_of_the_average():
    """A state saved by 2 ranks loaded by 1 or 3: every new rank's worker error is the old workers' mean plus the
    server errors laid back over each parameter, so the residual the average gradient still owes is the same."""
    numels = [13, 5]
    chunks = [math.ceil(m / 16) * 8 for m in numels]
    g = torch.Generator().manual_seed(3)
    worker_rows = torch.randn(2, sum(numels), generator=g)
    server_rows = torch.randn(2, sum(chunks), generator=g)
    for r in range(2):  # padding holds no error
        at = 0
        for m, c in zip(numels, chunks):
            for d in range(c):
                if r * c + d >= m:
                    server_rows[r, at + d] = 0.0
            at += c
    state = {"version": 1, "names": ["a", "b"], "numels": numels, "world_size": 2,
             "worker_error": worker_rows, "server_error": server_rows}
    # The residual the saved run's average owes, per parameter: mean of worker errors + server chunks laid out.
    owed = {}
    w_at, s_at = 0, 0
    for name, m, c in zip(["a", "b"], numels, chunks):
        laid = torch.cat([server_rows[0, s_at:s_at + c], server_rows[1, s_at:s_at + c]])[:m]
        owed[name] = (worker_rows[0, w_at:w_at + m] + worker_rows[1, w_at:w_at + m]) / 2 + laid
        w_at, s_at = w_at + m, s_at + c
    for new_world in (1, 3):
        per_rank = [resharded(state, new_world, r) for r in range(new_world)]
        for name in owed:
            mean = sum(wk[name] for wk, _ in per_rank) / new_world
            torch.testing.assert_close(mean, owed[name])
        assert all(server is None for _, server in per_rank)  # server errors start at zero
    same = resharded(state, 2, 1)  # the same world size: the rank's own buffers
    assert torch.equal(same[0]["a"], worker_rows[1, :13]) and torch.equal(same[1]["b"], server_rows[1, 8:16])


@pytest.mark.distributed
def test_a_state_from_2_ranks_loads_on_1(tmp_path):
    """The state_dict of a 2-rank run, loaded by a 1-rank group: the rank's worker error is the re-sharded one,
    its server error zero, and it then compresses on its own."""
    numels = [math.prod(s) for s in w.SHAPES]
    chunks = [math.ceil(m / 16) * 8 for m in numels]
    g = torch.Generator().manual_seed(5)
    server = torch.randn(2, sum(chunks), generator=g)
    at = 0
    for m, c in zip(numels, chunks):  # padding holds no server error
        for r in range(2):
            server[r, at + max(min(m - r * c, c), 0):at + c] = 0.0
        at += c
    saved = {"version": 1, "step": 7, "warmup_steps": 0, "wire_bytes": 1.0, "full_bytes": 2.0, "compressed_steps": 7,
             "world_size": 2, "names": [f"ps.{i}" for i in range(len(numels))], "numels": numels,
             "worker_error": torch.randn(2, sum(numels), generator=g), "server_error": server}
    out = str(tmp_path / "one{rank}.pt")
    mp.spawn(w.load_elsewhere, args=(1, str(tmp_path / "init"), saved, out), nprocs=1, join=True)
    got = torch.load(out.format(rank=0))
    expected, none = resharded(saved, 1, 0)
    assert none is None
    loaded = got["loaded"]
    assert loaded["world_size"] == 1 and loaded["step"] == 7
    assert torch.equal(loaded["server_error"][0], torch.zeros(sum(math.ceil(m / 8) * 8 for m in numels)))
    assert torch.equal(loaded["worker_error"][0], torch.cat([expected[f"ps.{i}"] for i in range(len(numels))]))
    assert got["step"] == 8 and all(torch.isfinite(t).all() for t in got["grads"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="warmup_steps"):
        OneBitState(warmup_steps=-1)
    with pytest.raises(ValueError, match="warmup_steps"):
        OneBitState(warmup_steps=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a OneBitState state_dict"):
        OneBitState().load_state_dict({"step": 3})
