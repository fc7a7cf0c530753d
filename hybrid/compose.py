"""model + plan -> the running hybrid model (on a trainer).

A thin orchestrator, in a fixed order:

1. resolve the plan against the model and log its table (rank 0);
2. replace every ``parameter_server`` module by its remote stand-in and create its tables on the
   servers (trainer 0 creates, every trainer waits at a barrier);
3. ``fsdp`` modules get ``fully_shard``, inner before outer (they may still be on meta);
4. anything still on the meta device is materialized and initialized (``reset_parameters``);
5. ``ddp`` and ``local`` modules are applied (DDP needs real tensors); ddp modules with equal
   options share one DDP (:func:`hybrid.dense.ddp.merge_groups`);

The model gets its :class:`~hybrid.ps.client.StepPipeline` (step numbering, prefetch, gradient
push), which ``hybrid.step(model, optimizer)`` drives.

The strategies themselves live in :mod:`hybrid.dense` (one ``apply_*`` per strategy, looked up in
``DENSE_STRATEGIES``) and :mod:`hybrid.ps.client`. State-dict keys of the result equal the plain
model's.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from hybrid.launch.init import RuntimeOptions, device_type
from hybrid.launch.roles import Role
from hybrid.log import logger
from hybrid.plan import Plan, ResolvedModule, ResolvedPlan, log_plan, resolve
from hybrid.ps.client import RemoteEmbeddingBag, RemoteEmbeddingBagCollection, StepPipeline, make_pipeline


def _parent(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    if not fqn:
        raise ValueError("the root module itself cannot be replaced; rule a submodule instead")
    parent_path, _, name = fqn.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), name


def _apply_parameter_server(
    model: nn.Module, entry: ResolvedModule, *, resolved: ResolvedPlan, role: Role, name: str,
    pipeline: StepPipeline, timeout_s: float, init_tables: str, start_step: int,
) -> RemoteEmbeddingBagCollection:
    """Swap the module at ``entry.fqn`` for its remote stand-in; trainer 0 creates the tables."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    opts = entry.options
    module = model.get_submodule(entry.fqn)
    cid = f"{name}/{entry.fqn}" if name else entry.fqn
    if isinstance(module, EmbeddingBagCollection):
        local, bag = module, None
    elif isinstance(module, nn.EmbeddingBag):
        local, bag = RemoteEmbeddingBag.as_collection(module, cid=cid), module
    else:
        raise NotImplementedError(
            f"modules.{entry.rule_key}: parameter_server for {type(module).__name__} at "
            f"{entry.fqn!r} is not implemented yet (EmbeddingBagCollection and nn.EmbeddingBag are)"
        )
    config = RemoteEmbeddingBagCollection.config_from(
        local, cid=cid, num_servers=resolved.num_servers, sharding=opts.sharding,
        servers=opts.server_list(resolved.num_servers), optimizer=opts.optimizer, num_trainers=role.num_trainers,
        staleness=resolved.plan.sync.staleness, gradient_scaling=resolved.plan.sync.gradient_scaling,
        id_policy=opts.id_policy)
    coll = RemoteEmbeddingBagCollection(config, pipeline=pipeline, server_names=pipeline.server_names,
                                        timeout_s=timeout_s)
    remote: nn.Module = coll if bag is None else RemoteEmbeddingBag(coll, include_last_offset=bag.include_last_offset)
    if role.index == 0:
        # The servers' step bookkeeping starts where the trainers' numbering does (a resumed run).
        coll.create_on_servers(init="zeros" if init_tables == "module" else "seed", start_step=start_step)
        if init_tables == "module":
            coll.write_tables(_local_weights(module, entry.fqn, config))
    parent, attr = _parent(model, entry.fqn)
    setattr(parent, attr, remote)
    logger.info(
        "applied parameter_server to %s: %d tables %s on %s, optimizer %s lr=%g",
        entry.fqn, len(coll.tables), opts.sharding, ",".join(coll.server_names[s] for s in coll.servers),
        opts.optimizer.name, opts.optimizer.lr,
    )
    return coll


