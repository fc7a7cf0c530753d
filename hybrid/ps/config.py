"""The typed configuration of a remote embedding collection, shared by trainers and servers.

A trainer builds one :class:`CollectionConfig` per ``parameter_server`` module when it composes
the model and sends it to every server that holds part of it; the server builds its shard from
the same object. Nothing else about a collection travels: both ends derive the table layout,
the optimizer and the step semantics from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from hybrid.errors import PlanError, did_you_mean, one_of

SparseOptimizerName = Literal["sgd", "adagrad", "rowwise_adagrad", "adam"]
SPARSE_OPTIMIZERS: tuple[str, ...] = get_args(SparseOptimizerName)
"""The row-sparse optimizers the servers implement."""

Pooling = Literal["sum", "mean", "none"]
"""How a feature's rows reach the model: pooled per bag (``sum``, ``mean``: an
``EmbeddingBagCollection``) or one row per id (``none``: an ``EmbeddingCollection``). Only the
trainer pools; a server stores and updates rows the same way for all three."""


def state_floats_per_row(name: str, dim: int) -> int:
    """float32 values of optimizer state kept per table row."""
    return {
        "sgd": 0,
        "adagrad": dim,  # one accumulator per element
        "rowwise_adagrad": 1,  # one accumulator per row, as FBGEMM
        "adam": 2 * dim + 1,  # exp_avg, exp_avg_sq and the row's own step count
    }[name]


StorageDtype = Literal["float32", "bfloat16", "float16"]
STORAGE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes of one stored table element, by ``storage_dtype``."""


def row_bytes(optimizer: str, dim: int, storage_dtype: StorageDtype = "float32") -> int:
    """Bytes a server holds per table row: the row in its storage dtype and its float32
    optimizer state."""
    return dim * STORAGE_BYTES[storage_dtype] + state_floats_per_row(optimizer, dim) * 4


WireDtype = Literal["float32", "bfloat16"]
WIRE_DTYPES: tuple[str, ...] = get_args(WireDtype)
WIRE_BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes of one row or gradient element on the wire, by ``wire_dtype``."""


PoolOn = Literal["auto", "trainer", "server"]
POOL_ON: tuple[str, ...] = get_args(PoolOn)

Sharding = Literal["table_wise", "row_wise"]
"""How a collection's tables are placed on its servers (:mod:`hybrid.ps.sharding`)."""
SHARDINGS: tuple[str, ...] = get_args(Sharding)

PsTransport = Literal["auto", "socket", "rpc"]
"""How step messages reach a parameter server (``runtime.ps_transport``, :mod:`hybrid.ps.transport`)."""
PS_TRANSPORTS: tuple[str, ...] = get_args(PsTransport)

GradientPushWay = Literal["rpc", "dist_autograd"]
"""How row gradients reach the servers (``runtime.gradient_push``)."""
GRADIENT_PUSHES: tuple[str, ...] = get_args(GradientPushWay)


def _bad(key: str, value: object, expected: str) -> PlanError:
    return PlanError(f"got {value!r}; expected {expected}", category="bad_value", key=key)


