"""AdaptiveBatchSizeTrainer(batch_unit="tokens") on 2 gloo ranks under torchrun: the same budgets on both ranks,
token-balanced contiguous shares, exact coverage, and weights equal plain SGD on each global batch's mean loss per
token (float64) from one process; also with rank_weights [1, 3] (rank 1 gets three quarters of the tokens) and "auto"
(each rank's forward timed per token; whatever weights it sets, coverage and gradients stay exact)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_tokens_common import N, Sequences, sgd_reference

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
@pytest.mark.parametrize("weights", [None, [1.0, 3.0], "auto"])
def test_two_ranks_share_token_budgets_exactly_and_match_one_process(tmp_path, weights):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "tests" / "integrations" / "_hf_tokens_ddp.py"), str(tmp_path)]
    cmd += [] if weights is None else [weights if weights == "auto" else ",".join(map(str, weights))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["world_size"] == 2 and r0["tokens_seen"] == r1["tokens_seen"]
    lengths = np.asarray(Sequences().lengths)
    assert r0["tokens_seen"] == 2 * int(lengths.sum())
    per_epoch = collections.defaultdict(list)
    for a, b in zip(r0["steps"], r1["steps"]):
        assert (a["size"], a["tokens"]) == (b["size"], b["tokens"])  # one global batch per step on every rank
        assert a["local_tokens"] + b["local_tokens"] == a["tokens"] == int(lengths[a["ids"] + b["ids"]].sum())
        if a["size"] >= 2 and weights != "auto":  # contiguous shares cut at the sample boundary nearest rank 0's quota
            quota = a["tokens"] * (0.5 if weights is None else weights[0] / sum(weights))
            assert abs(a["local_tokens"] - quota) <= int(lengths[a["ids"] + b["ids"]].max())
        per_epoch[a["epoch"]].extend(a["ids"] + b["ids"])
    assert sorted(per_epoch) == [0, 1] and all(sorted(ids) == list(range(N)) for ids in per_epoch.values())
    assert any(s["ghosts"] for s in r1["steps"])  # a one-sample step: rank 1 ran ghost micro-batches
    assert r0["weights"] == r1["weights"]
    reference = sgd_reference(Sequences(), [a["ids"] + b["ids"] for a, b in zip(r0["steps"], r1["steps"])])
    for got, want in zip(r0["weights"], reference.parameters()):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want.detach(), rtol=1e-12, atol=1e-13)
