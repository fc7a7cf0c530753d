"""model + plan -> the running hybrid model (on a trainer).

A thin orchestrator, in a fixed order:

1. resolve the plan against the model and log its table (rank 0);
2. replace every ``parameter_server`` module by its remote stand-in and create its tables on the
   servers (trainer 0 creates, every trainer waits at a barrier); the module may be on meta: the
   servers fill their own shards, so no table is ever allocated on a trainer;
3. ``fsdp`` modules get ``fully_shard``, inner before outer (they may still be on meta);
4. anything still on the meta device is materialized and initialized (``reset_parameters``);
   tensors built for real keep their values;
5. ``ddp`` and ``local`` modules are applied (DDP needs real tensors); ddp modules with equal
   options share one DDP (:func:`hybrid.dense.ddp.merge_groups`);

The model gets its :class:`~hybrid.ps.client.StepPipeline` (step numbering, prefetch, gradient
push), which ``hybrid.step(model, optimizer)`` drives.

The strategies themselves live in :mod:`hybrid.dense` (one ``apply_*`` per strategy, looked up in
``DENSE_STRATEGIES``) and :mod:`hybrid.ps.client`. State-dict keys of the result equal the plain
model's.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from hybrid.launch.init import RuntimeOptions, device_type
from hybrid.launch.roles import Role
from hybrid.log import logger
from hybrid.plan import Plan, ResolvedModule, ResolvedPlan, log_plan, resolve
from hybrid.ps.client import (
    RemoteCollection,
    RemoteEmbedding,
    RemoteEmbeddingBag,
    RemoteEmbeddingBagCollection,
    RemoteEmbeddingCollection,
    RemoteTable,
    StepPipeline,
    make_pipeline,
)


def _parent(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    if not fqn:
        raise ValueError("the root module itself cannot be replaced; rule a submodule instead")
    parent_path, _, name = fqn.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), name


def _apply_parameter_server(
    model: nn.Module, entry: ResolvedModule, *, resolved: ResolvedPlan, num_servers: int, role: Role, name: str,
    pipeline: StepPipeline, timeout_s: float, init_tables: str, seed: int, start_step: int,
) -> RemoteCollection:
    """Swap the module at ``entry.fqn`` for its remote stand-in; trainer 0 creates the tables."""
    opts = entry.options
    module = model.get_submodule(entry.fqn)
    cid = f"{name}/{entry.fqn}" if name else entry.fqn
    local, make_remote, wrap = _stand_in(module, cid, entry)
    config = RemoteCollection.config_from(
        local, cid=cid, num_servers=num_servers, sharding=opts.sharding,
        servers=None if resolved.in_process else opts.server_list(num_servers), optimizer=opts.optimizer,
        num_trainers=role.num_trainers,
        staleness=resolved.plan.sync.staleness, gradient_scaling=resolved.plan.sync.gradient_scaling,
        id_policy=opts.id_policy, init_seed=seed, storage_dtype=opts.storage_dtype, dynamic=opts.dynamic_ids(),
        wire_dtype=opts.wire_dtype, pool_on=opts.pool_on)
    coll = make_remote(config, pipeline=pipeline, server_names=pipeline.server_names, timeout_s=timeout_s,
                       hot_rows=opts.hot_rows)
    remote: nn.Module = coll if wrap is None else wrap(coll)
    source = _table_source(module, entry.fqn, init_tables, dynamic=config.dynamic is not None)
    if role.index == 0:
        # The servers' step bookkeeping starts where the trainers' numbering does (a resumed run).
        coll.create_on_servers(init="zeros" if source == "module" else "seed", start_step=start_step)
        if source == "module":
            coll.write_tables(_local_weights(module, config))
        elif isinstance(remote, RemoteEmbedding):
            remote.zero_padding_row()  # torch keeps the padding row zero
    parent, attr = _parent(model, entry.fqn)
    setattr(parent, attr, remote)  # the local tables, if any, go with the module
    logger.info(
        "applied parameter_server to %s: %d tables %s on %s, optimizer %s lr=%g, tables from %s",
        entry.fqn, len(coll.tables), opts.sharding, ",".join(coll.server_names[s] for s in coll.servers),
        opts.optimizer.name, opts.optimizer.lr, "the module" if source == "module" else f"the servers (seed {seed})",
    )
    return coll


def _stand_in(module: nn.Module, cid: str, entry: ResolvedModule):
    """What replaces ``module``: ``(the collection whose tables go to the servers, the remote
    collection's constructor, the wrapper of a plain one-table module or None)``."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    if isinstance(module, EmbeddingBagCollection):
        return module, RemoteEmbeddingBagCollection, None
    if isinstance(module, EmbeddingCollection):
        return module, partial(RemoteEmbeddingCollection, need_indices=module.need_indices()), None
    if isinstance(module, nn.EmbeddingBag):
        return (RemoteEmbeddingBag.as_collection(module, cid=cid, path=entry.fqn), RemoteEmbeddingBagCollection,
                partial(RemoteEmbeddingBag, include_last_offset=module.include_last_offset))
    if isinstance(module, nn.Embedding):
        if module.padding_idx is not None and not module.weight.is_meta \
                and bool(module.weight[module.padding_idx].detach().any()):
            raise ValueError(f"{entry.fqn}: row padding_idx={module.padding_idx} of the nn.Embedding is not zero; "
                             f"on a parameter server the padding row reads as zero (torch's default), so "
                             f"zero it before composing")
        return (RemoteEmbedding.as_collection(module, cid=cid, path=entry.fqn), RemoteEmbeddingCollection,
                partial(RemoteEmbedding, padding_idx=module.padding_idx))
    raise ValueError(f"modules.{entry.rule_key}: parameter_server for {type(module).__name__} at {entry.fqn!r}: "
                     f"expected an EmbeddingBagCollection, EmbeddingCollection, nn.EmbeddingBag or nn.Embedding")


def _table_source(module: nn.Module, fqn: str, init_tables: str, *, dynamic: bool = False) -> str:
    """Where a collection's initial rows come from: ``module`` (its weights, copied to the
    servers) or ``server`` (each server fills its rows). ``auto``: ``server`` for tables on the
    meta device, ``module`` for real ones. ``dynamic`` (``ids: dynamic``): always ``server`` --
    a row is made when its raw id is admitted, from (seed, table, id), so numbered rows have no
    place to go; ``auto`` leaves real weights unused (and says so), ``module`` is refused."""
    if init_tables not in ("auto", "module", "server"):
        raise ValueError(f"init_tables: got {init_tables!r}; expected one of 'auto', 'module', 'server'")
    meta = {p.is_meta for p in module.parameters()}
    if dynamic:
        if init_tables == "module":
            raise ValueError(f"{fqn}: ids: dynamic tables have no numbered rows to copy (a row is made when its id is "
                             f"admitted, from seed, table and id); compose with init_tables='server' or 'auto'")
        if False in meta:
            logger.info("%s: ids: dynamic, so its weights are not copied to the servers (each row is made when its "
                        "id is admitted); build it on the meta device to skip allocating them", fqn)
        return "server"
    if init_tables == "module" and True in meta:
        raise ValueError(f"{fqn}: its tables are on the meta device, so there is nothing to copy to the servers; "
                         f"compose with init_tables='server' or 'auto' (each server initializes its rows)")
    if init_tables != "auto":
        return init_tables
    if len(meta) > 1:
        raise ValueError(f"{fqn}: some of its tables are on the meta device and some are not; build them all on "
                         f"meta (the servers initialize them) or all for real (copied to the servers)")
    return "server" if True in meta else "module"


def _local_weights(module: nn.Module, config) -> dict[str, torch.Tensor]:
    """The tables of a local collection (or plain table), by table name, to copy onto the servers."""
    if isinstance(module, (nn.EmbeddingBag, nn.Embedding)):
        return {config.tables[0].name: module.weight.detach()}
    tables = module.embedding_bags if hasattr(module, "embedding_bags") else module.embeddings
    return {name: t.weight.detach() for name, t in tables.items()}


def _materialize(model: nn.Module, device: torch.device, *, seed: int) -> None:
    """Allocate and initialize every parameter and buffer still on meta (after sharding, so FSDP
    allocates shards); tensors built for real (a buffer computed in ``__init__`` outside the meta
    device, a module built on the CPU) keep their values.

    Modules are initialized in model order from the CPU generator seeded with ``seed`` (the
    caller's RNG state is left as it was), on the host whatever the trainer's device (a GPU
    trainer gets a CPU process's values), each on whole tensors of its own: an FSDP module keeps its
    shard of them. So every trainer's shards together are the one tensor a single process
    initializing the module gets, and only one module's whole parameters exist at a time.
    """
    stubs = (RemoteCollection, RemoteTable)
    on_meta = {
        fqn: ([n for n, p in m.named_parameters(recurse=False) if p.is_meta],
              [n for n, b in m.named_buffers(recurse=False) if b.is_meta])
        for fqn, m in model.named_modules() if not isinstance(m, stubs)
    }
    on_meta = {fqn: lists for fqn, lists in on_meta.items() if lists[0] or lists[1]}
    if not on_meta:
        return
    modules = dict(model.named_modules())
    for fqn, (params, buffers) in on_meta.items():  # refuse before allocating anything
        _check_restorable(modules[fqn], fqn, params, buffers)
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    # manual_seed seeds every device's generator: the trainer's GPU generator is restored too.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for fqn, (params, buffers) in on_meta.items():
            m = modules[fqn]
            if params:
                _reset_whole(m, params)  # nn.Linear, nn.BatchNorm (its running statistics too), ...
            if buffers and callable(getattr(m, "reset_buffers", None)):
                m.reset_buffers()
    logger.info("materialized the model on %s", device)


def _reset_whole(m: nn.Module, params: list[str]) -> None:
    """``m.reset_parameters()`` on whole host tensors, copied into the module's own: an FSDP
    ``DTensor`` keeps its local shard of the result, a GPU tensor the host's values. Drawn from
    the CPU generator, the values are the ones a single CPU process gets, whatever the device."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    own = {n: m._parameters[n] for n in params}
    for n, p in own.items():
        m._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
    try:
        m.reset_parameters()
        whole = {n: m._parameters[n].detach() for n in own}
    finally:
        for n, p in own.items():
            m._parameters[n] = p
    with torch.no_grad():
        for n, p in own.items():
            if isinstance(p, DTensor):
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                p.to_local().copy_(whole[n][tuple(slice(o, o + k) for o, k in zip(offset, shape))])
            else:
                p.copy_(whole[n])


def _check_restorable(m: nn.Module, fqn: str, params: list[str], buffers: list[str]) -> None:
    """Raise unless module ``m`` can fill what it has on meta: ``reset_parameters()`` for its
    parameters (and buffers), or ``reset_buffers()`` for buffers it computed in ``__init__`` (a
    torchrec DLRM's interaction indices, a positional table), which come back from meta as garbage."""
    where = fqn or "the model"
    if params and not callable(getattr(m, "reset_parameters", None)):
        names = ", ".join(f"{fqn}.{n}" if fqn else n for n in params)
        raise ValueError(
            f"parameter {names} of {type(m).__name__} was built on the meta device and nothing can initialize "
            f"it (the module has no reset_parameters()); build {where} outside `torch.device('meta')`"
        )
    if buffers and not params and not callable(getattr(m, "reset_buffers", None)):
        names = ", ".join(f"{fqn}.{n}" if fqn else n for n in buffers)
        raise ValueError(
            f"buffer {names} of {type(m).__name__} was built on the meta device and nothing can recompute it "
            f"(the module has no reset_buffers() or reset_parameters()); build {where} outside "
            f"`torch.device('meta')`, or give {type(m).__name__} a reset_buffers() method that fills it"
        )


def _guard_dense(module: nn.Module, fqn: str) -> None:
    """Refuse to run a DDP/FSDP module inside a distributed-autograd context.

    There, FSDP2 never syncs its gradients and DDP writes them into the context instead of
    ``.grad``, both silently. ``hybrid.step`` never makes a context current on the training thread.
    """
    import torch.distributed.autograd as dist_autograd

    def hook(_mod, _args):
        try:
            # No context exists in this process (the common case, checked in well under a
            # microsecond): none is current. Asking for the current one when there is none
            # raises from C++, whose unwinding costs tens of microseconds a forward.
            if not dist_autograd._get_debug_info()["num_autograd_contexts"]:
                return
            ctx = dist_autograd._current_context()
        except RuntimeError:  # distributed autograd not initialized, or no context on this thread
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
    init_tables: Literal["auto", "module", "server"] = "auto",
    seed: int = 0,
    start_step: int = 0,
) -> nn.Module:
    """Turn a plain model into the hybrid model on this trainer; returns the same object.

    ``parameter_server`` modules may be built on the meta device (the tables then never exist on
    a trainer); the rest of the model may be on meta too, and is materialized here (FSDP modules
    as their shards) by ``reset_parameters()``, seeded with ``seed``.

    Where a remote collection's initial rows come from (``init_tables``): ``"server"``: each
    server fills its rows with the layout-independent init of :mod:`hybrid.ps.init`, keyed by
    ``seed`` (``hybrid.init_tables(ebc, seed=seed)`` fills a local collection with the same rows);
    ``"module"``: the module's own weights (pretrained tables) are copied to the servers,
    streamed in bounded chunks; ``"auto"`` (default): ``server`` for tables on meta, ``module``
    for real ones. ``start_step`` numbers the first step (a resumed
    run's). ``name`` namespaces the tables on the servers when one job composes several models.
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
    num_servers, gradient_push = resolved.num_servers, options.gradient_push
    if resolved.in_process:
        # One-process mode: this trainer is server ps0 itself and trains the tables with the
        # servers' own shards and optimizers; gradients ride on the next lookup (there is no
        # RPC peer for distributed autograd), which applies the same updates.
        from hybrid.ps.server.service import ServerOptions
        from hybrid.ps.transport import serve_here

        serve_here("ps0", ServerOptions(huge_pages=options.huge_pages, memory_fraction=options.server_memory_fraction))
        num_servers, gradient_push = resolved.table_servers, "rpc"
    pipeline = make_pipeline(trainer=role.index, num_servers=num_servers,
                             staleness=resolved.plan.sync.staleness, gradient_push=gradient_push,
                             transport=options.ps_transport, timeout_s=options.rpc_timeout_s, start_step=start_step,
                             device=device)
    object.__setattr__(model, "_hybrid_pipeline", pipeline)  # hybrid.step(model) finds it; not a submodule
    for entry in resolved.by_strategy("parameter_server"):
        _apply_parameter_server(model, entry, resolved=resolved, num_servers=num_servers, role=role, name=name,
                                pipeline=pipeline,
                                timeout_s=options.rpc_timeout_s, init_tables=init_tables, seed=seed,
                                start_step=start_step)
    dist.barrier()  # tables exist on the servers before any trainer looks up
    order = resolved.apply_order()
    for entry in order:
        if entry.strategy == "fsdp":
            DENSE_STRATEGIES["fsdp"](model, entry.fqn, mesh=mesh, options=entry.options)
    _materialize(model, device, seed=seed)
    if device.type != "cpu":
        for n, m in model.named_modules():
            if not isinstance(m, (RemoteCollection, RemoteTable)):
                m.to(device)
    for entry in order:
        if entry.strategy == "local":
            DENSE_STRATEGIES["local"](model, entry.fqn, mesh=mesh, options=entry.options)
    # ddp modules with equal options share one DDP (one set of buckets) where that is exact.
    ddp = [(e.fqn, e.options) for e in order if e.strategy == "ddp"]
    # In async mode a CPU trainer routes and sends the lookup two steps ahead while DDP's
    # all-reduce is on the wire (StepPipeline.depth), time its thread would spend waiting.
    on_launch = pipeline.reduction_launched if pipeline.can_overlap_reduction() else None
    for root, fqns, opts in merge_groups(model, ddp):
        if apply_ddp_merged(model, root, fqns, mesh=mesh, options=opts, on_launch=on_launch) and on_launch:
            pipeline.depth = 2
    if pipeline.depth > 1 and role.index == 0:
        logger.info("prefetch depth 2: each step asks for the rows two steps ahead while DDP's all-reduce runs")
    for entry in order:
        if entry.strategy in ("ddp", "fsdp"):
            _guard_dense(model.get_submodule(entry.fqn), entry.fqn)
    return model


def materialize(model: nn.Module, *, seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
    """The plain model a hybrid run starts from, in one process: everything ``model`` has on the
    meta device is allocated on ``device`` and initialized as ``compose(model, ..., seed=seed)``
    initializes it -- embedding collections' tables with the rows the servers give them
    (:func:`hybrid.init_tables`), the other modules by ``reset_parameters()`` from ``seed`` in
    model order. Tensors built for real keep their values. Returns ``model`` (public as
    ``hybrid.materialize``)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    from hybrid.ps.init import init_tables

    device = torch.device(device)
    for m in model.modules():
        if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)) and any(p.is_meta for p in m.parameters()):
            init_tables(m, seed=seed).to(device)
    _materialize(model, device, seed=seed)
    return model
