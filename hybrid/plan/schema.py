"""The typed plan: what a plan YAML may say, with defaults and checks (torchtitan-style config).

Every dataclass is keyword-only, every field is documented, choices are ``Literal``s, and
``__post_init__`` raises :class:`PlanError` on a bad value. Errors raised here carry the field
name as their key; the loader prefixes the path (``modules.dense_arch.``) and the file line.

A rule in YAML is flat: ``strategy:`` plus that strategy's options side by side. The options
dataclass for each strategy comes from :data:`STRATEGY_OPTIONS`, so a new strategy is one
dataclass plus one registry line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from hybrid.plan.errors import Category, PlanError, did_you_mean, one_of
from hybrid.ps.config import OptimizerSpec as SparseOptimizer
from hybrid.ps.config import (IDS_MODES, POOL_ON, WIRE_DTYPES, DynamicIds, GradientScaling, IdPolicy, IdsMode, PoolOn,
                              Sharding, StorageDtype, WireDtype, check_choice)

Dtype = Literal["float32", "bfloat16", "float16"]
CommHook = Literal["none", "fp16", "bf16"]
"""A DDP communication hook (``comm_hook``): none, or gradients compressed to 16 bits on the wire."""

DEFAULT_RULE = "*"
"""The ``modules`` key of the default rule (quote it in YAML: ``"*":``)."""


def _bad(key: str, value: object, expected: str, category: Category = "bad_value") -> PlanError:
    return PlanError(f"got {value!r}; expected {expected}", category=category, key=key)


@dataclass(kw_only=True)
class Topology:
    """How many of the torchrun processes are parameter servers."""

    parameter_servers: int = 1
    """Processes that hold embedding tables (the last ranks); every other process is a trainer."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Trainers' collective backend: ``auto`` picks nccl on CUDA and gloo on CPU."""

    def __post_init__(self) -> None:
        if self.parameter_servers < 0:
            raise _bad("parameter_servers", self.parameter_servers, "an integer >= 0", "topology")


@dataclass(kw_only=True)
class SyncOptions:
    """How trainers and servers agree on embedding updates."""

    staleness: int = 0
    """0 = synchronous (equal to single-process training); k >= 1 = asynchronous, lookups may
    miss at most the last k updates."""
    gradient_scaling: GradientScaling = "mean"
    """``mean``: trainers' embedding gradients are averaged, as DDP averages dense ones, so the
    run equals single-process training on the concatenated global batch with a mean loss.
    ``sum``: they are added."""

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise _bad("staleness", self.staleness, "0 (sync) or an integer k >= 1 (async bound)")


@dataclass(kw_only=True)
class MixedPrecision:
    """FSDP2's ``MixedPrecisionPolicy``: the dtype of unsharded parameters and of reductions."""

    param_dtype: Dtype = "float32"
    """dtype that forward and backward compute in (the sharded copy stays float32)."""
    reduce_dtype: Dtype = "float32"
    """dtype of the gradient reduce-scatter."""


@dataclass(kw_only=True)
class FSDPOptions:
    """``strategy: fsdp`` — FSDP2 ``fully_shard`` over the trainers."""

    reshard_after_forward: bool = True
    """Free the unsharded parameters after forward (and all-gather again in backward)."""
    mixed_precision: MixedPrecision | None = None
    """E.g. ``{param_dtype: bfloat16, reduce_dtype: float32}``; none = everything in float32."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory."""
    activation_checkpointing: bool = False
    """Recompute this module's activations in backward instead of keeping them."""
    wrap: list[str] = field(default_factory=list)
    """Class names of descendant modules that get their own ``fully_shard`` first (like FSDP's
    transformer auto-wrap policy), e.g. ``[Linear]`` or ``[Perceptron]``."""

    def __post_init__(self) -> None:
        for i, name in enumerate(self.wrap):
            if not name or not name.isidentifier():
                raise _bad(f"wrap.{i}", name, "a module class name such as 'Linear'")


