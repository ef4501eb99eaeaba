"""AdaptiveBatchSizeTrainer(rank_weights=...): uneven shares on 2 gloo ranks under torchrun keep the coverage and
the gradients exact (weights equal a 1-process full-batch SGD reference); "auto" moves samples away from a slowed
rank and resumes its estimate from a checkpoint; bad weights are refused with the fix."""

from __future__ import annotations

import collections
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_common import PointSet, Recorder, SizeList, check_noise_by_hand
from _hf_helpers import quiet_args, recorder_loss, sgd_reference
from _script_runner import torchrun_ranks
from transformers import TrainingArguments

from batchpilot.data.shares import share_bounds
from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer
from batchpilot.integrations.hf.checks import check_rank_weights_setting


def torchrun(out: Path, *args: str) -> list[dict]:
    return torchrun_ranks("_hf_ddp.py", out, *args)


def check_shares_coverage_and_gradients(ranks: list[dict], num_samples: int, first_weights) -> None:
    """Each step's shares follow the weights in force, every epoch covers the data once, and the weights equal
    full-batch SGD on one process over the same global batches."""
    steps0, steps1 = ranks[0]["steps"], ranks[1]["steps"]
    assert [s["size"] for s in steps0] == [s["size"] for s in steps1]
    assert [s["rank_weights"] for s in steps0] == [s["rank_weights"] for s in steps1]
    weights = first_weights
    for s0, s1 in zip(steps0, steps1):
        for rank, s in enumerate((s0, s1)):
            start, stop = share_bounds(s["size"], rank, 2, weights)
            assert len(s["ids"]) == stop - start, (s["step"], weights)
        weights = s0["rank_weights"]  # decided after this step: the next step's
    per_epoch = collections.defaultdict(list)
    for r in ranks:
        for s in r["steps"]:
            per_epoch[s["epoch"]].extend(s["ids"])
    complete = [ids for epoch, ids in per_epoch.items() if epoch < max(per_epoch)]
    assert complete and all(sorted(ids) == list(range(num_samples)) for ids in complete)
    assert ranks[0]["weights"] == ranks[1]["weights"]
    reference, _ = sgd_reference(PointSet(num_samples), [a["ids"] + b["ids"] for a, b in zip(steps0, steps1)])
    for got, want in zip(ranks[0]["weights"], reference.parameters()):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want.detach(), rtol=0, atol=1e-13)


@pytest.mark.distributed
def test_fixed_rank_weights_share_by_weight_with_exact_gradients(tmp_path):
    ranks = torchrun(tmp_path / "fixed", "--rank-weights", "1,3")
    assert all(s["rank_weights"] == [1.0, 3.0] for r in ranks for s in r["steps"])
    # Rank 1 trained three times rank 0's samples (shares rounded by the largest remainder); sizes of 1 and 2
    # leave rank 0 a ghost micro-batch.
    assert sum(len(s["ids"]) for s in ranks[1]["steps"]) > 2.5 * sum(len(s["ids"]) for s in ranks[0]["steps"])
    assert any(s["ghosts"] for s in ranks[0]["steps"])
    check_shares_coverage_and_gradients(ranks, 61, (1.0, 3.0))


@pytest.mark.distributed
def test_auto_rank_weights_move_samples_off_a_slow_rank_and_resume(tmp_path):
    # Rank 1's forward sleeps 2 ms per sample (a slower node; a sleep, so the ratio survives a busy machine).
    # 8 samples in the first step (2 per device x 2 ranks x 2 micro-batches), then 24 (16 at the first epoch's end);
    # 240 samples, 1.6 epochs: 17 steps, re-estimated after step 10.
    options = ["--rank-weights", "auto", "--slow-rank1", "0.002", "--sizes", "24", "--samples", "240",
               "--epochs", "1.6", "--save-steps", "4"]
    ranks = torchrun(tmp_path / "auto", *options)
    steps = ranks[0]["steps"]
    assert len(steps) == 17
    assert all(s["rank_weights"] is None for s in steps[:9])
    w0, w1 = steps[9]["rank_weights"]  # decided after step 10
    assert w0 > 2 * w1 and math.isclose(w0 + w1, 2.0, rel_tol=1e-3)
    assert all(s["rank_weights"] == [w0, w1] for s in steps[10:])
    assert len(ranks[1]["steps"][12]["ids"]) < len(ranks[0]["steps"][12]["ids"])
    check_shares_coverage_and_gradients(ranks, 240, None)

    # A run resumed from the step-12 checkpoint continues with the saved estimate: the same shares, and the
    # same weights, bit for bit (no re-estimate falls in steps 13-17).
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "auto" / "ckpt" / "checkpoint-12", resumed_dir / "ckpt" / "checkpoint-12")
    saved = json.loads((resumed_dir / "ckpt" / "checkpoint-12" / "batchpilot_state.json").read_text())
    assert saved["rank_weights"]["balancer"]["weights"] == [w0, w1]
    resumed = torchrun(resumed_dir, *options)
    assert resumed[0]["resumed_from"].endswith("checkpoint-12")
    for clean, again in zip(ranks, resumed):
        assert [(s["size"], s["ids"], s["rank_weights"]) for s in clean["steps"][12:]] == \
            [(s["size"], s["ids"], s["rank_weights"]) for s in again["steps"]]
        assert clean["weights"] == again["weights"]


