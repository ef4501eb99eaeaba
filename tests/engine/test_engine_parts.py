"""The engine's parts on their own: the grouped settings, the decision path's override and failure hook, the
shared step-end and replay functions, the probe's settings, and the checkpoint reader's two names."""

from __future__ import annotations

import logging

import pytest
import torch
from _engine_helpers import make_problem

import batchpilot
from batchpilot.controllers import Constant
from batchpilot.engine import DataConfig, DecisionConfig, PilotConfig, SizeDriver
from batchpilot.engine.config import GROUP_OF
from batchpilot.engine.replay import error_summary, keep_finished_step
from batchpilot.engine.step_end import reduce_step_loss
from batchpilot.measure import GradientNoiseProbe

# Pilot's keyword arguments and their defaults before the settings were grouped.
OLD_DEFAULTS = dict(
    decide_every=1, min_batch_size=None, max_batch_size=None, on_invalid="raise", max_micro_batch_size=None,
    lr_rule=None, base_batch_size=None, lr_knee=4096, lr_schedulers=(), shuffle=True, seed=0, drop_last=False,
    num_workers=0, collate_fn=None, pin_memory=False, prefetch_factor=None, amp=None, grad_clip=None,
    skip_nonfinite=True, device=None, log_path=None, tensorboard_dir=None, progress=None, checkpoint_dir=None,
    checkpoint_every=None, keep_checkpoints=2, loss_reduction="mean", loss_history=50, noise_every=None,
    system_every=100, oom_recovery=False, rank=None, world_size=None,
)  # (lr_rule was "none"; since issue 21 None means the controller's recommended rule, else "none": docs/lr.md)
NEW_DEFAULTS = dict(rollback=None, rollback_window=100, rollback_spike=2.0, rollback_cooldown=200)  # issue 21
NEW_DEFAULTS.update(rank_weights=None, compression=None, save_on_sigterm=False)  # issue 23
NEW_DEFAULTS.update(batch_unit="samples", lengths=None, max_micro_batch_tokens=None)  # issue 24


def build(**settings):
    ds, model = make_problem()
    return model, batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8, **settings)


def train(pilot, model, steps):
    for x, y in pilot.batches(max_steps=steps):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    return [p.detach().clone() for p in model.parameters()]


def test_every_old_keyword_is_a_setting_with_its_old_default():
    assert set(GROUP_OF) == set(OLD_DEFAULTS) | set(NEW_DEFAULTS)
    config = PilotConfig()
    for name, default in {**OLD_DEFAULTS, **NEW_DEFAULTS}.items():
        assert getattr(getattr(config, GROUP_OF[name]), name) == default, name


def test_grouped_and_flat_settings_train_the_same_run():
    model, flat = build(shuffle=False, seed=3, min_batch_size=4, decide_every=2, controller=None)
    weights = train(flat, model, 5)
    model, grouped = build(data=DataConfig(shuffle=False, seed=3), decisions=DecisionConfig(min_batch_size=4,
                                                                                               decide_every=2))
    assert grouped.config == flat.config
    assert all(torch.equal(a, b) for a, b in zip(weights, train(grouped, model, 5)))


@pytest.mark.parametrize("settings, message", [
    (dict(num_worker=2), "unexpected keyword argument 'num_worker'; did you mean 'num_workers'"),
    (dict(dat=DataConfig()), "did you mean 'data'"),
    (dict(data=DataConfig(), num_workers=2), r"num_workers is given as a keyword while its group is passed as "
                                             r"data=DataConfig\(\.\.\.\)"),
    (dict(decisions=DataConfig()), "decisions must be a DecisionConfig"),
])
def test_a_setting_that_is_unknown_or_given_twice_is_refused(settings, message):
    with pytest.raises(TypeError, match=message):
        build(**settings)


def test_a_group_is_checked_like_the_keywords_all_problems_at_once():
    with pytest.raises(ValueError, match=r"(?s)invalid Pilot arguments:.*decide_every must be >= 1.*on_invalid"):
        build(decisions=DecisionConfig(decide_every=0, on_invalid="ignore"))


