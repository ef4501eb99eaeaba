"""PPOController: the shipped policy loads with torch only, decisions follow the policy and clamp, the Goodput
fallback fires out of distribution, the state round-trips exactly (refined weights and RNG included), refinement
changes weights only when on, and under 2 gloo ranks inside a Pilot rank 0 decides for all."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from _ppo_helpers import constant_policy, dist_worker, observation, random_policy

from batchpilot.controllers.goodput import Goodput
from batchpilot.controllers.ppo import PPOController
from batchpilot.controllers.ppo_features import FEATURES, features
from batchpilot.controllers.ppo_policy import SHIPPED_POLICY, PolicyMLP, load_policy, save_policy


def test_the_shipped_policy_loads_with_torch_only_and_describes_its_training():
    code = ("import sys, batchpilot.controllers.ppo as p; c = p.PPOController(); "
            "assert 'stable_baselines3' not in sys.modules and 'gymnasium' not in sys.modules; print(c.meta.features)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    net, meta = load_policy()
    assert meta.features == FEATURES and meta.actions == (0.25, 0.5, 1.0, 2.0, 4.0)
    assert (meta.first_interval, meta.interval, meta.bisect) == (10, 10, True)
    c = PPOController()
    assert (c.first_interval, c.interval, c.bisect) == (10, 10, True)  # the controller reads its schedule there
    assert "--actions 0.25,0.5,1,2,4 --interval 10 --first-interval 10" in meta.training["command"]
    training = meta.training
    assert training["gamma"] == 0.99 and training["gae_lambda"] == 0.95 and training["n_epochs"] == 4
    assert training["timesteps"] > 0 and "command" in training and "evaluation" in training
    assert SHIPPED_POLICY.stat().st_size < 200_000  # a small file
    assert torch.load(SHIPPED_POLICY, weights_only=True).keys() == net.state_dict().keys()


def test_the_shipped_policy_decides_in_distribution_on_a_simulated_observation():
    pytest.importorskip("gymnasium")
    from batchpilot.sim.episode import make_job
    from batchpilot.sim.trace import load_trace, shipped_traces

    trace = load_trace(shipped_traces()[0])
    job = make_job(trace, "gpus=8", start_size=trace.base_batch_size)
    job.run(10)
    c = PPOController()
    size = c.decide(job.observe())
    assert c.policy_decisions == 1 and c.fallbacks == 0, c.reason
    assert size in {max(32, round(job.batch_size * f)) for f in c.meta.actions}
    assert "policy chose" in c.reason


@pytest.mark.parametrize("action,size,expected", [(2, 256, 512), (2, 3000, 4096), (0, 256, 128), (0, 40, 32),
                                                  (1, 5000, 4096), (1, 10, 32)])
def test_decisions_follow_the_policy_and_clamp_to_the_bounds(action, size, expected):
    c = PPOController(32, 4096, policy=constant_policy(action), interval=10)
    assert c.decide(observation(10, size)) == expected
    assert c.policy_decisions == 1 and f"x{(0.5, 1, 2)[action]:g}" in c.reason


def test_it_acts_once_per_interval():
    c = PPOController(32, 4096, policy=constant_policy(2), interval=50)
    assert c.decide(observation(10, 256)) == 256  # first period not over yet
    assert c.decide(observation(50, 256)) == 512
    assert c.decide(observation(60, 512)) == 512 and "next decision at step 100" in c.reason
    assert c.decide(observation(100, 512)) == 1024


def test_the_decision_schedule_and_actions_come_from_the_policy_s_metadata():
    import dataclasses

    net, m = constant_policy(2)
    wide = dataclasses.replace(m, interval=20, first_interval=10)
    c = PPOController(32, 4096, policy=(net, wide))
    assert (c.first_interval, c.interval) == (10, 20)
    assert c.decide(observation(5, 64)) == 64  # before the first decision
    assert c.decide(observation(10, 64)) == 128  # first decision after 10 steps
    assert c.decide(observation(20, 128)) == 128 and "next decision at step 30" in c.reason
    assert c.decide(observation(30, 128)) == 256 and c.decide(observation(50, 256)) == 512
    assert PPOController(32, 4096, policy=(net, wide), interval=7).first_interval == 7  # an explicit interval wins
    # Seven actions: index 6 is x8.
    seven = PolicyMLP(len(FEATURES), 7, (4,))
    with torch.no_grad():
        for p in seven.parameters():
            p.zero_()
        seven.action_head.bias[6] = 10.0
    meta7 = dataclasses.replace(m, actions=(0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0), interval=10)
    assert PPOController(32, 4096, policy=(seven, meta7)).decide(observation(10, 64)) == 512


def test_a_policy_file_without_a_schedule_decides_every_50_steps_as_before(tmp_path):
    net, m = constant_policy(2)
    path = save_policy(net, m, tmp_path / "old.pt")
    data = json.loads(path.with_suffix(".json").read_text())
    del data["interval"], data["first_interval"]  # what the first shipped policy's file looked like
    path.with_suffix(".json").write_text(json.dumps(data))
    c = PPOController(32, 4096, policy=str(path))
    assert (c.first_interval, c.interval) == (50, 50) and c.meta.actions == (0.5, 1.0, 2.0)
    assert [c.decide(observation(s, 64)) for s in (10, 49, 50, 99, 100)] == [64, 64, 128, 64, 128]


def _up_below_down_above(middle: float = 0.5):
    """A 5-action policy (x1/4 ... x4) that picks x4 below ``middle`` of the batch's position in the bounds and x1/4
    above it: it alternates around the middle unless damped."""
    import dataclasses

    net, m = constant_policy(2)
    five = PolicyMLP(len(FEATURES), 5, (4,))
    with torch.no_grad():
        for p in five.parameters():
            p.zero_()
        five.policy_net[0].weight[0, FEATURES.index("batch_pos")] = 1.0
        five.policy_net[0].bias[0] = -middle
        five.action_head.weight[4, 0], five.action_head.weight[0, 0] = -100.0, 100.0
    return five, dataclasses.replace(m, actions=(0.25, 0.5, 1.0, 2.0, 4.0))


def _sizes(c: PPOController, start: int, n: int, first_step: int = 1) -> list[int]:
    sizes = [start]
    for step in range(first_step, first_step + n):
        sizes.append(c.decide(observation(step, sizes[-1])))
    return sizes


def test_damping_closes_in_on_the_size_a_policy_alternates_around():
    import math

    net, m = _up_below_down_above()
    plain = _sizes(PPOController(32, 4096, policy=(net, m), interval=1), 64, 12)
    assert plain[:5] == [64, 256, 1024, 256, 1024]  # alternates x4 / x1/4 forever
    damped_c = PPOController(32, 4096, policy=(net, m), interval=1, bisect=True)
    damped = _sizes(damped_c, 64, 40)
    assert damped[:4] == [64, 256, 1024, 512]  # the reversal moves x1/2, not x1/4
    three = PPOController(32, 4096, policy=(net, m), interval=1, bisect=True)
    _sizes(three, 64, 3)
    assert "damped from 256" in three.reason
    middle = math.sqrt(32 * 4096)  # batch_pos = 0.5
    assert all(abs(math.log2(b / middle)) < 0.25 for b in damped[-10:])  # within x1.19 of the middle
    # the state carries the step: a reloaded controller continues identically
    again = PPOController(32, 4096, policy=(net, m), interval=1, bisect=True)
    half = _sizes(again, 64, 20)
    state = again.state_dict()
    fresh = PPOController(32, 4096, policy=(net, m), interval=1, bisect=True)
    fresh.load_state_dict(state)
    assert _sizes(fresh, half[-1], 20, first_step=21)[1:] == damped[21:]
    assert PPOController(32, 4096, policy=(net, m)).bisect is False  # off unless the metadata or the caller says


def test_out_of_distribution_observations_go_to_goodput_and_say_why():
    # The policy saw features only in [0, 1] (widened by 0.25 x 1 + 0.05): a missing noise scale is fine for the
    # flag (1 is in range) but a noise ratio far below is not.
    c = PPOController(32, 4096, policy=constant_policy(2, low=0.0, high=0.0), interval=10)
    obs = observation(10, 256, noise=None)
    x = features(obs, 32, 4096)
    assert x[FEATURES.index("noise_missing")] == 1.0
    size = c.decide(obs)
    assert c.fallbacks == 1 and c.policy_decisions == 0
    assert "out of distribution" in c.reason and "outside its training range" in c.reason and "Goodput" in c.reason
    assert size == Goodput(32, 4096, interval=1).decide(obs)  # Goodput keeps the size without a noise scale
    # In distribution once each feature is inside the widened range: a policy trained on wide ranges acts.
    wide = PPOController(32, 4096, policy=constant_policy(2), interval=10)
    assert wide.decide(obs) == 512 and wide.fallbacks == 0
    assert c.out_of_distribution(x) is not None and wide.out_of_distribution(x) is None


def test_the_fallback_is_goodput_deciding_at_the_controllers_interval():
    c = PPOController(32, 4096, policy=constant_policy(2, low=0.0, high=0.0), interval=10)
    g = Goodput(32, 4096, interval=1)
    for step in (10, 20, 30):
        obs = observation(step, 256, noise=4000.0)
        assert c.decide(obs) == g.decide(obs)
    assert c.fallbacks == 3


def run_sequence(c: PPOController, start: int, stop: int, size: int = 256) -> tuple[list[int], int]:
    out = []
    for step in range(start, stop):
        size = c.decide(observation(step, size, loss=1.0 / (1 + 0.01 * step), throughput=4000 + 37 * (step % 7),
                                    noise=500.0 + 40 * step))
        out.append(size)
    return out, size


@pytest.mark.parametrize("refine", [False, True])
def test_state_round_trips_exactly_through_a_weights_only_checkpoint(refine):
    make = lambda: PPOController(32, 4096, policy=random_policy(), interval=1, refine=refine, refine_every=4,  # noqa: E731
                                 refine_lr=1e-3, seed=3)
    a = make()
    first, size = run_sequence(a, 1, 14)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b = make()
    b.load_state_dict(torch.load(buffer, weights_only=True))
    rest_a, _ = run_sequence(a, 14, 40, size)
    rest_b, _ = run_sequence(b, 14, 40, size)
    assert rest_a == rest_b
    assert (a.fallbacks, a.policy_decisions, a.updates) == (b.fallbacks, b.policy_decisions, b.updates)
    for x, y in zip(a.policy.state_dict().values(), b.policy.state_dict().values()):
        assert torch.equal(x, y)
    if refine:
        assert a.updates >= 5


def test_refinement_changes_the_weights_only_when_on():
    initial = {k: v.clone() for k, v in random_policy()[0].state_dict().items()}
    off = PPOController(32, 4096, policy=random_policy(), interval=1)
    on = PPOController(32, 4096, policy=random_policy(), interval=1, refine=True, refine_every=4, refine_lr=1e-3)
    run_sequence(off, 1, 30)
    run_sequence(on, 1, 30)
    assert off.updates == 0 and all(torch.equal(initial[k], v) for k, v in off.policy.state_dict().items())
    assert on.updates >= 6 and any(not torch.equal(initial[k], v) for k, v in on.policy.state_dict().items())
    net, _ = random_policy()  # the caller's network is never changed in place
    assert all(torch.equal(initial[k], v) for k, v in net.state_dict().items())


def test_bad_arguments_and_states_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="min_size=64 is larger than max_size=32"):
        PPOController(64, 32)
    with pytest.raises(ValueError, match="refine_lr"):
        PPOController(refine_lr=-1.0)
    with pytest.raises(TypeError, match="refine"):
        PPOController(refine="yes")
    with pytest.raises(TypeError, match="policy must be"):
        PPOController(policy=3)
    with pytest.raises(FileNotFoundError, match="not found"):
        PPOController(policy=tmp_path / "none.pt")
    net, meta = constant_policy(1)
    other = type(meta)(("a",) * len(FEATURES), meta.feature_low, meta.feature_high, meta.actions)
    with pytest.raises(ValueError, match="retrain"):
        PPOController(policy=(net, other))
    path = save_policy(net, meta, tmp_path / "p.pt")
    c = PPOController(policy=path)
    with pytest.raises(ValueError, match="same policy"):
        c.load_state_dict(PPOController(policy=random_policy()).state_dict())
    with pytest.raises(ValueError, match="refine"):
        c.load_state_dict(PPOController(policy=path, refine=True).state_dict())
    with pytest.raises(TypeError, match="Observation"):
        c.decide({"step": 1})
    with pytest.raises(TypeError, match="fallback"):
        PPOController(fallback=object())
    assert "PPOController(min_size=32" in repr(c)


@pytest.mark.distributed
def test_under_two_gloo_ranks_rank_0_decides_for_all(tmp_path):
    mp.spawn(dist_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"ppo{r}.json").read_text()) for r in range(2))
    assert r0["sizes"] == r1["sizes"]
    assert r0["decisions"] >= 3 and r1["decisions"] == 0  # rank 1's controller is never asked
    assert max(r0["sizes"]) == 64 and r0["sizes"][0] == 8  # rank 0's policy doubles: 8 -> 16 -> 32 -> 64


def test_the_refinement_reward_reads_loss_goodput_and_utilisation_from_observations():
    from batchpilot.controllers.ppo_refine import refinement_reward

    before = observation(50, 256, loss=1.0, throughput=5000.0, noise=1000.0)
    better = observation(100, 512, loss=0.9, throughput=12000.0, noise=1000.0)  # goodput x(12000/5000)(1256/1512)
    r = refinement_reward(before, better, base_size=256)
    goodput_gain = (12000 / 5000) * (1000 + 256) / (1000 + 512)
    assert r == pytest.approx(0.6 * 0.1 + 0.3 * math.log(goodput_gain) + 0.1 * 0.9)
    worse = observation(100, 512, loss=1.0, throughput=4000.0, noise=1000.0)
    assert refinement_reward(before, worse, 256) < r
    unmeasured = observation(100, 512, loss=1.0, throughput=4000.0, noise=None)  # no goodput without phi
    assert refinement_reward(before, unmeasured, 256) == pytest.approx(0.1 * 0.9)
    crash = observation(100, 512, loss=50.0, throughput=5000.0)  # each term clipped to [-1, 1]
    assert refinement_reward(before, crash, 256) >= -0.6 - 0.3
