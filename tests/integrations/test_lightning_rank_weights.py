"""AdaptiveBatchSize(rank_weights=...): uneven shares on 2 DDP ranks under torchrun keep the coverage and the
gradients exact (weights equal a 1-process full-batch SGD reference); "auto" moves samples away from a slowed
rank and resumes its estimate from a checkpoint; bad weights are refused with the fix."""

from __future__ import annotations

import collections
import math
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")

from _hf_common import check_noise_by_hand  # noqa: E402
from _lightning_ddp import NOISE_SAMPLES, Model, make_data, make_net  # noqa: E402
from _script_runner import torchrun_ranks  # noqa: E402

from batchpilot.data.shares import share_bounds  # noqa: E402
from batchpilot.integrations.lightning import AdaptiveBatchSize  # noqa: E402


def torchrun(out: Path, *args: str) -> list[dict]:
    return torchrun_ranks("_lightning_ddp.py", out, *args)


def sgd_reference(batches: list[list[int]], data) -> list[torch.Tensor]:
    """Plain full-batch-mean SGD (lr 0.1) over ``batches`` of sample ids."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y, _ = data.tensors
    for ids in batches:
        idx = torch.tensor(ids)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        optimizer.step()
    return [p.detach() for p in net.parameters()]


def check_shares_coverage_and_gradients(ranks: list[dict], num_samples: int) -> None:
    """Each step's shares follow the weights it was shared by, every complete epoch covers the data once, and the
    weights equal full-batch SGD on one process over the same global batches."""
    steps0, steps1 = ranks[0]["steps"], ranks[1]["steps"]
    assert [s["size"] for s in steps0] == [s["size"] for s in steps1]
    assert [s["rank_weights"] for s in steps0] == [s["rank_weights"] for s in steps1]
    for s0, s1 in zip(steps0, steps1):
        for rank, s in enumerate((s0, s1)):
            start, stop = share_bounds(s["size"], rank, 2, s["rank_weights"])
            assert len(s["ids"]) == stop - start, s
    per_epoch = collections.defaultdict(list)
    for r in ranks:
        for s in r["steps"]:
            per_epoch[s["epoch"]].extend(s["ids"])
    assert all(sorted(ids) == list(range(num_samples)) for epoch, ids in per_epoch.items() if epoch < max(per_epoch))
    assert ranks[0]["weights"] == ranks[1]["weights"]
    reference = sgd_reference([a["ids"] + b["ids"] for a, b in zip(steps0, steps1)], make_data(num_samples))
    for got, want in zip(ranks[0]["weights"], reference):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=1e-13)


@pytest.mark.distributed
def test_fixed_rank_weights_share_by_weight_with_exact_gradients(tmp_path):
    ranks = torchrun(tmp_path, "--rank-weights", "1,3")
    assert all(s["rank_weights"] == [1.0, 3.0] for r in ranks for s in r["steps"])
    assert sum(len(s["ids"]) for s in ranks[1]["steps"]) > 2.5 * sum(len(s["ids"]) for s in ranks[0]["steps"])
    assert any(not ids for s in ranks[0]["steps"] for ids in s["micro"])  # rank 0 ran ghost micro-batches
    check_shares_coverage_and_gradients(ranks, 61)


@pytest.mark.distributed
def test_auto_rank_weights_move_samples_off_a_slow_rank_and_resume(tmp_path):
    # Rank 1's training step sleeps 2 ms per sample (a slower node; a sleep, so the ratio survives a busy machine).
    # 4 samples in the first step, then 24; 240 samples, 18 steps, re-estimated after step 10; saved every 3.
    options = ["--rank-weights", "auto", "--slow-rank1", "0.002", "--sizes", "24", "--samples", "240",
               "--max-steps", "18"]
    ranks = torchrun(tmp_path / "auto", *options, "--save", str(tmp_path / "ckpt"))
    steps = ranks[0]["steps"]
    assert len(steps) == 18
    assert all(s["rank_weights"] is None for s in steps[:10])
    w0, w1 = steps[10]["rank_weights"]  # decided after step 10: step 11's
    assert w0 > 2 * w1 and math.isclose(w0 + w1, 2.0, rel_tol=1e-3)
    assert all(s["rank_weights"] == [w0, w1] for s in steps[10:])
    assert len(ranks[1]["steps"][12]["ids"]) < len(ranks[0]["steps"][12]["ids"])
    check_shares_coverage_and_gradients(ranks, 240)

    # The fit resumed from the step-12 checkpoint continues with the saved estimate: the same shares, and the same
    # weights, bit for bit (no re-estimate falls in steps 13-18).
    resumed = torchrun(tmp_path / "resumed", *options, "--resume", str(tmp_path / "ckpt" / "step=12.ckpt"))
    for clean, again in zip(ranks, resumed):
        assert [(s["size"], s["ids"], s["rank_weights"]) for s in clean["steps"][12:]] == \
            [(s["size"], s["ids"], s["rank_weights"]) for s in again["steps"]]
        assert clean["weights"] == again["weights"]


@pytest.mark.distributed
def test_the_noise_scale_from_uneven_shares_equals_the_estimate_by_hand(tmp_path):
    """Weights 2:3, every step measured: the four micro-batches of a step (two per rank, of unequal sizes; each
    rank's last read inside DDP's all-reduce) are the small batches; rank 0's controller saw the by-hand estimate."""
    ranks = torchrun(tmp_path, "--noise", "--rank-weights", "2,3")
    micro = [a["micro"] + b["micro"] for a, b in zip(ranks[0]["steps"], ranks[1]["steps"])]
    shares = [(len(m[0]) + len(m[1]), len(m[2]) + len(m[3])) for m in micro]
    assert all(a <= b for a, b in shares) and any(a < b for a, b in shares)  # rank 1's share is the larger
    # Goodput's step-time model reads rank 0's share of each batch (its micro-batch times are the ones fitted).
    assert all(seen["dist/lead_share"] == 0.4 for seen in ranks[0]["stats"])
    net = make_net()
    x, y, _ = make_data(NOISE_SAMPLES).tensors
    check_noise_by_hand(micro, ranks[0]["stats"], net,
                        lambda ids: torch.nn.functional.cross_entropy(net(x[torch.tensor(ids)]), y[torch.tensor(ids)]),
                        NOISE_SAMPLES)


