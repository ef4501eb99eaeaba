"""Adaptive gradient compression: a DDP communication hook that picks the compression the network calls for.

Seed 000 asks for a compression ratio that follows the network load. :class:`AdaptiveCompression` runs one of a
list of levels, from the least to the most lossy (default: fp32 all-reduce, fp16, PowerSGD rank 4, PowerSGD rank 1,
1-bit with error feedback), and every ``every`` steps rank 0 predicts the step time of each level from what it
measured (:mod:`.adaptive_rule`: compute, codec cost, per-collective latency, seconds per byte of the link) and picks
the least lossy level within ``tolerance`` of the fastest, with hysteresis and a minimum dwell. The choice is
broadcast from rank 0 at the first bucket of a step, so every rank runs the same level for the whole step.

Usage: ``Pilot(ddp_model, ..., compression="auto")``, or ``AdaptiveCompression().register(ddp_model)``. A step the
engine's noise probe measures is sent in full precision (``full_precision``, set by the engine), so the gradient
statistics are those of an uncompressed run.
"""

import math
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from . import adaptive_rule as rule
from .compression import OneBitState, one_bit_hook, ring_allreduce_bytes

__all__ = ["DEFAULT_LEVELS", "AdaptiveCompression", "adaptive_hook"]

#: The default levels, from the least to the most lossy.
DEFAULT_LEVELS = ("none", "fp16", "powersgd:4", "powersgd:1", "1bit")


def _name(kind: str, rank: int) -> str:
    return f"{kind}:{rank}" if kind == "powersgd" else kind


