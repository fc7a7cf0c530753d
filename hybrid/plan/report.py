"""The plan prints itself: module, strategy, options, parameters, bytes per trainer and server.

Estimates count what stays resident; they are what a user checks a plan against, not a profile:

- ``ddp`` / ``local``: the full parameters, their gradients and the dense optimizer state
  (``sgd`` 0, ``adagrad`` 1, ``adam`` 2 tensors per parameter) on every trainer. DDP's
  communication buckets are not counted.
- ``fsdp``: the same, sharded on dim 0 as FSDP2 does: each parameter's rows split into T chunks
  of ceil(rows / T), so a trainer holds ceil(rows / T) rows. With ``wrap``, an indented row per
  FSDP unit follows (each wrapped block, then the outer unit), already counted in the module's. With mixed precision the unsharded
  low-precision copy exists only around each forward/backward and is not counted; with
  ``cpu_offload`` the sharded state is in host memory but counted the same.
- ``parameter_server``: nothing on trainers but, with ``hot_rows``, their cache
  (:func:`hybrid.ps.client.cache.cache_bytes`); on each server the rows it holds times
  (embedding_dim x the storage dtype's bytes + the sparse optimizer's float32 state per row),
  with no gradient (the servers apply a fused update). The table shows the most loaded server.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from hybrid.log import logger
from hybrid.plan.errors import PlanError, one_of
from hybrid.plan.match import ResolvedModule, ResolvedPlan
from hybrid.ps.config import WIRE_BYTES, TableSpec, held_rows, row_bytes, table_specs
from hybrid.ps.server.memory import human_bytes
from hybrid.ps.sharding import shard_tables

DENSE_OPTIMIZER_STATE = {"sgd": 0, "adagrad": 1, "adam": 2}
"""Dense optimizer -> state tensors kept per parameter (plain SGD keeps none)."""


def dense_optimizer_state(name: str, *, key: str = "dense_optimizer") -> int:
    """The state tensors dense optimizer ``name`` keeps per parameter; a PlanError naming ``key``
    (``--dense-optimizer`` on the command line) for an optimizer the estimates do not know."""
    if name not in DENSE_OPTIMIZER_STATE:
        raise PlanError(f"got {name!r}; expected {one_of(DENSE_OPTIMIZER_STATE)}", category="bad_value", key=key)
    return DENSE_OPTIMIZER_STATE[name]


@dataclass
class ModuleEstimate:
    """Parameters and resident bytes of one resolved module."""

    entry: ResolvedModule
    params: int
    """Parameters this module owns (those of nested fsdp modules are theirs)."""
    trainer_bytes: int
    """Bytes on each trainer."""
    server_bytes: dict[int, int] = field(default_factory=dict)
    """Server index -> bytes on that server."""

    @property
    def max_server_bytes(self) -> int:
        return max(self.server_bytes.values(), default=0)


def estimate_memory(
    resolved: ResolvedPlan, model: nn.Module, *, dense_optimizer: str = "adagrad"
) -> list[ModuleEstimate]:
    """One :class:`ModuleEstimate` per entry of ``resolved``, in module order (see module docs)."""
    state = dense_optimizer_state(dense_optimizer)
    owned = _owned_parameters(resolved, model)
    modules = dict(model.named_modules())
    out = []
    for e in resolved.entries:
        params = owned[e.fqn]
        count = sum(p.numel() for p in params)
        if e.strategy == "parameter_server":
            servers = _server_bytes(e, modules[e.fqn], resolved.table_servers)
            out.append(ModuleEstimate(e, count, _cache_bytes(e, modules[e.fqn], resolved.table_servers), servers))
            continue
        shards = resolved.num_trainers if e.strategy == "fsdp" else 1
        per_trainer = sum(_shard_numel(p, shards) * p.element_size() for p in params) * (2 + state)
        out.append(ModuleEstimate(e, count, per_trainer))
    return out


_COLUMNS = [
    "module", "type", "matched by", "strategy", "options", "params", "per trainer", "per server",
]  # fmt: skip


def format_plan(
    resolved: ResolvedPlan, model: nn.Module, *, dense_optimizer: str = "adagrad"
) -> str:
    """The plan as a table, with a header line and a totals row (module docs explain the bytes)."""
    estimates = estimate_memory(resolved, model, dense_optimizer=dense_optimizer)
    rows = [_COLUMNS]
    for m in estimates:
        rows.append(_row(m))
        rows += _fsdp_unit_rows(m, model, resolved.num_trainers, DENSE_OPTIMIZER_STATE[dense_optimizer])
    servers: Counter[int] = Counter()
    for m in estimates:
        servers.update(m.server_bytes)
    params = sum(m.params for m in estimates)
    trainer = sum(m.trainer_bytes for m in estimates)
    server = max(servers.values(), default=0)
    rows.append(["total", "", "", "", "", f"{params:,}", human_bytes(trainer), human_bytes(server)])
    lines = [_header(resolved), *_table(rows, right=(5, 6, 7)), _footer(dense_optimizer)]
    if servers:
        lines.append("per server (rows + sparse optimizer state): " + ", ".join(
            f"ps{s} {human_bytes(servers[s])}" for s in range(resolved.table_servers)))
    return "\n".join(lines)


def _row(m: ModuleEstimate) -> list[str]:
    e = m.entry
    matched_by = "" if e.rule_key == e.fqn else e.rule_key
    server = human_bytes(m.max_server_bytes) if e.strategy == "parameter_server" else "-"
    return [
        e.fqn or "<root>",
        e.module_type,
        matched_by,
        e.strategy,
        summarize_options(e),
        f"{m.params:,}",
        human_bytes(m.trainer_bytes),
        server,
    ]


def _fsdp_unit_rows(m: ModuleEstimate, model: nn.Module, trainers: int, state: int) -> list[list[str]]:
    """An fsdp module with ``wrap``: one indented row per FSDP unit (each ``wrap`` block, then the
    outer unit with what is left), with its parameters and bytes per trainer (already counted in
    the module's row)."""
    e = m.entry
    if e.strategy != "fsdp" or not e.options.wrap:
        return []
    module = model.get_submodule(e.fqn)
    blocks = [(n, b) for n, b in module.named_modules() if n and type(b).__name__ in e.options.wrap]
    blocks = [(n, b) for n, b in blocks if not any(n.startswith(o + ".") for o, _ in blocks)]  # outermost

    def row(name: str, kind: str, params: list[nn.Parameter]) -> list[str]:
        size = sum(_shard_numel(p, trainers) * p.element_size() for p in params) * (2 + state)
        return [f"  {name}", kind, "", "fsdp unit", "", f"{sum(p.numel() for p in params):,}", human_bytes(size), "-"]

    inner = {id(p) for _, b in blocks for p in b.parameters()}
    prefix = f"{e.fqn}." if e.fqn else ""
    rows = [row(prefix + n, type(b).__name__, list(b.parameters())) for n, b in blocks]
    rest = [p for p in module.parameters() if id(p) not in inner]
    return rows + [row(e.fqn or "<root>", "(outer unit)", rest)]


def log_plan(resolved: ResolvedPlan, model: nn.Module, *, dense_optimizer: str = "adagrad") -> None:
    """Log :func:`format_plan`'s table once, at INFO, on the ``hybrid`` logger."""
    logger.info("plan:\n%s", format_plan(resolved, model, dense_optimizer=dense_optimizer))


def summarize(resolved: ResolvedPlan) -> str:
    """One line: process counts and how many modules each strategy got."""
    counts = Counter(e.strategy for e in resolved.entries)
    per = ", ".join(f"{n} {s}" for s, n in counts.items())
    return (
        f"{resolved.world_size} processes = {_plural(resolved.num_trainers, 'trainer')} + "
        f"{_plural(resolved.num_servers, 'parameter server')}; "
        f"{_plural(len(resolved.entries), 'module')} ({per or 'none'})"
    )


def summarize_options(e: ResolvedModule) -> str:
    """Key options, short: ``row_wise rowwise_adagrad lr=0.05``, ``reshard bf16/fp32``."""
    o = e.options
    if e.strategy == "parameter_server":
        parts = [o.sharding, o.optimizer.name, f"lr={o.optimizer.lr:g}"]
        parts += [] if o.servers == "all" else ["servers=" + ",".join(map(str, o.servers))]
        parts += [] if o.id_policy == "error" else [f"ids={o.id_policy}"]
        parts += [] if o.storage_dtype == "float32" else [f"rows={_short(o.storage_dtype)}"]
        parts += [] if o.wire_dtype == "float32" else [f"wire={_short(o.wire_dtype)}"]
        if o.ids == "dynamic":
            admit = f" admit_after={o.admit_after}" if o.admit_after > 1 else ""
            admit += f" window={o.admit_window}" if o.admit_window else ""
            parts.append(f"dynamic cap={o.capacity} evict={o.evict}{admit}")
        parts += [f"hot_rows={o.hot_rows}"] if o.hot_rows else []
        parts += [] if o.pool_on == "auto" else [f"pool_on={o.pool_on}"]
    elif e.strategy == "fsdp":
        parts = ["reshard" if o.reshard_after_forward else "no-reshard"]
        mp = o.mixed_precision
        parts += [f"{_short(mp.param_dtype)}/{_short(mp.reduce_dtype)}"] if mp else []
        parts += ["offload"] * o.cpu_offload + ["ckpt"] * o.activation_checkpointing
        parts += ["wrap=" + ",".join(o.wrap)] if o.wrap else []
    elif e.strategy == "ddp":
        parts = [f"bucket={o.bucket_cap_mb:g}MB"] + ["static"] * o.static_graph
        parts += ["grad-view"] * o.gradient_as_bucket_view
        parts += ["find-unused"] * o.find_unused_parameters
        parts += [] if o.broadcast_buffers == "auto" else [("" if o.broadcast_buffers else "no-") + "buffer-sync"]
        parts += [] if o.comm_hook == "none" else [f"{o.comm_hook}-hook"]
        parts += [] if o.merge else ["unmerged"]
    elif e.strategy == "local":
        parts = ["replicated, no sync"]
    else:
        parts = []
    return " ".join(parts)


def _owned_parameters(resolved: ResolvedPlan, model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Entry path -> its parameters; a parameter belongs to the innermost entry containing it."""
    fqns = {e.fqn for e in resolved.entries}
    owned: dict[str, list[nn.Parameter]] = {f: [] for f in fqns}
    for name, p in model.named_parameters():
        path = name.rpartition(".")[0]
        while path not in fqns and path:
            path = path.rpartition(".")[0]
        if path in fqns:
            owned[path].append(p)
    return owned


def _shard_numel(p: nn.Parameter, shards: int) -> int:
    """Elements of ``p`` on one rank when its dim 0 is split into ``shards`` chunks (FSDP2)."""
    if p.dim() == 0:
        return 1
    rows = p.shape[0]
    return math.ceil(rows / shards) * (p.numel() // rows if rows else 0)


def _cache_bytes(e: ResolvedModule, module: nn.Module, num_servers: int) -> int:
    """Bytes of a trainer's hot-row cache of the module's tables (``hot_rows``; 0 without)."""
    options = e.options
    if not options.hot_rows:
        return 0
    from hybrid.ps.client.cache import cache_bytes

    return cache_bytes(options.hot_rows, held_rows(_layouts(e, module, num_servers), options.dynamic_ids()),
                       WIRE_BYTES[options.wire_dtype])


def _server_bytes(e: ResolvedModule, module: nn.Module, num_servers: int) -> dict[int, int]:
    per_table = _table_bytes(e, module, num_servers)
    return {s: sum(per_table[s].values()) for s in range(num_servers)}


def _layouts(e: ResolvedModule, module: nn.Module, num_servers: int) -> list:
    """Where each of the module's tables goes (:func:`hybrid.ps.sharding.shard_tables`)."""
    options = e.options
    return shard_tables(_tables(e.fqn, module), num_servers, options.sharding,
                        options.server_list(num_servers) if num_servers > 1 else None)


def _table_bytes(e: ResolvedModule, module: nn.Module, num_servers: int) -> dict[int, dict[str, int]]:
    """Server -> table -> bytes of its rows and their sparse optimizer state on that server."""
    options = e.options
    layouts = _layouts(e, module, num_servers)
    rows = held_rows(layouts, options.dynamic_ids())
    return {s: {t.table.name: held[s] * row_bytes(options.optimizer.name, t.table.embedding_dim, options.storage_dtype)
                for t, (_, held) in zip(layouts, rows) if held.get(s)}
            for s in range(num_servers)}


def server_table_bytes(resolved: ResolvedPlan, model: nn.Module) -> dict[int, dict[str, int]]:
    """Server index -> ``module.table`` -> bytes that server holds of it (rows and sparse
    optimizer state, as the servers compute before allocating), every server listed."""
    modules = dict(model.named_modules())
    out: dict[int, dict[str, int]] = {s: {} for s in range(resolved.table_servers)}
    for e in resolved.by_strategy("parameter_server"):
        for s, tables in _table_bytes(e, modules[e.fqn], resolved.table_servers).items():
            out[s].update({f"{e.fqn}.{name}": n for name, n in tables.items()})
    return out


def check_server_memory(resolved: ResolvedPlan, model: nn.Module, *, fraction: float) -> None:
    """Raise :class:`PlanError` (category ``memory``) when the plan's parameter servers, all on
    this machine, need more than ``fraction`` of its available memory (``hybrid launch`` runs
    every process here); nothing has been allocated yet."""
    from hybrid.ps.server.memory import memory_shortfall

    per_server = server_table_bytes(resolved, model)
    need = {f"{table} on ps{s}": n for s, tables in per_server.items() for table, n in tables.items()}
    if not need:
        return
    who = ", ".join(f"ps{s}" for s in per_server) + " on this machine"
    short = memory_shortfall(need, fraction=fraction, who=who,
                             fix="run the parameter servers on more machines (docs/training.md), or make the "
                                 "tables smaller")
    if short is not None:
        raise PlanError(short, category="memory")


def _tables(fqn: str, module: nn.Module) -> list[TableSpec]:
    if hasattr(module, "embedding_bag_configs"):
        return table_specs(module.embedding_bag_configs())
    if hasattr(module, "embedding_configs"):  # EmbeddingCollection: sequence tables, no pooling
        return table_specs(module.embedding_configs())
    # nn.Embedding / nn.EmbeddingBag: one table, named after the module path.
    return [TableSpec(fqn, module.num_embeddings, module.embedding_dim, (fqn,))]


def _header(resolved: ResolvedPlan) -> str:
    plan, sync = resolved.plan, resolved.plan.sync
    mode = "sync" if sync.staleness == 0 else "async"
    model = f", model {plan.model}" if plan.model else ""
    trainers = _plural(resolved.num_trainers, "trainer")
    servers = _plural(resolved.num_servers, "parameter server")
    return (
        f"plan {plan.source or '(in memory)'}{model}: world size {resolved.world_size} = "
        f"{trainers} + {servers}; {mode} (staleness {sync.staleness}), "
        f"embedding gradients {sync.gradient_scaling}"
    )


def _footer(dense_optimizer: str) -> str:
    return (
        f"bytes: params + grads + {dense_optimizer} state on each trainer (fsdp: its dim-0 shard); "
        "rows + sparse optimizer state on the most loaded server"
    )


def _table(rows: list[list[str]], right: tuple[int, ...]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def fmt(r: list[str]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [fmt(rows[0]), rule, *(fmt(r) for r in rows[1:-1]), rule, fmt(rows[-1])]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
