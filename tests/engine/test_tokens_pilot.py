"""Token budgets in one Pilot: exact resume, the LR coupling, the log, the noise scale and the controller counting
tokens, token-weighted mean losses, ``drop_last`` in tokens, and bad settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _tokens_workers as w
import pytest
import torch

import batchpilot
from batchpilot.controllers import Goodput, LinearIncrease
from batchpilot.engine.decisions import observed_stats
from batchpilot.engine.tokens import micro_bound

REPO = Path(__file__).resolve().parents[2]


def run(steps: int, **settings) -> tuple[list[dict], list[torch.Tensor], batchpilot.Pilot]:
    model = w.make_model()
    pilot = w.make_pilot(model, **settings)
    records = w.train(pilot, model, steps)
    return records, [p.detach().clone() for p in model.parameters()], pilot


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_checkpoint_mid_epoch_resumes_exactly(tmp_path, num_workers):
    settings = dict(max_micro_batch_tokens=20, num_workers=num_workers, noise_every=3, lr_rule="sqrt")
    whole, weights, _ = run(25, controller=w.Budgets(w.BUDGETS), **settings)
    model = w.make_model()
    first = w.make_pilot(model, controller=w.Budgets(w.BUDGETS), **settings)
    part = w.train(first, model, 11)
    path = first.save_checkpoint(tmp_path / "ckpt.pt")
    first.close()
    model = w.make_model()
    second = w.make_pilot(model, controller=w.Budgets(w.BUDGETS), **settings)
    second.load_checkpoint(path)
    assert second.tokens_seen == sum(r["tokens"] for r in part) and second.samples_seen == sum(
        len(r["indices"]) for r in part)
    part += w.train(second, model, 25)
    second.close()
    assert [r["indices"] for r in part] == [r["indices"] for r in whole]
    assert [r["tokens"] for r in part] == [r["tokens"] for r in whole]
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))


def test_steps_weights_log_and_lr_count_tokens(tmp_path):
    log = tmp_path / "log.jsonl"
    records, weights, pilot = run(12, controller=w.Budgets(w.BUDGETS), lr_rule="linear", base_batch_size=50,
                                  log_path=log, max_micro_batch_tokens=16)
    pilot.close()
    lengths = w.make_data().lengths
    for r in records:
        assert r["tokens"] == sum(lengths[i] for i in r["indices"]) == sum(r["micro_tokens"])
    assert w.reference_weights([r["indices"] for r in records]) != [p.tolist() for p in weights]  # the LR changed
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [s for s in steps if s["type"] == "step"]
    assert [s["tokens"] for s in steps] == [r["tokens"] for r in records]
    assert steps[-1]["tokens_seen"] == pilot.tokens_seen == sum(r["tokens"] for r in records)
    assert steps[-1]["samples_seen"] == pilot.samples_seen == sum(len(r["indices"]) for r in records)
    # linear coupling in tokens: each step's LR is the base LR x its tokens / base_batch_size
    assert [s["lr"] for s in steps] == pytest.approx([0.05 * r["tokens"] / 50 for r in records], rel=1e-12)


def test_a_mean_loss_per_micro_batch_is_weighted_by_its_tokens():
    model = w.make_model()
    pilot = w.make_pilot(model, controller=w.Budgets(w.BUDGETS), loss_reduction="mean", max_micro_batch_tokens=16)
    indices = []
    for x, y, mask in pilot.batches(max_steps=10):
        m = pilot.micro_batch
        if m.micro_index == 0:
            indices.append([])
        indices[-1].extend([] if m.ghost else m.indices.tolist())
        pilot.backward(w.token_loss_sum(model, x, y, mask) / max(m.tokens, 1))  # the mean over its tokens
    assert any(len(s) > 1 for s in indices)
    reference = w.reference_weights(indices)
    for got, want in zip(model.parameters(), reference):
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_the_controller_and_the_noise_scale_see_tokens():
    seen_sizes = []
    controller = w.Budgets(w.BUDGETS)
    model = w.make_model()
    pilot = w.make_pilot(model, controller=controller, noise_every=1, max_micro_batch_tokens=30,
                         min_batch_size=10, max_batch_size=100)  # bounds in tokens: 5 -> 10, 150 -> 100, 220 -> 100
    pilot.add_callback(lambda p, record: seen_sizes.append(list(p._noise._sizes)))
    micro_tokens = []
    for x, y, mask in pilot.batches(max_steps=12):
        if pilot.micro_batch.micro_index == 0:
            micro_tokens.append([])
        micro_tokens[-1].append(pilot.micro_batch.tokens)
        pilot.backward(w.token_loss_sum(model, x, y, mask))
    total = sum(w.make_data().lengths)
    assert all(n == total for _, _, n in controller.seen)
    assert [b for b, _, _ in controller.seen][1:] == [min(max(w.BUDGETS[i % len(w.BUDGETS)], 10), 100)
                                                         for i in range(11)]
    # the small batches of the noise scale are the micro-batches' tokens, of every split step
    split = [(s, t) for s, t in zip(seen_sizes, micro_tokens) if len(t) > 1]
    assert split and all(s == [x for x in t if x] for s, t in split)
    assert "stats/noise_scale" in pilot.last_record or "stats/trace_cov" in pilot.last_record


def test_goodput_decides_token_budgets_from_a_model_in_tokens():
    model = w.make_model()
    pilot = w.make_pilot(model, controller=Goodput(), max_micro_batch_tokens=24, min_batch_size=30,
                         max_batch_size=400, noise_every=1)
    per_token: list[float] = []  # the fitted seconds per token of a micro-batch, step by step
    pilot.add_callback(lambda p, r: per_token.append(r.get("perf/micro_time_b_s", float("nan"))))
    records = w.train(pilot, model, 40)
    micro = observed_stats(pilot.last_record, world_size=1, max_micro_batch_size=micro_bound(pilot.loader))
    assert micro["perf/max_micro_batch_size"] == 24  # the bound Goodput plans micro-batches with is in tokens
    assert all(r["tokens"] <= 400 or len(r["indices"]) == 1 for r in records)
    # Its time model is fitted per token (a noisy fit may clamp the slope to 0 at a step, not at every step).
    assert 30 <= pilot.batch_size <= 400 and max(b for b in per_token if b == b) > 0


def test_drop_last_drops_a_tail_short_of_the_budget():
    records, _, pilot = run(40, batch_size=200, drop_last=True, shuffle=False)
    lengths = w.make_data().lengths
    epoch0 = [i for r in records if r["epoch"] == 0 for i in r["indices"]]
    rest = [i for i in range(w.NUM_SAMPLES) if i not in epoch0]
    assert sum(lengths[i] for i in rest) < 200 and rest == list(range(len(epoch0), w.NUM_SAMPLES))
    assert pilot.loader.sampler.dropped_samples >= len(rest) > 0


def test_a_linear_ramp_in_tokens_and_the_size_the_user_sets():
    records, _, pilot = run(6, controller=LinearIncrease(start=20, increment=30, interval=2, max_size=200),
                            batch_size=20)
    lengths = w.make_data().lengths
    budgets = [20, 20, 50, 50, 80, 80]
    assert all(r["tokens"] <= b or len(r["indices"]) == 1 for r, b in zip(records, budgets))
    assert all(r["tokens"] + lengths[next_i] > b for r, b, next_i in zip(records, budgets, (
        s["indices"][0] for s in records[1:])))  # each step stopped where the next sample would overflow
    pilot.set_batch_size(7)
    order, offset = pilot.loader.sampler.order(), pilot.loader.position()[1]
    assert pilot.loader.next_step_size() == sum(lengths[i] for i in order[offset:w.plan_token_batch(order, offset,
                                                                                                    lengths, 7)])


@pytest.mark.parametrize("settings, error, message", [
    (dict(batch_unit="token"), ValueError, "batch_unit='token'"),
    (dict(batch_unit="samples", lengths="lengths"), ValueError, "lengths is given but batch_unit='samples'"),
    (dict(lengths=None), ValueError, "batch_unit='tokens' needs lengths="),
    (dict(lengths=[3] * 5), ValueError, "lengths has 5 entries but the dataset has 83"),
    (dict(lengths="sizes"), ValueError, "lengths='sizes' names no attribute or column"),
    (dict(lengths=[0] * 83), ValueError, r"lengths\[0\] is 0"),
    (dict(max_micro_batch_tokens=-1), ValueError, "max_micro_batch_tokens=-1"),
])
def test_bad_token_settings_name_the_value_and_the_fix(settings, error, message):
    with pytest.raises(error, match=message):
        w.make_pilot(w.make_model(), **settings)


def test_a_checkpoint_counted_in_samples_does_not_load_into_a_run_in_tokens(tmp_path):
    model = w.make_model()
    samples = w.make_pilot(model, batch_unit="samples", lengths=None, batch_size=8)
    for x, y, mask in samples.batches(max_steps=2):
        samples.backward(w.token_loss_sum(model, x, y, mask))
    path = samples.save_checkpoint(tmp_path / "s.pt")
    tokens = w.make_pilot(w.make_model())
    with pytest.raises(Exception, match="batch_unit"):
        tokens.load_checkpoint(path)


def test_the_token_planning_benchmark_runs_on_a_tiny_budget(tmp_path):
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "token_planning.py"), "--out", str(tmp_path),
                    "--samples", "300", "--steps", "4", "--rounds", "1"], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(REPO / "src")}, timeout=300)
    result = json.loads((tmp_path / "token_planning.json").read_text())
    micro = f"micro<={result['settings']['budget_tokens'] // 4} tokens"
    assert set(result["planning"]) == {"world=1", f"world=1, {micro}", "world=4", f"world=4, {micro}"}
    assert result["step_seconds"]["tokens"] > 0 and result["planning_overhead_fraction_of_step"]


def test_running_out_of_memory_in_tokens_runs_the_step_again_with_fewer_samples_per_micro_batch():
    model = w.make_model()

    def forward_that_fits_40_tokens(x, y, mask):
        if mask.sum() > 40:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB.")
        return w.token_loss_sum(model, x, y, mask)

    pilot = w.make_pilot(model, controller=w.Budgets([120, 200, 90]), oom_recovery=True)
    by_step: dict[int, list[int]] = {}
    for x, y, mask in pilot.batches(max_steps=12):
        m = pilot.micro_batch
        if m.micro_index == 0:
            by_step[m.step] = []  # (a step run again starts over)
        by_step[m.step].extend([] if m.ghost else m.indices.tolist())
        with pilot.micro_step():
            pilot.backward(forward_that_fits_40_tokens(x, y, mask))
    assert pilot.oom_replays > 0 and pilot.loader.max_micro_batch_size is not None
    indices = [by_step[s] for s in range(12)]
    for got, want in zip(model.parameters(), w.reference_weights(indices)):
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
