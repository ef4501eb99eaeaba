"""AdaptiveBatchSize in real ``lightning.Trainer`` fits (CPU, tiny float64 model, no downloads).

Checked against values derived without Lightning: the sizes a controller decided, every sample once per
epoch, weights equal to a plain full-batch-mean SGD loop, one validation per epoch, sample-weighted epoch
means from ``self.log(..., batch_size=...)``, bitwise-equal mid-epoch resume without Lightning's
"not resumable" warning, 2 DDP ranks under torchrun, manual optimization, and gradient statistics equal
to a by-hand two-batch noise-scale estimate (1 process, 2 DDP ranks, manual optimization on 2 ranks, and
under an fp16 GradScaler).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")

from _hf_common import SizeList, StatsSpy, check_noise_by_hand
from _lightning_ddp import NOISE_SAMPLES, NUM_SAMPLES, SIZES, ManualModel, Model, make_data, make_net

from batchpilot.controllers import Constant, LinearIncrease
from batchpilot.integrations.lightning import AdaptiveBatchSize

REPO = Path(__file__).resolve().parents[2]


def trainer(tmp_path: Path, adaptive: AdaptiveBatchSize, **overrides) -> L.Trainer:
    settings = dict(
        max_epochs=2, accelerator="cpu", devices=1, callbacks=[adaptive], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
    )
    settings.update(overrides)
    return L.Trainer(**settings)


def expected_sizes(first: int, sizes: list[int], num_samples: int, epochs: int) -> list[int]:
    out, size, decided = [], first, iter(sizes * 10)
    for _ in range(epochs):
        left = num_samples
        while left:
            out.append(min(size, left))
            left -= out[-1]
            size = next(decided)
    return out


def sgd_reference(steps: list[dict], data, losses: list | None = None) -> list[torch.Tensor]:
    """Plain full-batch-mean SGD over the steps' samples; appends each step's mean loss to ``losses``."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y, _ = data.tensors
    for s in steps:
        idx = torch.tensor(s["ids"])
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        if losses is not None:
            losses.append(float(loss))
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize("workers", [0, 2])
def test_sizes_coverage_gradients_validation_and_logging(tmp_path, workers):
    data = make_data()
    adaptive = AdaptiveBatchSize(SizeList(SIZES), batch_size=4)
    model = Model(adaptive, data, workers=workers)
    fit = trainer(tmp_path, adaptive, accumulate_grad_batches=2)
    fit.fit(model)

    assert [s["size"] for s in model.steps] == expected_sizes(4, SIZES, NUM_SAMPLES, 2)
    assert fit.global_step == len(model.steps)  # one optimizer step per decided batch
    per_epoch = collections.defaultdict(list)
    for s in model.steps:
        per_epoch[s["epoch"]].extend(s["ids"])
    assert [sorted(per_epoch[e]) for e in (0, 1)] == [list(range(NUM_SAMPLES))] * 2
    # Accumulation over uneven and ghost micro-batches still gives the global-batch mean gradient.
    losses: list[float] = []
    for got, want in zip(model.net.parameters(), sgd_reference(model.steps, data, losses)):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-13)
    assert list(adaptive.driver.losses) == pytest.approx(losses, rel=1e-12)  # what a controller observes
    assert model.validations == 2  # Lightning still sees each epoch's real last batch
    metrics = fit.logged_metrics
    assert float(metrics["id_mean"]) == pytest.approx((NUM_SAMPLES - 1) / 2, abs=1e-9)  # each sample weighs once
    assert float(metrics["epoch"]) == 2.0 and float(metrics["train_coverage"]) == 0.0
    assert float(metrics["batch_size"]) == model.steps[-1]["size"]
    assert float(metrics["samples_seen"]) == 2 * NUM_SAMPLES


def test_manual_optimization_follows_the_sizes_exactly(tmp_path):
    # With automatic_optimization=False each batch is a whole step (Lightning allows no accumulation there):
    # the module calls manual_backward(adaptive.weight(loss)) and steps once per batch.
    data = make_data()
    adaptive = AdaptiveBatchSize(SizeList(SIZES), batch_size=4)
    model = ManualModel(adaptive, data)
    fit = trainer(tmp_path, adaptive)
    fit.fit(model)
    assert [s["size"] for s in model.steps] == expected_sizes(4, SIZES, NUM_SAMPLES, 2)
    assert fit.global_step == len(model.steps) and adaptive.driver.step == len(model.steps)
    per_epoch = collections.defaultdict(list)
    for s in model.steps:
        per_epoch[s["epoch"]].extend(s["ids"])
    assert [sorted(per_epoch[e]) for e in (0, 1)] == [list(range(NUM_SAMPLES))] * 2
    for got, want in zip(model.net.parameters(), sgd_reference(model.steps, data)):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-13)
    assert model.validations == 2 and adaptive.samples_seen == 2 * NUM_SAMPLES


