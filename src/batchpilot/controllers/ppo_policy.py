"""The PPO batch-size policy as a plain torch MLP: what :class:`~batchpilot.controllers.ppo.PPOController` runs.

A policy is two files side by side: ``NAME.pt`` (the weights, a dict of tensors that ``torch.load(...,
weights_only=True)`` reads) and ``NAME.json`` (its metadata: the feature names in order, each feature's range
seen in training, the action table, the network's shape and how it was trained). Stable-baselines3 is needed to
*train* one (:mod:`batchpilot.rl`), never to run one: :class:`PolicyMLP` rebuilds the actor-critic of SB3's
``MlpPolicy`` (separate policy and value networks, Raffin et al. 2021) from the weights alone.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["PolicyMLP", "PolicyMeta", "SHIPPED_POLICY", "load_policy", "save_policy", "weights_digest"]

SHIPPED_POLICY = Path(__file__).parent / "policies" / "ppo_default.pt"
"""The policy shipped in the package (trained by ``batchpilot rl train``, see docs/ppo.md)."""
FORMAT = "batchpilot-ppo-policy"
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


@dataclass(frozen=True)
class PolicyMeta:
    """What a policy file says about itself (its ``.json``).

    Attributes:
        features: Names of the observation entries, in order (``batchpilot.controllers.ppo_features.FEATURES``
            when it was trained).
        feature_low, feature_high: Per feature, the smallest and largest value seen in training (the
            out-of-distribution test of :class:`~batchpilot.controllers.ppo.PPOController` widens them).
        actions: What each discrete action multiplies the global batch by.
        hidden: Widths of the hidden layers (the same for the policy and the value network).
        activation: ``"tanh"`` (SB3's default) or ``"relu"``.
        training: How it was trained (settings, time, evaluation); free-form, JSON-able.
        interval: Steps between two decisions in training (the controller's default).
        first_interval: Steps before the first decision (``None``: ``interval``). A policy file without these two
            fields (the first shipped policy) decided every 50 steps.
        bisect: The controller damps the policy's reversals by default (``PPOController(bisect=...)``); ``False``
            for files without the field.
    """

    features: tuple[str, ...]
    feature_low: tuple[float, ...]
    feature_high: tuple[float, ...]
    actions: tuple[float, ...]
    hidden: tuple[int, ...] = (64, 64)
    activation: str = "tanh"
    training: Mapping[str, Any] = field(default_factory=dict)
    interval: int = 50
    first_interval: int | None = None
    bisect: bool = False

    def __post_init__(self) -> None:
        n = len(self.features)
        if n == 0 or len(self.feature_low) != n or len(self.feature_high) != n:
            raise ValueError(f"policy metadata: {n} features but {len(self.feature_low)} lows and "
                             f"{len(self.feature_high)} highs; each feature needs one training range.")
        if any(not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi)
               for lo, hi in zip(self.feature_low, self.feature_high)):
            raise ValueError("policy metadata: every feature range must be finite with low <= high.")
        if len(self.actions) < 2 or any(not (math.isfinite(a) and a > 0) for a in self.actions):
            raise ValueError(f"policy metadata: actions {self.actions!r} must be >= 2 positive factors, e.g. (0.5, 1, 2).")
        for name, value in (("interval", self.interval), ("first_interval", self.first_interval)):
            if not (value is None and name == "first_interval") and (isinstance(value, bool) or not isinstance(
                    value, int) or value < 1):
                raise ValueError(f"policy metadata: {name} must be a whole number of steps >= 1, got {value!r}.")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"policy metadata: activation {self.activation!r} is not one of {sorted(ACTIVATIONS)}.")

    @property
    def schedule(self) -> tuple[int, int]:
        """``(first_interval, interval)``: the steps before the first decision and between two decisions."""
        return (self.interval if self.first_interval is None else self.first_interval), self.interval

    def to_json(self) -> dict[str, Any]:
        """JSON-able form (what the ``.json`` file holds, with a format tag)."""
        out = asdict(self)
        out["training"] = dict(self.training)
        return {"format": FORMAT, "version": 1, **out}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PolicyMeta:
        """The inverse of :meth:`to_json`.

        Raises:
            ValueError: not a batchpilot PPO policy's metadata, or a field is missing.
        """
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ValueError(f"not a batchpilot PPO policy's metadata (no \"format\": \"{FORMAT}\"); pass the .json "
                             "written by batchpilot.rl.export.save_policy or `batchpilot rl train`.")
        try:
            return cls(features=tuple(str(f) for f in data["features"]),
                       feature_low=tuple(float(v) for v in data["feature_low"]),
                       feature_high=tuple(float(v) for v in data["feature_high"]),
                       actions=tuple(float(a) for a in data["actions"]),
                       hidden=tuple(int(h) for h in data["hidden"]), activation=str(data["activation"]),
                       training=dict(data.get("training", {})), interval=int(data.get("interval", 50)),
                       first_interval=None if data.get("first_interval") is None else int(data["first_interval"]),
                       bisect=bool(data.get("bisect", False)))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"policy metadata is missing or mangles a field ({type(exc).__name__}: {exc}).") from None


class PolicyMLP(nn.Module):
    """SB3's ``MlpPolicy`` actor-critic for a discrete action, in plain torch.

    ``forward(x)`` returns ``(logits, value)``: the policy network (``hidden`` layers with ``activation``) then a
    linear head to one logit per action, and a separate value network of the same shape to one number.
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: Sequence[int] = (64, 64), activation: str = "tanh") -> None:
        super().__init__()
        if obs_dim < 1 or n_actions < 2 or not hidden or any(h < 1 for h in hidden):
            raise ValueError(f"PolicyMLP needs obs_dim >= 1, n_actions >= 2 and hidden widths >= 1; got {obs_dim}, "
                             f"{n_actions}, {tuple(hidden)}.")
        act = ACTIVATIONS[activation]

        def trunk() -> nn.Sequential:
            layers: list[nn.Module] = []
            width = obs_dim
            for h in hidden:
                layers += [nn.Linear(width, h), act()]
                width = h
            return nn.Sequential(*layers)

        self.policy_net, self.value_net = trunk(), trunk()
        self.action_head = nn.Linear(hidden[-1], n_actions)
        self.value_head = nn.Linear(hidden[-1], 1)

    @property
    def obs_dim(self) -> int:
        first = self.policy_net[0]
        assert isinstance(first, nn.Linear)
        return first.in_features

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [..., n_actions], value [...])`` for observations ``x [..., obs_dim]``."""
        return self.action_head(self.policy_net(x)), self.value_head(self.value_net(x)).squeeze(-1)

    @torch.no_grad()
    def act(self, x: torch.Tensor) -> torch.Tensor:
        """The deterministic action: the index of the largest logit (SB3's ``predict(deterministic=True)``)."""
        return self.forward(x)[0].argmax(dim=-1)


def weights_digest(policy: nn.Module) -> str:
    """SHA-256 (first 16 hex digits) of the weights, in state-dict order: identifies a policy in a state dict."""
    h = hashlib.sha256()
    for name, tensor in policy.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().to(torch.float64).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


def save_policy(policy: PolicyMLP, meta: PolicyMeta, path: str | Path) -> Path:
    """Write ``path`` (``.pt``: the weights) and the metadata beside it (same name, ``.json``); return ``path``.

    Raises:
        ValueError: ``path`` does not end in ``.pt``, or the metadata does not fit the network.
    """
    path = Path(path)
    if path.suffix != ".pt":
        raise ValueError(f"save_policy: {str(path)!r} must end in .pt (the metadata goes beside it as .json).")
    n_actions = policy.action_head.out_features
    hidden = tuple(m.out_features for m in policy.policy_net if isinstance(m, nn.Linear))
    if policy.obs_dim != len(meta.features) or n_actions != len(meta.actions) or hidden != tuple(meta.hidden):
        raise ValueError(f"save_policy: the network takes {policy.obs_dim} features, has {n_actions} actions and hidden "
                         f"widths {hidden}; the metadata lists {len(meta.features)} features, {len(meta.actions)} "
                         f"actions and {tuple(meta.hidden)}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in policy.state_dict().items()}, path)
    _meta_path(path).write_text(json.dumps(meta.to_json(), indent=1) + "\n", encoding="utf-8")
    return path


def load_policy(path: str | Path | None = None) -> tuple[PolicyMLP, PolicyMeta]:
    """Read a policy written by :func:`save_policy` (``None``: the shipped one), with torch only.

    Raises:
        FileNotFoundError: the ``.pt`` or its ``.json`` is missing.
        ValueError: the files are not a batchpilot PPO policy, or the weights do not fit the metadata.
    """
    path = SHIPPED_POLICY if path is None else Path(path)
    meta_path = _meta_path(path)
    for p in (path, meta_path):
        if not p.is_file():
            raise FileNotFoundError(f"PPO policy file {str(p)!r} not found; pass the .pt written by `batchpilot rl "
                                    "train --out DIR` (its .json must lie beside it), or policy=None for the shipped one.")
    try:
        meta = PolicyMeta.from_json(json.loads(meta_path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(meta_path)!r} is not JSON ({exc}).") from None
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a damaged or foreign file
        raise ValueError(f"{str(path)!r} is not a policy's weights ({type(exc).__name__}: {exc}).") from None
    if not isinstance(weights, dict):
        raise ValueError(f"{str(path)!r} holds a {type(weights).__name__}, not a dict of weights.")
    policy = PolicyMLP(len(meta.features), len(meta.actions), meta.hidden, meta.activation)
    try:
        policy.load_state_dict(weights)
    except RuntimeError as exc:
        raise ValueError(f"{str(path)!r}: the weights do not fit the network its .json describes ({exc}).") from None
    policy.eval()
    return policy, meta
