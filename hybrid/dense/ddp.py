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
parameters only, so ``replicate`` broadcasts no buffers (e.g. BatchNorm running statistics);
hybrid does it itself, before each forward, where ``broadcast_buffers`` asks for it
(:func:`broadcasts_buffers`).

Several ddp modules of a plan with equal options share one reducer (:func:`merge_groups`,
:func:`apply_ddp_merged`): ``replicate`` on their common ancestor with the other branches in
``ignored_modules``. On CPU each gloo allreduce costs about 1.3 ms whatever its size, so a DLRM's
two small MLPs in one bucket save a millisecond per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import replicate
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh

from hybrid.dense.ring import ring_of
from hybrid.log import logger, warn_once
from hybrid.plan.schema import CommHook

COMM_HOOKS: tuple[str, ...] = get_args(CommHook)


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


def _mean_allreduce(group, bucket):  # noqa: ANN001 - DDP refuses a hook whose bucket annotation is not GradBucket
    # What DDP's built-in reduction computes, bit for bit: each gradient times 1 / trainers (the
    # reducer scales as it copies into the bucket when no hook is registered), then a sum.
    # The process group's own call, as DDP's reducer makes it: ``dist.all_reduce``'s checks and
    # logging around it cost the calling thread about 20 us more a call (66-70 us against 44-48).
    buffer = bucket.buffer().mul_(1.0 / group.size())
    return group.allreduce([buffer]).get_future().then(lambda fut: fut.value()[0])


def _ring_mean_allreduce(ring, bucket):  # noqa: ANN001 - DDP refuses a hook whose bucket annotation is not GradBucket
    # The same mean as _mean_allreduce, summed around the trainers' ring (hybrid.dense.ring); a
    # bucket the ring does not sum (not float32 on CPU) through the process group.
    buffer = bucket.buffer()
    if buffer.dtype != torch.float32 or buffer.device.type != "cpu":
        return _mean_allreduce(ring.group, bucket)
    return ring.allreduce_(buffer.mul_(1.0 / ring.size))


def _launch_then(hook, on_launch):
    """``hook`` (DDP's bucket reduction), then ``on_launch()`` while the reduction is on the wire."""

    def reduce_bucket(state, bucket):  # noqa: ANN001 - DDP refuses a hook whose bucket annotation is not GradBucket
        fut = hook(state, bucket)
        on_launch()
        return fut

    return reduce_bucket


def _is_under(fqn: str, root: str) -> bool:
    return root == "" or fqn == root or fqn.startswith(root + ".")


def _common_ancestor(fqns: list[str]) -> str:
    parts = [f.split(".") if f else [] for f in fqns]
    common = []
    for level in zip(*parts):
        if any(p != level[0] for p in level):
            break
        common.append(level[0])
    return ".".join(common)


def merge_groups(model: nn.Module, members: list[tuple[str, Any]]) -> list[tuple[str, list[str], Any]]:
    """Which ``ddp`` modules share one ``DistributedDataParallel``: ``[(root, fqns, options)]``.

    ``members`` are the plan's ddp modules as ``(fqn, options)``. Those with ``merge: true`` and
    equal options form one group, synchronized by one DDP applied on their closest common
    ancestor (``root``) over their parameters only -- one allreduce per bucket for all of them
    instead of at least one per module. A group is merged only where that is exact: no member
    inside another, and no module on the way from ``root`` down to a member (``root`` included,
    the members excluded) owns a parameter of its own, which the ancestor's DDP would
    otherwise take. Every other module forms a group of its own (``root == fqn``).
    """
    groups: list[tuple[Any, list[str]]] = []  # options dataclasses compare equal but do not hash
    alone: list[tuple[str, list[str], Any]] = []
    for fqn, opts in members:
        if not getattr(opts, "merge", False):
            alone.append((fqn, [fqn], opts))
            continue
        for gopts, fqns in groups:
            if gopts == opts:
                fqns.append(fqn)
                break
        else:
            groups.append((opts, [fqn]))
    out: list[tuple[str, list[str], Any]] = []
    for opts, fqns in groups:
        if len(fqns) > 1 and _mergeable(model, fqns):
            out.append((_common_ancestor(fqns), fqns, opts))
        else:
            out.extend((f, [f], opts) for f in fqns)
    return out + alone


