"""AdaptiveBatchSizeTrainer(batch_unit="tokens"): token-bounded global batches from the dataset's lengths, exact
coverage, exact token-weighted gradients (float64, against plain SGD on each global batch's mean loss per token),
passes bounded in tokens, the controller, LR schedule and logs in tokens, a real transformers causal LM, resume,
and the settings it refuses.

Expected batches come from data.tokens.plan_token_batch over the sampler's epoch order (a pure reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_common import SizeList
from _hf_helpers import exact_sgd, quiet_args
from _hf_tokens_common import VOCAB, N, Sequences, TokenNet, pad, sgd_reference
from transformers import TrainerCallback

from batchpilot.controllers import Auto
from batchpilot.data import AdaptiveBatchSampler
from batchpilot.data.tokens import plan_token_batch
from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer

BUDGETS = [30, 55, 12, 80, 3, 41]  # 3: below the longest sample (a step of one sample)


def expected_steps(data: Sequences, budgets: list[int], first: int, epochs: int, seed: int = 0) -> list[list[int]]:
    """Each step's dataset indices: plan_token_batch over the epoch order, budgets in decision order."""
    order = AdaptiveBatchSampler(len(data), 1, seed=seed).order
    lengths = np.asarray(data.lengths)
    steps, budget, nxt = [], first, iter(budgets * 20)
    for epoch in range(epochs):
        offset = 0
        while offset < len(data):
            stop = plan_token_batch(order(epoch), offset, lengths, budget)
            steps.append(order(epoch)[offset:stop].tolist())
            offset, budget = stop, next(nxt)
    return steps


class Observed(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.budgets, self.records = trainer, [], []

    def on_step_end(self, args, state, control, **kwargs):
        run = self.trainer.batchpilot
        self.records.append(run.last_step)
        self.budgets.append(run.batch_size)


@pytest.mark.parametrize("accumulation,max_tokens", [(1, None), (2, 9)])
def test_token_budgets_cover_exactly_and_equal_sgd_on_each_global_batch(tmp_path, accumulation, max_tokens):
    data, net = Sequences(), TokenNet()
    controller = SizeList(BUDGETS)
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=controller, model=net, train_dataset=data, data_collator=pad,
        batch_size=20, batch_unit="tokens", lengths="lengths", max_micro_batch_tokens=max_tokens,
        args=quiet_args(tmp_path, gradient_accumulation_steps=accumulation, num_train_epochs=2, logging_steps=1,
                        remove_unused_columns=False, **exact_sgd()),
    )
    spy = Observed(trainer)
    trainer.add_callback(spy)
    trainer.train()
    steps = expected_steps(data, BUDGETS, 20, 2)
    run = trainer.batchpilot
    assert [sorted(r.indices.tolist()) for r in spy.records] == [sorted(s) for s in steps]
    lengths = np.asarray(data.lengths)
    assert [r.global_tokens for r in spy.records] == [int(lengths[s].sum()) for s in steps]
    assert all(r.global_tokens <= b or r.global_size == 1 for r, b in zip(spy.records, [20] + BUDGETS * 9))
    assert run.samples_seen == 2 * N and run.epoch == 2 and run.tokens_seen == 2 * int(lengths.sum())
    if max_tokens is not None:  # passes of at most 9 tokens (a longer sample alone)
        assert max(t for t in net.tokens if t > 0) <= max(9, int(lengths.max()))
        assert len(net.seen) > accumulation * len(steps)
    reference = sgd_reference(data, steps)
    for a, b in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["tokens"] for h in logs] == [r.global_tokens for r in spy.records]
    assert logs[-1]["tokens_seen"] == run.tokens_seen and logs[-1]["samples_seen"] == 2 * N


def test_the_controller_lr_coupling_and_schedule_count_tokens(tmp_path):
    data = Sequences()
    seen = []

    class Budget:
        def decide(self, obs):
            seen.append((obs.batch_size, obs.samples_seen, obs.num_samples))
            return 40

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=Budget(), model=TokenNet(), train_dataset=data, data_collator=pad, batch_size=20,
        batch_unit="tokens", lengths=data.lengths, lr_rule="linear",
        args=quiet_args(tmp_path, num_train_epochs=1, logging_steps=1, remove_unused_columns=False,
                        learning_rate=0.1, lr_scheduler_type="linear", warmup_steps=0, optim="sgd"),
    )
    spy = Observed(trainer)
    trainer.add_callback(spy)
    trainer.train()
    total = int(np.sum(data.lengths))
    tokens = [r.global_tokens for r in spy.records]
    assert seen[0] == (20, tokens[0], total) and seen[1] == (40, tokens[0] + tokens[1], total)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    done = 0
    for log, t in zip(logs, tokens):  # linear decay over the epoch's tokens; LR x (tokens in force / 20)
        assert log["learning_rate"] == pytest.approx(0.1 * (total - done) / total, rel=1e-9)
        done += t
    assert logs[1]["lr_factor"] == pytest.approx(tokens[1] / 20, rel=1e-12)


