"""CUDA-only checks (skipped without a GPU; this project's CI has none): the paths that differ on a GPU.

Run them where a device is available with ``python -m pytest -q tests/test_cuda.py tests/test_engine_stats.py
-k cuda``. They check what CPU tests cannot: asynchronous kernels timed by CUDA events (the throughput model
that ``Goodput`` reads), a dataset already on the GPU, fp16 with a real GradScaler, Lightning's own
GradScaler under ``precision="16-mixed"``, accelerate's under the HF Trainer's ``fp16=True`` (with
``torch_compile``), and recovery from a real CUDA out-of-memory error (Pilot and the HF trainer).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.controllers import Goodput

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Dicts(torch.utils.data.Dataset):
    """Named tensors as a map-style dataset of dicts (what Trainer's collators expect)."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.tensors.items()}


def gpu_problem(n: int = 8192, dim: int = 1024, hidden: int = 8192):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)).cuda()
    return TensorDataset(x.cuda(), y.cuda()), model


def test_pilot_fp16_goodput_with_the_data_on_the_gpu():
    ds, model = gpu_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=64, controller=Goodput(min_size=64, max_size=2048, interval=10,
                             min_measurements=3), amp="fp16", lr_rule="adascale", base_batch_size=64, noise_every=4,
                             max_micro_batch_size=512)
    records = []
    pilot.add_callback(lambda p, record: records.append(dict(record)))
    for x, y in pilot.batches(max_steps=120):
        assert x.is_cuda and y.is_cuda
        pilot.backward(torch.nn.functional.cross_entropy(model(x).float(), y))
    last = records[-1]
    assert pilot.scaler is not None and pilot.scaler.get_scale() > 0
    assert math.isfinite(last["stats/noise_scale"]) and any("lr/adascale_gain" in r for r in records[-4:])
    # The micro-batch times come from CUDA events, so the GPU work is in them and the per-step overhead is
    # small; timed by the wall clock when backward() returns (queued kernels), the overhead held it all.
    assert last["perf/micro_time_b_s"] > 0
    assert last["perf/step_overhead_s"] < 0.5 * last["perf/step_time_s"]
    assert last["loss"] < records[0]["loss"]


@pytest.mark.parametrize("fused", [False, True])
def test_lightning_16_mixed_statistics_on_the_gpu(tmp_path, fused):
    # A fused optimizer unscales inside its step, so Lightning leaves .grad scaled: the statistics must not
    # read a 65536x norm (the estimate would be negative, so no noise scale).
    L = pytest.importorskip("lightning")
    from batchpilot.controllers import NoiseScale
    from batchpilot.integrations.lightning import AdaptiveBatchSize

    ds, net = gpu_problem(2048)
    cpu_data = TensorDataset(ds.tensors[0].cpu(), ds.tensors[1].cpu())
    adaptive = AdaptiveBatchSize(NoiseScale(min_size=32, max_size=512, interval=5, min_measurements=2),
                                 batch_size=32, noise_every=2)

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def train_dataloader(self):
            return adaptive.dataloader(cpu_data)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return adaptive.weight(torch.nn.functional.cross_entropy(self.net(x).float(), y))

        def configure_optimizers(self):
            if fused:
                return torch.optim.Adam(self.parameters(), lr=1e-3, fused=True)
            return torch.optim.SGD(self.parameters(), lr=0.05)

    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=2, accelerator="gpu", devices=1, precision="16-mixed",
                        callbacks=[adaptive], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Classifier())
    assert trainer.precision_plugin.scaler is not None  # on a GPU Lightning scales fp16 losses
    stats = adaptive.stats.stats
    assert stats["stats/noise_count"] > 0 and math.isfinite(stats["stats/noise_scale"])
    assert 0 < stats["stats/grad_sq_norm"] < 1e6  # the unscaled |G|^2, not 65536^2 times it
    assert stats["perf/micro_time_b_s"] > 0


