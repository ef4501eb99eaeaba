"""Seeing through the wrappers a training loop puts around a model: DDP and ``torch.compile``."""

from __future__ import annotations

import sys
from typing import cast

from torch import nn
from torch.nn.parallel import DistributedDataParallel


def _is_compiled(model: nn.Module) -> bool:
    # torch.compile(module) returns an OptimizedModule; its module is only imported once something compiled.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def unwrap(model: nn.Module) -> tuple[nn.Module, DistributedDataParallel | None]:
    """The plain module inside ``DistributedDataParallel`` and ``torch.compile`` wrappers (in any order and
    nesting), and the outermost DDP wrapper (``None`` without DDP).

    The plain module is what checkpoints hold, so a checkpoint written by a compiled or DDP-wrapped model
    loads into the bare one and the other way round (its keys carry no ``module.`` / ``_orig_mod.``)."""
    ddp = None
    while True:
        if isinstance(model, DistributedDataParallel):
            ddp = ddp or model
            model = model.module
        elif _is_compiled(model):
            model = cast(nn.Module, model._orig_mod)
        else:
            return model, ddp