def test_a_transformers_causal_lm_gets_the_mean_loss_per_token_of_each_global_batch(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    def model():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          bos_token_id=0, eos_token_id=0)).double()

    data = Sequences(24, seed=3)
    loss_tokens = [n - 1 for n in data.lengths]  # the causal LM shifts labels: a sequence of n has n - 1

    def collate(samples):
        batch = pad(samples)
        batch.pop("sample_id", None)
        batch["attention_mask"] = (batch["labels"] != -100).long()
        batch["labels"] = torch.where(batch["attention_mask"] == 1, batch["input_ids"], -100)
        return batch

    lm = model()
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=SizeList([25, 40, 14]), model=lm, train_dataset=data, data_collator=collate,
        batch_size=30, batch_unit="tokens", lengths=loss_tokens,
        args=quiet_args(tmp_path, gradient_accumulation_steps=2, num_train_epochs=1, **exact_sgd()),
    )
    spy = Observed(trainer)
    trainer.add_callback(spy)
    trainer.train()
    reference = model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for record in spy.records:
        optimizer.zero_grad()
        reference(**collate([data[i] for i in record.indices.tolist()]))["loss"].backward()
        optimizer.step()
    assert sum(r.global_size for r in spy.records) == len(data)
    assert any(r.global_size > 2 for r in spy.records)  # micro-batches of unequal tokens were weighted
    # transformers computes the causal-LM loss in float32 (ForCausalLMLoss upcasts the logits to float), hence 1e-7.
    for a, b in zip(lm.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_resume_in_tokens_is_bitwise(tmp_path):
    def trainer(out, **overrides):
        return AdaptiveBatchSizeTrainer(
            batch_size_scheduler=SizeList(BUDGETS), model=TokenNet(), train_dataset=Sequences(),
            data_collator=pad, batch_size=20, batch_unit="tokens", lengths="lengths",
            args=quiet_args(out, num_train_epochs=2, remove_unused_columns=False, **exact_sgd(), **overrides))

    full = trainer(tmp_path / "full")
    full.train()
    first = trainer(tmp_path / "part", save_strategy="steps", save_steps=7, max_steps=7)
    first.train()
    rest = trainer(tmp_path / "part")
    rest.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-7"))
    assert rest.batchpilot.tokens_seen == full.batchpilot.tokens_seen
    assert rest.batchpilot.samples_seen == full.batchpilot.samples_seen == 2 * N
    for a, b in zip(full.model.parameters(), rest.model.parameters()):
        assert torch.equal(a, b)


def test_token_settings_are_checked_with_their_fix(tmp_path):
    data = Sequences()

    def build(**kwargs):
        return AdaptiveBatchSizeTrainer(model=TokenNet(), train_dataset=data, data_collator=pad,
                                        args=quiet_args(tmp_path, remove_unused_columns=False), **kwargs)

    with pytest.raises(ValueError, match="needs the first step's token budget: batch_size="):
        build(batch_unit="tokens", lengths="lengths")
    with pytest.raises(ValueError, match="needs lengths="):
        build(batch_unit="tokens", batch_size=64)
    with pytest.raises(ValueError, match="batch_unit='samples'"):
        build(lengths="lengths")
    with pytest.raises(ValueError, match="batch_unit='bytes'"):
        build(batch_unit="bytes")
    with pytest.raises(ValueError, match="lengths has 3 entries but the dataset has 40"):
        build(batch_unit="tokens", lengths=[1, 2, 3], batch_size=64).train()


def test_the_noise_scale_counts_tokens_and_equals_the_two_batch_estimate_by_hand(tmp_path):
    """Every step measured, 2 micro-batches: the small batches are the micro-batches (their tokens), the big one
    the step (its tokens); McCandlish et al.'s estimate fed by hand in tokens equals what the controller saw."""
    from _hf_common import StatsSpy

    from batchpilot.stats import NoiseScaleEstimator

    data, net = Sequences(), TokenNet()
    spy = StatsSpy([40, 28, 60, 35])
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=spy, model=net, train_dataset=data, data_collator=pad, batch_size=40,
        batch_unit="tokens", lengths="lengths", noise_every=1,
        args=quiet_args(tmp_path, gradient_accumulation_steps=2, num_train_epochs=1, remove_unused_columns=False,
                        **exact_sgd()))
    trainer.train()
    lengths = np.asarray(data.lengths)
    forwards = iter(net.seen)
    reference, estimator = TokenNet(), NoiseScaleEstimator(ema_decay=0.99 ** (1 / 4))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    def grad(ids):
        reference.zero_grad()
        batch = pad([data[i] for i in ids])
        batch.pop("sample_id")
        reference(**batch)["loss"].backward()  # the mean loss per token of those samples
        return torch.cat([p.grad.flatten() for p in reference.parameters()]).clone()

    total = int(lengths.sum())
    assert len(spy.seen_stats) >= 10
    for seen in spy.seen_stats:
        parts = [next(forwards), next(forwards)]
        parts = [ids for ids in parts if ids]
        small = [grad(ids) for ids in parts]
        big = grad([i for ids in parts for i in ids])
        sizes = [int(lengths[ids].sum()) for ids in parts]  # tokens
        b_small = len(sizes) / sum(1 / n for n in sizes)
        if sum(sizes) > b_small:
            estimator.update(b_small, sum(float(g @ g) for g in small) / len(sizes), sum(sizes), float(big @ big),
                             population=total if sum(sizes) <= total else None)
        want = estimator.metrics()
        for key in ("stats/noise_scale", "stats/grad_sq_norm", "stats/trace_cov"):
            assert (key in seen) == (key in want), key
            if key in want:
                assert seen[key] == pytest.approx(want[key], rel=1e-9), key
        optimizer.step()
    assert "stats/trace_cov" in spy.seen_stats[-1]


