"""Sharded training with FSDP2 (``torch.distributed.fsdp.fully_shard``): the parts of a step and of a checkpoint
that differ from DDP.

A model sharded by ``fully_shard`` holds its parameters and gradients as ``DTensor`` shards (``Shard(0)`` over a 1-D
device mesh); its backward reduce-scatters each gradient. :class:`ShardedModel` stands in for the DDP wrapper in the
engine, so the rest of the step is DDP's:

- accumulation: every micro-batch but the step's last runs with ``set_requires_gradient_sync(False)`` (FSDP2's
  ``no_sync``: the unsharded gradients accumulate locally, the reduce-scatter runs once);
- the reduction: a reduce-scatter that sums and then divides by the world size (installed with the public
  ``set_custom_reduce_scatter``, with ``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms``
  so that FSDP divides nothing before it), the mean over ranks that DDP computes, so the engine's loss weights
  (``N n_j / B``) stay exact;
- the gradient norm: the squares of the local shards, summed in one float64 all-reduce (:meth:`ShardedModel.grad_norm`),
  so clipping and the non-finite check see the full norm, identical on every rank;
- the gradient noise scale: on a measured step every micro-batch reduce-scatters, and the reduce-scatter reads the
  squared norm of this rank's micro-batch gradient (its input, before any reduction) for the noise probe: the
  micro-batches of all ranks are the small batches (McCandlish et al. 2018), as with DDP's communication hook;
- checkpoint files: the model and optimizer go through ``torch.distributed.checkpoint`` (DCP) into a folder beside
  the ``step-N.pt`` file (:func:`save_dcp`, :func:`load_dcp`), which loads under another world size, with or without
  FSDP (DCP reshards on load).

Refused with FSDP2 (each with a message): ``oom_recovery`` (it needs the reduction after the ranks agree),
``amp="fp16"`` (the GradScaler's overflow check is per shard), ``compression`` (a DDP communication hook), and a
model whose trainable parameters are not all sharded over the default process group.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import distributed as bpdist
from ..clipping import sum_of_squares

DCP_SUFFIX = ".dcp"
"""The DCP folder of checkpoint ``step-N.pt`` is ``step-N.dcp`` beside it."""


def fsdp_modules(module: torch.nn.Module) -> list[Any]:
    """The modules of ``module`` that ``fully_shard`` was applied to (empty without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2 (before 2.6)
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or to one of its submodules."""
    return bool(fsdp_modules(module))


class _SummingReduceScatter:
    """FSDP2's reduce-scatter (``set_custom_reduce_scatter``): sums over the ranks, then divides by their number
    (the mean DDP takes), and hands the squared norm of this rank's input to the noise probe on a measured step."""

    def __init__(self, owner: ShardedModel) -> None:
        self.owner = owner

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        probe = self.owner.probe
        if probe is not None and probe.measuring:  # the local gradient: zero padding adds nothing to its norm
            probe.read_local_sq(sum_of_squares([input_tensor], lazy=True))
        reduce_scatter = getattr(torch.distributed, "reduce_scatter_single", None) or \
            torch.distributed.reduce_scatter_tensor  # (the older name, deprecated in torch 2.13)
        reduce_scatter(output_tensor, input_tensor, op=torch.distributed.ReduceOp.SUM, group=group)
        output_tensor.div_(torch.distributed.get_world_size(group))
        return None


class ShardedModel:
    """Stands in for the DDP wrapper of a ``fully_shard`` model (see the module's docstring): ``no_sync()``,
    ``process_group``, the noise probe's reading of local gradients, and the gradient norm over all shards.

    Raises:
        ValueError: a setting FSDP2 cannot train with, or trainable parameters that are not sharded (a module
            outside every ``fully_shard``), or sharded over a mesh that is not 1-D.
    """

    broadcast_buffers = False  # (read by the engine only when it reduces, which it never does here)
    require_forward_param_sync = False

    def __init__(self, module: torch.nn.Module, *, oom_recovery: bool, amp: str | None, compression: Any) -> None:
        from torch.distributed.tensor import DTensor

        problems = []
        if oom_recovery:
            problems.append("oom_recovery=True needs the gradients reduced after the ranks agree on a replay, but "
                            "FSDP2 reduce-scatters inside the backward; drop oom_recovery and set "
                            "max_micro_batch_size (or max_micro_batch_tokens) to a size that fits")
        if amp == "fp16":
            problems.append("amp='fp16' uses a GradScaler whose overflow check sees only this rank's shards (the ranks "
                            "could disagree on skipping a step); use amp='bf16', or FSDP2's "
                            "MixedPrecisionPolicy(param_dtype=torch.bfloat16) in fully_shard")
        if compression is not None:
            problems.append("compression= compresses inside DDP's all-reduce, which a fully_shard model does not "
                            "run; drop compression")
        params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        plain = [name for name, p in params if not isinstance(p, DTensor)]
        if plain:
            problems.append(f"the trainable parameters {plain[:3]}{' and more' if len(plain) > 3 else ''} are not "
                            "sharded: apply fully_shard to the root module too (fully_shard(model) after its layers), "
                            "or their gradients would never be reduced over ranks")
        meshes = [p.device_mesh for _, p in params if isinstance(p, DTensor)]  # (each fully_shard builds its own)
        if any(mesh.ndim != 1 or mesh != meshes[0] for mesh in meshes):
            problems.append("the model is sharded over a mesh that is not one 1-D mesh (HSDP or several meshes); "
                            "batchpilot shares the batch over the default process group: fully_shard over a 1-D mesh "
                            "of all ranks (the default)")
        if problems:
            raise ValueError("this fully_shard (FSDP2) model cannot train here:\n  - " + "\n  - ".join(problems))
        self.module = module
        self.modules = fsdp_modules(module)
        mesh = meshes[0] if meshes else None
        self.process_group = None if mesh is None else mesh.get_group()
        self.world_size = 1 if mesh is None else mesh.size()
        self.probe: Any = None  # the noise probe, once attached
        comm = _SummingReduceScatter(self)
        for m in self.modules:
            m.set_gradient_divide_factor(1.0)  # nothing divided before the reduce-scatter: the comm takes the mean
            m.set_force_sum_reduction_for_comms(True)
            m.set_custom_reduce_scatter(comm)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """FSDP2's equivalent of DDP's ``no_sync``: the backward inside keeps the unsharded gradients and reduces
        nothing. On a step the noise probe measures every micro-batch reduces (its local gradient is read in the
        reduce-scatter), and on one rank nothing is ever held back (there is nothing to send)."""
        if self.world_size == 1 or (self.probe is not None and self.probe.measuring):
            yield
            return
        self.module.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)  # type: ignore[operator]

    def attach_noise_probe(self, probe: Any) -> None:
        """Let ``probe`` read each micro-batch's local gradient in the reduce-scatter on measured steps."""
        self.probe = probe

    def grad_norm(self, params: list[torch.nn.Parameter]) -> float:
        """The L2 norm of the full gradient: the local shards' squares, summed over ranks in one all-reduce
        (``inf``/``nan`` when a gradient is not finite). Every rank must call it."""
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
        total = torch.tensor([float(sum_of_squares(local)) if local else 0.0], dtype=torch.float64)
        if self.world_size > 1:
            total = bpdist.all_reduce_sum(total)
        return math.sqrt(float(total[0]))