def check_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise :class:`PlanError` (key ``key``) unless ``value`` is one of ``choices`` (e.g.
    ``wire_dtype`` of :data:`WIRE_DTYPES`, ``pool_on`` of :data:`POOL_ON`)."""
    if value not in choices:
        raise _bad(key, value, one_of(choices))


@dataclass(kw_only=True)
class OptimizerSpec:
    """The row-sparse optimizer that the servers apply to the rows a step touched (the plan's
    ``optimizer`` mapping of a ``parameter_server`` module)."""

    name: SparseOptimizerName
    """Which optimizer: ``sgd``, ``adagrad``, ``rowwise_adagrad`` (one accumulator per row, as
    FBGEMM) or ``adam`` (lazy: touched rows only, each with its own step count)."""
    lr: float = 0.01
    """Learning rate."""
    eps: float = 1e-8
    """Added to the denominator (adagrad, rowwise_adagrad, adam)."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.999
    """Adam's second-moment decay."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient of touched rows."""
    initial_accumulator_value: float = 0.0
    """Starting value of adagrad's accumulators."""

    def __post_init__(self) -> None:
        if self.name not in SPARSE_OPTIMIZERS:
            detail = (f"unknown sparse optimizer {self.name!r}{did_you_mean(self.name, SPARSE_OPTIMIZERS)}; "
                      f"the servers implement {one_of(SPARSE_OPTIMIZERS)}")
            raise PlanError(detail, category="unknown_optimizer", key="name")
        for name, ok, expected in (
            ("lr", self.lr > 0, "a learning rate > 0"),
            ("eps", self.eps > 0, "a value > 0"),
            ("beta1", 0 <= self.beta1 < 1, "a value in [0, 1)"),
            ("beta2", 0 <= self.beta2 < 1, "a value in [0, 1)"),
            ("weight_decay", self.weight_decay >= 0, "a value >= 0"),
            ("initial_accumulator_value", self.initial_accumulator_value >= 0, "a value >= 0"),
        ):
            if not ok:
                raise _bad(name, getattr(self, name), expected)

    @property
    def accumulates(self) -> bool:
        """Plain SGD without weight decay: the update is linear in the gradient, so a server adds
        each trainer's contribution straight into the weights, repeated rows and all."""
        return self.name == "sgd" and not self.weight_decay


IdsMode = Literal["range", "dynamic"]
IDS_MODES: tuple[str, ...] = get_args(IdsMode)
GradientScaling = Literal["mean", "sum"]
"""How the trainers' row gradients combine: ``mean`` (scaled by 1 / trainers, as DDP averages) or ``sum``."""
IdPolicy = Literal["error", "modulo"]
"""An id outside its table: ``error`` refuses the batch, ``modulo`` wraps it."""


def part_of(ids, partitions: int):
    """The part of each raw id of a dynamic table: ``fmix64(id) mod partitions``, the same on
    trainers (routing) and servers (admission)."""
    import torch

    from hybrid.ops.id_map import id_hash

    return torch.remainder(id_hash(ids), partitions)


@dataclass(frozen=True, kw_only=True)
class DynamicIds:
    """``ids: dynamic`` -- tables keyed by raw int64 ids (see docs/dynamic_ids.md).

    Each table's ``capacity`` rows are split into ``partitions`` fixed parts by the id's hash;
    a part lives whole on one server (part ``p`` on the collection's server ``p % S``), and
    admission and eviction happen within a part, so they do not depend on how many servers
    there are: one process and any number of servers admit and evict the same ids."""

    capacity: int
    """Rows per table over all servers (each part holds ``capacity / partitions``, rounded)."""
    admit_after: int = 1
    """Sightings (steps whose pushes include the id) before a row is created; before that a
    lookup returns zeros and the id's gradient is dropped. 1: created on first touch."""
    evict: str = "none"
    """When a part is full: ``none`` (the step fails, nothing changes), ``lru`` (the row
    touched longest ago goes, ties by smaller id; never one touched this step) or
    ``ttl:<steps>`` (rows untouched for more than ``steps`` steps expire; a full part with
    none expired fails the step as ``none``)."""
    partitions: int = 0
    """Parts per table; 0: ``min(64, capacity)``."""
    admit_window: int = 0
    """With ``admit_after`` > 1: sightings count within windows of this many steps (steps
    ``[k * W, (k + 1) * W)``); once every trainer's pushes of a window are in, the sightings of
    ids still without a row are forgotten, so they take memory for the ids of one window at
    most. 0: kept until admission (they grow with every distinct id ever seen)."""

    def __post_init__(self) -> None:
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise _bad("capacity", self.capacity, "a number of rows >= 1 (ids: dynamic)")
        if not isinstance(self.admit_after, int) or self.admit_after < 1:
            raise _bad("admit_after", self.admit_after, "a number of sightings >= 1")
        if not isinstance(self.admit_window, int) or isinstance(self.admit_window, bool) or self.admit_window < 0:
            raise _bad("admit_window", self.admit_window, "a number of steps >= 0 (0: sightings never forgotten)")
        if self.admit_window and self.admit_after == 1:
            raise _bad("admit_window", self.admit_window,
                       "0 with admit_after: 1 (every id gets a row on first touch: there are no sightings to forget)")
        self.ttl  # validates evict
        if self.partitions == 0:
            object.__setattr__(self, "partitions", min(64, self.capacity))
        if not 1 <= self.partitions <= self.capacity:
            raise _bad("partitions", self.partitions, f"0 or a number of parts in [1, capacity={self.capacity}]")

    @property
    def ttl(self) -> int | None:
        """The ``ttl:<steps>`` of ``evict``, else None."""
        e = self.evict
        if e in ("none", "lru"):
            return None
        if isinstance(e, str) and e.startswith("ttl:") and e[4:].isdigit() and int(e[4:]) >= 1:
            return int(e[4:])
        raise _bad("evict", e, "'none', 'lru' or 'ttl:<steps>' with steps >= 1, e.g. 'ttl:1000'")

    def part_capacity(self, part: int) -> int:
        """Rows of part ``part``."""
        q, r = divmod(self.capacity, self.partitions)
        return q + (part < r)