def test_the_loss_history_without_weight(tmp_path):
    """Without weight() the controller still sees each step's sample mean (from the loss Lightning returns divided
    by the accumulation); a manual training_step that returns no loss adds none (not a zero)."""

    class Unweighted(Model):
        def training_step(self, batch, batch_idx):
            x, y, _ = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            micro = self.adaptive.micro_batch
            self.seen.append((float(loss.detach()), micro.size, micro.is_last))
            return loss

    class Silent(ManualModel):
        def training_step(self, batch, batch_idx):
            x, y, _ = batch
            self.optimizers().zero_grad()
            self.manual_backward(torch.nn.functional.cross_entropy(self.net(x), y) * self.adaptive.loss_weight)
            self.optimizers().step()

    adaptive = AdaptiveBatchSize(SizeList(SIZES), batch_size=4)
    model = Unweighted(adaptive, make_data(), val=False)
    model.seen = []
    trainer(tmp_path, adaptive, accumulate_grad_batches=2).fit(model)
    expected, step = [], []
    for loss, n, last in model.seen:
        step += [(loss, n)] if n else []
        if last:
            expected.append(sum(v * n for v, n in step) / sum(n for _, n in step))
            step = []
    assert list(adaptive.driver.losses) == pytest.approx(expected, rel=1e-12)
    silent = AdaptiveBatchSize(SizeList(SIZES), batch_size=4)
    trainer(tmp_path, silent).fit(Silent(silent, make_data(), val=False))
    assert silent.driver.step == len(expected_sizes(4, SIZES, NUM_SAMPLES, 2)) and not silent.driver.losses