def dcp_folder(path: str | Path) -> Path:
    """The DCP folder that holds the model and optimizer of checkpoint file ``path``."""
    path = Path(path)
    return path.with_name(path.stem + DCP_SUFFIX)


def _placeholders(state: dict[str, Any]) -> dict[str, Any]:
    """The tensors of a (sharded) model state as stride-0 placeholders of their full shapes (a few bytes each), so
    that a checkpoint's fit check sees names and shapes without the weights."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            out[name] = torch.empty((), dtype=value.dtype).expand(*value.shape)
        else:
            out[name] = value
    return out


def save_dcp(state: dict[str, Any], path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the model and optimizer of a sharded run to ``dcp_folder(path)`` through DCP (every rank writes its
    shards), and put in ``state`` what the ``.pt`` file keeps of them: the model's names and full shapes, the
    optimizer's parameter groups, and the folder's name. Every rank must call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = dcp_folder(path)
    model_state, optim_state = get_state_dict(module, optimizer)
    if bpdist.rank_and_world()[0] == 0 and folder.exists():
        shutil.rmtree(folder)  # a folder of an earlier run of this step: its shards may be more than ours
    if bpdist.is_distributed():
        bpdist.barrier()
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))
    state["model"] = _placeholders(model_state)
    state["optimizer"] = {"param_groups": state["optimizer"]["param_groups"], "state": {}}
    state["sharded"] = {"dcp": folder.name}


def resolve_dcp(state: dict[str, Any], path: Path) -> None:
    """Point a sharded checkpoint's DCP folder name (see :func:`save_dcp`) at the folder beside ``path``."""
    sharded = state.get("sharded")
    if isinstance(sharded, dict) and "dcp" in sharded:
        sharded["path"] = str(Path(path).with_name(sharded["dcp"]))


def dcp_problems(state: dict[str, Any]) -> list[str]:
    """Why the DCP folder of a sharded checkpoint cannot be loaded (empty: it can): missing, or its metadata
    (written last) absent."""
    sharded = state.get("sharded")
    if not isinstance(sharded, dict):
        return []
    folder = Path(sharded.get("path", sharded.get("dcp", "")))
    if not (folder / ".metadata").is_file():
        return [f"its model and optimizer live in the DCP folder {str(folder)!r}, which is missing or incomplete "
                "(no .metadata); copy the folder beside the .pt file, or load an earlier checkpoint"]
    return []


def load_dcp(state: dict[str, Any], module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the model and optimizer of a sharded checkpoint from its DCP folder into ``module`` and ``optimizer``,
    sharded or not and under any world size (DCP reshards). Every rank must call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(module, optimizer)
    target: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    dcp.load(target, checkpoint_id=state["sharded"]["path"])
    set_state_dict(module, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"])


def prune_dcp(directory: str | os.PathLike) -> None:
    """Remove the DCP folders in ``directory`` whose ``step-N.pt`` is gone (pruned), on rank 0."""
    directory = Path(directory)
    for folder in directory.glob(f"step-*{DCP_SUFFIX}"):
        if folder.is_dir() and not folder.with_suffix(".pt").exists():
            shutil.rmtree(folder, ignore_errors=True)