@dataclass(frozen=True)
class TableSpec:
    """One embedding table as both ends see it."""

    name: str
    """The table's name (``EmbeddingBagConfig.name``)."""
    num_embeddings: int
    """Rows."""
    embedding_dim: int
    """Columns."""
    feature_names: tuple[str, ...]
    """Features looked up in this table, in the collection's order."""
    pooling: Pooling = "sum"
    """How a bag of rows becomes one vector on the trainer (``none``: it does not)."""

    @property
    def nbytes(self) -> int:
        return self.num_embeddings * self.embedding_dim * 4


def table_specs(configs) -> list[TableSpec]:
    """TableSpecs from torchrec ``EmbeddingBagConfig``s (in the collection's order), or from
    ``EmbeddingConfig``s (an ``EmbeddingCollection``'s: unpooled, pooling ``none``)."""
    from torchrec.modules.embedding_configs import PoolingType

    out = []
    for c in configs:
        if not hasattr(c, "pooling"):  # EmbeddingConfig
            out.append(TableSpec(name=c.name, num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim,
                                 feature_names=tuple(c.feature_names or [c.name]), pooling="none"))
            continue
        pooling = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}.get(c.pooling)
        if pooling is None:
            raise ValueError(f"table {c.name!r}: pooling {c.pooling} is not supported on a parameter server "
                             f"(sum, mean)")
        out.append(TableSpec(name=c.name, num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim,
                             feature_names=tuple(c.feature_names or [c.name]), pooling=pooling))
    return out