def test_a_set_batch_size_override_and_the_controller_share_one_decision_path():
    driver = SizeDriver(Constant(16), batch_size=8, num_samples=100, decide_every=2, max_batch_size=12,
                        names=("controller", "batch_size"), world_size=1)
    driver.end_step(8, 1.0)  # step 1: the controller is not due
    assert driver.next_size(8, epoch=0, coverage=0.1) is None
    assert driver.next_size(8, epoch=0, coverage=0.1, override=20) == (12, "user", "clamped 20 down to max_size=12")
    driver.end_step(8, 1.0)  # step 2: due
    assert driver.next_size(8, epoch=0, coverage=0.2) == (12, "Constant", "clamped 16 down to max_size=12")
    assert driver.next_size(8, epoch=0, coverage=0.2, override=9) == (9, "user", "set_batch_size() override")
    assert driver.decide(8, epoch=0, coverage=0.2) == 12 and driver.last_decision["new_size"] == 12


def test_a_failing_controller_reaches_the_failure_hook_before_it_is_raised():
    class Failing(Constant):
        def decide(self, obs):
            raise ZeroDivisionError("no size today")

    seen = []
    driver = SizeDriver(Failing(8), batch_size=8, num_samples=100, world_size=1)
    driver.end_step(8, 1.0)
    with pytest.raises(ZeroDivisionError):
        driver.next_size(8, epoch=0, coverage=0.0, on_failure=seen.append)
    assert [type(e) for e in seen] == [ZeroDivisionError]


def test_keep_finished_step_notes_where_the_step_went_or_logs_why_not(caplog):
    error = RuntimeError("the controller broke")
    keep_finished_step(lambda: "ckpt/step-5.pt", error, step=5, lead=True, resume_hint="load_checkpoint(dir)")
    assert error.__notes__ == ["batchpilot saved the finished step 5 to ckpt/step-5.pt before stopping: fix the "
                               "controller and resume from it (load_checkpoint(dir)); nothing trained is lost."]

    def failing_save():
        raise OSError("disk full")

    other = RuntimeError("again")
    with caplog.at_level(logging.ERROR, logger="batchpilot"):
        keep_finished_step(failing_save, other, step=6, lead=True, resume_hint="-", what="the batch size controller")
    assert "the batch size controller failed at step 6 and saving that step failed too: disk full" in caplog.text
    assert not hasattr(other, "__notes__")
    assert error_summary(RuntimeError("first\nsecond")) == "first" and error_summary(KeyError()) == "KeyError"


def test_the_step_loss_is_the_weighted_mean_over_the_global_batch():
    losses = [(torch.tensor(1.0), 3.0), (torch.tensor(2.0), 1.0)]
    assert reduce_step_loss(losses, 4, world_size=1, rank=0) == pytest.approx((3 * 1.0 + 1 * 2.0) / 4)


def test_the_probe_population_is_checked_and_split_every_says_when_a_step_is_split():
    params = [torch.nn.Parameter(torch.zeros(2))]
    probe = GradientNoiseProbe(params, every=4, population=100)
    assert probe.population == 100 and probe.split_every == 4
    probe.population = None
    assert probe.population is None
    for bad, error in [(0, ValueError), (2.5, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="population"):
            probe.population = bad
    assert GradientNoiseProbe(params, every=4, ranks_are_small_batches=True).split_every is None


def test_the_checkpoint_reader_has_one_name_and_the_old_one_warns(tmp_path):
    model, pilot = build()
    train(pilot, model, 2)
    path = pilot.save_checkpoint(tmp_path / "a.pt")
    state = batchpilot.read_checkpoint(path)
    assert state["pilot"]["step"] == 2
    with pytest.warns(DeprecationWarning, match=r"use batchpilot.read_checkpoint\(path\)"):
        old = batchpilot.load_checkpoint(path)
    assert old["pilot"] == state["pilot"]
