"""Trainer side of the parameter servers: collection stand-ins, routing and pooling, the step
pipeline (prefetch and gradient push)."""

from __future__ import annotations

import torch

from hybrid.ps.client.collection import (
    BadBatchError,
    BadIdError,
    RemoteCollection,
    RemoteEmbedding,
    RemoteEmbeddingBag,
    RemoteEmbeddingBagCollection,
    RemoteEmbeddingCollection,
    RemoteTable,
)
from hybrid.ps.client.pipeline import (
    DistAutogradPush,
    RidingPush,
    ServerError,
    StepPipeline,
    StepTimes,
    pipeline_of,
    step,
)
from hybrid.ps.config import GRADIENT_PUSHES
from hybrid.ps.transport import connect


def make_pipeline(*, trainer: int, num_servers: int, staleness: int, gradient_push: str = "rpc",
                  transport: str = "auto", timeout_s: float = 300.0, start_step: int = 0,
                  device: torch.device | str = "cpu") -> StepPipeline:
    """A step pipeline of trainer ``trainer`` to servers ``ps0..``, with one transport per server
    (:func:`hybrid.ps.transport.connect`; distributed-autograd lookups need RPC). Received rows
    go to ``device`` (the trainer's)."""
    if gradient_push not in GRADIENT_PUSHES:
        raise ValueError(f"gradient_push must be one of {', '.join(GRADIENT_PUSHES)}, got {gradient_push!r}")
    names = [f"ps{s}" for s in range(num_servers)]
    mode = "rpc" if gradient_push == "dist_autograd" else transport
    transports = {s: connect(names[s], trainer, mode=mode, timeout_s=timeout_s) for s in range(num_servers)}
    push = RidingPush() if gradient_push == "rpc" else DistAutogradPush(timeout_s)
    return StepPipeline(trainer=trainer, transports=transports, server_names=names, push=push, staleness=staleness,
                        timeout_s=timeout_s, start_step=start_step, device=device)


__all__ = [
    "BadBatchError", "BadIdError", "DistAutogradPush", "GRADIENT_PUSHES", "RemoteCollection", "RemoteEmbedding",
    "RemoteEmbeddingBag", "RemoteEmbeddingBagCollection", "RemoteEmbeddingCollection", "RemoteTable", "RidingPush",
    "ServerError", "StepPipeline", "StepTimes", "make_pipeline", "pipeline_of", "step",
]
