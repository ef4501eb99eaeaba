"""BatchSizeEnv (sim/env.py): gymnasium's checker, determinism by seed, the actions, the reward terms and their
documented sums, held-out cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _sim_cases import make_trace

pytest.importorskip("gymnasium")

from gymnasium.utils.env_checker import check_env  # noqa: E402

from batchpilot.controllers.ppo_features import FEATURES, features  # noqa: E402
from batchpilot.sim.cluster import ClusterSpec  # noqa: E402
from batchpilot.sim.env import ACTIONS, WIDE_ACTIONS, BatchSizeEnv, Case, held_out_cases, random_cluster  # noqa: E402

TRACES = [make_trace(phi=(200.0, 20000.0), a=0.02, b=2e-4, target_progress=1e6),
          make_trace(phi=(50.0, 5000.0), a=0.05, b=1e-4, target_progress=5e5, base=32, workload="other")]


def rollout(env: BatchSizeEnv, seed: int, actions: list[int]) -> list[tuple]:
    out = []
    obs, _ = env.reset(seed=seed)
    out.append(obs.tolist())
    for a in actions:
        obs, reward, terminated, truncated, _ = env.step(a)
        out.append((obs.tolist(), reward, terminated, truncated))
        if terminated or truncated:
            obs, _ = env.reset()
            out.append(obs.tolist())
    return out


def test_the_environment_passes_gymnasium_s_checker():
    check_env(BatchSizeEnv(TRACES, seed=0), skip_render_check=True)
    check_env(BatchSizeEnv(TRACES, ["cpu", "gpus=8,speedup=10"], randomise=False), skip_render_check=True)


def test_it_is_deterministic_given_a_seed():
    actions = list(np.random.default_rng(0).integers(0, 3, 300))
    first = rollout(BatchSizeEnv(TRACES), 7, actions)
    assert first == rollout(BatchSizeEnv(TRACES), 7, actions)
    assert first != rollout(BatchSizeEnv(TRACES), 8, actions)
    seeded = BatchSizeEnv(TRACES, seed=7)  # the constructor's seed stands for the first reset's
    obs, _ = seeded.reset()
    assert obs.tolist() == first[0]


def test_actions_multiply_the_batch_and_the_bounds_clamp_it():
    env = BatchSizeEnv(TRACES, ["cpu"], randomise=False, min_size=32, max_size=256)
    env.reset(seed=0)
    assert env.job.batch_size == 64
    sizes = [env.step(a)[4]["batch_size"] for a in (2, 2, 2, 1, 0, 0, 0, 0)]
    assert sizes == [128, 256, 256, 256, 128, 64, 32, 32]
    assert ACTIONS == (0.5, 1.0, 2.0)
    with pytest.raises(ValueError, match="action"):
        env.step(3)
    with pytest.raises(RuntimeError, match="reset"):
        BatchSizeEnv(TRACES).step(1)


def test_the_action_set_and_the_first_interval_are_the_environment_s():
    assert WIDE_ACTIONS == (0.25, 0.5, 1.0, 2.0, 4.0)
    env = BatchSizeEnv(TRACES, ["cpu"], randomise=False, min_size=32, max_size=4096,
                       actions=(0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0), interval=20, first_interval=10)
    env.reset(seed=0)
    assert env.job.steps == 10 and env.action_space.n == 7
    info = env.step(6)[4]  # x8
    assert info["batch_size"] == 512 and env.job.steps == 30
    assert env.step(0)[4]["batch_size"] == 64 and env.job.steps == 50
    with pytest.raises(ValueError, match="index 0..6"):
        env.step(7)
    for bad in ({"actions": (2.0,)}, {"actions": (0.5, -1.0)}, {"first_interval": 0}):
        with pytest.raises(ValueError, match="actions|first_interval"):
            BatchSizeEnv(TRACES, **bad)


def test_the_observation_is_the_feature_vector_of_the_simulated_observation():
    env = BatchSizeEnv(TRACES, ["gpus=4,load=0.2"], randomise=False)
    obs, info = env.reset(seed=0)
    assert obs.shape == (len(FEATURES),) and env.observation_space.contains(obs)
    np.testing.assert_array_equal(obs, features(env.job.observe(), 32, 4096))
    assert obs[FEATURES.index("world")] == pytest.approx(2 / 6)
    assert obs[FEATURES.index("util")] == pytest.approx(env.job.history[-1]["utilization"], rel=1e-6)


@pytest.mark.parametrize("policy", ["static", "greedy"])
def test_the_reward_terms_sum_as_documented(policy):
    """Per docs/simulator.md: sum(acc) = (metric at the end - at the start) / (target - at the start) (about 1);
    sum(time) = 1 - T / T_ref with T the time to target and T_ref the reference static batch's (``t_ref``'s
    increments telescope); sum(util) = sum(u dt) / T_ref; each reward is 0.6 acc + 0.3 time + 0.1 util. A static run
    at the reference size on a quiet cluster takes T_ref itself, so its time terms sum to 0."""
    trace = TRACES[0]
    env = BatchSizeEnv([trace], ["cpu"], randomise=False)
    obs, info = env.reset(seed=0)
    m_start = float(np.interp(0.0, trace.progress, trace.metric_values))
    sums = dict(info["terms"])
    total_reward = 0.6 * sums["acc"] + 0.3 * sums["time"] + 0.1 * sums["util"]
    util_seconds = info["terms"]["util"] * env.reference_time_s
    done = False
    while not done:
        up, down = obs[FEATURES.index("gain_up")], obs[FEATURES.index("gain_down")]
        action = 1 if policy == "static" else 2 if up > 0.05 else 0 if down > 0.05 else 1  # greedy on the features
        obs, reward, terminated, truncated, info = env.step(action)
        assert reward == pytest.approx(0.6 * info["terms"]["acc"] + 0.3 * info["terms"]["time"]
                                       + 0.1 * info["terms"]["util"], rel=1e-12)
        for key in sums:
            sums[key] += info["terms"][key]
        total_reward += reward
        util_seconds += info["terms"]["util"] * env.reference_time_s
        done = terminated or truncated
    assert terminated and not truncated
    job, t_ref = env.job, info["reference_time_s"]
    assert sums["acc"] == pytest.approx((job.metric - m_start) / (trace.target - m_start), rel=1e-9)
    assert sums["acc"] == pytest.approx(1.0, abs=0.01)
    assert sums["time"] == pytest.approx(1 - info["time_to_target_s"] / t_ref, abs=1e-9)
    assert util_seconds == pytest.approx(sum(h["utilization"] * (min(h["time_s"], job.time_to_target_s) - prev)
                                             for h, prev in zip(job.history, [0.0] + [h["time_s"] for h in job.history])),
                                         rel=1e-9)
    if policy == "static":
        assert sums["time"] == pytest.approx(0.0, abs=1e-4)
    else:
        assert sums["time"] > 0.05  # following the goodput gains beats the reference static 64
    assert math.isfinite(total_reward)


def test_held_out_cases_are_fixed_and_differ_from_training_episodes():
    cases = held_out_cases(TRACES, n=6)
    again = held_out_cases(TRACES, n=6)
    assert [(c.spec, c.seed, c.start_size) for c in cases] == [(c.spec, c.seed, c.start_size) for c in again]
    assert all(a.trace == b.trace for a, b in zip(cases, again))
    assert all(c.start_size == c.trace.base_batch_size for c in cases)
    env = BatchSizeEnv(cases=cases)
    seen = []
    for _ in range(7):
        env.reset()
        seen.append(env.case)
    assert seen[:6] == cases and seen[6] is cases[0]
    training = BatchSizeEnv(TRACES)
    training.reset(seed=0)
    assert all(training.case.seed != c.seed for c in cases)


def test_random_clusters_span_the_documented_ranges():
    rng = np.random.default_rng(0)
    specs = [random_cluster(rng) for _ in range(300)]
    sizes = [s.size for s in specs]
    assert min(sizes) == 1 and max(sizes) == 64
    assert any(len({d.speed for d in s.devices}) > 1 for s in specs) and any(s.failure_rate_per_hour > 0 for s in specs)
    assert all(0 <= s.network.load_mean <= 0.5 and 1 <= s.speedup <= 100 for s in specs)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="interval"):
        BatchSizeEnv(TRACES, interval=0)
    with pytest.raises(ValueError, match="min_size"):
        BatchSizeEnv(TRACES, min_size=64, max_size=32)
    with pytest.raises(ValueError, match="reward_weights"):
        BatchSizeEnv(TRACES, reward_weights=(1.0, 2.0))
    with pytest.raises(ValueError, match="Trace"):
        BatchSizeEnv(["not a trace"])
    assert isinstance(Case(TRACES[0], ClusterSpec(), 64, 0), Case)


def test_a_hopeless_episode_is_truncated_not_terminated():
    env = BatchSizeEnv(TRACES, ["cpu"], randomise=False, time_limit_factor=0.05)
    env.reset(seed=0)
    steps, done = 0, False
    while not done:
        _, _, terminated, truncated, info = env.step(0)
        steps += 1
        done = terminated or truncated
    assert truncated and not terminated and info["time_to_target_s"] == float("inf") and steps < 200
    with pytest.raises(ValueError, match="time_limit_factor"):
        BatchSizeEnv(TRACES, time_limit_factor=0)


def test_a_job_that_ends_before_the_first_decision_is_drawn_again_or_ends_at_the_first_step():
    short = make_trace(a=1e-3, b=1e-4, target_progress=2e4, base=32)  # 50 steps at 4096 overshoot it tenfold
    env = BatchSizeEnv([short], seed=0)
    for _ in range(100):
        env.reset()
        assert not env.job.done
    fixed = BatchSizeEnv([short], ["cpu"], randomise=False, min_size=1024)  # starts at 1024: done at once
    obs, info = fixed.reset(seed=0)
    assert fixed.job.done and info["terms"]["acc"] > 0.9
    obs, reward, terminated, truncated, info = fixed.step(1)
    assert terminated and not truncated and reward == 0.0 and info["terms"] == {"acc": 0.0, "time": 0.0, "util": 0.0}
