"""The exported torch MLP gives the stable-baselines3 policy's deterministic actions and values; files round-trip
(weights_only loadable) and bad files are refused clearly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from batchpilot.controllers.ppo_policy import PolicyMeta, PolicyMLP, load_policy, save_policy

pytest.importorskip("stable_baselines3")
from _rl_helpers import PickTheSign  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402

from batchpilot.rl.export import export_policy  # noqa: E402

NAMES = ("a", "b", "c")


def sb3_model(seed: int = 0, **policy_kwargs) -> PPO:
    model = PPO("MlpPolicy", PickTheSign(), n_steps=64, batch_size=64, n_epochs=1, seed=seed, device="cpu",
                policy_kwargs=policy_kwargs or None)
    model.learn(128)  # a few updates, so the weights are not the initial ones
    return model


def export(model):
    return export_policy(model, features=NAMES, feature_low=[-1] * 3, feature_high=[1] * 3, actions=(0.5, 1, 2),
                         training={"note": "test"})


@pytest.mark.parametrize("kwargs", [{}, {"net_arch": [16, 8], "activation_fn": torch.nn.ReLU}])
def test_exported_mlp_gives_the_same_actions_and_values_as_sb3(kwargs):
    model = sb3_model(**kwargs)
    mlp, meta = export(model)
    obs = np.random.default_rng(0).uniform(-3, 3, (5000, 3)).astype(np.float32)
    sb3_actions, _ = model.predict(obs, deterministic=True)
    ours = mlp.act(torch.as_tensor(obs)).numpy()
    assert (ours == sb3_actions).all()
    assert len(set(sb3_actions.tolist())) > 1  # the comparison covers more than one action
    with torch.no_grad():
        sb3_values = model.policy.predict_values(torch.as_tensor(obs)).squeeze(-1)
        dist = model.policy.get_distribution(torch.as_tensor(obs))
        logits, values = mlp(torch.as_tensor(obs))
    torch.testing.assert_close(values, sb3_values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.log_softmax(logits, -1), dist.distribution.logits, rtol=1e-5, atol=1e-5)
    assert meta.hidden == tuple(kwargs.get("net_arch", (64, 64)))


def test_policy_files_round_trip_and_load_with_weights_only(tmp_path):
    mlp, meta = export(sb3_model())
    path = save_policy(mlp, meta, tmp_path / "p.pt")
    weights = torch.load(path, weights_only=True)
    assert set(weights) == set(mlp.state_dict())
    again, meta2 = load_policy(path)
    assert meta2 == meta
    x = torch.randn(100, 3)
    torch.testing.assert_close(again(x)[0], mlp(x)[0], rtol=0, atol=0)
    assert json.loads((tmp_path / "p.json").read_text())["training"] == {"note": "test"}


def test_bad_policies_and_files_are_refused(tmp_path):
    model = sb3_model()
    with pytest.raises(ValueError, match="3 actions"):
        export_policy(model, features=NAMES, feature_low=[0] * 3, feature_high=[1] * 3, actions=(0.5, 2))
    with pytest.raises(ValueError, match="not a stable-baselines3"):
        export_policy(object(), features=NAMES, feature_low=[0] * 3, feature_high=[1] * 3, actions=(0.5, 1, 2))
    with pytest.raises(ValueError, match="training range"):
        PolicyMeta(features=NAMES, feature_low=(0,), feature_high=(1, 1, 1), actions=(0.5, 1, 2))
    mlp, meta = export(model)
    with pytest.raises(ValueError, match="end in .pt"):
        save_policy(mlp, meta, tmp_path / "p.pth")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_policy(tmp_path / "missing.pt")
    save_policy(mlp, meta, tmp_path / "p.pt")
    (tmp_path / "p.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a policy's weights"):
        load_policy(tmp_path / "p.pt")
    torch.save(PolicyMLP(3, 3, (5,)).state_dict(), tmp_path / "p.pt")
    with pytest.raises(ValueError, match="do not fit"):
        load_policy(tmp_path / "p.pt")
    (tmp_path / "p.json").write_text("{}")
    with pytest.raises(ValueError, match="format"):
        load_policy(tmp_path / "p.pt")
