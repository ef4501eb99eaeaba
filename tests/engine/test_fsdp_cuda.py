"""FSDP2 on GPUs with NCCL (skipped without CUDA): the CPU tests of test_fsdp.py on the device. With 2 or more
GPUs, 2 processes: the same weights as DDP; with 1, a 1-rank fully_shard model against the bare model. Then a DCP
checkpoint that resumes exactly."""

from __future__ import annotations

import _fsdp_workers as w
import pytest
import torch
from test_fsdp import close, read, spawn

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                                 reason="needs a CUDA device and NCCL")]


def test_fsdp_on_gpus_trains_the_weights_of_the_unsharded_model(tmp_path):
    ranks = min(torch.cuda.device_count(), 2)
    reference = "ddp" if ranks == 2 else "plain"
    spawn(w.train_worker, tmp_path, (reference, "fsdp"), "nccl", nprocs=ranks)
    ref, fsdp = read(tmp_path, f"{reference}0"), read(tmp_path, "fsdp0")
    assert ref["sizes"] == fsdp["sizes"] and ref["accumulation"] == fsdp["accumulation"]
    close([fsdp["norms"]], [ref["norms"]], 1e-9)
    close(fsdp["weights"], ref["weights"], 1e-6)
    assert "stats/trace_cov" in fsdp["noise"]


def test_fsdp_checkpoint_on_gpus_resumes_exactly(tmp_path):
    ranks = min(torch.cuda.device_count(), 2)
    spawn(w.checkpoint_worker, tmp_path, "nccl", nprocs=ranks)
    r0 = read(tmp_path, "ckpt0")
    assert r0["loaded"] == "step-000000010.pt" and r0["at10_loaded"] == r0["at10"]
    assert r0["resumed"] == r0["first"]
