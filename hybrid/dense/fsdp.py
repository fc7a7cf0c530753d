"""``strategy: fsdp`` -- FSDP2 (``torch.distributed.fsdp.fully_shard``) over the trainers.

Each parameter is sharded on dim 0 across the trainers' mesh; forward and backward all-gather it,
and a plain ``loss.backward()`` reduce-scatters (averages) its gradient. Parameters become
``DTensor``s with the same names, so state-dict keys do not change (``.full_tensor()`` gathers
one). Activation checkpointing uses the composable ``torch.distributed._composable.checkpoint``,
which works from forward hooks and, unlike ``checkpoint_wrapper`` (which inserts
``_checkpoint_wrapped_module.`` into every key below it), keeps every name.

Works on meta-device modules (shard first, then materialize: only the shard is allocated).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from hybrid.log import logger, warn_once

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(value: str, what: str) -> torch.dtype:
    if value not in DTYPES:
        raise ValueError(f"fsdp {what}: got {value!r}; expected one of {', '.join(map(repr, DTYPES))}")
    return DTYPES[value]


def _mp_policy(mp: Any, *, outermost: bool) -> MixedPrecisionPolicy:
    """Compute in ``param_dtype``, reduce gradients in ``reduce_dtype``.

    The outermost module casts its output back to float32 so that it drops into a float32 model
    (its neighbours -- DDP modules, pooled embeddings -- and the loss stay in float32); inner
    ``wrap`` blocks pass ``param_dtype`` activations to each other without casting.
    """
    if mp is None:
        return MixedPrecisionPolicy()
    param = _dtype(mp.param_dtype, "mixed_precision.param_dtype")
    output = getattr(mp, "output_dtype", None) or "float32"
    return MixedPrecisionPolicy(
        param_dtype=param,
        reduce_dtype=_dtype(mp.reduce_dtype, "mixed_precision.reduce_dtype"),
        output_dtype=_dtype(output, "mixed_precision.output_dtype") if outermost and param != torch.float32 else None,
    )


def _offload_policy(cpu_offload: bool, mesh: DeviceMesh, name: str) -> OffloadPolicy:
    if not cpu_offload:
        return OffloadPolicy()
    if mesh.device_type == "cpu":
        # CPUOffloadPolicy pins host memory for copies to an accelerator; with none present
        # fully_shard fails ("Cannot access accelerator device when none is available"). On a
        # CPU mesh the shards already live in host memory, so there is nothing to offload.
        warn_once(f"fsdp on {name}: cpu_offload ignored, the trainers run on CPU so parameters already live in host memory")
        return OffloadPolicy()
    return CPUOffloadPolicy()


def _wrap_targets(module: nn.Module, wrap: list[str], name: str) -> list[nn.Module]:
    """Descendants whose class name is in ``wrap``, innermost first; skips what FSDP already manages."""
    managed = {s for m in module.modules() if m is not module and isinstance(m, FSDPModule) for s in m.modules()}
    found: list[nn.Module] = []
    seen: set[str] = set()
    for m in module.modules():
        cls = type(m).__name__
        if m is not module and m not in managed and cls in wrap:
            found.append(m)
            seen.add(cls)
    for cls in wrap:
        if cls not in seen:
            warn_once(f"fsdp on {name}: wrap class {cls!r} matches no descendant module")
    return found[::-1]  # modules() is pre-order: reversed, every block comes before its ancestors


def apply_fsdp(model: nn.Module, fqn: str, *, mesh: DeviceMesh, options: Any) -> None:
    """Shard ``model.get_submodule(fqn)`` over ``mesh`` (the trainers) with ``fully_shard``, in place.

    Options (read by attribute):

    - ``reshard_after_forward``: free the gathered parameters after forward and gather them again
      in backward (less memory, one more all-gather);
    - ``mixed_precision``: ``None`` or an object with ``param_dtype`` and ``reduce_dtype``
      (``"float32"``, ``"bfloat16"``, ``"float16"``); the sharded parameters and the optimizer
      stay float32 and the module's output is cast back to float32;
    - ``cpu_offload``: ``CPUOffloadPolicy`` (shards, gradients and optimizer state in host
      memory); ignored with a warning on a CPU mesh, where that is where they are already;
    - ``activation_checkpointing``: recompute activations in backward; applied to every ``wrap``
      block, or to the whole module when ``wrap`` is empty;
    - ``wrap``: class names of descendants that get their own ``fully_shard`` first, inner before
      outer (each block then gathers and frees its own parameters).
    """
    module = model.get_submodule(fqn)
    name = fqn or "<root>"
    blocks = _wrap_targets(module, list(options.wrap), name)
    offload = _offload_policy(options.cpu_offload, mesh, name)
    if options.activation_checkpointing:
        for m in blocks or [module]:
            checkpoint(m)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=options.reshard_after_forward,
                    mp_policy=_mp_policy(options.mixed_precision, outermost=False), offload_policy=offload)
    fully_shard(module, mesh=mesh, reshard_after_forward=options.reshard_after_forward,
                mp_policy=_mp_policy(options.mixed_precision, outermost=True), offload_policy=offload)
    mp = options.mixed_precision
    logger.info(
        "applied fsdp to %s (reshard_after_forward=%s, mixed_precision=%s, cpu_offload=%s, "
        "activation_checkpointing=%s, wrapped %d blocks, %d trainers)",
        name, options.reshard_after_forward,
        f"{mp.param_dtype}/{mp.reduce_dtype}" if mp is not None else "none",
        isinstance(offload, CPUOffloadPolicy), options.activation_checkpointing, len(blocks), mesh.size(),
    )
