"""1-bit gradient compression with error feedback, as a DDP communication hook.

Each rank adds its *worker error* to its gradient, ``x = g + e_w``, and sends only the signs of ``x`` (bit-packed,
8 per byte) and one fp32 scale per chunk, ``scale = |chunk|_2 / sqrt(n_chunk)`` (the RMS: 1-bit Adam's scale,
Tang et al. 2021, arXiv 2102.02888, Sec. 4); what the signs miss, ``e_w <- x - scale * sign(x)``, is carried into
the next step (error feedback: 1-bit SGD, Seide et al. 2014; EF-SGD, Karimireddy et al. 2019). The exchange is
the two-phase compressed all-reduce of 1-bit Adam's backend: every parameter is padded to a multiple of
``8 N`` and cut into ``N`` chunks, chunk ``r`` of every parameter going to rank ``r`` (``all_to_all_single``);
rank ``r`` decodes and averages its chunks over the ranks, adds its *server error*, compresses again
(``e_s <- y - scale * sign(y)``) and sends the result to every rank (``all_gather``); every rank decodes the
same averaged gradient. A rank sends ``2 (N-1) (n/(8N) + 4k)`` bytes for a bucket of ``n`` values in ``k``
parameters, against ``2 (N-1)/N * 4n`` for a ring all-reduce in fp32: about 32x fewer at any ``N``.

Chunks are cut per *parameter*, not per bucket: the result, and the error buffers (kept per parameter), do not
depend on how DDP groups parameters into buckets, which it changes after its first iteration and which a resumed
run builds anew. ``sign(0)`` is ``+1`` (``x >= 0``), NaN ``-1``: deterministic.

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.)
"""

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("batchpilot")