def test_logged_progress_reaches_loggers(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    adaptive = AdaptiveBatchSize(LinearIncrease(start=4, increment=4, interval=2, max_size=16), batch_size=4)
    model = Model(adaptive, make_data(), val=False)
    fit = trainer(tmp_path, adaptive, max_epochs=1, logger=CSVLogger(str(tmp_path)), log_every_n_steps=1)
    fit.fit(model)
    rows = (Path(fit.logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert {"batch_size", "train_coverage", "epoch", "samples_seen"} <= set(header)
    sizes = [float(r.split(",")[header.index("batch_size")]) for r in rows[1:] if r.split(",")[header.index("batch_size")]]
    assert sizes == [float(s["size"]) for s in model.steps] == [4, 4, 8, 8, 12, 12, 13]


def test_mid_epoch_resume_is_exact_and_not_flagged_as_unresumable(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(ckpt_path=None):
        data = make_data()
        adaptive = AdaptiveBatchSize(SizeList(SIZES), batch_size=4)
        model = Model(adaptive, data, workers=2 if ckpt_path else 0, val=False)
        saver = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=5, save_top_k=-1,
                                filename="{step}")
        fit = trainer(tmp_path, adaptive, accumulate_grad_batches=2, enable_checkpointing=True,
                      callbacks=[adaptive, saver])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit.fit(model, ckpt_path=ckpt_path)
        return model, [str(w.message) for w in caught]

    full, _ = run()
    resumed, caught = run(str(tmp_path / "ckpt" / "step=5.ckpt"))  # mid-epoch: epoch 0 has 9 steps
    assert not [m for m in caught if "not resumable" in m]
    assert [(s["size"], s["ids"]) for s in resumed.steps] == [(s["size"], s["ids"]) for s in full.steps[5:]]
    assert all(torch.equal(a, b) for a, b in zip(full.net.parameters(), resumed.net.parameters()))


def test_resume_from_an_epoch_end_checkpoint_is_exact(tmp_path):
    # ModelCheckpoint's default saves at epoch ends, where Lightning restores no loader state (it is not
    # restarting mid-epoch): the callback's own state carries the data position. It used to replay epoch 0's
    # order at the first size.
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(ckpt_path=None):
        adaptive = AdaptiveBatchSize(SizeList(SIZES), batch_size=4)
        model = Model(adaptive, make_data(), val=False)
        saver = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, filename="end-{step}",
                                save_on_train_epoch_end=True)
        fit = trainer(tmp_path, adaptive, max_epochs=3, accumulate_grad_batches=2, enable_checkpointing=True,
                      callbacks=[adaptive, saver])
        fit.fit(model, ckpt_path=ckpt_path)
        return model

    full = run()
    first_epoch = sum(1 for s in full.steps if s["epoch"] == 0)
    resumed = run(str(tmp_path / "ckpt" / f"end-step={first_epoch}.ckpt"))
    assert [(s["size"], s["ids"]) for s in resumed.steps] == [(s["size"], s["ids"]) for s in full.steps[first_epoch:]]
    assert all(torch.equal(a, b) for a, b in zip(full.net.parameters(), resumed.net.parameters()))


@pytest.mark.parametrize("workers", [0, 2])
def test_drop_last_trains_every_epoch(tmp_path, workers):
    # The callback ends an epoch whose tail will be dropped; the next epoch's loop must start with the next
    # data epoch. In process every other epoch used to be empty.
    class DropLast(Model):
        def train_dataloader(self):
            return self.adaptive.dataloader(self.data, num_workers=self.workers, seed=1, drop_last=True)

    adaptive = AdaptiveBatchSize(batch_size=7)  # 61 samples: 8 steps of 7, 5 dropped per epoch
    model = DropLast(adaptive, make_data(), workers=workers)
    trainer(tmp_path, adaptive, max_epochs=3).fit(model)
    assert [s["epoch"] for s in model.steps] == [e for e in range(3) for _ in range(8)]
    assert all(s["size"] == 7 for s in model.steps)
    assert model.validations == 3 and adaptive.samples_seen == 3 * 56


def test_drop_last_steps_epoch_interval_lr_schedulers(tmp_path):
    # Lightning steps epoch-interval schedulers at what it knows is the epoch's last batch; an epoch whose
    # tail is dropped ends only when the callback learns it, after that point, so the callback steps them.
    class Halving(Model):
        def train_dataloader(self):
            return self.adaptive.dataloader(self.data, seed=1, drop_last=True)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]

    adaptive = AdaptiveBatchSize(batch_size=7)  # 61 samples: 5 dropped per epoch
    model = Halving(adaptive, make_data(), val=False)
    trainer(tmp_path, adaptive, max_epochs=3).fit(model)
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 / 8)  # halved 3 times


def test_a_changing_accumulation_or_a_mid_step_validation_is_refused(tmp_path):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    adaptive = AdaptiveBatchSize(batch_size=4)
    model = Model(adaptive, make_data(), val=False)
    changing = trainer(tmp_path, adaptive, callbacks=[adaptive, GradientAccumulationScheduler({0: 1, 1: 2})])
    with pytest.raises(ValueError, match="accumulate_grad_batches changes during the run"):
        changing.fit(model)
    adaptive = AdaptiveBatchSize(batch_size=4)
    model = Model(adaptive, make_data())
    with pytest.raises(ValueError, match="val_check_interval=3 is not a multiple of accumulate_grad_batches=2"):
        trainer(tmp_path, adaptive, accumulate_grad_batches=2, val_check_interval=3).fit(model)
    adaptive = AdaptiveBatchSize(batch_size=4)
    model = Model(adaptive, make_data(), val=False)
    with pytest.raises(ValueError, match="use fast_dev_run=2"):
        trainer(tmp_path, adaptive, accumulate_grad_batches=2, fast_dev_run=True).fit(model)


