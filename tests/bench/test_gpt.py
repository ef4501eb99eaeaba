"""The gpt workload: a deterministic local corpus, a causal byte-level transformer, token budgets in the bench."""

from __future__ import annotations

import math
import platform
from dataclasses import replace

import pytest
import torch
from _benchmarks import load_benchmark

from batchpilot import Pilot
from batchpilot.bench import get_workload, run_benchmark
from batchpilot.bench.gpt import (
    TinyGPT,
    gpt_loss,
    gpt_model,
    gpt_optimizer,
    gpt_pilot_settings,
    gpt_score,
    validation_loss,
)
from batchpilot.bench.gpt_data import (
    DEV_DIGEST,
    GPT_CONTEXT,
    GPT_MODULES,
    IGNORE,
    PAD,
    corpus_digest,
    gpt_corpus,
    gpt_data,
    samples_of,
    token_lengths,
)
from batchpilot.bench.runner import dataset_units


@pytest.fixture(scope="module")
def data():
    return gpt_data()


def test_corpus_is_deterministic_and_split_by_document(data):
    train, val = data
    again_train, again_val = gpt_data()
    for a, b in zip(train.tensors + val.tensors, again_train.tensors + again_val.tensors):
        assert torch.equal(a, b)
    docs = gpt_corpus()
    assert len(docs) == len(GPT_MODULES) == 48
    if platform.python_version() == "3.11.7":  # the interpreter the target was set on
        assert corpus_digest(docs) == DEV_DIGEST
    # No validation block appears in the training set: the split is by module.
    train_rows = {bytes(r[r != IGNORE].tolist()) for r in train.tensors[1][:3000]}
    val_rows = {bytes(r[r != IGNORE].tolist()) for r in val.tensors[1]}
    assert len(train_rows & val_rows) <= 5  # only boilerplate lines shared by two modules could repeat


def test_samples_have_variable_lengths_and_consistent_padding(data):
    train, val = data
    lengths = token_lengths(train)
    assert len(lengths) == len(train) > 10_000 and sum(lengths) > 1_000_000
    assert min(lengths) >= 1 and max(lengths) == GPT_CONTEXT and len(set(lengths)) == GPT_CONTEXT  # every length
    x, y = train.tensors
    for i in (0, 1, 500, len(train) - 1):
        n = lengths[i]
        assert torch.equal(x[i, 1:n], y[i, : n - 1])  # targets are the inputs shifted by one byte
        assert (x[i, n:] == PAD).all() and (y[i, n:] == IGNORE).all()
        assert (x[i, :n] < 256).all()


def test_samples_of_cuts_blocks_at_blank_lines_and_context():
    doc = b"short\n\n" + b"a" * 30 + b"\n\n\n" + b"b" * 150
    out = samples_of(doc, context=64, min_length=16)
    assert out == [b"a" * 30, b"b" * 65, b"b" * 65, b"b" * 20]  # "short" is below min_length


def test_model_is_causal_and_ignores_padding():
    model = gpt_model(0).eval()
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 200_000
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 20), generator=g)
    with torch.no_grad():
        full = model(x)
        changed = x.clone()
        changed[:, 10:] = torch.randint(0, 256, (2, 10), generator=g)
        torch.testing.assert_close(model(changed)[:, :10], full[:, :10])  # position t sees only 0..t
        padded = torch.full((2, GPT_CONTEXT), PAD)
        padded[:, :20] = x
        out = model(padded)
    assert out.shape == (2, 20, 256)  # columns of padding alone are dropped
    torch.testing.assert_close(out, full)
    with pytest.raises(ValueError, match="longer than the context"):
        model(torch.zeros(1, GPT_CONTEXT + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        TinyGPT(width=30, heads=4)


def test_loss_sums_over_real_tokens_only():
    logits = torch.randn(2, 3, 256, dtype=torch.float64)
    y = torch.tensor([[1, 2, IGNORE, IGNORE], [3, IGNORE, IGNORE, IGNORE]])
    expected = sum(-torch.log_softmax(logits[i, t], -1)[y[i, t]] for i, t in ((0, 0), (0, 1), (1, 0)))
    torch.testing.assert_close(gpt_loss(logits, y), expected)


def test_tokens_are_counted_and_the_model_learns(data):
    train, val = data
    model = gpt_model(0)
    before = validation_loss(model, val)
    assert before == pytest.approx(math.log(256), abs=0.3)  # untrained: near uniform over bytes
    pilot = Pilot(model, gpt_optimizer(model.parameters(), 3e-3), train, batch_size=1024, progress=False, seed=0,
                  **gpt_pilot_settings(train))
    records = []
    pilot.add_callback(lambda p, r: records.append(r))
    lengths = token_lengths(train)
    for x, y in pilot.batches(max_steps=40):
        pilot.backward(gpt_loss(model(x), y))
    pilot.close()
    assert all(r["tokens"] <= 1024 for r in records)
    assert all(r["tokens"] + 64 > 1024 for r in records)  # a step stops only where the next sample would not fit
    order = pilot.loader.sampler.order()[: records[-1]["samples_seen"]]
    assert records[-1]["tokens_seen"] == sum(lengths[i] for i in order)
    after = validation_loss(model, val)
    assert after < before - 2.0
    assert gpt_score(model, val) == pytest.approx(math.exp(-after))


def test_bench_runs_the_gpt_workload_in_tokens(tmp_path):
    wl = replace(get_workload("gpt"), min_batch_size=512, max_batch_size=1024, grid=(512, 1024))
    results = run_benchmark(wl, "static:1024", [0], target_accuracy=math.exp(-2.6), budget_s=30, eval_every=0.02,
                            out_dir=tmp_path, progress=False, calibrate_steps=1)
    run = results["runs"][0]
    assert run["stop_reason"] == "target" and run["tokens_to_target"] is not None
    assert 0 < run["tokens_to_target"] <= run["tokens"] <= 1024 * run["steps"]
    assert run["curve"][-1]["tokens_seen"] == run["tokens"]
    assert results["calibration"]["sizes"] == [512, 1024]  # token budgets
    assert run["cost_model_s"] > 0.5 * run["steps"] * results["calibration"]["step_s"][1]  # priced at its tokens
    script = load_benchmark("gpt_tokens")  # benchmarks/gpt_tokens.py's table and plot on these results
    out = script.table(results)
    assert out["best_static"] == "static:1024" and out["rows"]["static:1024"]["tokens_ratio"] == 1.0
    assert out["verdict"] is None  # no adaptive policy ran
    assert script.plot_tokens(results, tmp_path).stat().st_size > 10_000


def test_the_bench_counts_the_gpt_training_set_in_tokens(data):
    train = data[0]
    units, unit = dataset_units(get_workload("gpt"), train)
    assert unit == "tokens" and units == sum(token_lengths(train)) > 40 * len(train)
    assert dataset_units(get_workload("synthetic"), train) == (len(train), "samples")
    # A budget above the sample count is fine; one above the tokens is refused in tokens.
    with pytest.raises(ValueError, match=rf"training set of {units} tokens: static:{units + 1}"):
        run_benchmark(get_workload("gpt"), f"static:{len(train) + 1},static:{units + 1}", [0], progress=False)
