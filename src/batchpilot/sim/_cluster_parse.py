"""The text form of a cluster (``ClusterSpec.parse``): comma-separated ``key=value`` items.

======================  ==========================================================================================
``cpu``                 one device, the recording machine (alone: the whole spec; the default of every key)
``gpus=N``              ``N`` devices (also ``devices=N``); default 1
``speed=S``             every device ``S`` times the recording device, fixed cost included; default 1
``speedup=S``           a GPU preset: per-sample work ``S`` times faster, the fixed per-step cost ``a`` unchanged
``hetero=H``            device speeds drawn log-uniformly in ``[1/(1+H), 1+H]`` (times ``speed``) from ``seed``
``speeds=S1:S2:...``    explicit per-device speeds (their count is the number of devices)
``memory=M``            largest micro-batch per device in samples; default: the trace's
``compute=A:B``         one device's step time ``A + B * m`` seconds instead of the trace's measured curve
``latency=SEC``         per-message latency; default 2e-5
``bandwidth=BPS``       bytes per second per link; default 1.25e10 (100 Gb/s)
``load=M[:A[:P]]``      background load ``M + A sin(2 pi t / P)``, ``P`` in seconds (default 86400)
``per_node=K``          ``K`` devices per node (default 1): a node fails as a whole
``intra_bandwidth=BPS`` bytes per second inside a node, used when the healthy devices fit in one node
``fail=R``              failures per node per hour; ``restart=SEC`` (default 30) and ``repair=SEC`` (default 600)
``compress=C``          none, fp16, bf16, 1bit, powersgd or powersgd:R
``overlap=G``           ``g`` of ``T = (T_c^g + T_n^g)^(1/g)``; default 2
``seed=K``              the seed of the ``hetero`` draw (default: the one passed to ``parse``)
======================  ==========================================================================================
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["KEYS", "parse_spec"]

KEYS = ("gpus", "devices", "speed", "speedup", "hetero", "speeds", "memory", "compute", "latency", "bandwidth",
        "intra_bandwidth", "per_node", "load", "fail", "restart", "repair", "compress", "overlap", "seed")


def _float(key: str, value: str, low: float = 0.0, strict: bool = False) -> float:
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not math.isfinite(x) or x < low or (strict and x == low):
        bound = f"> {low:g}" if strict else f">= {low:g}"
        raise ValueError(f"cluster spec: {key}={value!r} must be a number {bound}; e.g. {key}={_EXAMPLES[key]}.")
    return x


def _int(key: str, value: str, low: int) -> int:
    if not (value.isascii() and value.isdigit()) or int(value) < low:
        raise ValueError(f"cluster spec: {key}={value!r} must be a whole number >= {low}; e.g. {key}={_EXAMPLES[key]}.")
    return int(value)


_EXAMPLES = {"gpus": "16", "devices": "16", "speed": "2", "speedup": "30", "hetero": "0.5", "speeds": "1:1:0.5",
             "memory": "512", "compute": "0.002:1e-5", "latency": "5e-5", "bandwidth": "1.25e9", "load": "0.3:0.2",
             "intra_bandwidth": "3e11", "per_node": "8",
             "fail": "0.01", "restart": "30", "repair": "600", "compress": "1bit", "overlap": "2", "seed": "0"}


def parse_spec(text: str, seed: int = 0) -> dict[str, Any]:
    """The keyword arguments of ``ClusterSpec`` for ``text`` (see the module docstring), with ``speeds`` (one per
    device) and ``memory`` for the devices and ``network`` (``Network``'s keyword arguments) in place of objects."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"cluster spec {text!r} is empty; pass e.g. 'cpu' or 'gpus=16,bandwidth=1.25e9'.")
    items: dict[str, str] = {}
    for raw in text.split(","):
        item = raw.strip()
        if item == "cpu":
            continue
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or key not in KEYS:
            raise ValueError(f"cluster spec {text!r}: {item!r} is not 'cpu' or key=value with a key among "
                             f"{', '.join(KEYS)} (docs/simulator.md, 'The cluster model').")
        if key in items or (key in ("gpus", "devices", "speeds") and {"gpus", "devices", "speeds"} & set(items)):
            raise ValueError(f"cluster spec {text!r}: {key} given twice (gpus, devices and speeds all set the number "
                             "of devices); give it once.")
        items[key] = value
    if "compute" in items and "speedup" in items:
        raise ValueError(f"cluster spec {text!r}: compute= sets the device's curve, speedup= scales the trace's; "
                         "give one of them.")
    rng_seed = _int("seed", items["seed"], 0) if "seed" in items else seed
    n = _int(k, items[k], 1) if (k := "gpus" if "gpus" in items else "devices") in items else 1
    speed = _float("speed", items["speed"], 0.0, strict=True) if "speed" in items else 1.0
    if "speeds" in items:
        speeds = [_float("speeds", s, 0.0, strict=True) * speed for s in items["speeds"].split(":")]
    else:
        speeds = [speed] * n
    if "hetero" in items:
        h = _float("hetero", items["hetero"])
        draws = np.random.default_rng(rng_seed).uniform(-1.0, 1.0, len(speeds)) * math.log1p(h)
        speeds = [s * float(math.exp(d)) for s, d in zip(speeds, draws)]
    out: dict[str, Any] = {"speeds": speeds, "memory": _int("memory", items["memory"], 1) if "memory" in items else None}
    network: dict[str, float] = {}
    if "latency" in items:
        network["latency_s"] = _float("latency", items["latency"])
    if "bandwidth" in items:
        network["bandwidth_Bps"] = _float("bandwidth", items["bandwidth"], 0.0, strict=True)
    if "intra_bandwidth" in items:
        network["intra_node_bandwidth_Bps"] = _float("intra_bandwidth", items["intra_bandwidth"], 0.0, strict=True)
    if "load" in items:
        parts = items["load"].split(":")
        if len(parts) > 3:
            raise ValueError(f"cluster spec: load={items['load']!r} has more than MEAN:AMPLITUDE:PERIOD; e.g. load=0.3:0.2.")
        network["load_mean"] = _float("load", parts[0])
        if network["load_mean"] >= 1:
            raise ValueError(f"cluster spec: load={items['load']!r}: the mean load must be below 1 (a share of the "
                             "bandwidth); e.g. load=0.3:0.2.")
        if len(parts) > 1:
            network["load_amplitude"] = _float("load", parts[1])
        if len(parts) > 2:
            network["load_period_s"] = _float("load", parts[2], 0.0, strict=True)
    out["network"] = network
    if "compute" in items:
        parts = items["compute"].split(":")
        if len(parts) != 2:
            raise ValueError(f"cluster spec: compute={items['compute']!r} must be A:B (seconds per step = A + B * "
                             "samples); e.g. compute=0.002:1e-5.")
        out["device_compute"] = (_float("compute", parts[0]), _float("compute", parts[1]))
    for key, name, strict in (("speedup", "speedup", True), ("fail", "failure_rate_per_hour", False),
                              ("restart", "restart_s", False), ("repair", "repair_s", False)):
        if key in items:
            out[name] = _float(key, items[key], 0.0, strict=strict)
    if "per_node" in items:
        out["devices_per_node"] = _int("per_node", items["per_node"], 1)
    if "overlap" in items:
        out["overlap"] = _float("overlap", items["overlap"], 1.0)
    if "compress" in items:
        out["compression"] = items["compress"]
    return out