__all__ = ["OneBitState", "one_bit_hook", "pack_signs", "ring_allreduce_bytes", "unpack_signs"]

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: ``2 (N-1)/N * nbytes`` (reduce-scatter, then
    all-gather; Patarasuk and Yuan 2009). The ``full_bytes`` yardstick of every batchpilot compression hook."""
    return 2.0 * (world_size - 1) / world_size * nbytes


def pack_signs(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor ``[..., 8m]`` into uint8 ``[..., m]``, first element in the highest bit."""
    shape = bits.shape[:-1] + (bits.shape[-1] // 8, 8)
    weights = _BITS.to(bits.device)
    return (bits.reshape(shape).to(torch.uint8) * weights).sum(dim=-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Undo :func:`pack_signs`: uint8 ``[..., m]`` to bool ``[..., 8m]``."""
    weights = _BITS.to(packed.device)
    bits = (packed.unsqueeze(-1) & weights) != 0
    return bits.reshape(packed.shape[:-1] + (packed.shape[-1] * 8,))


@dataclass(frozen=True)
class _Layout:
    """Where each parameter of a bucket lies in the bucket and in the ``[N, T]`` exchange matrix."""

    keys: tuple[int, ...]  # id() of each parameter
    numels: tuple[int, ...]
    chunks: tuple[int, ...]  # chunk length c_i (a multiple of 8): parameter padded to N * c_i
    columns: tuple[int, ...]  # first column of parameter i's chunk in the [N, T] matrix
    width: int  # T = sum c_i
    counts: torch.Tensor  # [N, k] real (unpadded) values of parameter i in chunk r (at least 1: a divisor)
    real: torch.Tensor  # [N, T] bool: a real value, not padding
    column_param: torch.Tensor  # [T] the parameter of each column

    @staticmethod
    def build(params: list[torch.Tensor], world_size: int, device: torch.device) -> "_Layout":
        numels = tuple(p.numel() for p in params)
        chunks = tuple(math.ceil(m / (8 * world_size)) * 8 for m in numels)
        columns = tuple(sum(chunks[:i]) for i in range(len(chunks)))
        counts = torch.tensor([[min(max(m - r * c, 0), c) for m, c in zip(numels, chunks)]
                               for r in range(world_size)], dtype=torch.float32, device=device)
        real = torch.cat([torch.arange(c, device=device).unsqueeze(0) < counts[:, i:i + 1]
                          for i, c in enumerate(chunks)], dim=1)
        column_param = torch.repeat_interleave(torch.arange(len(chunks), device=device),
                                               torch.tensor(chunks, device=device))
        return _Layout(tuple(id(p) for p in params), numels, chunks, columns, sum(chunks), counts.clamp(min=1), real,
                       column_param)

    def scale_columns(self, scales: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` per-parameter scales spread over their chunks' columns: ``[..., T]``."""
        return scales.index_select(-1, self.column_param)

    def segments(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """Parameter ``i``'s columns of ``matrix`` (``[..., T]``), one tensor each."""
        return [matrix[..., o:o + c] for o, c in zip(self.columns, self.chunks)]


def _chunk_scales(matrix: torch.Tensor, layout: _Layout, counts: torch.Tensor) -> torch.Tensor:
    """RMS of each parameter's chunk over its real values: ``sqrt(|chunk|^2 / count)``, ``[..., k]``."""
    sums = torch.stack([seg.pow(2).sum(dim=-1) for seg in layout.segments(matrix)], dim=-1)
    return torch.sqrt(sums / counts)


def _encode(bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One message per row: the signs (``bits``: value >= 0) packed, then the fp32 scales as bytes: uint8
    ``[rows, T/8 + 4k]``."""
    return torch.cat([pack_signs(bits), scales.contiguous().view(torch.uint8)], dim=-1)


def _signed(bits: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """``scale * sign``: ``spread`` where ``bits``, ``-spread`` elsewhere."""
    return torch.where(bits, spread, spread.neg())


def _decode(messages: torch.Tensor, layout: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Messages ``[rows, T/8 + 4k]`` to values ``± scale`` ``[rows, T]`` and the scales ``[rows, k]``."""
    split = layout.width // 8
    scales = messages[:, split:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # 4-byte aligned
    spread = layout.scale_columns(scales)
    return _signed(unpack_signs(messages[:, :split]), spread), scales


class OneBitState:
    """State of :func:`one_bit_hook`: error buffers, step counter and byte counters.

    Register it with ``state.register(ddp_model)`` (which also names the parameters, for :meth:`state_dict`), or
    ``ddp_model.register_comm_hook(state, one_bit_hook)`` followed by ``state.bind(ddp_model.module)``.

    Args:
        process_group: The group DDP reduces over (``None``: the default group).
        warmup_steps: Steps sent in full precision (a plain all-reduce average) before compressing; a step is one
            synchronised backward pass (under gradient accumulation with ``no_sync``, one optimizer step).

    Attributes:
        step: Synchronised backward passes so far.
        full_precision: When True, the current step is sent as a plain all-reduce average and the error buffers
            are left alone (the engine sets it on the steps whose gradient statistics it measures).
        wire_bytes: Bytes this rank sent to other ranks so far (a ring all-reduce counted as
            :func:`ring_allreduce_bytes`, an all-to-all as ``(N-1)/N`` of its input, an all-gather as ``N-1``
            times its input).
        full_bytes: What a ring all-reduce of the same buckets in fp32 would have sent.
        compressed_steps: Steps sent compressed.
    """

    def __init__(self, process_group: Any = None, *, warmup_steps: int = 10) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}; e.g. warmup_steps=10.")
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.step = 0
        self.full_precision = False
        self.wire_bytes = 0.0
        self.full_bytes = 0.0
        self.compressed_steps = 0
        self._worker: dict[int, torch.Tensor] = {}  # id(param) -> e_w, shaped like the flat parameter
        self._server: dict[int, torch.Tensor] = {}  # id(param) -> e_s of this rank's chunk, [c_i]
        self._names: dict[int, str] = {}
        self._params: dict[str, torch.nn.Parameter] = {}
        self._layouts: dict[tuple[int, ...], _Layout] = {}
        self._world = 0

    # ------------------------------------------------------------------ setup
    def bind(self, module: torch.nn.Module) -> None:
        """Name the parameters of ``module`` (the model DDP wraps), so the error buffers can be checkpointed."""
        self._params = dict(module.named_parameters())
        self._names = {id(p): name for name, p in self._params.items()}

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Bind ``ddp_model.module`` and register :func:`one_bit_hook` on ``ddp_model``."""
        self.bind(ddp_model.module)
        ddp_model.register_comm_hook(self, one_bit_hook)

    def hook(self, process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """:func:`one_bit_hook` with this state, as a hook ``hook(state, bucket)`` whose own ``state`` argument is
        ignored: ``Pilot(..., compression=OneBitState(warmup_steps=50).hook)``."""
        return one_bit_hook(self, bucket)

    def rescale_errors(self, factor: float) -> None:
        """Multiply the error buffers by ``factor`` (the gradients' scale changed: an fp16 GradScaler's loss scale
        went from ``s`` to ``factor * s``; exact for its powers of two)."""
        for errors in (self._worker, self._server):
            for e in errors.values():
                e.mul_(factor)

    def world_size(self) -> int:
        """Ranks in the process group."""
        return dist.get_world_size(self.process_group)

    def _layout(self, params: list[torch.Tensor], world: int, device: torch.device) -> "_Layout":
        key = tuple(id(p) for p in params)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _Layout.build(params, world, device)
        return layout

    # ------------------------------------------------------------------ the hook's two paths
    def _full(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buffer = bucket.buffer()
        world = self.world_size()
        self.wire_bytes += ring_allreduce_bytes(buffer.numel() * buffer.element_size(), world)
        return allreduce_hook(self.process_group, bucket)

    def _compressed(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer, params = bucket.buffer(), list(bucket.parameters())
        world, rank = self.world_size(), dist.get_rank(self.process_group)
        device = buffer.device
        layout = self._layout(params, world, device)
        # Worker: x = g + e_w, padded, chunk r of every parameter in row r.
        xs = []
        for p, g, m, c in zip(params, bucket.gradients(), layout.numels, layout.chunks):
            e = self._worker.get(id(p))
            x = g.reshape(-1).float() if e is None else g.reshape(-1).float() + e
            xs.append(torch.nn.functional.pad(x, (0, world * c - m)).view(world, c))
        matrix = torch.cat(xs, dim=1)
        scales = _chunk_scales(matrix, layout, layout.counts)
        bits = matrix >= 0
        sent = _encode(bits, scales)
        worker_error = matrix - _signed(bits, layout.scale_columns(scales))  # padding dropped when stored
        received = torch.empty_like(sent)
        row_bytes = sent.shape[1]
        self.wire_bytes += 2 * (world - 1) * row_bytes  # all-to-all, then all-gather, of one row each
        # Every collective is issued from the thread that runs the hooks, in bucket order, so the ranks issue
        # them in the same order (gloo matches collectives by issue order; one launched from a future's callback
        # could overtake the next bucket's). The all-to-all is waited for here, the all-gather overlaps the rest
        # of the backward pass.
        dist.all_to_all_single(received, sent, group=self.process_group)
        # Server: average chunk `rank` over the ranks, add e_s, compress again.
        values, _ = _decode(received, layout)
        real = layout.real[rank]
        mean = torch.where(real, values.sum(dim=0) / world, 0.0)
        errors = [self._server.get(k) for k in layout.keys]
        if any(e is not None for e in errors):
            mean = mean + torch.cat([torch.zeros(c, device=device) if e is None else e
                                     for e, c in zip(errors, layout.chunks)])
        y = mean.unsqueeze(0)
        server_scales = _chunk_scales(y, layout, layout.counts[rank:rank + 1])
        bits_s = y >= 0
        own = _encode(bits_s, server_scales).reshape(-1)
        server_error = torch.where(real, y - _signed(bits_s, layout.scale_columns(server_scales)), 0.0).reshape(-1)
        gathered = torch.empty(world, own.numel(), dtype=torch.uint8, device=device)
        fut = _all_gather(gathered, own, self.process_group).get_future()

        def decode(done: torch.futures.Future[Any]) -> torch.Tensor:
            done.wait()
            averaged, all_scales = _decode(gathered, layout)
            # A non-finite gradient anywhere (identical on every rank) leaves the error buffers as they were:
            # the step is skipped (skip_nonfinite, or a GradScaler's overflow), so must its residuals be.
            ok = torch.isfinite(all_scales).all()
            # On a GPU the choice stays on the device (no synchronisation); on the CPU a branch is cheaper.
            keep = None if ok.device.type == "cpu" and bool(ok) else ok
            out = []
            for i, (p, m) in enumerate(zip(params, layout.numels)):
                o, c = layout.columns[i], layout.chunks[i]
                out.append(averaged[:, o:o + c].reshape(-1)[:m])
                for errors, new in ((self._worker, worker_error[:, o:o + c].reshape(-1)[:m]),
                                    (self._server, server_error[o:o + c])):
                    old = errors.get(id(p))
                    errors[id(p)] = new.clone() if keep is None else torch.where(keep, new, 0.0 if old is None else old)
            return torch.cat(out).to(buffer.dtype)

        return fut.then(decode)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters and every rank's error buffers (a collective: every rank must call it, as a Pilot's
        ``state_dict()`` does). Buffers are on the CPU, ``worker_error`` ``[N, n]`` and ``server_error``
        ``[N, s]`` over the parameters in ``names`` (``None`` before the first compressed step)."""
        state: dict[str, Any] = {"version": 1, "step": self.step, "warmup_steps": self.warmup_steps,
                                 "wire_bytes": self.wire_bytes, "full_bytes": self.full_bytes,
                                 "compressed_steps": self.compressed_steps, "world_size": None, "names": [], "numels": [],
                                 "worker_error": None, "server_error": None}
        if not self._worker:
            return state
        if not self._names:
            raise RuntimeError("OneBitState.state_dict() needs the parameters' names: call state.bind(model) "
                               "(or register it with state.register(ddp_model)).")
        missing = [k for k in self._worker if k not in self._names]
        if missing:
            raise RuntimeError(f"{len(missing)} compressed parameters are not in the bound module; bind the "
                               "module DDP wraps (state.bind(ddp_model.module)).")
        keys = [k for k in (id(p) for p in self._params.values()) if k in self._worker]
        world = self.world_size()
        state["world_size"] = world
        state["names"] = [self._names[k] for k in keys]
        state["numels"] = [self._worker[k].numel() for k in keys]
        state["worker_error"] = _gather_rows(torch.cat([self._worker[k] for k in keys]), self.process_group)
        state["server_error"] = _gather_rows(torch.cat([self._server[k] for k in keys]), self.process_group)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Under the saved world size each rank takes its own buffers; under another,
        they are re-sharded by :func:`resharded` (the residual of the average gradient is kept)."""
        if not isinstance(state, dict) or state.get("version") != 1:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a OneBitState state_dict (version {found!r}); pass what OneBitState.state_dict() "
                             "returned.")
        unknown = [n for n in state["names"] if n not in self._params]
        if unknown:
            raise ValueError(f"the 1-bit state holds error buffers of parameters {unknown[:3]} that this model does "
                             "not have (or the state is not bound: state.bind(model)); load it into the model that "
                             "saved it.")
        world = self.world_size()
        worker, server = resharded(state, world, dist.get_rank(self.process_group))
        self.step, self.warmup_steps = int(state["step"]), int(state["warmup_steps"])
        self.wire_bytes, self.full_bytes = float(state["wire_bytes"]), float(state["full_bytes"])
        self.compressed_steps = int(state["compressed_steps"])
        self._worker, self._server = {}, {}
        for name, error in worker.items():
            p = self._params[name]
            self._worker[id(p)] = error.to(p.device, torch.float32).clone()
            chunk = math.ceil(p.numel() / (8 * world)) * 8
            own = torch.zeros(chunk) if server is None else server[name]
            self._server[id(p)] = own.to(p.device, torch.float32).clone()


def resharded(state: dict[str, Any], world_size: int, rank: int
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Rank ``rank``'s worker and server errors by parameter name from a saved :meth:`OneBitState.state_dict`.

    Under the saved world size: the rank's own. Under another (``M`` ranks from ``N``): every new rank's worker
    error is ``mean_i e_w,i + e_s`` (the saved workers' mean plus the saved server errors laid back over the whole
    parameter) and the server errors start at zero (``None``). The average gradient the ranks send next then
    carries the same residual as before, ``mean_i e_w,i + e_s``, whatever ``M``.
    """
    names, numels, saved = state["names"], state["numels"], state["world_size"]
    worker_rows, server_rows = state["worker_error"], state["server_error"]
    if worker_rows is None:
        return {}, None
    chunks = [math.ceil(m / (8 * saved)) * 8 for m in numels]
    same = saved == world_size
    if not same:
        logger.info("the 1-bit compression state was saved by %d ranks, this run has %d: each rank's worker error is "
                    "the saved ranks' mean plus the saved server error, server errors start at zero", saved,
                    world_size)
    mean = None if same else worker_rows.mean(dim=0)
    worker, server = {}, {}
    w, s = 0, 0
    for name, m, c in zip(names, numels, chunks):
        if same:
            worker[name], server[name] = worker_rows[rank, w:w + m], server_rows[rank, s:s + c]
        else:
            assert mean is not None
            worker[name] = mean[w:w + m] + server_rows[:, s:s + c].reshape(-1)[:m]
        w, s = w + m, s + c
    return worker, (server if same else None)


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> Any:
    """Start an all-gather of ``tensor`` into the rows of ``output`` (``all_gather_single`` since torch 2.13);
    return its work handle."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output.reshape(-1), tensor, group=group, async_op=True)


def _gather_rows(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``tensor`` (same size everywhere) as the rows of one CPU tensor."""
    rows = torch.empty(dist.get_world_size(group), tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    _all_gather(rows, tensor.contiguous(), group).wait()
    return rows.cpu()


def one_bit_hook(state: OneBitState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: 1-bit sign compression with worker and server error feedback (module docstring).

    Full precision (DDP's default all-reduce average) during ``state.warmup_steps`` steps and while
    ``state.full_precision`` is set. Works on gloo and NCCL.
    """
    buffer = bucket.buffer()
    world = state.world_size()
    state.full_bytes += ring_allreduce_bytes(buffer.numel() * 4, world)
    compress = state.step >= state.warmup_steps and not state.full_precision
    fut = state._compressed(bucket) if compress else state._full(bucket)
    if bucket.is_last():
        state.step += 1
        state.compressed_steps += int(compress)
    return fut
