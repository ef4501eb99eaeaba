"""FSDP2 (``fully_shard``) on 2 real gloo processes on the CPU: the same weights as DDP at the same global batches
(changing sizes, accumulation, clipping, the noise scale measured on every 2nd step), DCP checkpoints that resume
exactly on 2 ranks and reshard onto 1, and the settings FSDP2 refuses."""

from __future__ import annotations

import json
from pathlib import Path

import _fsdp_workers as w
import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed


def spawn(fn, tmp_path: Path, *args, nprocs: int = 2, init: str = "init") -> None:
    mp.spawn(fn, args=(nprocs, str(tmp_path / init), str(tmp_path), *args), nprocs=nprocs, join=True)


def read(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / f"{name}.json").read_text())


def close(a: list, b: list, tol: float) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64),
                                   rtol=0, atol=tol)


@pytest.mark.slow
def test_fsdp_trains_the_weights_ddp_trains(tmp_path):
    spawn(w.train_worker, tmp_path, ("ddp", "fsdp"))
    ddp, fsdp = read(tmp_path, "ddp0"), read(tmp_path, "fsdp0")
    assert fsdp["grad_types"] == ["NoneType"]  # the gradients are dropped after each step
    assert ddp["sizes"] == fsdp["sizes"] and len(set(fsdp["sizes"])) > 5  # changing sizes, 1 sample included
    assert ddp["accumulation"] == fsdp["accumulation"] and max(fsdp["accumulation"]) >= 3
    assert max(fsdp["norms"]) > 0.5  # clipping at 0.5 was active
    close([fsdp["norms"]], [ddp["norms"]], 1e-9)  # the full norm from the shards
    close(fsdp["weights"], ddp["weights"], 1e-6)
    close(fsdp["weights"], ddp["weights"], 1e-12)  # what float64 gives (measured: about 1e-16)
    assert fsdp["weights"] == read(tmp_path, "fsdp1")["weights"]
    # The noise scale from each rank's micro-batch gradients, read in the reduce-scatter, as DDP's hook reads them.
    assert set(fsdp["noise"]) == set(ddp["noise"]) and "stats/trace_cov" in fsdp["noise"]
    assert fsdp["noise"] == read(tmp_path, "fsdp1")["noise"]
    for key, value in ddp["noise"].items():
        assert fsdp["noise"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_exactly_and_reshards_from_two_ranks_to_one_and_back(tmp_path):
    spawn(w.checkpoint_worker, tmp_path)
    r0, r1 = read(tmp_path, "ckpt0"), read(tmp_path, "ckpt1")
    assert r0["loaded"] == "step-000000010.pt" and r0["step"] == w.STEPS
    assert "step-000000010.dcp" in r0["files"] and "step-000000010.pt" in r0["files"]
    assert r0["at10_loaded"] == r0["at10"]
    assert r0["resumed"] == r0["first"] == r1["resumed"]  # bit for bit
    assert r0["snapshot_runs"][0] == r0["snapshot_runs"][1]  # an in-memory snapshot restores bit for bit
    spawn(w.reshard_worker, tmp_path, nprocs=1, init="init_one")
    for mode in ("fsdp", "plain"):  # a 1-rank fully_shard model, and the bare model
        one = read(tmp_path, f"reshard_{mode}")
        assert one["step"] == w.STEPS
        assert one["at10"] == r0["at10"]  # the DCP shards of 2 ranks, resharded onto 1
        close(one["final"], r0["first"], 1e-12)  # then the same global batches on 1 rank
    kept = ["step-000000018.dcp", "step-000000018.pt", "step-000000020.dcp", "step-000000020.pt"]
    assert read(tmp_path, "reshard_fsdp")["kept"] == kept  # keep_checkpoints=2 prunes the DCP folders too
    spawn(w.reload_worker, tmp_path, init="init_reload")  # and the 1-rank checkpoint of step 15 back onto 2 ranks
    reloaded = read(tmp_path, "reload0")
    assert reloaded["step"] == w.STEPS and reloaded["final"] == read(tmp_path, "reload1")["final"]
    close(reloaded["final"], r0["first"], 1e-12)


def test_fsdp_refuses_what_it_cannot_train_with(tmp_path):
    spawn(w.refuse_worker, tmp_path, nprocs=1)
    messages = read(tmp_path, "refuse0")
    assert "oom_recovery" in messages["oom"] and "max_micro_batch_size" in messages["oom"]
    assert "amp='bf16'" in messages["fp16"]
    assert "drop compression" in messages["compression"]
    assert "not sharded" in messages["root"] and "fully_shard(model)" in messages["root"]
    assert "other shapes: 0.weight (12, 5) vs (13, 5) here" in messages["other_model"] and messages["unchanged"]
    assert "DCP folder" in messages["no_dcp"] and "missing or incomplete" in messages["no_dcp"]


@pytest.mark.slow
def test_fsdp_with_rank_weights_and_the_automatic_mode_trains_the_weights_ddp_trains(tmp_path):
    """Unequal shares ([1, 3] and "auto") and batch_size="auto" (its start probes snapshot and restore the sharded
    model, as the rollback guard does) give the weights DDP gives, on both ranks; save_on_sigterm saves through
    DCP and the resumed run ends with the uninterrupted run's weights; a torch.compile'd forward trains the same
    weights; the rollback guard undoes a NaN step after a change of size as under DDP."""
    spawn(w.features_worker, tmp_path)
    for rank in (0, 1):
        out = read(tmp_path, f"features{rank}")
        for name in ("weights", "auto_weights", "auto"):
            close(out[f"{name}/ddp"], out[f"{name}/fsdp"], 1e-12)
        assert out["probe/ddp"] == out["probe/fsdp"] and out["probe/fsdp"][2] > 2  # the sweep and the range test
    assert read(tmp_path, "features0")["auto/fsdp"] == read(tmp_path, "features1")["auto/fsdp"]
    for rank in (0, 1):  # save_on_sigterm: a SIGTERM to rank 1 in step 5 stops both ranks after saving step 5
        sig = read(tmp_path, f"features{rank}")["sigterm"]
        assert sig["stopped"] == 5 and sig["preempted"] and sig["loaded"] == "step-000000005.pt"
        close(sig["resumed"], sig["straight"], 0.0)
        close(read(tmp_path, f"features{rank}")["compiled"], sig["straight"], 1e-12)  # torch.compile'd forward
        ddp, fsdp = (read(tmp_path, f"features{rank}")[f"rollback/{m}"] for m in ("ddp", "fsdp"))
        assert fsdp["rollbacks"] == ddp["rollbacks"] == 1 and fsdp["told"] == ddp["told"] and fsdp["last"] == 8
        close(fsdp["weights"], ddp["weights"], 1e-12)  # the guard restored the sharded snapshot, as DDP's
