"""``batchpilot rl train``: train the PPO batch-size policy in the simulator and export it (docs/ppo.md).

    batchpilot rl train --timesteps 200000 --seed 0 --out policy/

writes ``OUT/ppo_default.pt`` and ``OUT/ppo_default.json`` (the files the package ships in
``batchpilot/controllers/policies/``; the metadata records how they were made and the held-out evaluation) and
``OUT/evaluation.json`` (one row per held-out simulated episode). Needs the optional extra ``rl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_rl_parser", "train_and_save"]

POLICY_NAME = "ppo_default.pt"
REWARD_WEIGHTS = (0.0, 1.0, 0.0)
"""``(w_acc, w_time, w_util)`` of the shipped policy's training: the time term alone. Seed 000's (0.6, 0.3, 0.1)
trained a policy 1.6x slower than the oracle against 1.2x: discounted per decision, the accuracy term pays for
reaching the target in fewer *decisions*, i.e. larger batches, whatever the time (docs/ppo.md)."""
ACTIONS = (0.25, 0.5, 1.0, 2.0, 4.0)
"""The shipped policy's action factors (``batchpilot.sim.env.WIDE_ACTIONS``)."""
INTERVAL, FIRST_INTERVAL = 10, 10
"""The shipped policy's decision schedule: a decision every 10 steps (docs/ppo.md)."""


def _say(enabled: bool, text: str) -> None:
    if enabled:
        print(text, file=sys.stderr, flush=True)