@dataclass(kw_only=True)
class DDPOptions:
    """``strategy: ddp`` — ``DistributedDataParallel`` over the trainers."""

    bucket_cap_mb: float = 25.0
    """Size of DDP's gradient all-reduce buckets, in MiB."""
    static_graph: bool = False
    """The set of used parameters never changes between iterations (lets DDP optimise)."""
    gradient_as_bucket_view: bool = False
    """Gradients are views into the all-reduce buckets (saves one gradient-sized copy)."""
    find_unused_parameters: bool = False
    """Search the graph for parameters that got no gradient (costs a graph walk each step)."""
    broadcast_buffers: bool | str = "auto"
    """Broadcast rank 0's buffers to every trainer before each forward, as DDP does by default
    (one collective per step, so that running statistics such as BatchNorm's agree; hybrid does
    it itself, since composable ``replicate`` syncs no buffers).
    ``auto``: only when the module holds a floating-point buffer; integer buffers (index tables
    such as DLRM's ``triu_indices``, BatchNorm's ``num_batches_tracked``, which every trainer
    counts alike) are left alone, as TorchRec's DistributedModelParallel leaves all of them."""
    comm_hook: CommHook = "none"
    """``none``: DDP's own mean all-reduce; ``fp16``/``bf16``: compress gradients to this dtype for
    the all-reduce (``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``)."""
    merge: bool = True
    """Share one ``DistributedDataParallel`` (one set of allreduce buckets, applied on their
    common ancestor) with the plan's other ddp modules that have the same options, as TorchRec's
    DistributedModelParallel does for all dense modules; ``false``: one DDP for this module."""

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise _bad("bucket_cap_mb", self.bucket_cap_mb, "a size in MiB > 0")
        if not isinstance(self.broadcast_buffers, bool) and self.broadcast_buffers != "auto":
            raise _bad("broadcast_buffers", self.broadcast_buffers, "true, false or 'auto'")


_DYNAMIC_ONLY = tuple(f.name for f in fields(DynamicIds))
"""The options of ``ids: dynamic`` (a rule's keys of the same names): refused under ``ids: range``,
where nothing would read them."""


