"""Pilot(..., compression=...) on 2 real gloo ranks: 1-bit training converges, its error buffers survive a
checkpoint (a resumed run ends with the same weights as one that never stopped), the noise statistics are those of
an uncompressed run on the steps they are measured, and bad settings are refused."""

from __future__ import annotations

import _one_bit_workers as w
import pytest
import torch
import torch.multiprocessing as mp

import batchpilot
from batchpilot.engine.compression_setup import check_compression


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pilot_compression")
    mp.spawn(w.pilot_scenarios, args=(2, str(out / "init"), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"pilot{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.distributed
def test_resume_from_a_checkpoint_is_exact(runs):
    for rank in runs:
        straight, resumed = rank["straight"], rank["resumed"]
        assert straight["compressed_steps"] > 0
        assert resumed["hook_step"] == straight["hook_step"] == 12
        assert resumed["compressed_steps"] == straight["compressed_steps"]
        for a, b in zip(straight["weights"], resumed["weights"]):
            assert torch.equal(a, b)
        assert resumed["noise"] == straight["noise"]
    assert all(torch.equal(a, b) for a, b in zip(runs[0]["straight"]["weights"], runs[1]["straight"]["weights"]))
    saved = runs[0]["checkpoint"]  # every rank's error buffers, written by rank 0
    assert saved["kind"] == "OneBitState" and saved["state"]["world_size"] == 2
    assert saved["state"]["worker_error"].shape[0] == 2 and saved["state"]["worker_error"].abs().sum() > 0
    assert not torch.equal(saved["state"]["worker_error"][0], saved["state"]["worker_error"][1])


@pytest.mark.distributed
def test_measured_steps_are_reduced_in_full_precision(runs):
    # 12 steps, 2 of warm-up, noise measured on steps 0, 4, 8 (full precision): 12 - 2 - 2 = 8 compressed.
    assert runs[0]["straight"]["compressed_steps"] == 8
    for rank in runs:
        plain, compressed = rank["plain_every_step"], rank["1bit_every_step"]
        assert compressed["compressed_steps"] == 0 and compressed["hook_step"] == 8
        assert compressed["noise"] == plain["noise"] and "stats/trace_cov" in plain["noise"]
        assert all(torch.equal(a, b) for a, b in zip(plain["weights"], compressed["weights"]))
        assert compressed["losses"] == plain["losses"]


@pytest.mark.distributed
def test_one_bit_training_converges(runs):
    plain, compressed = runs[0]["plain"], runs[0]["1bit"]
    assert compressed["compressed_steps"] == 60 - 10  # the default warm-up: 10 steps
    assert compressed["full_loss"] < 0.5 * compressed["losses"][0]
    assert compressed["full_loss"] < plain["full_loss"] + 0.1
    assert compressed["wire_bytes"] < compressed["full_bytes"] / 4  # tiny model: 4-byte scales weigh in


@pytest.mark.distributed
def test_a_plain_hook_trains(runs):
    plain = runs[0]["fp16_hook"]
    assert plain["compressed_steps"] is None and len(plain["losses"]) == 4  # no state: no checkpoint part
    assert all(torch.isfinite(t).all() for t in plain["weights"])


@pytest.mark.distributed
def test_warm_up_counts_optimizer_steps_under_accumulation(runs):
    assert runs[0]["accumulated"]["hook_step"] == 5  # 2 micro-batches per rank and step, one synced backward


@pytest.mark.distributed
def test_error_buffers_follow_the_fp16_loss_scale(runs):
    before, after = runs[0]["fp16_rescaled"]
    assert before.abs().sum() > 0
    assert torch.equal(after, before / 4)


@pytest.mark.distributed
def test_refused_with_oom_recovery_or_a_model_with_its_own_hook(runs):
    errors = runs[0]["errors"]
    assert "oom_recovery=True" in errors["oom_recovery"]
    assert "already has one" in errors["own_hook"]


def test_bad_compression_settings():
    with pytest.raises(ValueError, match="'2bit' is not a known compression.*'1bit', 'auto'"):
        check_compression("2bit")
    with pytest.raises(TypeError, match="compression must be .* got 3"):
        check_compression(3)
    check_compression(None)
    check_compression("1bit")
    model = torch.nn.Linear(3, 2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.zeros(8, dtype=torch.long))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not a known compression"):
        batchpilot.Pilot(model, opt, data, batch_size=4, compression="1-bit")
    with pytest.raises(ValueError, match="not a DDP model"):
        batchpilot.Pilot(model, opt, data, batch_size=4, compression="1bit")
