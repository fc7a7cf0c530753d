"""``strategy: ddp`` -- data parallel over the trainers, through torch's composable ``replicate``.

``torch.distributed._composable.replicate`` runs a real ``DistributedDataParallel`` (same
reducer, buckets, options and comm hooks) from forward hooks instead of wrapping the module. So,
unlike ``DistributedDataParallel(module)``, nothing gets a ``module.`` prefix: ``state_dict()``,
``load_state_dict()``, ``named_parameters()``, ``get_submodule()`` and
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` see the plain model's names.
(Wrapping and stripping the prefix with state-dict hooks would fix ``state_dict()`` alone, and
``get_model_state_dict`` then fails: it expects ``module`` after a DDP wrapper.) It also works
on the root (``fqn == ""``).

One difference from ``DistributedDataParallel(module)``: the reducer is built over the module's
parameters only, so buffers (e.g. BatchNorm running statistics) are not broadcast from rank 0
before each forward; each trainer keeps its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._composable import replicate
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh

from hybrid.log import logger, warn_once

COMM_HOOKS = ("none", "fp16", "bf16")


def _bf16_compress_hook_any_backend(state, bucket):  # noqa: ANN001 - DDP refuses a hook whose bucket annotation is not GradBucket
    # DDP refuses a hook *named* bf16_compress_hook unless it runs on CUDA with NCCL >= 2.10
    # (older NCCL cannot reduce bfloat16). Gloo reduces bfloat16 fine on CPU, so on CPU the same
    # hook goes in under another name.
    return default_hooks.bf16_compress_hook(state, bucket)


def _comm_hook(name: str, device_type: str):
    if name == "fp16":
        return default_hooks.fp16_compress_hook
    if name == "bf16":
        return _bf16_compress_hook_any_backend if device_type == "cpu" else default_hooks.bf16_compress_hook
    raise ValueError(f"ddp comm_hook: got {name!r}; expected one of {', '.join(map(repr, COMM_HOOKS))}")


def apply_ddp(model: nn.Module, fqn: str, *, mesh: DeviceMesh, options: Any) -> None:
    """Make ``model.get_submodule(fqn)`` data parallel over ``mesh`` (the trainers), in place.

    Options (read by attribute): ``bucket_cap_mb``, ``static_graph``, ``gradient_as_bucket_view``,
    ``find_unused_parameters`` (as ``DistributedDataParallel``'s), and ``comm_hook``: ``"none"``,
    ``"fp16"`` or ``"bf16"`` (``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``:
    gradients are all-reduced in that dtype, divided by the world size first).

    The module's parameters must be materialized on the mesh's device. As the
    ``DistributedDataParallel`` constructor does, this broadcasts rank 0's parameters to every
    trainer now (a collective: every trainer must call it). Gradients of a plain
    ``loss.backward()`` are then averaged over the trainers.
    """
    module = model.get_submodule(fqn)
    name = fqn or "<root>"
    hook = None if options.comm_hook == "none" else _comm_hook(options.comm_hook, mesh.device_type)
    if not any(p.requires_grad for p in module.parameters()):
        warn_once(f"ddp on {name}: no parameter requires a gradient, nothing to synchronize; left as is")
        return
    if any(p.is_meta for p in module.parameters()):
        raise ValueError(f"ddp on {name}: parameters are still on the meta device; materialize them first")
    group = mesh.get_group()
    replicate(
        module,
        process_group=group,
        bucket_cap_mb=options.bucket_cap_mb,
        static_graph=options.static_graph,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
        find_unused_parameters=options.find_unused_parameters,
    )
    if hook is not None:
        module.register_comm_hook(group, hook)
    # replicate() builds its DistributedDataParallel lazily, in the first forward; build it now so
    # that the broadcast from rank 0 and DDP's cross-rank shape check happen here, at compose time.
    replicate.state(module).lazy_init()
    logger.info(
        "applied ddp to %s (bucket_cap_mb=%g, static_graph=%s, gradient_as_bucket_view=%s, "
        "find_unused_parameters=%s, comm_hook=%s, %d trainers)",
        name, options.bucket_cap_mb, options.static_graph, options.gradient_as_bucket_view,
        options.find_unused_parameters, options.comm_hook, mesh.size(),
    )
