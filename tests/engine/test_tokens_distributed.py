"""Token budgets on two real gloo processes: every epoch covered exactly, the ranks' shares near-equal in tokens
(or in proportion to rank_weights), and the weights equal to one process taking each step's samples as one big
batch with the mean token loss (float64, 1e-12), with DDP (which averages over ranks) and with the engine's own
reduction (which sums)."""

from __future__ import annotations

import json
from pathlib import Path

import _tokens_workers as w
import pytest
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed


def spawn(tmp_path: Path, ddp: bool, max_tokens: int | None, rank_weights, steps: int) -> list[dict]:
    mp.spawn(w.token_worker, args=(2, str(tmp_path / "init"), str(tmp_path), ddp, max_tokens, rank_weights, steps),
             nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("ddp,max_tokens,rank_weights", [(True, None, None), (False, 16, None), (True, 16, [1.0, 3.0]),
                                                         (True, 16, "auto")])
def test_two_ranks_cover_exactly_and_match_one_big_batch_per_step(tmp_path, ddp, max_tokens, rank_weights):
    steps = 30
    r0, r1 = spawn(tmp_path, ddp, max_tokens, rank_weights, steps)
    lengths = w.make_data().lengths
    steps_indices, epochs = [], {}
    for a, b in zip(r0["records"], r1["records"]):
        assert a["tokens"] == b["tokens"] and a["accumulation_steps"] == b["accumulation_steps"]
        assert len(a["micro_tokens"]) == len(b["micro_tokens"]) == a["accumulation_steps"]
        indices = a["indices"] + b["indices"]
        assert sum(lengths[i] for i in indices) == a["tokens"]
        tokens = [sum(lengths[i] for i in r["indices"]) for r in (a, b)]
        quota = [a["tokens"] / 2] * 2 if rank_weights is None else [a["tokens"] / 4, 3 * a["tokens"] / 4]
        # every rank has a sample, and is within one sample of its quota in tokens ("auto": the quotas move)
        if len(indices) >= 2 and rank_weights != "auto":
            assert all(t > 0 and abs(t - q) <= w.MAX_LEN for t, q in zip(tokens, quota)), (tokens, quota)
        if max_tokens is not None:
            for r in (a, b):
                assert all(t <= max_tokens for t in r["micro_tokens"]), r["micro_tokens"]
        steps_indices.append(indices)
        epochs.setdefault(a["epoch"], []).extend(indices)
    assert len(steps_indices) == steps
    complete = [e for e in epochs if e + 1 in epochs]
    assert complete  # 30 steps cross at least one epoch end
    for e in complete:
        assert sorted(epochs[e]) == list(range(w.NUM_SAMPLES)), e
    assert r0["weights"] == r1["weights"]
    assert r0["noise"] == r1["noise"] and r0["noise"]  # one estimate, in tokens, on every rank
    reference = w.reference_weights(steps_indices)
    for got, want in zip(r0["weights"], reference):
        diff = max(abs(g - v) for g, v in zip(_flat(got), _flat(want)))
        assert diff < 1e-12, diff
    assert r0["tokens_seen"] == sum(lengths[i] for s in steps_indices for i in s)
    assert r0["samples_seen"] == sum(len(s) for s in steps_indices)
    # The controller observed token counts: the budget in force, the tokens seen and the dataset's tokens.
    assert all(n == sum(lengths) for _, _, n in r0["observed"])
    assert r0["observed"][-1][1] == r0["tokens_seen"]


def _flat(value) -> list[float]:
    return [x for v in value for x in _flat(v)] if isinstance(value, list) else [value]
