"""The simulated cluster: devices, a network with a background load, failures, gradient compression.

A step of global batch ``B`` on the healthy devices (Pollux, Qiao et al., OSDI '21, section 3.2):

* device ``i`` gets ``b_i`` samples, proportional to its share (default: its speed), and runs ``k_i =
  ceil(b_i / memory_i)`` micro-batches of ``m_i = ceil(b_i / k_i)`` samples: ``T_i = k_i * c(m_i) / speed_i``, where
  ``c(m)`` is the recording device's measured step time (the trace's table, :meth:`Trace.compute_seconds`), or
  ``a + b * m`` with ``ClusterSpec.device_compute = (a, b)``; with ``speedup = s`` (a GPU) the per-sample part is
  ``s`` times faster and the fixed part ``a`` stays: ``c_s(m) = a + (c(m) - a) / s``. ``T_compute = max_i T_i``.
* the gradient (``grad_bytes`` x the compression factor) is all-reduced by a ring over the ``N`` healthy devices:
  ``T_net = 2 (N - 1) latency + 2 (N - 1) / N * bytes / (bandwidth * (1 - load(t)))`` (Patarasuk & Yuan 2009);
  ``T_net = 0`` on one device. Devices are grouped in nodes of ``devices_per_node`` (default 1); when the healthy
  devices all sit in one node, the ring runs over ``Network.intra_node_bandwidth_Bps`` (if given) without the load.
* the two overlap as in Pollux: ``T = (T_compute^g + T_net^g)^(1/g)``, ``g >= 1`` (``ClusterSpec.overlap``; 1 adds
  them, a large ``g`` takes the larger).

The background load is seed 000's day/night pattern: ``load(t) = mean + amplitude * sin(2 pi t / period)``,
clipped to ``[0, 0.95]``, the share of the bandwidth between nodes that other jobs take. Each node fails as a
Poisson process (``failure_rate_per_hour``); a failed node is out for ``repair_s`` and the job restarts on the
others, and again when it comes back, each restart costing ``restart_s`` of the clock (Pollux's fixed rescale
cost). Failure times are drawn from ``(seed, node, draw)``, so they do not depend on how the clock is advanced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._cluster_parse import parse_spec
from ._device import DeviceSource
from ._interp import fit_compute

__all__ = ["COMPRESSION", "Cluster", "ClusterSpec", "Device", "DeviceSource", "Network", "StepTime", "compression_factor"]

#: Bytes on the wire per float32 gradient byte. 1bit: one sign bit per value plus a float32 scale per 256 values
#: (1-bit SGD, Seide et al. 2014; 1-bit Adam, Tang et al. 2021). powersgd: see :func:`compression_factor`.
COMPRESSION = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "1bit": 1 / 32 + 1 / 256}
MAX_LOAD = 0.95
MAX_EVENTS = 10_000  # failures and repairs in one advance() beyond which the cluster cannot run a step


def compression_factor(compression: str, grad_bytes: int) -> float:
    """Bytes factor of ``compression``: :data:`COMPRESSION`, or for ``powersgd[:R]`` (rank ``R``, default 4; Vogels
    et al. 2019) ``min(1, 2 R / sqrt(P))`` with ``P = grad_bytes / 4``: a rank-``R`` factorisation of the gradient
    taken as one square ``sqrt(P) x sqrt(P)`` matrix sends ``2 R sqrt(P)`` values instead of ``P``."""
    if compression in COMPRESSION:
        return COMPRESSION[compression]
    kind, _, rank = compression.partition(":")
    if kind == "powersgd" and (rank == "" or (rank.isdigit() and int(rank) >= 1)):
        return min(1.0, 2 * int(rank or 4) / math.sqrt(max(grad_bytes / 4, 1.0)))
    raise ValueError(f"unknown compression {compression!r}; use one of none, fp16, bf16, 1bit, powersgd, "
                     "powersgd:R (R a rank >= 1).")


def _positive(name: str, value: float, *, zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        (value >= 0 if zero else value > 0)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>= 0' if zero else '> 0'}, got {value!r}.")


@dataclass(frozen=True)
class Device:
    """One accelerator: ``speed`` multiplies its samples per second (1 = the recording device), ``memory`` is its
    largest micro-batch in samples (``None``: the trace's ``max_micro_batch_size``)."""

    speed: float = 1.0
    memory: int | None = None

    def __post_init__(self) -> None:
        _positive("Device.speed", self.speed)
        if self.memory is not None and (isinstance(self.memory, bool) or not isinstance(self.memory, int)
                                        or self.memory < 1):
            raise ValueError(f"Device.memory must be None or a whole number of samples >= 1, got {self.memory!r}.")


@dataclass(frozen=True)
class Network:
    """Ring all-reduce parameters and the background load ``mean + amplitude * sin(2 pi t / period)`` (share of
    the bandwidth taken by others; seed 000's day/night pattern with the default period of a day).
    ``intra_node_bandwidth_Bps``: the links inside one node (NVLink, say; ``None``: ``bandwidth_Bps``), used when all
    healthy devices sit in one node; the background load is on the shared network between nodes only."""

    latency_s: float = 20e-6
    bandwidth_Bps: float = 12.5e9
    load_mean: float = 0.0
    load_amplitude: float = 0.0
    load_period_s: float = 86400.0
    intra_node_bandwidth_Bps: float | None = None

    def __post_init__(self) -> None:
        _positive("Network.latency_s", self.latency_s, zero=True)
        if self.intra_node_bandwidth_Bps is not None:
            _positive("Network.intra_node_bandwidth_Bps", self.intra_node_bandwidth_Bps)
        _positive("Network.bandwidth_Bps", self.bandwidth_Bps)
        _positive("Network.load_amplitude", self.load_amplitude, zero=True)
        _positive("Network.load_period_s", self.load_period_s)
        if not (isinstance(self.load_mean, (int, float)) and 0 <= self.load_mean < 1):
            raise ValueError(f"Network.load_mean must be in [0, 1), got {self.load_mean!r}.")

    def load(self, time_s: float) -> float:
        """The background load at ``time_s``, clipped to ``[0, 0.95]``."""
        value = self.load_mean + self.load_amplitude * math.sin(2 * math.pi * time_s / self.load_period_s)
        return min(max(value, 0.0), MAX_LOAD)


@dataclass(frozen=True)
class ClusterSpec:
    """What the cluster is (see the module docstring for the model and :meth:`parse` for the text form).

    Attributes:
        devices, network: The devices and the network between them.
        overlap: ``g`` of ``T = (T_c^g + T_n^g)^(1/g)``.
        failure_rate_per_hour: Failures per node per hour (Poisson).  restart_s: Clock cost of a restart.
        repair_s: How long a failed device stays out.  compression: See :func:`compression_factor`.
        device_compute: ``(a, b)`` of one device in seconds (``None``: the trace's measured curve).
        speedup: Per-sample speed-up over the recording device, fixed per-step cost unchanged (a GPU preset).
        devices_per_node: Devices ``i`` with the same ``i // devices_per_node`` form a node: they fail together, and
            talk over ``Network.intra_node_bandwidth_Bps`` when the job fits in one node.
        name: The text it was parsed from, for reports.
    """

    devices: tuple[Device, ...] = (Device(),)
    network: Network = field(default_factory=Network)
    overlap: float = 2.0
    failure_rate_per_hour: float = 0.0
    restart_s: float = 30.0
    compression: str = "none"
    device_compute: tuple[float, float] | None = None
    speedup: float = 1.0
    repair_s: float = 600.0
    devices_per_node: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        if not self.devices or not all(isinstance(d, Device) for d in self.devices):
            raise ValueError(f"ClusterSpec.devices must be a non-empty tuple of Device, got {self.devices!r}.")
        object.__setattr__(self, "devices", tuple(self.devices))
        if not (isinstance(self.overlap, (int, float)) and math.isfinite(self.overlap) and self.overlap >= 1):
            raise ValueError(f"ClusterSpec.overlap (g) must be a finite number >= 1, got {self.overlap!r}.")
        _positive("ClusterSpec.failure_rate_per_hour", self.failure_rate_per_hour, zero=True)
        _positive("ClusterSpec.restart_s", self.restart_s, zero=True)
        _positive("ClusterSpec.repair_s", self.repair_s, zero=True)
        _positive("ClusterSpec.speedup", self.speedup)
        if isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int) or \
                self.devices_per_node < 1:
            raise ValueError(f"ClusterSpec.devices_per_node must be a whole number >= 1, got {self.devices_per_node!r}.")
        compression_factor(self.compression, 4)  # raises for an unknown name
        if self.device_compute is not None:
            a, b = (float(v) for v in self.device_compute)
            if not (math.isfinite(a) and math.isfinite(b) and a >= 0 and b >= 0 and a + b > 0):
                raise ValueError(f"ClusterSpec.device_compute (a, b) must be finite, >= 0 and not both 0, got "
                                 f"{self.device_compute!r}.")
            object.__setattr__(self, "device_compute", (a, b))

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> ClusterSpec:
        """A spec from its text form, e.g. ``"cpu"``, ``"gpus=16"``,
        ``"gpus=16,hetero=0.5,bandwidth=1.25e9,latency=5e-5,load=0.3:0.2,fail=0.01,compress=1bit"`` (grammar in
        :func:`batchpilot.sim._cluster_parse.parse_spec` and docs/simulator.md; ``seed`` draws ``hetero`` speeds
        unless the text has ``seed=``). ``ValueError`` naming the bad item and the fix."""
        values = parse_spec(text, seed)
        memory = values.pop("memory")
        devices = tuple(Device(speed, memory) for speed in values.pop("speeds"))
        return cls(devices=devices, network=Network(**values.pop("network")), name=text.strip(), **values)

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def nodes(self) -> int:
        return -(-len(self.devices) // self.devices_per_node)


@dataclass(frozen=True)
class StepTime:
    """One simulated step: total ``seconds``, its slowest device's ``compute_s``, the all-reduce's ``network_s``,
    and ``utilization``, the mean over healthy devices of their busy compute share of the step."""

    seconds: float
    compute_s: float
    network_s: float
    utilization: float


def _split(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` as whole numbers proportional to ``weights`` (largest remainders get the leftovers)."""
    w = np.asarray(weights, dtype=float)
    exact = total * w / w.sum()
    out = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - out), kind="stable")[: total - int(out.sum())]:
        out[i] += 1
    return [int(v) for v in out]


class Cluster:
    """A :class:`ClusterSpec` running one job of ``trace``, with a clock (see the module docstring)."""

    def __init__(self, spec: ClusterSpec, trace: DeviceSource, seed: int = 0) -> None:
        if not isinstance(spec, ClusterSpec):
            raise TypeError(f"spec must be a ClusterSpec (ClusterSpec.parse('gpus=16') makes one), got {spec!r}.")
        self.spec, self.trace, self.seed = spec, trace, int(seed)
        self.time_s = 0.0
        n = spec.nodes  # failures are per node (a node is one device unless devices_per_node says otherwise)
        self._down_until: list[float | None] = [None] * n
        self._draws = [0] * n
        self._next_failure = [self._draw(i, 0.0) for i in range(n)]
        self.failures = 0
        self.restarts = 0
        self._last: dict[str, float] = {}
        self._memory = [d.memory or trace.max_micro_batch_size for d in spec.devices]
        self._speeds = [d.speed for d in spec.devices]
        self._bytes = trace.grad_bytes * compression_factor(spec.compression, trace.grad_bytes)

    def _draw(self, node: int, start: float) -> float:
        """The next failure time of ``node`` after ``start`` (exponential gap from ``(seed, node, draw)``)."""
        rate = self.spec.failure_rate_per_hour
        if rate == 0:
            return math.inf
        k = self._draws[node]
        self._draws[node] += 1
        return start + float(np.random.default_rng([self.seed, node, k]).exponential(3600.0 / rate))

    @property
    def healthy(self) -> list[int]:
        """Indices of the devices that are up."""
        per = self.spec.devices_per_node
        return [i for i in range(self.spec.size) if self._down_until[i // per] is None]

    def _name(self, node: int) -> str:
        per = self.spec.devices_per_node
        last = min((node + 1) * per, self.spec.size) - 1
        return f"device {node}" if per == 1 else f"node {node} (devices {node * per}-{last})"

    def load(self) -> float:
        """The network's background load now."""
        return self.spec.network.load(self.time_s)

    def compute_seconds(self, micro_batch: int, device: int = 0) -> float:
        """Seconds of one forward/backward of ``micro_batch`` samples on ``device``."""
        return self._base_seconds(micro_batch) / self.spec.devices[device].speed

    def _base_seconds(self, micro_batch: int) -> float:
        """:meth:`compute_seconds` on a device of speed 1."""
        spec = self.spec
        if spec.device_compute is not None:
            a, b = spec.device_compute
            return a + b * micro_batch
        a = self.trace.compute[0]
        return a + max(self.trace.compute_seconds(micro_batch) - a, 0.0) / spec.speedup

    def network_seconds(self) -> float:
        """Ring all-reduce time of one (compressed) gradient over the healthy devices now: over the intra-node links
        when they all sit in one node, else limited by the loaded network between nodes."""
        up = self.healthy
        n = len(up)
        if n <= 1:
            return 0.0
        net = self.spec.network
        one_node = len({i // self.spec.devices_per_node for i in up}) == 1
        if one_node and net.intra_node_bandwidth_Bps is not None:
            bandwidth = net.intra_node_bandwidth_Bps
        else:
            bandwidth = net.bandwidth_Bps * (1.0 - self.load())
        return 2 * (n - 1) * net.latency_s + 2 * (n - 1) / n * self._bytes / bandwidth

    def step_time(self, global_batch: int, shares: Sequence[float] | None = None) -> StepTime:
        """The time of one step of ``global_batch`` samples now; ``shares`` (one per device, >= 0) sets the local
        batches (default: proportional to the devices' speeds; a failed device's share is ignored)."""
        if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
            raise ValueError(f"global_batch must be a whole number >= 1, got {global_batch!r}.")
        up = self.healthy
        if shares is None:
            weights = [self.spec.devices[i].speed for i in up]
        else:
            if len(shares) != self.spec.size or not all(math.isfinite(s) and s >= 0 for s in shares):
                raise ValueError(f"shares must hold {self.spec.size} finite numbers >= 0 (one per device), got "
                                 f"{list(shares)!r}.")
            weights = [float(shares[i]) for i in up]
            if sum(weights) <= 0:
                raise ValueError(f"shares {list(shares)!r} give the healthy devices {up} nothing; give them a share.")
        busy, mem = [], []
        base: dict[int, float] = {}  # speed-1 seconds per micro-batch size: often one size for all devices
        for i, b_i in zip(up, _split(int(global_batch), weights)):
            if b_i == 0:
                busy.append(0.0)
                continue
            k = -(-b_i // self._memory[i])
            m = -(-b_i // k)
            if m not in base:
                base[m] = self._base_seconds(m)
            busy.append(k * base[m] / self._speeds[i])
            mem.append(m / self._memory[i])
        compute = max(busy)
        network = self.network_seconds()
        g = self.spec.overlap
        seconds = compute if network == 0 else (compute ** g + network ** g) ** (1.0 / g)
        utilization = sum(busy) / len(up) / seconds
        self._last = {"seconds": seconds, "compute_s": compute, "network_s": network, "utilization": utilization,
                      "mem_frac": max(mem), "global_batch": float(global_batch)}
        return StepTime(seconds, compute, network, utilization)

    def advance(self, seconds: float) -> list[str]:
        """Move the clock ``seconds`` on; returns the failures and repairs in that time (``"failure: device 3"``,
        ``"repaired: device 3"``). Each costs ``restart_s`` more; with every device down the clock waits for the first
        repair (``"waiting: ..."``)."""
        _positive("seconds", seconds, zero=True)
        end = self.time_s + seconds
        events: list[str] = []
        while True:
            candidates = [(t, 1, i) for i, t in enumerate(self._down_until) if t is not None and t <= end]
            candidates += [(t, 0, i) for i, t in enumerate(self._next_failure)
                           if self._down_until[i] is None and t <= end]
            if not candidates:
                break
            t, repair, i = min(candidates)
            if repair:
                self._down_until[i] = None
                self._next_failure[i] = self._draw(i, t)
                events.append(f"repaired: {self._name(i)}")
            else:
                self._down_until[i] = t + self.spec.repair_s
                self._next_failure[i] = math.inf
                self.failures += 1
                events.append(f"failure: {self._name(i)}")
            end += self.spec.restart_s
            self.restarts += 1
            if len(events) > MAX_EVENTS:  # failures and repairs come faster than restarts end: no step ever runs
                raise RuntimeError(f"the cluster spent {end - self.time_s - seconds:.3g} s restarting within one advance "
                                   f"({len(events)} failures and repairs): with fail={self.spec.failure_rate_per_hour:g}"
                                   f"/h per node and restart={self.spec.restart_s:g} s it never runs a step; lower "
                                   "fail= or restart=.")
            if not self.healthy:
                back = min(t for t in self._down_until if t is not None)
                if back > end:
                    events.append(f"waiting: no healthy device for {back - end:.0f} s")
                    end = back
        self.time_s = end
        return events

    def perf_stats(self) -> dict[str, float]:
        """What the engine's throughput model would report on the slowest healthy device now (the keys
        :class:`~batchpilot.controllers.Goodput` reads): its ``perf/micro_time_a_s`` and ``perf/micro_time_b_s`` (an
        affine fit of :meth:`compute_seconds` over the trace's sizes), ``perf/step_overhead_s`` (the step's time
        beyond its compute at the last :meth:`step_time`, else the all-reduce's), ``perf/max_micro_batch_size``
        and ``dist/world_size``."""
        up = self.healthy
        slowest = min(up, key=lambda i: self.spec.devices[i].speed)
        sizes = self.trace.step_sizes
        a, b = fit_compute(sizes, [self.compute_seconds(s, slowest) for s in sizes])
        overhead = self._last["seconds"] - self._last["compute_s"] if self._last else self.network_seconds()
        return {"perf/micro_time_a_s": a, "perf/micro_time_b_s": b, "perf/step_overhead_s": overhead,
                "perf/max_micro_batch_size": float(min(self._memory[i] for i in up)), "dist/world_size": float(len(up))}

    def observation_stats(self) -> dict[str, float]:
        """The system and cluster state now, under the keys the engine's monitor and the feature function use
        (utilisation, memory share and communication share are those of the last :meth:`step_time`, 0 before;
        ``system/gpu_util`` in percent, the unit of the engine's monitor, :mod:`batchpilot.stats.system`)."""
        net = self.spec.network
        last = self._last
        comm = last["network_s"] / (last["network_s"] + last["compute_s"]) if last else 0.0
        return {"system/gpu_util": 100.0 * last.get("utilization", 0.0), "system/gpu_mem_frac": last.get("mem_frac", 0.0),
                "cluster/latency_s": net.latency_s, "cluster/bandwidth_Bps": net.bandwidth_Bps * (1 - self.load()),
                "cluster/load": self.load(), "cluster/healthy_frac": len(self.healthy) / self.spec.size,
                "cluster/comm_frac": comm, "dist/world_size": float(len(self.healthy))}

    def state_dict(self) -> dict[str, Any]:
        """The clock, the devices' health and failure draws, and the last step (JSON-able)."""
        return {"time_s": self.time_s, "seed": self.seed, "down_until": list(self._down_until),
                "next_failure": [None if math.isinf(t) else t for t in self._next_failure], "draws": list(self._draws),
                "failures": self.failures, "restarts": self.restarts, "last": dict(self._last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` when it belongs to a cluster of another size."""
        n = self.spec.nodes
        if len(state.get("down_until", [])) != n or len(state.get("draws", [])) != n:
            raise ValueError(f"this state is of a cluster with {len(state.get('down_until', []))} nodes, not {n}; "
                             "load it into a Cluster of the same ClusterSpec.")
        self.time_s = float(state["time_s"])
        self.seed = int(state["seed"])
        self._down_until = [None if t is None else float(t) for t in state["down_until"]]
        self._next_failure = [math.inf if t is None else float(t) for t in state["next_failure"]]
        self._draws = [int(k) for k in state["draws"]]
        self.failures, self.restarts = int(state["failures"]), int(state["restarts"])
        self._last = {k: float(v) for k, v in state["last"].items()}