def test_an_int_val_check_interval_must_count_over_the_fit(tmp_path):
    # With check_val_every_n_epoch=1 (the default) an int interval counts batches from each epoch's start: once
    # the batch grew so that epochs have fewer batches than the interval, validation stopped without a word
    # (Lightning refuses such an interval, but this loader's length is only a bound). Counted over the fit
    # (check_val_every_n_epoch=None) it validates every k batches whatever the epochs' lengths.
    def growing():
        adaptive = AdaptiveBatchSize(LinearIncrease(start=4, increment=8, interval=3, max_size=32), batch_size=4)
        return adaptive, Model(adaptive, make_data())

    adaptive, model = growing()
    with pytest.raises(ValueError, match=r"val_check_interval=4 with check_val_every_n_epoch=1 .* "
                                         r"Pass check_val_every_n_epoch=None"):
        trainer(tmp_path, adaptive, max_epochs=3, val_check_interval=4).fit(model)
    adaptive, model = growing()
    trainer(tmp_path, adaptive, max_epochs=3, val_check_interval=4, check_val_every_n_epoch=None).fit(model)
    assert [sum(s["epoch"] == e for s in model.steps) for e in range(3)] == [7, 3, 3]  # epochs 1, 2 < 4 batches
    assert model.validations == len(model.steps) // 4 == 3


def test_the_loader_without_its_callback_in_the_trainer_is_refused(tmp_path):
    adaptive = AdaptiveBatchSize(SizeList(SIZES), batch_size=4)
    model = Model(adaptive, make_data(), val=False)
    with pytest.raises(RuntimeError, match="callback is not in the Trainer"):
        trainer(tmp_path, adaptive, callbacks=[]).fit(model)


def test_a_reloaded_loader_of_another_dataset_is_refused(tmp_path):
    class Growing(Model):
        def train_dataloader(self):
            n = 61 if self.current_epoch == 0 else 80  # a curriculum that changes the dataset
            return self.adaptive.dataloader(make_data(n), seed=1)

    adaptive = AdaptiveBatchSize(batch_size=8)
    model = Growing(adaptive, make_data(), val=False)
    with pytest.raises(ValueError, match="reloaded training dataset has 80 samples, the previous one 61"):
        trainer(tmp_path, adaptive, reload_dataloaders_every_n_epochs=1).fit(model)


def test_error_messages_name_the_lightning_arguments():
    with pytest.raises(ValueError, match="change batch_size or the bounds"):
        AdaptiveBatchSize(batch_size=64, max_batch_size=32)
    with pytest.raises(ValueError, match="controller must be a batchpilot controller"):
        AdaptiveBatchSize("linear", batch_size=32)
    with pytest.raises(ValueError, match=r"controller must be an instance, got the class Constant; call it"):
        AdaptiveBatchSize(Constant, batch_size=32)


@pytest.mark.parametrize("limit, message", [(0.5, "fraction"), (3, "not a multiple of accumulate_grad_batches=2")])
def test_limit_train_batches_must_mean_whole_steps(tmp_path, limit, message):
    adaptive = AdaptiveBatchSize(batch_size=4)
    model = Model(adaptive, make_data(), val=False)
    with pytest.raises(ValueError, match=message):
        trainer(tmp_path, adaptive, accumulate_grad_batches=2, limit_train_batches=limit).fit(model)


def test_the_loader_needs_the_callback_in_the_trainer(tmp_path):
    adaptive = AdaptiveBatchSize(SizeList(SIZES), batch_size=4)
    model = Model(AdaptiveBatchSize(batch_size=4), make_data(), val=False)  # a different callback's loader
    with pytest.raises(RuntimeError, match="AdaptiveBatchSize has no loader"):
        trainer(tmp_path, adaptive).fit(model)


def test_the_package_exports_the_callback_and_its_loader():
    from batchpilot.integrations import lightning as integration

    assert integration.__all__ == ["AdaptiveBatchSize", "AdaptiveLoader"]
    assert isinstance(AdaptiveBatchSize(batch_size=4).dataloader(make_data()), integration.AdaptiveLoader)


def test_invalid_settings_fail_at_construction():
    with pytest.raises(ValueError, match="outside"):
        AdaptiveBatchSize(batch_size=64, max_batch_size=32)


