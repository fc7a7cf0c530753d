"""``strategy: local`` -- the module stays as it is: replicated on every trainer, no gradient sync."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hybrid.log import logger


def apply_local(model: nn.Module, fqn: str, *, mesh: DeviceMesh, options: Any = None) -> None:
    """Leave ``model.get_submodule(fqn)`` untouched and log it.

    Each trainer updates its own copy from its own batches only, so the copies drift apart
    unless the module is frozen or deterministic (no parameters, or ``requires_grad=False``).
    """
    module = model.get_submodule(fqn)
    params = sum(p.numel() for p in module.parameters())
    logger.info(
        "applied local to %s (%s, %d parameters replicated on %d trainers, no gradient sync)",
        fqn or "<root>", type(module).__name__, params, mesh.size(),
    )