class AdaptiveCompression:
    """State of :func:`adaptive_hook`: the levels, their sub-hook states, the measurements and the byte counters.

    Args:
        process_group: The group DDP reduces over (``None``: the default group).
        levels: Level names from the least to the most lossy: ``none``, ``fp16``, ``bf16``, ``powersgd:R``, ``1bit``.
        initial: The level of the first steps (default: the first, full precision, as DDP's first iteration and
            1-bit Adam's warm-up want).
        every: Steps between decisions (one tiny broadcast each, whose time is the latency sample).
        min_dwell: Steps a level chosen on its measured time runs at least before it may be left; a level chosen on a
            prediction (not measured within ``memory`` steps) may be left at the next decision if it disappoints.
        tolerance: Step time a less lossy gradient is worth: the least lossy level predicted within ``1 + tolerance``
            of the fastest is the target (0.05: 5%).
        hysteresis: A more lossy target is taken only when the current level is predicted slower than
            ``1 + tolerance + hysteresis`` times the fastest (0.05).
        memory: Steps a level's measured collective time stands for it; an older level is predicted by the model
            again, so a level tried on a slow network is tried again when the network may have changed (1000: trying
            the levels again costs a few decisions, about 4% of the steps at worst).
        warmup_steps: Steps sent in full precision (fp32 all-reduce) before any level runs, as 1-bit Adam's warm-up
            (Tang et al. 2021) and PowerSGD's ``start_powerSGD_iter``; no decision is taken during them.
        link_delay: Seconds to wait per byte sent, after each bucket's collectives (an emulated slow link for tests
            and benchmarks: ``1 / bandwidth``; 0: none).

    Attributes:
        level: The name of the level in use.
        wire_bytes: Bytes this rank sent to other ranks so far (the unit of
            :class:`~batchpilot.distributed.compression.OneBitState`). full_bytes: what fp32 ring all-reduces of the
            same buckets would have sent. step: synchronised backward passes so far. switches: ``(step, level)`` of
            every change. predicted: the last decision's predicted step seconds per level (rank 0).
            full_precision: when set (by the engine, on the steps its noise probe measures), the step is an fp32
            all-reduce and is left out of the measurements.
    """

    def __init__(self, process_group: Any = None, *, levels: Sequence[str] = DEFAULT_LEVELS, initial: str | None = None,
                 every: int = 10, min_dwell: int = 20, tolerance: float = 0.05, hysteresis: float = 0.05,
                 memory: int = 1000, warmup_steps: int = 0, link_delay: float = 0.0) -> None:
        if isinstance(levels, str) or not isinstance(levels, Sequence) or not levels:
            raise ValueError(f"levels must be a non-empty list of level names, got {levels!r}; e.g. ['none', 'fp16', '1bit']")
        parsed = [rule.parse_level(name) for name in levels]
        if len(set(parsed)) != len(parsed):
            raise ValueError(f"levels {list(levels)!r} name a level twice; list each once, least lossy first")
        rule.check_number("every", every, low=1, integer=True, example="every=10")
        rule.check_number("min_dwell", min_dwell, low=0, integer=True, example="min_dwell=20")
        rule.check_number("tolerance", tolerance, low=0, example="tolerance=0.05")
        rule.check_number("hysteresis", hysteresis, low=0, example="hysteresis=0.05")
        rule.check_number("memory", memory, low=every, integer=True, example="memory=1000")
        rule.check_number("warmup_steps", warmup_steps, low=0, integer=True, example="warmup_steps=100")
        rule.check_number("link_delay", link_delay, low=0, example="link_delay=1e-8 (100 MB/s)")
        self.names = tuple(_name(*level) for level in parsed)
        start = self.names[0] if initial is None else _name(*rule.parse_level(initial))
        if start not in self.names:
            raise ValueError(f"initial={initial!r} is not one of the levels {list(self.names)}")
        self.process_group = process_group
        self.every, self.min_dwell, self.tolerance, self.hysteresis = every, min_dwell, tolerance, hysteresis
        self.memory, self.warmup_steps = memory, warmup_steps
        self.link_delay = float(link_delay)
        self._kinds = parsed
        self._current = self.names.index(start)
        self.step = 0
        self.wire_bytes = 0.0
        self.full_bytes = 0.0
        self.switches: list[tuple[int, str]] = []
        self.predicted: dict[str, float] = {}
        self.full_precision = False
        self._since_switch = 0
        self._powersgd = {i: self._new_powersgd(r) for i, (k, r) in enumerate(parsed) if k == "powersgd"}
        self._residual: dict[int, torch.Tensor] = {}  # id(param) -> PowerSGD's error, per parameter
        self.one_bit = OneBitState(process_group, warmup_steps=0) if ("1bit", 0) in parsed else None
        self._names: dict[int, str] = {}
        self._params: dict[str, torch.nn.Parameter] = {}
        self._factors: dict[int, dict[int, torch.Tensor]] = {}  # PowerSGD level -> id(param) -> its factor Q
        self._shapes: dict[int, list[tuple[int, ...]]] = {}
        self._codec: list[float] | None = None  # rank 0: seconds of each level's local tensor work per step
        self._calibrations = 0
        self._records: dict[int, list[float]] = {}  # level -> [collective s per step, bytes sent per step, at step]
        self._other = 0.0  # the step time outside the collectives
        self._trial = False  # rank 0: the current level was chosen on a prediction, not on a measurement
        self._window: list[tuple[float, float, float, float]] = []  # (step s, comm s, wire, full) of valid steps
        self._latency: list[float] = []
        self._lock = threading.Lock()
        self._in_step = False
        self._step_start: float | None = None
        self._intervals: list[tuple[float, float]] = []
        self._step_wire = self._step_full = 0.0
        self._valid = False

    def _new_powersgd(self, rank: int) -> PowerSGDState:
        state = PowerSGDState(self.process_group, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                              use_error_feedback=True, warm_start=True)
        state.iter = state.start_powerSGD_iter  # the first steps run `initial`; buckets are final when it starts
        return state

    @property
    def level(self) -> str:
        """The level in use."""
        return self.names[self._current]

    # ------------------------------------------------------------------ setup
    def bind(self, module: torch.nn.Module) -> None:
        """Name the parameters of ``module`` (the model DDP wraps), so the error buffers can be checkpointed."""
        self._params = dict(module.named_parameters())
        self._names = {id(p): name for name, p in self._params.items()}
        if self.one_bit is not None:
            self.one_bit.bind(module)

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Bind ``ddp_model.module`` and register :func:`adaptive_hook` on ``ddp_model``."""
        self.bind(ddp_model.module)
        ddp_model.register_comm_hook(self, adaptive_hook)

    def hook(self, process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """:func:`adaptive_hook` with this state; DDP's ``state`` argument is ignored (``Pilot(compression=...)``)."""
        return self._run(bucket)

    def rescale_errors(self, factor: float) -> None:
        """Multiply the error-feedback buffers by ``factor`` (an fp16 GradScaler's loss scale changed by it)."""
        for e in self._residual.values():
            e.mul_(factor)
        if self.one_bit is not None:
            self.one_bit.rescale_errors(factor)

    def _world(self) -> int:
        return dist.get_world_size(self.process_group)

    # ------------------------------------------------------------------ one bucket
    def _run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if not self._in_step:
            self._begin_step()
        start = time.perf_counter()
        index, params, buffer = bucket.index(), list(bucket.parameters()), bucket.buffer()
        self._shapes[index] = [tuple(g.shape) for g in bucket.gradients()]
        world = self._world()
        full = ring_allreduce_bytes(buffer.numel() * 4, world)
        plain = self.full_precision or self.step < self.warmup_steps
        kind = "none" if plain else self._kinds[self._current][0]
        if plain:
            self._valid = False
        if kind != "powersgd" and self._residual:  # PowerSGD's residual is sent with the next step's gradient
            for p, g in zip(params, bucket.gradients()):
                e = self._residual.pop(id(p), None)
                if e is not None:
                    g.view(-1).add_(e)
        if kind == "powersgd":
            fut, wire = self._powersgd_bucket(bucket, index, params, world)
        elif kind == "1bit":
            assert self.one_bit is not None
            before = self.one_bit.wire_bytes
            fut = one_bit_hook(self.one_bit, bucket)
            wire = self.one_bit.wire_bytes - before
        else:
            wire = ring_allreduce_bytes(buffer.numel() * (buffer.element_size() if kind == "none" else 2), world)
            if kind == "none":
                fut = default_hooks.allreduce_hook(self.process_group, bucket)
            else:
                hook = default_hooks.fp16_compress_hook if kind == "fp16" else default_hooks.bf16_compress_hook
                fut = hook(self.process_group, bucket)
        self.wire_bytes += wire
        self.full_bytes += full
        self._step_wire += wire
        self._step_full += full
        if bucket.is_last():
            self._in_step = False
            self.step += 1
            self._since_switch += 1

        def done(result: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            tensor = result.value()
            with self._lock:  # one emulated link per rank: transfers queue behind each other
                if self.link_delay > 0:
                    time.sleep(self.link_delay * wire)
                self._intervals.append((start, time.perf_counter()))
            return tensor

        return fut.then(done)

    def _powersgd_bucket(self, bucket: dist.GradBucket, index: int, params: list[Any],
                         world: int) -> tuple[torch.futures.Future[torch.Tensor], float]:
        """Torch's PowerSGD hook with its error and warm-start factors kept per parameter: DDP regroups its buckets
        after its first iteration, and a resumed run starts from the first grouping again."""
        state, rank = self._powersgd[self._current], self._kinds[self._current][1]
        grads = bucket.gradients()
        device, dtype = bucket.buffer().device, bucket.buffer().dtype
        state.error_dict[index] = torch.cat([
            self._residual.pop(id(p)) if id(p) in self._residual else torch.zeros(p.numel(), dtype=dtype, device=device)
            for p in params
        ])
        order = rule.powersgd_factors([tuple(g.shape) for g in grads], rank)  # torch's order of the factors in memory
        factors = self._factors.setdefault(self._current, {})
        if order and all(id(params[pos]) in factors for pos, _, _ in order):
            state.q_memory_dict[index] = torch.cat([factors[id(params[pos])] for pos, _, _ in order]).to(device)
            state.p_memory_dict[index] = torch.empty(sum(n for _, _, n in order), dtype=dtype, device=device)
        else:  # some factor is new: torch draws all of the bucket's afresh, as on its first step
            state.q_memory_dict.pop(index, None)
            state.p_memory_dict.pop(index, None)
        before = state.total_numel_after_compression
        fut = powerSGD_hook(state, bucket)
        wire = ring_allreduce_bytes((state.total_numel_after_compression - before) * bucket.buffer().element_size(), world)

        def keep(result: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            for p, e in zip(params, state.error_dict.pop(index).split([p.numel() for p in params])):
                self._residual[id(p)] = e
            qs = state.q_memory_dict.pop(index).split([q for _, q, _ in order])
            state.p_memory_dict.pop(index, None)
            for (pos, _, _), q in zip(order, qs):
                factors[id(params[pos])] = q
            return result.value()

        return fut.then(keep), wire

    # ------------------------------------------------------------------ steps and decisions
    def _begin_step(self) -> None:
        """The first bucket of a step: close the previous step's measurement, then decide if it is a decision step."""
        now = time.perf_counter()
        with self._lock:
            intervals, self._intervals = sorted(self._intervals), []
        if self._step_start is not None and self._valid and intervals:
            comm, end = 0.0, -math.inf
            for a, b in intervals:  # union of the buckets' [hook call, result] intervals
                comm += max(0.0, b - max(a, end))
                end = max(end, b)
            self._window.append((now - self._step_start, comm, self._step_wire, self._step_full))
        self._step_start, self._in_step = now, True
        self._step_wire = self._step_full = 0.0
        self._valid = self._since_switch > 0
        if self.step > self.warmup_steps and self.step % self.every == 0 and self._world() > 1:
            self._valid = False
            self._agree()

    def _agree(self) -> None:
        """Every rank's collective times of the window are reduced to their minimum per step (the last rank to arrive
        at a collective waits for no one, so the minimum is free of the wait for a straggler, which no compression
        shortens); rank 0 decides and broadcasts its choice (one int64, whose time is a latency sample)."""
        times = torch.full((self.every,), math.inf, dtype=torch.float64)
        own = [row[1] for row in self._window][-self.every:]
        times[: len(own)] = torch.tensor(own, dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MIN, group=self.process_group)
        self._window = [(row[0], t, row[2], row[3]) for row, t in zip(self._window[-self.every:], times.tolist())]
        rank0 = dist.get_rank(self.process_group) == 0
        choice = torch.tensor([self._decide() if rank0 else -1], dtype=torch.int64)
        start = time.perf_counter()
        dist.broadcast(choice, group=self.process_group, group_src=0)
        self._latency = (self._latency + [time.perf_counter() - start])[-8:]
        new = int(choice.item())
        if new != self._current:
            self._current, self._since_switch = new, 0
            self.switches.append((self.step, self.names[new]))
        self._window = []

    def _decide(self) -> int:
        """Rank 0's choice. The current level's collective time per step is recorded (medians since the last
        decision); a level recorded within ``memory`` steps is predicted from its record, any other from the model of
        :mod:`.adaptive_rule`, with the seconds per byte of the record that sent the most bytes (the one least
        blurred by fixed costs)."""
        if self._window:
            step_s, comm_s, wire, _ = (statistics.median(column) for column in zip(*self._window))
            self._records[self._current] = [comm_s, wire, float(self.step)]
            self._other = max(0.0, step_s - comm_s)
        dwell = self.every if self._trial else self.min_dwell  # a level tried on a prediction may go at once
        if len(self._window) < 2 or self._since_switch < dwell or not self._shapes or not self._latency:
            return self._current
        shapes = [s for index in sorted(self._shapes) for s in self._shapes[index]]
        world, buckets = self._world(), len(self._shapes)
        if self._calibrations < 5:  # the fastest of a few timings: a busy machine only slows one down
            timed = [rule.codec_seconds(k, r, shapes, world) for k, r in self._kinds]
            self._codec = timed if self._codec is None else [min(a, b) for a, b in zip(self._codec, timed)]
            self._calibrations += 1
        assert self._codec is not None
        latency = statistics.median(self._latency)
        fresh = {i: r for i, r in self._records.items() if self.step - r[2] <= self.memory}
        i = max(fresh, key=lambda j: fresh[j][1])
        comm, wire, _ = fresh[i]
        per_byte = max(0.0, comm - self._codec[i] - rule.MESSAGES[self._kinds[i][0]] * buckets * latency) / max(wire, 1.0)
        predicted = [
            self._other + fresh[i][0] if i in fresh else rule.predict_step_seconds(
                self._other, self._codec[i], rule.MESSAGES[k] * buckets, rule.level_bytes(k, r, shapes, world), latency, per_byte)
            for i, (k, r) in enumerate(self._kinds)
        ]
        self.predicted = dict(zip(self.names, predicted))
        choice = rule.choose_level(predicted, self._current, self.tolerance, self.hysteresis)
        self._trial = choice not in fresh
        return choice

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The choice, the measurements, the counters, the PowerSGD factors and every rank's PowerSGD residuals and
        1-bit error buffers (a collective: every rank must call it, as a Pilot's ``state_dict()`` does)."""
        world = self._world()
        state: dict[str, Any] = {
            "version": 1, "levels": list(self.names), "current": self._current, "step": self.step,
            "since_switch": self._since_switch, "wire_bytes": self.wire_bytes, "full_bytes": self.full_bytes,
            "switches": [list(s) for s in self.switches], "predicted": dict(self.predicted),
            "codec": None if self._codec is None else list(self._codec), "calibrations": self._calibrations,
            "records": [[i, *r] for i, r in sorted(self._records.items())], "other": self._other, "trial": self._trial,
            "window": [list(w) for w in self._window],
            "latency": list(self._latency), "world_size": world, "residual_names": [], "residual": None,
            "powersgd": {self.names[i]: rule.powersgd_state_dict(s, {self._names[k]: q for k, q in self._factors.get(i, {}).items()})
                         for i, s in self._powersgd.items()},
            "one_bit": None if self.one_bit is None else self.one_bit.state_dict(),
        }
        if self._residual:
            keys = [k for k in (id(p) for p in self._params.values()) if k in self._residual]
            if len(keys) != len(self._residual):
                raise RuntimeError("AdaptiveCompression.state_dict() needs the parameters' names: call state.bind(model) "
                                   "with the module DDP wraps (or register it with state.register(ddp_model)).")
            flat = torch.cat([self._residual[k].reshape(-1) for k in keys]).cpu()
            rows = torch.empty(world, flat.numel(), dtype=flat.dtype)
            dist.all_gather_into_tensor(rows.view(-1), flat, group=self.process_group)
            state["residual_names"], state["residual"] = [self._names[k] for k in keys], rows
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (on every rank). Under another world size each rank's PowerSGD residual is the
        mean of the saved ranks' (1-bit: see :meth:`~batchpilot.distributed.compression.OneBitState.load_state_dict`)."""
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("not an AdaptiveCompression state_dict; pass what AdaptiveCompression.state_dict() returned")
        if list(state["levels"]) != list(self.names):
            raise ValueError(f"the state was saved with levels {state['levels']}, this hook has {list(self.names)}; "
                             "construct AdaptiveCompression with the same levels to resume")
        self._current, self.step, self._since_switch = int(state["current"]), int(state["step"]), int(state["since_switch"])
        self.wire_bytes, self.full_bytes = float(state["wire_bytes"]), float(state["full_bytes"])
        self.switches = [(int(a), str(b)) for a, b in state["switches"]]
        self.predicted = dict(state["predicted"])
        self._codec = None if state["codec"] is None else [float(c) for c in state["codec"]]
        self._calibrations = int(state["calibrations"])
        self._records = {int(i): [float(x) for x in r] for i, *r in state["records"]}
        self._other, self._trial = float(state["other"]), bool(state["trial"])
        self._window = [(float(a), float(b), float(c), float(d)) for a, b, c, d in state["window"]]
        self._latency = [float(x) for x in state["latency"]]
        self._step_start, self._intervals, self._in_step = None, [], False
        for i, s in self._powersgd.items():
            factors = rule.load_powersgd_state(s, state["powersgd"][self.names[i]])
            self._factors[i] = {id(self._params[n]): q for n, q in factors.items() if n in self._params}
        self._residual = {}
        if state["residual"] is not None:
            unknown = [n for n in state["residual_names"] if n not in self._params]
            if unknown:
                raise ValueError(f"the state holds PowerSGD residuals of parameters {unknown[:3]} that the bound model "
                                 "does not have; bind the model that saved it (state.bind(ddp_model.module))")
            rows = state["residual"]
            same = int(state["world_size"]) == self._world()
            flat = rows[dist.get_rank(self.process_group)] if same else rows.mean(dim=0)
            at = 0
            for n in state["residual_names"]:
                p = self._params[n]
                self._residual[id(p)] = flat[at:at + p.numel()].to(p.device, p.dtype).clone()
                at += p.numel()
        if self.one_bit is not None and state["one_bit"] is not None:
            self.one_bit.load_state_dict(state["one_bit"])


def adaptive_hook(state: AdaptiveCompression, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the level ``state`` chose for this step (module docstring); returns the average."""
    return state._run(bucket)