def test_example_runs_and_resumes(tmp_path):
    def example(*args: str) -> dict:
        out = subprocess.run(
            [sys.executable, str(REPO / "examples" / "lightning_mnist1d.py"), "--output-dir", str(tmp_path),
             "--train-samples", "600", "--max-size", "64", "--interval", "5", *args],
            capture_output=True, text=True, timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads((tmp_path / "summary.json").read_text())

    first = example("--epochs", "1")
    assert first["samples_seen"] == 600 and first["final_batch_size"] == 64
    resumed = example("--epochs", "2", "--resume")  # continues from last.ckpt: one more epoch
    assert resumed["samples_seen"] == 2 * 600 and resumed["steps"] > first["steps"]


def torchrun(out: Path, *args: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "tests" / "_lightning_ddp.py"), str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def net_loss(net: torch.nn.Module, data):
    """``ids -> net's mean loss on those samples of data`` (for check_noise_by_hand)."""
    x, y, _ = data.tensors
    return lambda ids: torch.nn.functional.cross_entropy(net(x[torch.tensor(ids)]), y[torch.tensor(ids)])


def test_noise_scale_comes_from_the_micro_batches_exactly(tmp_path):
    spy = StatsSpy([12, 9, 15, 6])
    adaptive = AdaptiveBatchSize(spy, batch_size=6, noise_every=1)
    model = Model(adaptive, make_data(), val=False)
    trainer(tmp_path, adaptive, accumulate_grad_batches=3).fit(model)
    net = make_net()
    check_noise_by_hand([s["micro"] for s in model.steps], spy.seen_stats, net, net_loss(net, make_data()),
                        len(make_data()))
    measured = spy.seen_stats[-1]["stats/noise_count"]
    assert measured == sum(len(s["ids"]) > 1 for s in model.steps) and "perf/micro_time_b_s" in spy.seen_stats[-1]
    state = json.loads(json.dumps(adaptive.state_dict()))  # JSON-safe; the estimate travels with the callback
    fresh = AdaptiveBatchSize(StatsSpy([6]), batch_size=6, noise_every=1)
    fresh.load_state_dict(state)
    more = Model(fresh, make_data(), val=False)
    trainer(tmp_path, fresh, accumulate_grad_batches=3, max_epochs=1).fit(more)
    assert fresh.stats.probe.estimator.count == measured + sum(len(s["ids"]) > 1 for s in more.steps)


class CompilableModel(Model):
    """``Model`` without the bookkeeping: a training_step dynamo can trace (Lightning's ``self.log`` cannot)."""

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return self.adaptive.weight(torch.nn.functional.cross_entropy(self.net(x), y))


@pytest.mark.parametrize("compiled", ["lightning_module", "net"])
def test_a_compiled_model_trains_as_eager(tmp_path, compiled):
    # Given a compiled LightningModule, Lightning compiles training_step, which calls the callback: what it
    # reads there (weights, sizes) must stay out of the graph. aot_eager: bit-identical to eager.
    import torch._dynamo

    def fit(compile_what):
        torch._dynamo.reset()
        adaptive = AdaptiveBatchSize(SizeList(SIZES), batch_size=4)
        model = CompilableModel(adaptive, make_data(), val=False)
        net = model.net
        if compile_what == "net":
            model.net = torch.compile(model.net, backend="aot_eager")
        module = torch.compile(model, backend="aot_eager") if compile_what == "lightning_module" else model
        trainer(tmp_path, adaptive, accumulate_grad_batches=2).fit(module)
        return [p.detach() for p in net.parameters()], adaptive.samples_seen

    eager, seen = fit(None)
    weights, compiled_seen = fit(compiled)
    torch._dynamo.reset()
    assert compiled_seen == seen == 2 * NUM_SAMPLES
    assert all(torch.equal(a, b) for a, b in zip(weights, eager))


def test_fp16_grad_scaler_keeps_the_statistics_exact(tmp_path):
    # Lightning makes no GradScaler on CPU by default; given one, .grad holds scaled gradients (autocast
    # leaves the float64 net alone, so only the scaling differs) and the statistics must undo the scale.
    from lightning.pytorch.plugins.precision import MixedPrecision

    spy = StatsSpy([12, 9, 15, 6])
    adaptive = AdaptiveBatchSize(spy, batch_size=6, noise_every=1)
    model = Model(adaptive, make_data(), val=False)
    scaler = torch.amp.GradScaler("cpu")
    fit = trainer(tmp_path, adaptive, accumulate_grad_batches=3, max_epochs=1,
                  plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    fit.fit(model)
    assert fit.precision_plugin.scaler is scaler and scaler.get_scale() == 2.0**16  # used, never overflowed
    net = make_net()
    check_noise_by_hand([s["micro"] for s in model.steps], spy.seen_stats, net, net_loss(net, make_data()),
                        len(make_data()))


def test_gradient_statistics_need_a_small_batch(tmp_path):
    from batchpilot.controllers import NoiseScale

    adaptive = AdaptiveBatchSize(NoiseScale(), batch_size=4)
    with pytest.raises(ValueError, match="accumulate_grad_batches >= 2"):
        trainer(tmp_path, adaptive).fit(Model(adaptive, make_data(), val=False))
    adaptive = AdaptiveBatchSize(NoiseScale(), batch_size=4)
    with pytest.raises(ValueError, match="manual optimization .* on one process; train on >= 2 ranks"):
        trainer(tmp_path, adaptive).fit(ManualModel(adaptive, make_data(), val=False))
    with pytest.raises(ValueError, match="noise_every"):
        AdaptiveBatchSize(batch_size=4, noise_every=0)


@pytest.mark.distributed
@pytest.mark.parametrize("manual", [False, True])
def test_ddp_noise_scale_from_the_ranks_and_micro_batches(tmp_path, manual):
    """2 gloo ranks x 2 micro-batches: each rank's last micro-batch is read inside DDP's all-reduce. With
    manual optimization (one micro-batch per step) the ranks alone are the small batches."""
    ranks = torchrun(tmp_path, "--noise", *(["--manual"] if manual else []))
    assert {len(s["micro"]) for r in ranks for s in r["steps"]} == ({1} if manual else {2})
    steps = zip(ranks[0]["steps"], ranks[1]["steps"])
    net = make_net()
    check_noise_by_hand([a["micro"] + b["micro"] for a, b in steps], ranks[0]["stats"], net,
                        net_loss(net, make_data(NOISE_SAMPLES)), NOISE_SAMPLES)


@pytest.mark.distributed
def test_ddp_two_ranks_under_torchrun(tmp_path):
    ranks = torchrun(tmp_path)
    assert [r["world_size"] for r in ranks] == [2, 2]
    sizes = [[s["size"] for s in r["steps"]] for r in ranks]
    assert sizes[0] == sizes[1] == expected_sizes(4, SIZES, NUM_SAMPLES, 2)
    per_epoch = collections.defaultdict(list)
    for r in ranks:
        for s in r["steps"]:
            per_epoch[s["epoch"]].extend(s["ids"])
    assert [sorted(per_epoch[e]) for e in (0, 1)] == [list(range(NUM_SAMPLES))] * 2
    assert ranks[0]["weights"] == ranks[1]["weights"]
    merged = [{"ids": a["ids"] + b["ids"]} for a, b in zip(ranks[0]["steps"], ranks[1]["steps"])]
    for got, want in zip(ranks[0]["weights"], sgd_reference(merged, make_data())):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=1e-13)


@pytest.mark.distributed
def test_ddp_resume_restores_each_ranks_dropout_draws(tmp_path):
    """2 gloo ranks, dropout with each rank's own generator: the checkpoint after step 3 holds every rank's
    generator states, and the resumed fit trains the same steps to the same weights."""
    full = torchrun(tmp_path / "full", "--dropout", "--save", str(tmp_path / "ckpt"))
    resumed = torchrun(tmp_path / "resumed", "--dropout", "--resume", str(tmp_path / "ckpt" / "step=3.ckpt"))
    for whole, rest in zip(full, resumed):
        assert rest["steps"] == whole["steps"][3:]
        assert rest["weights"] == whole["weights"]


def test_a_later_fit_with_another_module_measures_that_modules_parameters(tmp_path):
    # A second fit whose module trains the same parameters keeps its StepStats, but the statistics must re-read
    # the new module's trainable parameters (they read the first fit's module, so a layer of the new one
    # unfrozen later was never measured).
    adaptive = AdaptiveBatchSize(StatsSpy([6]), batch_size=6, noise_every=1)
    first = Model(adaptive, make_data(), val=False)
    trainer(tmp_path, adaptive, accumulate_grad_batches=3, max_epochs=1).fit(first)
    stats = adaptive.stats
    second = Model(adaptive, make_data(), val=False)
    second.net = first.net  # the same trainable parameters: nothing to rebuild
    second.extra = torch.nn.Linear(2, 2).requires_grad_(False)
    trainer(tmp_path, adaptive, accumulate_grad_batches=3, max_epochs=1).fit(second)
    assert adaptive.stats is stats
    second.extra.requires_grad_(True)  # unfrozen after this fit: the next measured step must see it
    assert any(p is second.extra.weight for p in adaptive.stats._params_of())