def test_a_real_cuda_out_of_memory_error_is_recovered():
    # A layer whose output for the first micro-batch needs ~1.5x the device's memory: the real allocator
    # fails, the engine halves the micro-batch until the step fits, and training goes on.
    total = torch.cuda.get_device_properties(0).total_memory
    rows = 1 << 14
    width = int(1.5 * total / (rows * 4))  # float32 output of the first forward: ~1.5 x the memory
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(2 * rows, 4, generator=g), torch.randn(2 * rows, 1, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=rows, oom_recovery=True)
    for x, y in pilot.batches(max_steps=2):
        with pilot.micro_step():
            pilot.backward(torch.nn.functional.mse_loss(model(x), y))
    assert pilot.step == 2 and pilot.samples_seen == 2 * rows
    assert pilot.oom_replays >= 1 and pilot.loader.max_micro_batch_size <= rows // 2
    assert math.isfinite(pilot.last_record["loss"])


def test_the_bench_runs_on_the_gpu(tmp_path):
    from batchpilot.bench import run_benchmark

    results = run_benchmark("synthetic", "static:64,goodput", [0], budget_s=30, out_dir=tmp_path, progress=False,
                            calibrate_steps=1, device="cuda")
    assert results["config"]["device"].startswith("cuda:") and results["config"]["device_name"]
    assert all(r["time_to_target_s"] is not None for r in results["runs"])
    assert all(b > 0 for b in results["calibration"]["step_s"])


def test_hf_fp16_statistics_and_a_compiled_model_on_the_gpu(tmp_path):
    # accelerate's real fp16 path: a GradScaler scales .grad until clip_grad_norm_ unscales it. The
    # statistics divide the scale out, so the fp16 estimate is the fp32 one's size, not 2**32 times it.
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.cross_entropy(self.net(x).float(), labels)}

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g)
    points = Dicts(x=x, labels=(x[:, 0] > 0).long())

    def train(**precision):
        trainer = AdaptiveBatchSizeTrainer(
            batch_size_scheduler=lambda step, size: 32, model=Net(), train_dataset=points, noise_every=1,
            args=TrainingArguments(output_dir=str(tmp_path / str(precision)), per_device_train_batch_size=8,
                                   gradient_accumulation_steps=2, num_train_epochs=1, report_to=[],
                                   save_strategy="no", disable_tqdm=True, learning_rate=1e-3, **precision),
        )
        trainer.train()
        return trainer

    fp32 = train()
    fp16 = train(fp16=True, torch_compile=True)
    assert fp16.accelerator.scaler is not None
    s16, s32 = fp16.batchpilot.stats.stats, fp32.batchpilot.stats.stats
    for key in ("stats/trace_cov", "stats/grad_sq_norm"):
        assert math.isfinite(s16[key]) and 0.5 < s16[key] / s32[key] < 2.0, key


def test_hf_oom_recovery_with_a_real_cuda_out_of_memory_error(tmp_path):
    # As test_a_real_cuda_out_of_memory_error_is_recovered, through AdaptiveBatchSizeTrainer(oom_recovery=True).
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer

    total = torch.cuda.get_device_properties(0).total_memory
    rows = 1 << 14
    width = int(1.5 * total / (rows * 4))
    g = torch.Generator().manual_seed(0)

    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1))

        def forward(self, x, y):
            return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}

    trainer = AdaptiveBatchSizeTrainer(
        model=Wide(), oom_recovery=True,
        train_dataset=Dicts(x=torch.randn(2 * rows, 4, generator=g), y=torch.randn(2 * rows, 1, generator=g)),
        args=TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=rows, num_train_epochs=1,
                               report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-3),
    )
    trainer.train()
    run = trainer.batchpilot
    assert run.samples_seen == 2 * rows and run.oom_replays >= 1 and run.max_micro_batch_size <= rows // 2


def test_a_checkpoint_keeps_the_training_devices_cuda_stream_only():
    # The state of the device the run trains on, restored into the device the resumed run trains on (a
    # rank's device index can differ after a resume on another node layout).
    from batchpilot.rng import gather_rng_states, restore_rng_states

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.manual_seed(3)
    torch.rand(4, device=device)
    states = gather_rng_states(1, device)
    assert states[0]["cuda_device"] is True and len(states[0]["cuda"]) == 1
    expected = torch.rand(5, device=device)
    torch.rand(100, device=device)
    restore_rng_states(states, 0, 1, device)
    assert torch.equal(torch.rand(5, device=device), expected)
