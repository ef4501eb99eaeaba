"""AdaptiveBatchSizeTrainer under torchrun with 2 gloo ranks: equal sizes on every rank, exact coverage,
weights equal a 1-process reference; the noise scale from the ranks and micro-batches; a failed rank
restarted by torchrun resumes to bitwise-equal weights (and a single process resumes the 2-rank checkpoint).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_common import PointSet, Recorder, SizeList, check_noise_by_hand
from _hf_helpers import SIZES, exact_sgd, group_by_step, quiet_args, record_steps, recorder_loss, sgd_reference

from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer

REPO = Path(__file__).resolve().parents[2]


def torchrun(out: Path, *args: str, restarts: int = 0, env: dict | None = None) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           f"--max-restarts={restarts}", str(REPO / "tests" / "_hf_ddp.py"), str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.distributed
def test_torchrun_two_ranks_match_a_single_process_reference(tmp_path):
    ranks = torchrun(tmp_path / "ddp")
    assert [r["world_size"] for r in ranks] == [2, 2]
    sizes = [[s["size"] for s in r["steps"]] for r in ranks]
    assert sizes[0] == sizes[1]  # every rank ran every step at the same global size
    assert any(s["ghosts"] for r in ranks for s in r["steps"])
    per_epoch = collections.defaultdict(list)
    for r in ranks:
        for s in r["steps"]:
            per_epoch[s["epoch"]].extend(s["ids"])
    assert sorted(per_epoch) == [0, 1] and all(sorted(ids) == list(range(61)) for ids in per_epoch.values())
    assert ranks[0]["weights"] == ranks[1]["weights"]
    global_batches = [s0["ids"] + s1["ids"] for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"])]
    reference, _ = sgd_reference(PointSet(61), global_batches)
    for got, want in zip(ranks[0]["weights"], reference.parameters()):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want.detach(), rtol=0, atol=1e-13)


@pytest.mark.distributed
@pytest.mark.parametrize("compiled", [False, True])
def test_torchrun_noise_scale_from_the_ranks_and_micro_batches(tmp_path, compiled):
    """2 gloo ranks x 2 micro-batches, every step measured: the four micro-batches of a step are the small
    batches (each rank's last one read inside DDP's all-reduce by the communication hook), the step the big
    one; what rank 0's controller saw equals the estimate computed by hand along a plain SGD replay. With
    ``torch_compile`` accelerate wraps the DDP model in a compiled module, where the hook must still go."""
    ranks = torchrun(tmp_path / "noise", "--noise", *(["--compile"] if compiled else []))
    assert ranks[0]["wrapped"] == ("OptimizedModule" if compiled else "DistributedDataParallel")
    data, steps = PointSet(64), ranks[0]["steps"]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    micro = [[ids for r in ranks for ids in r["micro"][2 * k:2 * k + 2]] for k in range(len(steps))]  # 2 per rank
    assert [sum(map(len, m)) for m in micro] == [s["size"] for s in steps]
    reference = Recorder()
    check_noise_by_hand(micro, ranks[0]["stats"], reference, recorder_loss(reference, data), len(data))


@pytest.mark.distributed
def test_torchrun_max_micro_batch_size_keeps_gradients_and_statistics(tmp_path):
    """2 gloo ranks, micro-batches of up to 4 rows run one row at a time: the passes but the last of each
    step accumulate under no_sync (else DDP's hook would see each pass and the statistics would be wrong),
    the statistics equal the by-hand estimate over every pass of both ranks, and the weights the uncut run's."""
    whole = torchrun(tmp_path / "whole", "--noise")
    cut = torchrun(tmp_path / "cut", "--noise", "--max-micro", "1")
    assert max(len(ids) for r in whole for ids in r["micro"]) == 4
    assert max(len(ids) for r in cut for ids in r["micro"]) == 1
    steps = cut[0]["steps"]
    assert [s["ids"] for s in steps] == [s["ids"] for s in whole[0]["steps"]]
    shares = [[len(s["ids"]) for s in r["steps"]] for r in cut]
    per_rank = [group_by_step(r["micro"], share) for r, share in zip(cut, shares)]
    data, reference = PointSet(64), Recorder()
    check_noise_by_hand([a + b for a, b in zip(*per_rank)], cut[0]["stats"], reference,
                        recorder_loss(reference, data), len(data))
    assert cut[0]["weights"] == cut[1]["weights"]
    for got, want in zip(cut[0]["weights"], whole[0]["weights"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-13)


@pytest.mark.distributed
def test_torchrun_refuses_oom_recovery_on_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "tests" / "_hf_ddp.py"), str(tmp_path), "--oom-recovery"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "oom_recovery=True needs one process (world size 2 here)" in proc.stderr


@pytest.mark.distributed
def test_torchrun_restart_after_a_failure_resumes_exactly(tmp_path):
    """Rank 1 dies after step 9 of the first attempt; torchrun restarts both ranks, which resume from
    checkpoint-8 (with init_torchrun and 2 dataloader workers) and finish like a run that never failed."""
    clean = torchrun(tmp_path / "clean", "--save-steps", "4")
    failed = torchrun(tmp_path / "failed", "--save-steps", "4", "--fail-at-step", "9", "--workers", "2",
                      restarts=1, env={"BATCHPILOT_INIT_TORCHRUN": "1"})
    assert failed[0]["resumed_from"].endswith("checkpoint-8")
    for a, b in zip(clean, failed):
        assert [(s["size"], s["ids"]) for s in a["steps"][8:]] == [(s["size"], s["ids"]) for s in b["steps"]]
        assert a["weights"] == b["weights"]

    # The same 2-rank checkpoint resumed by a single process: positions are global, so the rest is the same.
    model = Recorder()
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=SizeList(SIZES), model=model, train_dataset=PointSet(61),
        args=quiet_args(tmp_path / "one", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        num_train_epochs=2, seed=3, **exact_sgd()),  # the script's seed: the same data order
    )
    steps = record_steps(trainer)
    trainer.train(resume_from_checkpoint=str(tmp_path / "clean" / "ckpt" / "checkpoint-8"))
    rest = list(zip(clean[0]["steps"][8:], clean[1]["steps"][8:]))
    assert [s.global_size for s in steps] == [a["size"] for a, _ in rest]
    assert [sorted(s.indices.tolist()) for s in steps] == [sorted(a["ids"] + b["ids"]) for a, b in rest]
    for got, want in zip(model.parameters(), clean[0]["weights"]):
        torch.testing.assert_close(got.detach(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-13)

