"""train_policy: PPO learns a trivial environment on a small budget, is seeded, and records feature ranges;
the cosine schedule; a tiny `batchpilot rl train` run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("stable_baselines3")
from _rl_helpers import PickTheSign  # noqa: E402

from batchpilot.rl.train import cosine_schedule, train_policy  # noqa: E402


def trivial(seed: int = 0, timesteps: int = 20_000):
    return train_policy(timesteps, seed, env_fns=[PickTheSign] * 4, feature_names=("a", "b", "c"),
                        actions=(0.5, 1.0, 2.0), n_steps=128, batch_size=128, learning_rate=3e-3, ent_coef=0.0)


def test_ppo_learns_a_trivial_environment_and_is_seeded():
    result = trivial()
    obs = np.random.default_rng(5).uniform(-1, 1, (2000, 3)).astype(np.float32)
    best = np.array([PickTheSign.best(o) for o in obs])
    chosen = result.policy.act(torch.as_tensor(obs)).numpy()
    assert (chosen == best).mean() > 0.9  # a random policy gets 1/3
    assert result.meta.feature_low[0] >= -1 and result.meta.feature_high[0] <= 1
    assert result.meta.feature_low[0] < -0.95 and result.meta.feature_high[0] > 0.95  # ranges seen in training
    assert result.meta.training["gamma"] == 0.99 and result.meta.training["gae_lambda"] == 0.95
    assert result.meta.training["n_epochs"] == 4
    again = trivial()
    for (k, a), b in zip(result.policy.state_dict().items(), again.policy.state_dict().values()):
        assert torch.equal(a, b), k


def test_cosine_schedule_goes_from_the_initial_rate_to_the_final():
    lr = cosine_schedule(1e-3, 1e-5)
    assert lr(1.0) == pytest.approx(1e-3) and lr(0.0) == pytest.approx(1e-5)
    assert lr(0.5) == pytest.approx(1e-5 + (1e-3 - 1e-5) / 2)
    values = [lr(p) for p in np.linspace(1, 0, 11)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    with pytest.raises(ValueError, match="initial > 0"):
        cosine_schedule(0.0)
    assert not math.isnan(lr(2.0))


def test_train_policy_refuses_bad_arguments():
    with pytest.raises(ValueError, match="timesteps"):
        train_policy(0, env_fns=[PickTheSign], feature_names=("a", "b", "c"), actions=(0.5, 1, 2))
    with pytest.raises(ValueError, match="feature_names"):
        train_policy(100, env_fns=[PickTheSign])


def test_batchpilot_rl_train_writes_a_policy_the_controller_loads(tmp_path, capsys):
    from batchpilot.cli import main
    from batchpilot.controllers.ppo import PPOController

    out = tmp_path / "policy"
    assert main(["rl", "train", "--timesteps", "512", "--n-envs", "2", "--seed", "1", "--eval-episodes", "1",
                 "--out", str(out), "--no-progress", "--actions", "0.25,0.5,1,2,4", "--interval", "15",
                 "--first-interval", "5"]) == 0
    printed = capsys.readouterr().out
    assert "median ppo/oracle" in printed and "policy:" in printed
    c = PPOController(policy=out / "ppo_default.pt")
    # The action set and the schedule travel in the metadata; the controller reads them from there.
    assert c.meta.actions == (0.25, 0.5, 1.0, 2.0, 4.0) and c.policy.action_head.out_features == 5
    assert (c.first_interval, c.interval) == (5, 15) and (c.meta.first_interval, c.meta.interval) == (5, 15)
    assert "--actions 0.25,0.5,1,2,4 --interval 15 --first-interval 5" in c.meta.training["command"]
    rows = json.loads((out / "evaluation.json").read_text())["rows"]
    assert rows[0]["ppo_decisions"] >= 1 and rows[0]["greedy_ratio"] > 0
    assert c.meta.training["timesteps"] == 512 and c.meta.training["seed"] == 1
    assert "--reward-weights" in c.meta.training["command"] and "evaluation" in c.meta.training
    assert (out / "evaluation.json").is_file()


def test_batchpilot_rl_train_refuses_bad_options(capsys):
    from batchpilot.cli import main

    for argv, text in ((["--timesteps", "0"], "--timesteps"), (["--reward-weights", "1,2"], "--reward-weights"),
                       (["--actions", "2"], "--actions"), (["--actions", "0.5,-1"], "--actions"),
                       (["--interval", "0"], "--interval"), (["--first-interval", "0"], "--first-interval")):
        with pytest.raises(SystemExit) as exc:
            main(["rl", "train", *argv])
        assert exc.value.code == 2 and text in capsys.readouterr().err