@dataclass(kw_only=True)
class PSOptions:
    """``strategy: parameter_server`` — the tables live on parameter servers, reached by RPC."""

    optimizer: SparseOptimizer
    """The servers' sparse optimizer, e.g. ``{name: rowwise_adagrad, lr: 0.05}`` (required)."""
    sharding: Sharding = "row_wise"
    """``row_wise``: every table's rows spread cyclically over the servers; ``table_wise``:
    each whole table on one server, balanced by bytes."""
    servers: list[int] | str = "all"
    """``all``, or the indices of the servers that hold these tables, e.g. ``[0, 1]``."""
    id_policy: IdPolicy = "error"
    """What an id >= num_embeddings does: ``error`` stops the step, ``modulo`` wraps it."""
    storage_dtype: StorageDtype = "float32"
    """How the servers store the rows: ``bfloat16`` / ``float16`` halve their memory; the
    optimizer state and every update's arithmetic stay float32 and each new row is rounded to
    nearest once (rows travel as ``wire_dtype`` says). ``float32`` is exact."""
    wire_dtype: WireDtype = "float32"
    """The dtype rows travel in from the servers and row gradients back to them: ``bfloat16``
    halves those bytes, each value rounded to nearest (ties to even) as it is sent; trainers
    compute in float32 and servers widen the gradients to float32 before the optimizer.
    ``float32`` is exact."""
    pool_on: PoolOn = "auto"
    """Where a training step's bags are pooled: ``trainer`` (the servers send the deduplicated
    rows), ``server`` (each server pools the bags of its tables and sends them, then turns the
    bags' gradients back into row gradients: fewer bytes when bags hold several ids; needs every
    table whole on one server -- ``sharding: table_wise`` or one server --, no ``hot_rows`` and
    ``gradient_push: rpc``), or ``auto``: on the servers for a trainer that reaches every server
    of the module over the network (another host, or ``runtime.ps_transport`` socket or rpc) where
    the module can be pooled there, else on the trainer. Exact either way in float32
    (docs/plans.md)."""
    ids: IdsMode = "range"
    """``range``: ids in ``[0, num_embeddings)``, every row allocated up front; ``dynamic``: raw
    int64 ids, a row created on an id's first touch (docs/dynamic_ids.md)."""
    capacity: int = 0
    """``ids: dynamic``: rows per table over all servers (required there)."""
    admit_after: int = 1
    """``ids: dynamic``: sightings before an id gets a row (until then it reads zeros)."""
    evict: str = "none"
    """``ids: dynamic``: ``none`` | ``lru`` | ``ttl:<steps>`` when a table is full."""
    partitions: int = 0
    """``ids: dynamic``: hash parts per table (0: ``min(64, capacity)``)."""
    admit_window: int = 0
    """``ids: dynamic`` with ``admit_after`` > 1: steps per window sightings count in; 0: no window."""
    hot_rows: int = 0
    """Async mode (``sync.staleness`` >= 1): rows of each table, per server, every trainer keeps
    from its lookups and uses again while the staleness bound allows, the most used ones
    (docs/plans.md); 0: none."""

    def dynamic_ids(self):
        """The collection's :class:`hybrid.ps.config.DynamicIds` (None under ``ids: range``)."""
        if self.ids != "dynamic":
            return None
        return DynamicIds(**{name: getattr(self, name) for name in _DYNAMIC_ONLY})

    def __post_init__(self) -> None:
        check_choice("ids", self.ids, IDS_MODES)
        if not isinstance(self.hot_rows, int) or self.hot_rows < 0:
            raise _bad("hot_rows", self.hot_rows, "a number of rows >= 0 (0: no cache)")
        check_choice("wire_dtype", self.wire_dtype, WIRE_DTYPES)
        check_choice("pool_on", self.pool_on, POOL_ON)
        if self.ids == "dynamic":
            if self.capacity == 0:  # not given: the mistake is where ids: dynamic was written
                raise PlanError("'dynamic' needs capacity, the rows per table over all servers (>= 1); "
                                "this rule has none", category="bad_value", key="ids")
            if self.capacity < 1:
                raise _bad("capacity", self.capacity, "a number of rows >= 1 with ids: dynamic")
            self.dynamic_ids()  # checks admit_after, evict, partitions
        else:
            for f in fields(self):
                if f.name in _DYNAMIC_ONLY and getattr(self, f.name) != f.default:
                    raise PlanError(f"got {getattr(self, f.name)!r}, which only ids: dynamic reads, and this "
                                    f"rule has ids: {self.ids}; remove it or set ids: dynamic",
                                    category="bad_value", key=f.name)
        if isinstance(self.servers, str):
            if self.servers != "all":
                expected = "'all' or a list of server indices such as [0, 1]"
                raise _bad("servers", self.servers, expected)
            return
        if not self.servers:
            raise _bad("servers", self.servers, "'all' or a non-empty list of server indices")
        if any(s < 0 for s in self.servers) or len(set(self.servers)) != len(self.servers):
            raise _bad("servers", self.servers, "distinct server indices >= 0")

    def server_list(self, num_servers: int) -> list[int]:
        """The server indices these tables go on, given the topology's ``num_servers``."""
        return list(range(num_servers)) if self.servers == "all" else list(self.servers)


@dataclass(kw_only=True)
class LocalOptions:
    """``strategy: local`` — replicated on every trainer with no gradient sync (no options)."""


STRATEGY_OPTIONS: dict[str, type] = {
    "fsdp": FSDPOptions,
    "ddp": DDPOptions,
    "parameter_server": PSOptions,
    "local": LocalOptions,
}
"""Strategy name -> its options dataclass; a new strategy is one dataclass and one line here."""

OPTION_NAMES: frozenset[str] = frozenset(
    ["strategy"] + [f.name for cls in STRATEGY_OPTIONS.values() for f in fields(cls)]
)
"""Every key a rule may hold, whatever its strategy (used to parse override paths)."""


