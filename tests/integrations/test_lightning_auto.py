"""AdaptiveBatchSize(batch_size="auto") in real ``lightning.Trainer`` fits (CPU): the start probes run with the
module's training_step before Lightning's loop, the fit starts from the pre-probe weights at the knee with the
found LR, every epoch covers every sample once, a resume from a checkpoint after the probes does not probe
again, and bad combinations are refused."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")

from _lightning_ddp import Model, make_data  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from batchpilot.controllers import Auto, Constant  # noqa: E402
from batchpilot.integrations.lightning import AdaptiveBatchSize  # noqa: E402

N = 256


class AutoModel(Model):
    """``Model`` whose bookkeeping skips the probe steps (``adaptive.probing``)."""

    def training_step(self, batch, batch_idx):
        if self.adaptive.probing:
            x, y, _ = batch
            return self.adaptive.weight(torch.nn.functional.cross_entropy(self.net(x), y))
        return super().training_step(batch, batch_idx)


class AtStart(Callback):
    """The weights and LR when Lightning's loop starts its first batch (after the probes)."""

    def __init__(self) -> None:
        self.weights = self.lr = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.weights is None:
            self.weights = [p.detach().clone() for p in pl_module.parameters()]
            self.lr = trainer.optimizers[0].param_groups[0]["lr"]


def small_auto() -> Auto:
    return Auto(8, 64, timed_steps=1, min_epoch_steps=4, lr_steps=40, interval=1000)


def fit(tmp_path: Path, *callbacks, ckpt_path=None, **overrides):
    adaptive = AdaptiveBatchSize(small_auto(), batch_size="auto")
    model = AutoModel(adaptive, make_data(N), val=False)
    settings = dict(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                    num_sanity_val_steps=0, accumulate_grad_batches=2)
    settings.update(overrides)
    if any(isinstance(c, ModelCheckpoint) for c in callbacks):
        settings["enable_checkpointing"] = True
    trainer = L.Trainer(callbacks=[adaptive, *callbacks], **settings)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, adaptive, trainer


def test_auto_probes_then_fits_from_the_pre_probe_state_at_the_knee(tmp_path):
    torch.manual_seed(0)
    before = [p.detach().clone() for p in AutoModel(AdaptiveBatchSize(batch_size=4), make_data(N)).net.parameters()]
    start = AtStart()
    model, adaptive, trainer = fit(tmp_path, start)

    probe = adaptive.probe
    assert probe is not None and probe.steps > 0 and probe.lr is not None and probe.lr > 0
    assert probe.start_size in [size for size, _ in probe.throughput]
    phases = [r["phase"] for r in adaptive.probe_records]
    assert phases[0] == "throughput" and "lr_range_test" in phases and phases[-1] == "start"
    assert all(torch.equal(a, b) for a, b in zip(before, start.weights))  # the probes were undone
    assert start.lr == pytest.approx(probe.lr) and probe.lr != 0.1  # the range test found an LR
    assert model.steps[0]["size"] == probe.start_size
    per_epoch = collections.defaultdict(list)
    for s in model.steps:
        per_epoch[s["epoch"]].extend(s["ids"])
    assert [sorted(per_epoch[e]) for e in (0, 1)] == [list(range(N))] * 2
    assert trainer.global_step == len(model.steps)


def test_auto_resume_after_the_probes_does_not_probe_again(tmp_path):
    full = fit(tmp_path, ModelCheckpoint(dirpath=tmp_path, filename="s{step}", every_n_train_steps=3,
                                         save_top_k=-1))
    assert full[1].probe_records
    resumed = fit(tmp_path, ckpt_path=str(tmp_path / "sstep=3.ckpt"))
    model, adaptive, trainer = resumed
    assert adaptive.probe_records == [] and adaptive.probe == full[1].probe
    assert [(s["size"], s["micro"]) for s in model.steps] == [(s["size"], s["micro"]) for s in full[0].steps[3:]]
    assert trainer.global_step == full[2].global_step
    assert all(torch.equal(a, b) for a, b in zip(full[0].net.parameters(), model.net.parameters()))


def test_auto_bad_combinations(tmp_path):
    with pytest.raises(ValueError, match="batch_size='auto' starts the automatic mode"):
        AdaptiveBatchSize(Constant(32), batch_size="auto")
    with pytest.raises(ValueError, match="pass batch_size='auto'"):
        AdaptiveBatchSize(Auto(), batch_size=32)

    class TwoOptimizers(AutoModel):
        def configure_optimizers(self):
            half = len(list(self.parameters())) // 2
            params = list(self.parameters())
            return [torch.optim.SGD(params[:half], lr=0.1), torch.optim.SGD(params[half:], lr=0.1)]

        def training_step(self, batch, batch_idx):
            raise AssertionError("never reached")

    adaptive = AdaptiveBatchSize(batch_size="auto")
    model = TwoOptimizers(adaptive, make_data(N), val=False)
    model.automatic_optimization = False
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[adaptive])
    with pytest.raises(ValueError, match="manual optimization.*\n.*2 optimizers"):
        trainer.fit(model)


class FixedLR(Model):
    """``Model`` (no probes, bookkeeping of every step) with SGD at ``lr``."""

    lr = 0.1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_auto_fit_is_the_fit_started_by_hand_at_the_knee_with_the_found_lr(tmp_path):
    """The probes leave no trace: the auto fit is bitwise the fit of a constant size at the knee with the found
    LR, started from the same weights, data order and generators (Auto grows no further within this fit)."""
    model, adaptive, _ = fit(tmp_path)
    probe = adaptive.probe
    FixedLR.lr = probe.lr
    by_hand = AdaptiveBatchSize(batch_size=probe.start_size)
    reference = FixedLR(by_hand, make_data(N), val=False)
    L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
              num_sanity_val_steps=0, accumulate_grad_batches=2, callbacks=[by_hand]).fit(reference)
    assert [(s["size"], s["micro"]) for s in model.steps] == [(s["size"], s["micro"]) for s in reference.steps]
    assert all(torch.equal(a, b) for a, b in zip(model.net.parameters(), reference.net.parameters()))


def test_auto_refuses_one_micro_batch_per_step_before_probing(tmp_path):
    adaptive = AdaptiveBatchSize(small_auto(), batch_size="auto")
    model = AutoModel(adaptive, make_data(N), val=False)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[adaptive])
    with pytest.raises(ValueError, match="accumulate_grad_batches >= 2"):
        trainer.fit(model)
    assert adaptive.probe is None and adaptive.probe_records == []