def _path_modules(fqns: list[str], root: str) -> set[str]:
    """Modules from ``root`` down to each of ``fqns``, ``root`` included, ``fqns`` excluded."""
    path = set()
    depth = len(root.split(".")) if root else 0
    for f in fqns:
        parts = f.split(".") if f else []
        for k in range(depth, len(parts)):
            path.add(".".join(parts[:k]))
    return path - set(fqns)


def _mergeable(model: nn.Module, fqns: list[str]) -> bool:
    from torch.distributed.fsdp import FSDPModule

    if any(a != b and _is_under(b, a) for a in fqns for b in fqns):
        return False
    root = _common_ancestor(fqns)
    if isinstance(model.get_submodule(root), FSDPModule):
        return False
    return not any(any(True for _ in model.get_submodule(p).parameters(recurse=False))
                   for p in _path_modules(fqns, root))


def apply_ddp_merged(model: nn.Module, root: str, fqns: list[str], *, mesh: DeviceMesh, options: Any,
                     on_launch: Callable[[], None] | None = None) -> bool:
    """One DDP for the modules ``fqns`` (a group from :func:`merge_groups`), applied on ``root``;
    whether it was (not when no member has a parameter that takes gradients). ``on_launch`` as
    :func:`apply_ddp`'s.

    ``replicate(root, ignored_modules=...)`` takes the members' parameters and nothing else (the
    other branches under ``root`` are ignored), and its forward hooks on ``root`` drive the
    reducer. So a member must run inside ``root``'s forward: one that is called on its own
    would silently skip the sync; it raises instead, naming the group.
    """
    if len(fqns) == 1 and root == fqns[0]:
        return apply_ddp(model, root, mesh=mesh, options=options, on_launch=on_launch)
    if not _has_gradients(", ".join(fqns), [p for f in fqns for p in model.get_submodule(f).parameters()]):
        return False
    path = _path_modules(fqns, root)
    ignored = []
    for p in path:
        for name, child in model.get_submodule(p).named_children():
            child_fqn = f"{p}.{name}" if p else name
            if child_fqn not in fqns and child_fqn not in path:
                ignored.append(child)
    _replicate(model, root, mesh=mesh, options=options, ignored_modules=ignored,
               what=f"{', '.join(fqns)} (one reducer on {root or '<root>'})", on_launch=on_launch)
    _require_inside(model, root, fqns)
    return True


def _require_inside(model: nn.Module, root: str, fqns: list[str]) -> None:
    """A member of a merged DDP group that runs outside the root's forward raises."""
    root_mod = model.get_submodule(root)
    depth = [0]

    def enter(_m, _args):
        depth[0] += 1

    def leave(_m, _args, _out):
        depth[0] -= 1

    root_mod.register_forward_pre_hook(enter, prepend=True)
    root_mod.register_forward_hook(leave, always_call=True)
    group = ", ".join(fqns)

    def check(_m, _args, *, fqn: str) -> None:
        # Recomputation inside a backward (activation checkpointing) is not a new forward.
        if depth[0] or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        raise RuntimeError(
            f"{fqn} ran outside the forward of {root or 'the model'}: the ddp modules {group} share one "
            f"DistributedDataParallel whose gradient sync is driven by {root or 'the model'}'s forward, so "
            f"their gradients would not be synchronized. Call {root or 'the model'}, or set `merge: false` "
            f"on these modules in the plan (one DDP each)"
        )

    for f in fqns:
        model.get_submodule(f).register_forward_pre_hook(lambda m, a, f=f: check(m, a, fqn=f))


def apply_ddp(model: nn.Module, fqn: str, *, mesh: DeviceMesh, options: Any,
              on_launch: Callable[[], None] | None = None) -> bool:
    """Make ``model.get_submodule(fqn)`` data parallel over ``mesh`` (the trainers), in place.

    Options (read by attribute): ``bucket_cap_mb``, ``static_graph``, ``gradient_as_bucket_view``,
    ``find_unused_parameters`` (as ``DistributedDataParallel``'s), ``broadcast_buffers`` (a bool
    as DDP's, or ``"auto"``: :func:`broadcasts_buffers`), and ``comm_hook``: ``"none"`` (DDP's
    own mean all-reduce), ``"fp16"`` or ``"bf16"`` (``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``:
    gradients are all-reduced in that dtype, divided by the world size first).

    The module's parameters must be materialized on the mesh's device. As the
    ``DistributedDataParallel`` constructor does, this broadcasts rank 0's parameters to every
    trainer now (a collective: every trainer must call it). Gradients of a plain
    ``loss.backward()`` are then averaged over the trainers.

    ``on_launch``, if given, is called inside the backward each time a bucket's reduction has
    been launched (the composer sends postponed lookups there: the trainer's thread would
    otherwise wait for the network). Returns whether DDP was applied (not on a module without
    parameters that take gradients).
    """
    name = fqn or "<root>"
    if not _has_gradients(name, list(model.get_submodule(fqn).parameters())):
        return False
    _replicate(model, fqn, mesh=mesh, options=options, ignored_modules=[], what=name, on_launch=on_launch)
    return True