def _jsonable(value: Any) -> Any:
    """``inf``/``nan`` as strings (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def train_and_save(timesteps: int, seed: int, out: str | Path, *, n_envs: int = 8, eval_episodes: int = 20,
                   threads: int = 1, reward_weights: tuple[float, float, float] = REWARD_WEIGHTS,
                   actions: tuple[float, ...] = ACTIONS, interval: int = INTERVAL,
                   first_interval: int | None = FIRST_INTERVAL, bisect: bool = True, progress: bool = True,
                   **train_kw: Any) -> dict[str, Any]:
    """Train (:func:`batchpilot.rl.train.train_policy` with the environment's ``reward_weights``), evaluate on
    ``eval_episodes`` held-out simulated jobs (:func:`batchpilot.rl.evaluate.evaluate_policy`; 0: skip) and write
    the files; return the evaluation (``{}`` when skipped). ``actions``, ``interval`` and ``first_interval`` set the
    environment's action set and decision schedule; they go in the policy's metadata, with ``bisect`` (the
    controller damps the policy's reversals, :class:`~batchpilot.controllers.ppo.PPOController`), which the
    evaluation uses too."""
    import torch

    from ..controllers.ppo_policy import save_policy
    from ..rl.evaluate import evaluate_policy, format_evaluation
    from ..rl.train import train_policy

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda text: _say(True, text)) if progress else None
    _say(progress, f"training PPO: {timesteps} decisions, seed {seed}, {n_envs} environments, {threads} thread(s)")
    env_kwargs = {**train_kw.pop("env_kwargs", {}), "reward_weights": tuple(reward_weights),
                  "actions": tuple(actions), "interval": interval, "first_interval": first_interval}
    result = train_policy(timesteps, seed, n_envs, threads=threads, progress=say, env_kwargs=env_kwargs, **train_kw)
    _say(progress, f"trained in {result.seconds:.0f} s")
    evaluation: dict[str, Any] = {}
    training = dict(result.meta.training)
    trained = dataclasses.replace(result.meta, bisect=bisect)
    weights = ",".join(f"{w:g}" for w in reward_weights)
    training.update(command=f"batchpilot rl train --timesteps {timesteps} --seed {seed} --n-envs {n_envs} "
                    f"--threads {threads} --eval-episodes {eval_episodes} --reward-weights {weights} "
                    f"--actions {','.join(f'{a:g}' for a in actions)} --interval {interval} --first-interval "
                    f"{interval if first_interval is None else first_interval}" + ("" if bisect else " --no-bisect"),
                    machine=f"{platform.machine()} {platform.system()}, torch {torch.__version__}",
                    date=time.strftime("%Y-%m-%d", time.gmtime()))
    if eval_episodes > 0:
        _say(progress, f"evaluating on {eval_episodes} held-out simulated episodes")
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            evaluation = evaluate_policy((result.policy, trained), n=eval_episodes, progress=say)
        finally:
            torch.set_num_threads(previous)
        training["evaluation"] = _jsonable(evaluation["summary"])
        (out / "evaluation.json").write_text(json.dumps(_jsonable(evaluation), indent=1) + "\n", encoding="utf-8")
        print(format_evaluation(evaluation))
    meta = dataclasses.replace(trained, training=training)
    path = save_policy(result.policy, meta, out / POLICY_NAME)
    print(f"policy: {path} (metadata {path.with_suffix('.json')})")
    return evaluation


def add_rl_parser(sub: Any) -> None:
    """Register ``batchpilot rl train`` on the subparsers ``sub`` of the main parser."""
    rl = sub.add_parser("rl", help="train the PPO batch-size policy in the simulator",
                        description="Reinforcement learning of the batch size (docs/ppo.md).")
    rl_sub = rl.add_subparsers(dest="rl_command", metavar="ACTION")
    rl_sub.required = True
    p = rl_sub.add_parser("train", help="train PPO in the simulator and export the policy",
                          description="Train PPO (stable-baselines3) on batchpilot.sim.env.BatchSizeEnv over the "
                          "shipped traces and random clusters, evaluate it on held-out simulated jobs against the "
                          "goodput oracle, Goodput and the best static batch, and write OUT/ppo_default.pt + .json "
                          "(what PPOController(policy=...) loads) and OUT/evaluation.json.")
    p.add_argument("--timesteps", type=int, default=200_000, help="decisions to train on. Default: 200000.")
    p.add_argument("--seed", type=int, default=0, help="seed of PPO and the environments. Default: 0.")
    p.add_argument("--out", default="ppo-policy", help="output folder. Default: ./ppo-policy.")
    p.add_argument("--n-envs", type=int, default=8, help="parallel environments (one process). Default: 8.")
    p.add_argument("--eval-episodes", type=int, default=20,
                   help="held-out simulated episodes to evaluate on (0: skip). Default: 20.")
    p.add_argument("--threads", type=int, default=1, help="torch threads. Default: 1.")
    default = ",".join(f"{w:g}" for w in REWARD_WEIGHTS)
    p.add_argument("--reward-weights", default=default,
                   help=f"w_acc,w_time,w_util of the environment's reward (docs/simulator.md). Default: {default}.")
    acts = ",".join(f"{a:g}" for a in ACTIONS)
    p.add_argument("--actions", default=acts, help=f"the factors the actions multiply the batch by. Default: {acts}.")
    p.add_argument("--interval", type=int, default=INTERVAL, help=f"steps between decisions. Default: {INTERVAL}.")
    p.add_argument("--first-interval", type=int, default=FIRST_INTERVAL,
                   help=f"steps before the first decision. Default: {FIRST_INTERVAL}.")
    p.add_argument("--no-bisect", dest="bisect", action="store_false",
                   help="do not damp the policy's reversals (PPOController's bisect, recorded in the metadata).")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="print only the results.")
    p.set_defaults(run=_run, subparser=p)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    for name, value, low in (("--timesteps", args.timesteps, 1), ("--n-envs", args.n_envs, 1),
                             ("--eval-episodes", args.eval_episodes, 0), ("--threads", args.threads, 1),
                             ("--seed", args.seed, 0), ("--interval", args.interval, 1),
                             ("--first-interval", args.first_interval, 1)):
        if value < low:
            parser.error(f"{name} must be a whole number >= {low}, got {value}.")
    try:
        weights = tuple(float(w) for w in args.reward_weights.split(","))
    except ValueError:
        weights = ()
    if len(weights) != 3 or not all(math.isfinite(w) for w in weights):
        parser.error(f"--reward-weights {args.reward_weights!r} must be three numbers w_acc,w_time,w_util, e.g. "
                     "0.6,0.3,0.1.")
    try:
        actions = tuple(float(a) for a in args.actions.split(","))
    except ValueError:
        actions = ()
    if len(actions) < 2 or not all(math.isfinite(a) and a > 0 for a in actions):
        parser.error(f"--actions {args.actions!r} must be two or more positive factors, e.g. 0.5,1,2.")
    try:
        train_and_save(args.timesteps, args.seed, args.out, n_envs=args.n_envs, eval_episodes=args.eval_episodes,
                       threads=args.threads, reward_weights=weights, actions=actions, interval=args.interval,
                       first_interval=args.first_interval, bisect=args.bisect, progress=args.progress)
    except ImportError as exc:
        parser.exit(2, f"batchpilot rl train: error: {exc}\n")
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    except OSError as exc:
        parser.exit(2, f"batchpilot rl train: error: {exc}\n")
    return 0
