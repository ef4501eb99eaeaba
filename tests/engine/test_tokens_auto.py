"""``batch_size="auto"`` with ``batch_unit="tokens"``: the start probes sweep token budgets, the default bounds
become token counts, coverage stays exact, and a checkpoint resumes the run exactly."""

from __future__ import annotations

import _tokens_workers as w
import pytest
import torch

import batchpilot
from batchpilot.controllers import Auto
from batchpilot.data.tokens import plan_token_batch


def long_data() -> w.Sequences:
    """Six copies of the token problem's data (498 samples), so that the sweep has room to double."""
    ds = w.make_data()
    x, y, mask = (torch.cat([t] * 6) for t in ds.tensors)
    out = w.Sequences(x, y, mask)
    out.lengths = ds.lengths * 6
    return out


def auto_pilot(model, controller=None, **settings) -> batchpilot.Pilot:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    settings = {"batch_unit": "tokens", "lengths": "lengths", "loss_reduction": "sum", "seed": 3, **settings}
    auto = Auto(min_size=40, max_size=160, lr_steps=12, timed_steps=2) if controller is None else controller
    return batchpilot.Pilot(model, opt, long_data(), batch_size="auto", controller=auto, **settings)


def train(pilot, model, steps):
    """Training steps' (tokens, indices), and the tokens of each probe micro-batch the loop saw."""
    steps_seen, probe_tokens = [], []
    for x, y, mask in pilot.batches(max_steps=steps):
        m = pilot.micro_batch
        if pilot.probing:
            probe_tokens.append(m.tokens)
        else:
            if m.micro_index == 0:
                steps_seen.append({"tokens": m.global_tokens, "indices": [], "epoch": m.epoch})
            steps_seen[-1]["indices"].extend(m.indices.tolist())
        pilot.backward(w.token_loss_sum(model, x, y, mask))
    return steps_seen, probe_tokens


def test_the_probes_sweep_token_budgets_and_keep_exact_coverage():
    model = w.make_model()
    pilot = auto_pilot(model)
    steps, probe_tokens = train(pilot, model, 40)
    probe = pilot.controller.probe
    pilot.close()
    assert probe is not None and [s for s, _ in probe.throughput][:2] == [40, 80]  # (160 too unless 80 was slow)
    assert probe.bound in ("knee", "max_size") and 40 <= probe.start_size <= 160
    assert probe.lr is not None and probe.lr > 0 and sum(probe_tokens) > 0
    data = long_data()
    order = pilot.loader.sampler.order(0)
    offset = 0
    for step in steps:  # the training steps are the epoch's order, cut at the knee's budget from its first sample
        if step["epoch"] != 0:
            break
        stop = plan_token_batch(order, offset, data.lengths, probe.start_size)
        assert step["indices"] == [int(i) for i in order[offset:stop]]
        assert step["tokens"] == sum(data.lengths[i] for i in step["indices"])
        offset = stop
    assert offset > 0 and pilot.tokens_seen == sum(s["tokens"] for s in steps)
    assert pilot.samples_seen == sum(len(s["indices"]) for s in steps)  # probe steps are no training steps


def test_default_bounds_become_tokens_and_given_ones_stay():
    pilot = auto_pilot(w.make_model(), controller=Auto())
    mean = sum(long_data().lengths) / 498
    assert (pilot.controller.min_size, pilot.controller.max_size) == (round(32 * mean), round(4096 * mean))
    assert pilot.loader.sampler.batch_size == pilot.controller.min_size  # the sweep's first budget
    pilot.close()
    pilot = auto_pilot(w.make_model(), controller=Auto(max_size=100))
    assert (pilot.controller.min_size, pilot.controller.max_size) == (min(round(32 * mean), 100), 100)
    pilot.close()
    with pytest.raises(ValueError, match="mean_length"):
        Auto().count_tokens(float("nan"))


def test_a_checkpoint_after_the_probes_resumes_exactly_without_probing_again(tmp_path):
    def fixed_knee() -> Auto:  # one size to sweep: both runs start at 80 whatever the timings
        return Auto(min_size=80, max_size=80, lr_steps=12, timed_steps=2)

    model = w.make_model()
    whole = auto_pilot(model, fixed_knee())
    steps, _ = train(whole, model, 30)
    weights = [p.detach().clone() for p in model.parameters()]
    whole.close()
    model = w.make_model()
    first = auto_pilot(model, fixed_knee())
    part, _ = train(first, model, 12)
    path = first.save_checkpoint(tmp_path / "ckpt.pt")
    first.close()
    model = w.make_model()
    second = auto_pilot(model, fixed_knee())
    second.load_checkpoint(path)
    rest, probe_tokens = train(second, model, 30)
    second.close()
    assert probe_tokens == []  # the probes' outcome is in the checkpoint
    assert [s["indices"] for s in part + rest] == [s["indices"] for s in steps]
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