def _local_weights(module: nn.Module, fqn: str, config) -> dict[str, torch.Tensor]:
    """The tables of a local collection (or bag), by table name, to copy onto the servers."""
    if isinstance(module, nn.EmbeddingBag):
        weights = {config.tables[0].name: module.weight}
    else:
        weights = {name: bag.weight for name, bag in module.embedding_bags.items()}
    meta = sorted(n for n, w in weights.items() if w.is_meta)
    if meta:
        raise ValueError(f"{fqn}: table {meta[0]} is on the meta device, so there is nothing to copy to the servers; "
                         f"compose with init_tables='server' (each server initializes its rows)")
    return {n: w.detach() for n, w in weights.items()}


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate and initialize everything still on meta (after sharding, so FSDP allocates shards)."""
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return
    # A buffer computed in __init__ (DLRM's interaction indices, a positional table) comes back
    # from to_empty as garbage; only its module can recompute it. Find them before allocating.
    meta_buffers = {
        fqn: [n for n, b in m.named_buffers(recurse=False) if b.is_meta]
        for fqn, m in model.named_modules()
        if not isinstance(m, (RemoteEmbeddingBagCollection, RemoteEmbeddingBag))
    }
    model.to_empty(device=device)
    for fqn, m in model.named_modules():
        if isinstance(m, (RemoteEmbeddingBagCollection, RemoteEmbeddingBag)):
            continue
        reset = getattr(m, "reset_parameters", None)
        has_params = any(True for _ in m.parameters(recurse=False))
        if callable(reset) and has_params:
            reset()  # nn.Linear, nn.BatchNorm (its running statistics too), ...
        if meta_buffers.get(fqn):
            reset_buffers = getattr(m, "reset_buffers", None)
            if callable(reset_buffers):
                reset_buffers()
            elif not (callable(reset) and has_params):
                names = ", ".join(f"{fqn}.{n}" if fqn else n for n in meta_buffers[fqn])
                raise ValueError(
                    f"buffer {names} of {type(m).__name__} was built on the meta device and nothing can "
                    f"recompute it (the module has no reset_buffers() or reset_parameters()); build "
                    f"{fqn or 'the model'} outside `torch.device('meta')`, or give {type(m).__name__} a "
                    f"reset_buffers() method that fills it"
                )
    logger.info("materialized the model on %s", device)


def _guard_dense(module: nn.Module, fqn: str) -> None:
    """Refuse to run a DDP/FSDP module inside a distributed-autograd context.

    There, FSDP2 never syncs its gradients and DDP writes them into the context instead of
    ``.grad``, both silently. ``hybrid.step`` never makes a context current on the training thread.
    """
    import torch.distributed.autograd as dist_autograd

    def hook(_mod, _args):
        try:
            ctx = dist_autograd._current_context()
        except RuntimeError:
            return
        raise RuntimeError(
            f"{fqn or 'the model'} (a DDP/FSDP module) ran inside distributed-autograd context "
            f"{ctx._context_id()}: its gradients would not be synchronized. Run the training step "
            f"with `with hybrid.step(model, optimizer) as s:` instead of dist_autograd.context()"
        )

    module.register_forward_pre_hook(hook)


def compose(
    model: nn.Module,
    plan: Plan | ResolvedPlan,
    *,
    role: Role,
    name: str = "",
    runtime_options: RuntimeOptions | None = None,
    init_tables: Literal["module", "server"] = "module",
    start_step: int = 0,
) -> nn.Module:
    """Turn a plain model into the hybrid model on this trainer; returns the same object.

    ``init_tables="module"`` copies the model's embedding weights to the servers (the hybrid run
    starts exactly where the plain one would), streamed in bounded chunks; ``"server"`` lets each
    server initialize its shards (use it for tables built on meta). ``start_step`` numbers the
    first step (a resumed run's). ``name`` namespaces the tables on the servers
    when one job composes several models.
    """
    from hybrid.dense import DENSE_STRATEGIES
    from hybrid.dense.ddp import apply_ddp_merged, merge_groups

    if not role.is_trainer:
        raise RuntimeError(f"compose runs on trainers; {role.name} is a parameter server")
    options = runtime_options or RuntimeOptions()
    resolved = plan if isinstance(plan, ResolvedPlan) else resolve(plan, model, world_size=role.world_size)
    if role.index == 0:
        log_plan(resolved, model)
    device = torch.device(device_type(), torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type(), (role.num_trainers,))
    pipeline = make_pipeline(trainer=role.index, num_servers=resolved.num_servers,
                             staleness=resolved.plan.sync.staleness, gradient_push=options.gradient_push,
                             transport=options.ps_transport, timeout_s=options.rpc_timeout_s, start_step=start_step,
                             device=device)
    object.__setattr__(model, "_hybrid_pipeline", pipeline)  # hybrid.step(model) finds it; not a submodule
    for entry in resolved.by_strategy("parameter_server"):
        _apply_parameter_server(model, entry, resolved=resolved, role=role, name=name, pipeline=pipeline,
                                timeout_s=options.rpc_timeout_s, init_tables=init_tables, start_step=start_step)
    dist.barrier()  # tables exist on the servers before any trainer looks up
    order = resolved.apply_order()
    for entry in order:
        if entry.strategy == "fsdp":
            DENSE_STRATEGIES["fsdp"](model, entry.fqn, mesh=mesh, options=entry.options)
    _materialize(model, device)
    if device.type != "cpu":
        for n, m in model.named_modules():
            if not isinstance(m, (RemoteEmbeddingBagCollection, RemoteEmbeddingBag)):
                m.to(device)
    for entry in order:
        if entry.strategy == "local":
            DENSE_STRATEGIES["local"](model, entry.fqn, mesh=mesh, options=entry.options)
    # ddp modules with equal options share one DDP (one set of buckets) where that is exact.
    ddp = [(e.fqn, e.options) for e in order if e.strategy == "ddp"]
    for root, fqns, opts in merge_groups(model, ddp):
        apply_ddp_merged(model, root, fqns, mesh=mesh, options=opts)
    for entry in order:
        if entry.strategy in ("ddp", "fsdp"):
            _guard_dense(model.get_submodule(entry.fqn), entry.fqn)
    return model