@pytest.mark.distributed
def test_the_noise_scale_from_uneven_shares_equals_the_estimate_by_hand(tmp_path):
    """Weights 2:3, every step measured: the four micro-batches of a step (two per rank, of unequal sizes) are the
    small batches; what rank 0's controller saw equals the two-batch estimate computed by hand (sizes weighted)."""
    ranks = torchrun(tmp_path, "--noise", "--rank-weights", "2,3")
    steps = ranks[0]["steps"]
    micro = [[ids for r in ranks for ids in r["micro"][2 * k:2 * k + 2]] for k in range(len(steps))]
    assert [sum(map(len, m)) for m in micro] == [s["size"] for s in steps]
    shares = [(len(m[0]) + len(m[1]), len(m[2]) + len(m[3])) for m in micro]
    assert all(a <= b for a, b in shares) and any(a < b for a, b in shares)  # rank 1's share is the larger
    # Goodput's step-time model reads rank 0's share of each batch (its micro-batch times are the ones fitted).
    assert all(seen["dist/lead_share"] == 0.4 for seen in ranks[0]["stats"])
    reference = Recorder()
    check_noise_by_hand(micro, ranks[0]["stats"], reference, recorder_loss(reference, PointSet(64)), 64)


@pytest.mark.parametrize(("value", "error", "message"), [
    ([1.0, 2.0], ValueError, "has 2 weights ([1.0, 2.0]) but world_size is 1"),
    ([0.0], ValueError, "rank_weights[0] is 0.0; each weight must be a finite number > 0"),
    ([-1], ValueError, "rank_weights[0] is -1"),
    ([float("nan")], ValueError, "rank_weights[0] is nan"),
    ([float("inf")], ValueError, "rank_weights[0] is inf"),
    ("fast", ValueError, "rank_weights='fast' is not a valid setting"),
    (2.0, TypeError, "rank_weights must be None, 'auto' or a list of one weight per rank"),
    ([True], TypeError, "rank_weights[0] is True of type bool"),
])
def test_bad_rank_weights_are_refused_with_the_fix(tmp_path, value, error, message):
    with pytest.raises(error) as caught:
        AdaptiveBatchSizeTrainer(batch_size_scheduler=SizeList([4]), model=Recorder(), train_dataset=PointSet(8),
                                 args=quiet_args(tmp_path), rank_weights=value)
    assert message in str(caught.value)


def test_one_process_takes_one_weight_and_auto(tmp_path):
    for value in ([2.5], "auto"):
        model = Recorder()
        trainer = AdaptiveBatchSizeTrainer(batch_size_scheduler=SizeList([4, 8]), model=model,
                                           train_dataset=PointSet(24), args=quiet_args(tmp_path, num_train_epochs=1),
                                           rank_weights=value)
        trainer.train()
        assert trainer.batchpilot.samples_seen == 24
        assert trainer.batchpilot.rank_weights == ((2.5,) if value != "auto" else None)


def test_per_rank_item_normalisation_is_refused_with_uneven_shares(tmp_path):
    # A loss normalised by num_items_in_batch (compute_loss_func) divides by each rank's own item count when
    # average_tokens_across_devices=False: uneven shares would then be weighted like even ones.
    args = TrainingArguments(output_dir=str(tmp_path), average_tokens_across_devices=False, use_cpu=True)
    with pytest.raises(ValueError, match="average_tokens_across_devices=True"):
        check_rank_weights_setting([1.0, 2.0], args, 2, True)
    assert check_rank_weights_setting([1.0, 2.0], args, 2, False) == (1.0, 2.0)
    assert check_rank_weights_setting(None, args, 2, True) is None