@dataclass(kw_only=True)
class Rule:
    """One entry of ``modules``: the strategy a module (and its subtree) uses, with its options."""

    key: str
    """The ``modules`` key it came from: a module path, a glob, or ``"*"``."""
    strategy: str
    """A key of :data:`STRATEGY_OPTIONS`."""
    options: Any
    """An instance of ``STRATEGY_OPTIONS[strategy]``."""
    where: str = ""
    """``file:line`` of the rule, with the overrides that changed it, or the overrides that
    wrote it: where an error about the whole rule points."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_OPTIONS:
            raise PlanError(
                f"got {self.strategy!r}{did_you_mean(self.strategy, STRATEGY_OPTIONS)}; "
                f"expected {one_of(STRATEGY_OPTIONS)}",
                category="bad_value",
                key="strategy",
            )
        cls = STRATEGY_OPTIONS[self.strategy]
        assert isinstance(self.options, cls), f"{self.strategy} needs {cls.__name__}"


@dataclass(kw_only=True)
class Plan:
    """A whole plan: topology, one rule per module path or glob, and sync options."""

    model: str | None = None
    """The model the plan is written for: ``package.module:attr`` or a name registered in the
    ``hybrid.models`` entry-point group (:mod:`hybrid.train.spec`). ``hybrid plan show/check``
    build it unless ``--model`` names another; a training config naming another is refused."""
    world_size: int | None = None
    """Default number of processes (trainers + servers) for ``hybrid plan show/check``."""
    topology: Topology = field(default_factory=Topology)
    """Process counts and backend."""
    modules: dict[str, Rule] = field(default_factory=dict)
    """Module path or glob (or ``"*"``, the default rule) -> rule."""
    sync: SyncOptions = field(default_factory=SyncOptions)
    """Sync or async embedding updates."""
    source: str = ""
    """The file it was loaded from (set by ``load_plan``; not a YAML key)."""
    locate: Callable[[str], str] | None = field(default=None, compare=False, repr=False)
    """Plan key -> where its value was written (set by the loader; see :meth:`where`)."""

    def where(self, key: str) -> str:
        """Where the value of plan key ``key`` came from: ``file:line``, the command-line override
        that set it, or the file alone; for errors found after loading (``resolve``)."""
        return self.locate(key) if self.locate is not None else self.source

    def __post_init__(self) -> None:
        if self.world_size is not None and self.world_size < 1:
            raise _bad("world_size", self.world_size, "a number of processes >= 1", "topology")
        for key, rule in self.modules.items():
            assert isinstance(rule, Rule) and rule.key == key, f"modules[{key!r}] holds {rule!r}"
            if rule.strategy == "parameter_server" and rule.options.hot_rows and self.sync.staleness == 0:
                raise PlanError(f"got {rule.options.hot_rows}; a trainer's cached rows are never fresh enough for "
                                f"a synchronous lookup: set sync.staleness >= 2 (k = 1 reads rows one step older "
                                f"than a prefetch brings) or hot_rows: 0", category="bad_value",
                                key=f"modules.{key}.hot_rows")
            if rule.strategy == "parameter_server" and rule.options.pool_on == "server":
                self._check_pool_on(key, rule)

    def _check_pool_on(self, key: str, rule: Rule) -> None:
        """``pool_on: server`` needs every table whole on one server and no trainer cache."""
        o = rule.options
        why = None
        if o.hot_rows:
            why = "and hot_rows do not go together (the cache keeps rows; the servers send bags): set hot_rows: 0"
        elif o.sharding == "row_wise" and len(o.server_list(self.topology.parameter_servers)) > 1:
            why = ("needs every table whole on one server; row_wise spreads each table over the servers: set "
                   "sharding: table_wise (or keep pool_on: trainer)")
        if why is not None:
            raise PlanError(f"server {why}", category="bad_value", key=f"modules.{key}.pool_on")

    @property
    def default_rule(self) -> Rule | None:
        """The ``"*"`` rule, if the plan has one."""
        return self.modules.get(DEFAULT_RULE)
