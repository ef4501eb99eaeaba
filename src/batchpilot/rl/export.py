"""A stable-baselines3 PPO policy -> the plain torch :class:`~batchpilot.controllers.ppo_policy.PolicyMLP`
(SB3 docs, "Exporting models": the actor-critic's weights, loaded into a network that needs torch only).

SB3's ``MlpPolicy`` for a flat ``Box`` observation and a ``Discrete`` action is: the observation as it is
(``FlattenExtractor``), a policy MLP and a value MLP (``mlp_extractor.policy_net`` / ``value_net``), then linear heads
(``action_net``: one logit per action; ``value_net``: the value). :func:`export_policy` copies those weights one to
one; its deterministic action is the largest logit, as SB3's ``predict(deterministic=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..controllers.ppo_policy import ACTIVATIONS, PolicyMeta, PolicyMLP, load_policy, save_policy

__all__ = ["export_policy", "load_policy", "save_policy"]

_PREFIXES = (("mlp_extractor.policy_net.", "policy_net."), ("mlp_extractor.value_net.", "value_net."),
             ("action_net.", "action_head."), ("value_net.", "value_head."))


def _activation_name(fn: Any) -> str:
    for name, cls in ACTIVATIONS.items():
        if fn is cls:
            return name
    raise ValueError(f"export_policy: activation {fn!r} is not supported; train with activation_fn in "
                     f"{[c.__name__ for c in ACTIVATIONS.values()]}.")


def export_policy(
    model: Any,
    *,
    features: Sequence[str],
    feature_low: Sequence[float],
    feature_high: Sequence[float],
    actions: Sequence[float],
    training: Mapping[str, Any] | None = None,
) -> tuple[PolicyMLP, PolicyMeta]:
    """Copy a trained SB3 ``PPO`` (or its ``.policy``) into a :class:`PolicyMLP` with its metadata.

    Args:
        model: ``stable_baselines3.PPO`` or its ``ActorCriticPolicy``, trained on a flat ``Box`` observation of
            ``len(features)`` entries and a ``Discrete(len(actions))`` action, without observation normalisation.
        features, feature_low, feature_high: The feature names and each one's range seen in training.
        actions: What each action multiplies the batch by.
        training: How it was trained (stored in the metadata).

    Raises:
        ValueError: the policy is not an MLP actor-critic of that shape.
    """
    policy = getattr(model, "policy", model)
    if not isinstance(policy, nn.Module) or not hasattr(policy, "mlp_extractor"):
        raise ValueError(f"export_policy: {type(model).__name__} is not a stable-baselines3 PPO or ActorCriticPolicy.")
    n_actions = getattr(getattr(policy, "action_space", None), "n", None)
    if n_actions is None:
        raise ValueError("export_policy: the policy's action space is not Discrete; only discrete batch actions export.")
    if int(n_actions) != len(actions):
        raise ValueError(f"export_policy: the policy has {n_actions} actions, the action table {len(actions)}.")
    arch: Any = getattr(policy, "net_arch", None)
    if arch is None:
        raise ValueError("export_policy: the policy has no net_arch; only SB3's MlpPolicy exports.")
    if isinstance(arch, dict):
        pi, vf = list(arch.get("pi", [])), list(arch.get("vf", []))
    else:
        pi = vf = list(arch)
    if pi != vf or not pi:
        raise ValueError(f"export_policy: policy and value networks must have the same non-empty widths, got pi={pi}, "
                         f"vf={vf}.")
    meta = PolicyMeta(features=tuple(features), feature_low=tuple(float(v) for v in feature_low),
                      feature_high=tuple(float(v) for v in feature_high), actions=tuple(float(a) for a in actions),
                      hidden=tuple(int(h) for h in pi), activation=_activation_name(policy.activation_fn),
                      training=dict(training or {}))
    mlp = PolicyMLP(len(meta.features), len(meta.actions), meta.hidden, meta.activation)
    state: dict[str, torch.Tensor] = {}
    for key, value in policy.state_dict().items():
        for old, new in _PREFIXES:
            if key.startswith(old):
                state[new + key[len(old):]] = value.detach().to("cpu", torch.float32).clone()
                break
    try:
        mlp.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"export_policy: the SB3 weights do not fit a {meta.hidden} MLP over {len(features)} features "
                         f"({exc}).") from None
    mlp.eval()
    return mlp, meta
