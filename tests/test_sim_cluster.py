"""The cluster model: step times against hand-computed values, heterogeneity, load, failures, state, the spec text."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from batchpilot.sim.cluster import COMPRESSION, Cluster, ClusterSpec, Device, Network, StepTime, compression_factor
from batchpilot.sim.trace import Trace, load_trace

LAT, BW, BYTES = 1e-4, 1e8, 4_000_000  # a 1M-parameter model on a slow network: the all-reduce matters


def trace() -> Trace:
    return Trace(workload="toy", base_batch_size=32, num_samples=10_000, metric="accuracy", target=0.9,
                 progress=[0.0, 1000.0], metric_values=[0.1, 0.95], loss=[2.0, 0.1], noise_scale=[100.0, 400.0],
                 grad_sq=[1.0, 0.25], grad_var=[100.0, 100.0], step_sizes=(32, 64, 128),
                 step_seconds=(0.010, 0.012, 0.016), compute=(0.008, 6.25e-5), max_micro_batch_size=128,
                 grad_bytes=BYTES)


def net(n: int) -> float:
    return 2 * (n - 1) * LAT + 2 * (n - 1) / n * BYTES / BW


def spec(text: str) -> ClusterSpec:
    return ClusterSpec.parse(f"{text},latency={LAT},bandwidth={BW}")


def test_one_device_is_the_recording_machine():
    c = Cluster(ClusterSpec.parse("cpu"), trace())
    assert c.step_time(64) == StepTime(0.012, 0.012, 0.0, 1.0)
    assert c.step_time(96).seconds == pytest.approx(0.014)
    assert c.step_time(256).seconds == pytest.approx(2 * 0.016)  # memory 128: two micro-batches of 128
    assert c.observation_stats()["system/gpu_mem_frac"] == 1.0 and c.observation_stats()["dist/world_size"] == 1.0


def test_two_devices_by_hand():
    c = Cluster(spec("gpus=2"), trace())
    st = c.step_time(128)  # 64 each: 0.012 compute; the ring: 2 latencies + 1 x bytes / bandwidth
    assert st.compute_s == pytest.approx(0.012) and st.network_s == pytest.approx(2 * LAT + BYTES / BW)
    assert st.seconds == pytest.approx(math.sqrt(0.012 ** 2 + (2 * LAT + BYTES / BW) ** 2))  # g = 2
    assert st.utilization == pytest.approx(0.012 / st.seconds)
    g1 = Cluster(spec("gpus=2,overlap=1"), trace()).step_time(128)
    assert g1.seconds == pytest.approx(0.012 + 2 * LAT + BYTES / BW)


def test_sixteen_devices_with_a_memory_bound_by_hand():
    c = Cluster(spec("gpus=16,memory=64"), trace())
    st = c.step_time(2048)  # 128 each, 64 per micro-batch: 2 x 0.012
    assert st.compute_s == pytest.approx(0.024)
    assert st.network_s == pytest.approx(net(16)) == pytest.approx(30 * LAT + 30 / 16 * BYTES / BW)
    assert st.seconds == pytest.approx(math.hypot(0.024, net(16)))
    assert c.observation_stats()["cluster/comm_frac"] == pytest.approx(net(16) / (net(16) + 0.024))
    odd = c.step_time(2050)  # two devices take 129 samples: 3 micro-batches of 43
    assert odd.compute_s == pytest.approx(3 * (0.010 - 6.25e-5 * (32 - 43)))


def test_device_compute_speedup_and_compression():
    st = Cluster(spec("gpus=4,compute=0.002:1e-5"), trace()).step_time(400)
    assert st.compute_s == pytest.approx(0.002 + 1e-5 * 100)
    gpu = Cluster(spec("gpus=4,speedup=10"), trace()).step_time(256)
    assert gpu.compute_s == pytest.approx(0.008 + (0.012 - 0.008) / 10)  # the fixed part stays
    assert Cluster(spec("speedup=10"), trace()).step_time(1).compute_s == pytest.approx(0.008 + 6.25e-5 / 10)
    high_a = replace(trace(), compute=(0.009, 6.25e-5))  # c(1) = 0.0080625 from the table is below a = 0.009
    assert Cluster(spec("speedup=10"), high_a).step_time(1).compute_s == pytest.approx(0.009)  # never under a
    fp16 = Cluster(spec("gpus=4,compress=fp16"), trace()).step_time(256)
    assert fp16.network_s == pytest.approx(6 * LAT + 6 / 4 * BYTES / 2 / BW)
    onebit = Cluster(spec("gpus=4,compress=1bit"), trace()).step_time(256)
    assert onebit.network_s == pytest.approx(6 * LAT + 6 / 4 * BYTES * (1 / 32 + 1 / 256) / BW)
    assert compression_factor("powersgd", BYTES) == pytest.approx(8 / 1000)  # 2 R / sqrt(1e6), R = 4
    assert compression_factor("powersgd:16", 400) == 1.0 and COMPRESSION["bf16"] == 0.5
    with pytest.raises(ValueError, match="unknown compression 'zip'"):
        compression_factor("zip", 4)


def test_heterogeneous_speeds_and_shares():
    specs = [ClusterSpec.parse("gpus=8,hetero=0.5", seed=s) for s in (0, 0, 1)]
    speeds = [[d.speed for d in s.devices] for s in specs]
    assert speeds[0] == speeds[1] != speeds[2]
    assert all(1 / 1.5 <= v <= 1.5 for v in speeds[0]) and len(set(speeds[0])) == 8
    assert [d.speed for d in ClusterSpec.parse("gpus=8,hetero=0.5,seed=1").devices] == speeds[2]
    c = Cluster(spec("speeds=1:0.5"), trace())
    st = c.step_time(96)  # by speed: 64 and 32 samples, 0.012 and 0.010 / 0.5
    assert st.compute_s == pytest.approx(0.020)
    assert st.utilization == pytest.approx((0.012 + 0.020) / 2 / st.seconds)
    equal = c.step_time(96, shares=[1, 1])  # 48 each: the slow device takes 0.011 / 0.5
    assert equal.compute_s == pytest.approx(0.022)
    with pytest.raises(ValueError, match="shares must hold 2 finite numbers"):
        c.step_time(96, shares=[1.0])


def test_background_load_follows_the_day_night_sine():
    s = spec("gpus=2,load=0.5:0.4:100")
    c = Cluster(s, trace())
    assert c.load() == 0.5 and c.step_time(128).network_s == pytest.approx(2 * LAT + BYTES / (BW * 0.5))
    c.advance(25.0)  # a quarter period: the peak, 0.9
    assert c.load() == pytest.approx(0.9)
    assert c.step_time(128).network_s == pytest.approx(2 * LAT + BYTES / (BW * 0.1))
    assert c.observation_stats()["cluster/bandwidth_Bps"] == pytest.approx(BW * 0.1)
    c.advance(50.0)
    assert c.load() == pytest.approx(0.1)
    assert Network(load_mean=0.9, load_amplitude=0.5).load(0.25 * 86400) == 0.95  # clipped


def test_failures_are_deterministic_by_seed_and_cost_restarts():
    s = ClusterSpec.parse("gpus=4,fail=60,restart=5,repair=30")  # one failure per device per minute
    runs = []
    for seed in (0, 0, 1):
        c = Cluster(s, trace(), seed=seed)
        runs.append((c.advance(120.0), c.time_s, c.failures))
    assert runs[0] == runs[1] and runs[0] != runs[2]
    events, clock, failures = runs[0]
    assert failures >= 2 and any(e.startswith("repaired: device") for e in events)
    assert clock == pytest.approx(120.0 + 5.0 * len([e for e in events if not e.startswith("waiting")]))
    split = Cluster(s, trace(), seed=0)
    assert split.advance(40.0) + split.advance(80.0) == events and split.time_s == pytest.approx(clock)


def test_a_failed_device_leaves_the_ring_and_everything_down_waits():
    c = Cluster(spec("gpus=2,fail=3600,restart=1,repair=1000"), trace(), seed=0)
    first = c._next_failure[:]  # the drawn failure times
    events = c.advance(min(first) + 1e-9)
    assert events[0].startswith("failure: device")
    stats = c.observation_stats()
    assert stats["cluster/healthy_frac"] == 0.5 and stats["dist/world_size"] == 1.0
    assert c.step_time(256).network_s == 0.0 and c.step_time(256).compute_s == pytest.approx(2 * 0.016)
    one = Cluster(ClusterSpec.parse("fail=3600,restart=0,repair=50"), trace(), seed=3)
    failure_at = one._next_failure[0]
    assert failure_at < 20.0  # one failure per second on average
    assert one.advance(20.0) == ["failure: device 0", f"waiting: no healthy device for {failure_at + 30:.0f} s",
                                 "repaired: device 0"]
    assert one.time_s == pytest.approx(failure_at + 50.0) and one.healthy == [0]


def test_nodes_fail_together_and_one_node_talks_over_its_own_links():
    s = spec("gpus=4,per_node=2,intra_bandwidth=1e10,load=0.5,fail=3600,restart=0,repair=1000")
    assert s.nodes == 2 and s.network.intra_node_bandwidth_Bps == 1e10
    c = Cluster(s, trace(), seed=0)
    assert c.step_time(256).network_s == pytest.approx(6 * LAT + 6 / 4 * BYTES / (BW * 0.5))  # across nodes, loaded
    first = min(c._next_failure)
    events = c.advance(first + 1e-9)
    node = 0 if events[0].startswith("failure: node 0") else 1
    assert events == [f"failure: node {node} (devices {2 * node}-{2 * node + 1})"]
    assert c.healthy == [2 * (1 - node), 2 * (1 - node) + 1]
    assert c.step_time(256).network_s == pytest.approx(2 * LAT + BYTES / 1e10)  # one node: its links, no load
    no_intra = Cluster(spec("gpus=2,per_node=2,load=0.5"), trace()).step_time(128)
    assert no_intra.network_s == pytest.approx(2 * LAT + BYTES / (BW * 0.5))  # no intra bandwidth given: the network


def test_state_round_trip_continues_exactly():
    s = ClusterSpec.parse("gpus=8,hetero=0.3,fail=120,restart=2,repair=20,load=0.2:0.1:60")
    a = Cluster(s, trace(), seed=5)
    a.advance(33.0)
    a.step_time(512)
    b = Cluster(s, trace(), seed=0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.observation_stats() == a.observation_stats()
    for dt in (10.0, 45.0, 3.0):
        assert a.advance(dt) == b.advance(dt) and a.time_s == b.time_s
        assert a.step_time(700) == b.step_time(700)
    with pytest.raises(ValueError, match="cluster with 8 nodes, not 1"):
        Cluster(ClusterSpec.parse("cpu"), trace()).load_state_dict(a.state_dict())


def test_observation_and_perf_stats():
    c = Cluster(spec("gpus=4"), trace())
    keys = {"system/gpu_util", "system/gpu_mem_frac", "cluster/latency_s", "cluster/bandwidth_Bps", "cluster/load",
            "cluster/healthy_frac", "cluster/comm_frac", "dist/world_size"}
    assert set(c.observation_stats()) == keys
    st = c.step_time(256)
    perf = c.perf_stats()
    assert perf["perf/micro_time_a_s"] == pytest.approx(0.008, rel=0.05) and perf["dist/world_size"] == 4.0
    assert perf["perf/step_overhead_s"] == pytest.approx(st.seconds - st.compute_s)
    assert all(math.isfinite(v) for v in c.observation_stats().values())


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ("gpus=0", "gpus='0' must be a whole number >= 1; e.g. gpus=16"),
    ("gpus=x", "gpus='x' must be a whole number"),
    ("foo=1", "'foo=1' is not 'cpu' or key=value"),
    ("gpus", "'gpus' is not 'cpu' or key=value"),
    ("gpus=2,gpus=4", "gpus given twice"),
    ("gpus=2,speeds=1:1", "speeds given twice"),
    ("load=1.2", "mean load must be below 1"),
    ("load=0.1:0.1:0:4", "more than MEAN:AMPLITUDE:PERIOD"),
    ("bandwidth=0", "bandwidth='0' must be a number > 0"),
    ("compress=zip", "unknown compression 'zip'"),
    ("compute=1", "must be A:B"),
    ("compute=0.1:0.1,speedup=3", "give one of them"),
    ("overlap=0.5", "overlap='0.5' must be a number >= 1"),
    ("hetero=-1", "hetero='-1' must be a number >= 0"),
    ("per_node=0", "per_node='0' must be a whole number >= 1; e.g. per_node=8"),
    ("intra_bandwidth=-3", "intra_bandwidth='-3' must be a number > 0"),
])
def test_parse_errors_name_the_item_and_the_fix(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ClusterSpec.parse(text)


def test_parse_and_constructor_checks():
    s = ClusterSpec.parse("gpus=16,hetero=0.5,bandwidth=1.25e9,latency=5e-5,load=0.3:0.2,fail=0.01,compress=1bit")
    assert s.size == 16 and s.network == Network(5e-5, 1.25e9, 0.3, 0.2) and s.compression == "1bit"
    assert s.failure_rate_per_hour == 0.01 and s.name.startswith("gpus=16")
    assert ClusterSpec.parse("cpu") == ClusterSpec(name="cpu")
    assert [d.speed for d in ClusterSpec.parse("speed=2,speeds=1:3").devices] == [2.0, 6.0]
    with pytest.raises(ValueError, match="Device.memory"):
        Device(memory=0)
    with pytest.raises(ValueError, match="overlap"):
        ClusterSpec(overlap=0.5)
    with pytest.raises(TypeError, match="ClusterSpec.parse"):
        Cluster("gpus=2", trace())  # type: ignore[arg-type]


def test_shipped_trace_on_a_cluster_gains_throughput_with_the_batch():
    t = load_trace("mnist1d")
    c = Cluster(ClusterSpec.parse("gpus=16"), t)
    rates = [b / c.step_time(b).seconds for b in (32, 512, 8192)]
    assert rates[0] < rates[1] < rates[2]
    assert np.isfinite(rates).all()


def test_a_cluster_that_restarts_faster_than_it_fails_is_refused_not_hung():
    # 8 nodes failing 30 times an hour each, 20 s per restart and 60 s per repair: a failure or repair arrives about
    # every 8 s while each costs 20 s, so no step could ever run; advance() must say so instead of looping forever.
    from batchpilot.sim.cluster import Cluster, ClusterSpec
    from batchpilot.sim.trace import load_trace

    cluster = Cluster(ClusterSpec.parse("gpus=8,fail=30,restart=20,repair=60"), load_trace("digits"))
    with pytest.raises(RuntimeError, match="never runs a step; lower fail= or restart="):
        cluster.advance(100.0)