class FitsTokens(TokenNet):
    """A TokenNet that 'fits' ``limit`` labelled tokens per forward: more raise torch.OutOfMemoryError."""

    def __init__(self, limit: int | None) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, input_ids, labels=None, sample_id=None):
        if self.training and self.limit is not None and int((labels != -100).sum()) > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {int((labels != -100).sum())}.")
        return super().forward(input_ids, labels, sample_id)


def test_oom_recovery_in_tokens_runs_the_step_again_and_keeps_the_gradient_exact(tmp_path):
    data = Sequences()

    def run(limit, **kwargs):
        net = FitsTokens(limit)
        trainer = AdaptiveBatchSizeTrainer(
            batch_size_scheduler=SizeList(BUDGETS), model=net, train_dataset=data, data_collator=pad, batch_size=20,
            batch_unit="tokens", lengths="lengths", args=quiet_args(tmp_path, num_train_epochs=1,
                                                                   remove_unused_columns=False, **exact_sgd()),
            **kwargs)
        trainer.train()
        return net, trainer

    net, trainer = run(25, oom_recovery=True)  # budgets of 30 to 80 tokens do not fit in one pass
    assert trainer.batchpilot.oom_replays >= 1 and max(t for t in net.tokens) <= 25
    steps = expected_steps(data, BUDGETS, 20, 1)
    reference = sgd_reference(data, steps)
    for a, b in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_auto_probes_token_budgets_then_covers_every_sample_once(tmp_path):
    """batch_size_scheduler=Auto() in tokens: no first budget needed; the sweep doubles token budgets from
    min_size; the run starts from the pre-probe weights at the knee and its epoch covers every sample once."""
    data = Sequences(160)
    net = TokenNet()
    auto = Auto(24, 96, timed_steps=1, min_epoch_steps=4, lr_steps=20, interval=1000)
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=auto, model=net, train_dataset=data, data_collator=pad, batch_unit="tokens",
        lengths="lengths", args=quiet_args(tmp_path, num_train_epochs=1, remove_unused_columns=False, **exact_sgd()))
    spy = Observed(trainer)
    trainer.add_callback(spy)
    trainer.train()
    probe = trainer.batchpilot.probe
    assert probe is not None and [size for size, _ in probe.throughput][:2] == [24, 48]
    assert probe.lr is not None and 24 <= probe.start_size <= 96
    ids = [i for r in spy.records for i in r.indices.tolist()]
    assert sorted(ids) == list(range(len(data)))  # the probes' samples were not trained on
    first = spy.records[0]
    assert first.global_tokens == sum(data.lengths[i] for i in first.indices) <= probe.start_size
    assert (auto.min_size, auto.max_size) == (24, 96)  # given bounds are token counts already


def test_auto_without_bounds_sweeps_from_32_samples_of_the_mean_length(tmp_path):
    data = Sequences(160)
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler="auto", model=TokenNet(), train_dataset=data, data_collator=pad, batch_unit="tokens",
        lengths="lengths", args=quiet_args(tmp_path, remove_unused_columns=False))
    trainer.get_train_dataloader()
    auto, mean = trainer.batchpilot.driver.controller, float(np.mean(data.lengths))
    assert (auto.min_size, auto.max_size) == (round(32 * mean), round(4096 * mean))
    assert trainer.batchpilot.loader.sampler.batch_size == auto.min_size