def _has_gradients(name: str, params: list[nn.Parameter]) -> bool:
    """Whether DDP over ``params`` has anything to synchronize (warns once if not); refuses
    parameters still on the meta device."""
    if not any(p.requires_grad for p in params):
        warn_once(f"ddp on {name}: no parameter requires a gradient, nothing to synchronize; left as is")
        return False
    if any(p.is_meta for p in params):
        raise ValueError(f"ddp on {name}: parameters are still on the meta device; materialize them first")
    return True


def broadcasts_buffers(module: nn.Module, ignored_modules: list[nn.Module], setting: bool | str) -> bool:
    """Whether DDP on ``module`` (minus ``ignored_modules``) broadcasts buffers before each
    forward: ``setting`` when a bool; for ``"auto"``, whether it holds a floating-point buffer.
    An integer buffer is an index table or a counter that every trainer keeps alike; a float one
    may be a running statistic, which only the broadcast keeps equal across trainers."""
    if isinstance(setting, bool):
        return setting
    return any(b.is_floating_point() or b.is_complex() for b in _own_buffers(module, ignored_modules))


def _own_buffers(module: nn.Module, ignored_modules: list[nn.Module]) -> list[torch.Tensor]:
    skip = {id(b) for m in ignored_modules for b in m.buffers()}
    return [b for b in module.buffers() if id(b) not in skip]


def _sync_buffers_from_rank0(module: nn.Module, ignored_modules: list[nn.Module], group) -> None:
    """What ``DistributedDataParallel(broadcast_buffers=True)`` does and composable ``replicate``
    does not (its DDP holds the parameters only): rank 0's buffers go to every trainer now and
    before each forward of ``module``. The buffers are looked up at each forward, since a module
    may reassign them."""

    def sync(*_args) -> None:
        buffers = _own_buffers(module, ignored_modules)
        if buffers:
            with torch.no_grad():
                dist._broadcast_coalesced(group, buffers, 256 * 2**20, 0)

    sync()
    module.register_forward_pre_hook(sync)


def _replicate(model: nn.Module, fqn: str, *, mesh: DeviceMesh, options: Any, ignored_modules: list[nn.Module],
               what: str, on_launch: Callable[[], None] | None) -> None:
    module = model.get_submodule(fqn)
    broadcast = broadcasts_buffers(module, ignored_modules, options.broadcast_buffers)
    group = mesh.get_group()
    hook = _comm_hook(options.comm_hook, mesh.device_type) if options.comm_hook != "none" else None
    state = group
    if hook is None and mesh.device_type == "cpu" and (ring := ring_of(group)) is not None:
        hook, state = _ring_mean_allreduce, ring
    if on_launch is not None:
        hook = _launch_then(hook or _mean_allreduce, on_launch)
    replicate(
        module,
        ignored_modules=ignored_modules,
        process_group=group,
        bucket_cap_mb=options.bucket_cap_mb,
        static_graph=options.static_graph,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
        find_unused_parameters=options.find_unused_parameters,
    )
    if hook is not None:
        module.register_comm_hook(state, hook)
    # replicate() builds its DistributedDataParallel lazily, in the first forward; build it now so
    # that the broadcast from rank 0 and DDP's cross-rank shape check happen here, at compose time.
    replicate.state(module).lazy_init()
    if broadcast:
        _sync_buffers_from_rank0(module, ignored_modules, group)
    logger.info(
        "applied ddp to %s (bucket_cap_mb=%g, static_graph=%s, gradient_as_bucket_view=%s, "
        "find_unused_parameters=%s, broadcast_buffers=%s%s, comm_hook=%s, all-reduce over %s, %d trainers)",
        what, options.bucket_cap_mb, options.static_graph, options.gradient_as_bucket_view,
        options.find_unused_parameters, broadcast, " (auto)" if options.broadcast_buffers == "auto" else "",
        options.comm_hook, "the trainers' ring" if state is not group else "the process group", mesh.size(),
    )
