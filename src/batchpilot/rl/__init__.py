"""Training the PPO batch-size policy in the simulator (stable-baselines3, the optional extra ``rl``) and exporting
it to the plain torch MLP that :class:`~batchpilot.controllers.ppo.PPOController` runs. ``import batchpilot`` does not
import this package, and importing it does not import stable-baselines3 or gymnasium: the functions that need them
import them when called (docs/ppo.md)."""

from .evaluate import evaluate_policy, format_evaluation
from .export import export_policy, load_policy, save_policy
from .gae import gae
from .train import TrainResult, cosine_schedule, make_env_fns, train_policy

__all__ = [
    "TrainResult",
    "cosine_schedule",
    "evaluate_policy",
    "export_policy",
    "format_evaluation",
    "gae",
    "load_policy",
    "make_env_fns",
    "save_policy",
    "train_policy",
]