@dataclass(frozen=True, kw_only=True)
class CollectionConfig:
    """Everything trainers and servers must agree on about one remote collection."""

    cid: str
    """Unique name of the collection in the job (the module path, namespaced by ``compose``)."""
    tables: tuple[TableSpec, ...]
    """The tables, in the collection's order."""
    layouts: tuple  # tuple[TableLayout, ...]; typed loosely to keep this module import-light
    """Where each table's rows live (:mod:`hybrid.ps.sharding`), one per table."""
    optimizer: OptimizerSpec
    """The servers' sparse optimizer."""
    num_trainers: int
    """Trainers whose gradients make up one step (sync mode waits for all of them)."""
    staleness: int = 0
    """0: sync; k >= 1: a lookup of step t waits only for steps through t - 1 - k."""
    gradient_scaling: GradientScaling = "mean"
    """``mean``: each trainer's gradient is scaled by 1 / num_trainers, as DDP averages."""
    id_policy: IdPolicy = "error"
    """An id outside its table: ``error`` refuses the batch, ``modulo`` wraps it."""
    init_seed: int = 0
    """Seed of the tables' initial values (see :mod:`hybrid.ps.init`)."""
    weighted: bool = False
    """The collection takes per-sample weights (``is_weighted``)."""
    servers: tuple[int, ...] = field(default=())
    """Servers holding at least one table, ascending (derived from ``layouts`` when empty)."""
    storage_dtype: StorageDtype = "float32"
    """How the servers store the rows (optimizer state and update math stay float32)."""
    dynamic: DynamicIds | None = None
    """``ids: dynamic``: raw int64 ids, rows created on first touch (None: ``ids: range``)."""
    wire_dtype: WireDtype = "float32"
    """The dtype of the rows in a server's replies and of the gradients trainers push:
    ``bfloat16`` halves their bytes (each value rounded to nearest, ties to even, once per
    crossing); the servers' storage, optimizer state and update math do not change."""
    pool_on: PoolOn = "auto"
    """Where a step's bags are pooled: ``trainer`` (the servers send rows), ``server`` (the
    servers pool each trainer's bags and send them, and turn the bags' gradients back into row
    gradients; every table whole on one server), or ``auto``: each trainer pools on the servers
    where it reaches every server of the collection over a network connection and the collection
    can be pooled there, else on itself (:meth:`RemoteCollection.pools_on_server
    <hybrid.ps.client.collection.RemoteCollection>`)."""

    def __post_init__(self) -> None:
        check_choice("wire_dtype", self.wire_dtype, WIRE_DTYPES)
        check_choice("pool_on", self.pool_on, POOL_ON)
        if not self.servers:
            object.__setattr__(self, "servers", tuple(sorted({s for lay in self.layouts for s in lay.servers})))

    @property
    def unpooled(self) -> bool:
        """An unpooled collection's (``EmbeddingCollection``, ``nn.Embedding``): rows reach the
        model one per id, there are no bags."""
        return any(t.pooling == "none" for t in self.tables)

    @property
    def scale(self) -> float:
        """What a server multiplies each trainer's gradient by."""
        return 1.0 / self.num_trainers if self.gradient_scaling == "mean" else 1.0

    def parts_on(self, server: int, table: int) -> list[int]:
        """Dynamic tables: the parts of table ``table`` that ``server`` holds, ascending."""
        lay = self.layouts[table]
        if server not in lay.servers:
            return []
        k, s = lay.servers.index(server), lay.num_shards
        return list(range(k, self.dynamic.partitions, s))

    def held(self, server: int) -> list[int]:
        """Indices of the tables with rows on ``server``, in collection order."""
        return [i for i, lay in enumerate(self.layouts) if server in lay.servers]

    def bytes_on(self, server: int) -> dict[str, int]:
        """Table name -> bytes ``server`` holds of it (rows and optimizer state), for its tables."""
        rows = held_rows(self.layouts, self.dynamic)
        return {self.layouts[i].table.name: rows[i][1][server] *
                row_bytes(self.optimizer.name, self.layouts[i].table.embedding_dim, self.storage_dtype)
                for i in self.held(server)}


def held_rows(layouts, dynamic: DynamicIds | None) -> list[tuple[int, dict[int, int]]]:
    """Per table (its layout, :mod:`hybrid.ps.sharding`): its embedding_dim, and server -> rows
    of it that server holds; a dynamic table's are the capacity of the parts it holds there
    (parts ``k, k + shards, ...`` on the table's ``k``-th server), whatever num_embeddings says."""
    out = []
    for lay in layouts:
        if dynamic is None:
            rows = {s: lay.shard_rows(k) for k, s in enumerate(lay.servers)}
        else:
            rows = {s: sum(dynamic.part_capacity(p) for p in range(k, dynamic.partitions, lay.num_shards))
                    for k, s in enumerate(lay.servers)}
        out.append((lay.table.embedding_dim, rows))
    return out


def single_table_name(path: str) -> str:
    """The table name of a plain ``nn.Embedding`` / ``nn.EmbeddingBag`` at module path ``path``
    (the same whatever ``compose``'s ``name``, so a checkpoint loads into a model composed under
    another name: the collection id namespaces it on the servers)."""
    return path.replace(".", "_").replace("/", "_") or "weight"


def collection_handle(cid: str) -> int:
    """The integer that names collection ``cid`` in step messages: the same on every process,
    computed, never negotiated (a server refuses two collections with one handle)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(cid.encode(), digest_size=7).digest(), "little")