@pytest.mark.parametrize(("value", "error", "message"), [
    ([0.0, 1.0], ValueError, "rank_weights[0] is 0.0; each weight must be a finite number > 0"),
    ([1.0, -2.0], ValueError, "rank_weights[1] is -2.0"),
    ([float("nan")], ValueError, "rank_weights[0] is nan"),
    ("even", ValueError, "rank_weights='even' is not a valid setting"),
    ({"a": 1}, TypeError, "rank_weights must be None, 'auto' or a list of one weight per rank"),
    ([], ValueError, "rank_weights is empty"),
])
def test_bad_rank_weights_are_refused_at_construction(value, error, message):
    with pytest.raises(error) as caught:
        AdaptiveBatchSize(batch_size=4, rank_weights=value)
    assert message in str(caught.value)


def test_weights_of_another_length_than_the_world_size_stop_the_fit_at_its_start(tmp_path):
    adaptive = AdaptiveBatchSize(batch_size=4, rank_weights=[1.0, 2.0])
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, callbacks=[adaptive], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), num_sanity_val_steps=0)
    with pytest.raises(ValueError, match=r"has 2 weights \(\[1.0, 2.0\]\) but world_size is 1"):
        trainer.fit(Model(adaptive, make_data(), val=False))


def test_one_process_takes_one_weight_and_auto(tmp_path):
    for value in ([2.5], "auto"):
        adaptive = AdaptiveBatchSize(batch_size=4, rank_weights=value)
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, callbacks=[adaptive], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(tmp_path), num_sanity_val_steps=0)
        trainer.fit(Model(adaptive, make_data(), val=False))
        assert adaptive.samples_seen == 61
        assert adaptive.rank_weights == ((2.5,) if value != "auto" else None)
