"""Trainer side: modules that stand in for embedding collections whose tables live on servers,
and return exactly what the originals return.

:class:`RemoteCollection` is what every stand-in shares -- the tables' layout, the control plane
(creating tables, loading given weights, reading them back, the counters, over RPC) and the
lookup of a batch's rows, through the model's :class:`~hybrid.ps.client.pipeline.StepPipeline`
in a training step (one message per server, gradients pushed back) or, outside one (evaluation,
``torch.no_grad()``), as of the last step this trainer finished. The subclasses differ only in
what they make of the rows:

- :class:`RemoteEmbeddingBagCollection` replaces a torchrec ``EmbeddingBagCollection`` (pooled:
  a ``KeyedTensor``), :class:`RemoteEmbeddingBag` a plain ``nn.EmbeddingBag``;
- :class:`RemoteEmbeddingCollection` replaces a torchrec ``EmbeddingCollection`` (unpooled: a
  ``Dict[str, JaggedTensor]``), :class:`RemoteEmbedding` a plain ``nn.Embedding``.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from hybrid.errors import PlanError
from hybrid.log import logger
from hybrid.ps.client.cache import HotRows
from hybrid.ps.client.pipeline import StepPipeline, _server_error
from hybrid.ps.client.routing import BadBatchError, BadIdError, RoutedBatch, Router, wants_weight_grad
from hybrid.ps.config import (
    CollectionConfig,
    OptimizerSpec,
    collection_handle,
    held_rows,
    single_table_name,
    table_specs,
)
from hybrid.ps.server import service
from hybrid.ps.sharding import shard_tables
from hybrid.ps.transport import call

WRITE_CHUNK_BYTES = 16 << 20
"""Rows written to a server per message when loading given weights."""
WRITE_WINDOW_BYTES = 64 << 20
"""At most this much of a load in flight per server (bounded memory on both ends)."""

__all__ = ["BadBatchError", "BadIdError", "RemoteCollection", "RemoteEmbedding", "RemoteEmbeddingBag",
           "RemoteEmbeddingBagCollection", "RemoteEmbeddingCollection", "RemoteTable", "single_table_name"]


class RemoteCollection(nn.Module):
    """Tables of one collection on parameter servers: what every stand-in shares (see the module
    docstring). ``state_dict()`` yields the original's keys (``<tables_attr>.<table>.weight``),
    fetched from the servers."""

    tables_attr = ""
    """The original module's attribute holding its tables (``embedding_bags``, ``embeddings``)."""

    def __init__(self, config: CollectionConfig, *, pipeline: StepPipeline, server_names: list[str],
                 timeout_s: float = 300.0, hot_rows: int = 0) -> None:
        """``hot_rows``: rows per table and server this trainer keeps from its lookups and uses
        again within the staleness bound (:mod:`hybrid.ps.client.cache`; 0: none)."""
        super().__init__()
        self.config = config
        self.cid = config.cid
        self.tables = list(config.tables)
        self.layouts = list(config.layouts)
        self.servers = list(config.servers)
        self.server_names = server_names
        self.handle = collection_handle(config.cid)
        self.timeout_s = timeout_s
        self.router = Router(config)
        self.hot_rows: HotRows | None = None
        if hot_rows:
            if config.staleness < 1:
                raise PlanError(f"{config.cid}: hot_rows needs sync.staleness >= 1 (a cached row is never fresh "
                                f"enough for a synchronous lookup)", category="bad_value", key="hot_rows")
            if pipeline.push_strategy.autograd:
                raise PlanError(f"{config.cid}: hot_rows needs runtime.gradient_push: rpc (with dist_autograd every "
                                f"row must come from its server)", category="bad_value", key="hot_rows")
            self.hot_rows = HotRows(hot_rows, config.staleness, held_rows(config.layouts, config.dynamic),
                                    getattr(torch, config.wire_dtype))
        self.pools_on_server = self._pools_on_server(pipeline, hot_rows)
        """Whether a step's lookups come back pooled (:meth:`Router.pooled`): ``pool_on``
        resolved for this trainer."""
        self._tags = 0
        object.__setattr__(self, "pipeline", pipeline)  # not a submodule
        pipeline.collections.append(self)

    def _pools_on_server(self, pipeline: StepPipeline, hot_rows: int) -> bool:
        """``pool_on`` for this trainer: ``auto`` pools on the servers where the collection can be
        pooled there and every one of its servers is reached over a network connection (TCP or
        RPC: pooled bags are fewer bytes to carry), and on the trainer where a server shares its
        memory (rows cost little to move there, and pooling would load the server). Where every
        server is across the network but something stands in the way, says what, once (info)."""
        config = self.config
        if config.pool_on == "trainer":
            return False
        why = self._cannot_pool_on_server(pipeline, hot_rows)
        if config.pool_on == "server":
            if why is not None:
                raise PlanError(f"{config.cid}: pool_on: server {why}", category="bad_value", key="pool_on")
            return True
        remote = not any(pipeline.transports[s].shares_memory for s in config.servers)
        if why is not None and remote and not config.unpooled:
            logger.info("%s: trainer %d pools its bags itself (pool_on: auto); its servers, across the network, "
                        "would send fewer bytes pooling them, but pool_on: server %s", config.cid,
                        pipeline.trainer, why)
        return why is None and remote

    def _cannot_pool_on_server(self, pipeline: StepPipeline, hot_rows: int) -> str | None:
        """Why this collection cannot be pooled on its servers, or ``None``."""
        config = self.config
        split = [lay.table.name for lay in config.layouts if lay.num_shards > 1]
        if split:
            return (f"needs every table whole on one server; {split} are split over servers (sharding: "
                    f"table_wise, or one server)")
        if config.unpooled:
            return "pools bags: an unpooled collection (EmbeddingCollection, nn.Embedding) has none"
        if hot_rows:
            return "and hot_rows do not go together (the cache keeps rows; the servers send bags)"
        if pipeline.push_strategy.autograd:
            return "needs runtime.gradient_push: rpc (distributed autograd records rows, not bags)"
        return None

    @property
    def _hybrid_pipeline(self) -> StepPipeline:
        return self.pipeline

    @staticmethod
    def config_from(module: nn.Module, *, cid: str, num_servers: int, sharding: str = "row_wise",
                    servers: list[int] | None = None, optimizer: OptimizerSpec | dict, num_trainers: int,
                    **options) -> CollectionConfig:
        """The :class:`CollectionConfig` of a local ``EmbeddingBagCollection`` or
        ``EmbeddingCollection`` (real or on meta)."""
        if hasattr(module, "embedding_bag_configs"):
            specs, weighted = table_specs(module.embedding_bag_configs()), module.is_weighted()
        else:
            specs, weighted = table_specs(module.embedding_configs()), False
        if weighted and any(t.pooling == "mean" for t in specs):
            raise ValueError(f"{cid}: per-sample weights with mean pooling are not supported "
                             f"(torch's embedding_bag refuses them)")
        seen: dict[str, str] = {}
        for t in specs:
            for f in t.feature_names:
                if f in seen:
                    raise ValueError(f"{cid}: feature {f!r} is read by tables {seen[f]!r} and {t.name!r}; on a "
                                     f"parameter server a feature reads one table (give each table its own "
                                     f"feature names)")
                seen[f] = t.name
        opt = optimizer if isinstance(optimizer, OptimizerSpec) else OptimizerSpec(**optimizer)
        return CollectionConfig(cid=cid, tables=tuple(specs), layouts=tuple(shard_tables(specs, num_servers, sharding,
                                                                                         servers)),
                                optimizer=opt, num_trainers=num_trainers, weighted=weighted, **options)

    # -- control plane --------------------------------------------------------------------------
    def _call(self, server: int, fn, *args) -> torch.futures.Future:
        return call(self.server_names[server], fn, args, timeout_s=self.timeout_s)

    def _wait(self, futures: list[tuple[int, torch.futures.Future]], what: str) -> list:
        out = []
        for s, f in futures:
            try:
                out.append(f.wait())
            except Exception as e:  # noqa: BLE001
                raise _server_error(what, self.server_names[s], e) from e
        return out

    def create_on_servers(self, *, init: str = "seed", start_step: int | None = None) -> None:
        """Create the shards on the servers (call on one trainer, then barrier the trainers):
        ``init="seed"`` fills each row with its layout-independent initial value
        (:mod:`hybrid.ps.init`, seeded by ``config.init_seed``), ``"zeros"`` with zeros (weights
        written next). The servers count steps from ``start_step`` (default: the pipeline's next
        step, so a collection added after some steps is read as of now). Raises
        :class:`~hybrid.errors.PlanError` when a server's shard does not fit in its memory
        (``runtime.server_memory_fraction``): that server allocated nothing."""
        if start_step is None:
            start_step = self.pipeline.next_step
        futs = [(s, self._call(s, service.rpc_create, self.config, start_step, init)) for s in self.servers]
        refused = [answer for answer in self._wait(futs, f"creating {self.cid}") if isinstance(answer, str)]
        if refused:  # a shard that does not fit its server's memory: the plan's mistake
            raise PlanError(refused[0], category="memory")

    def write_tables(self, weights: dict[str, torch.Tensor]) -> None:
        """Overwrite whole tables on the servers, streamed in chunks of at most
        :data:`WRITE_CHUNK_BYTES`, at most :data:`WRITE_WINDOW_BYTES` in flight per server."""
        if self.config.dynamic is not None:
            raise ValueError(f"{self.cid} has ids: dynamic: its rows are named by ids, not numbered, so numbered "
                             f"weights cannot be written into it; restore a checkpoint to set its rows")
        if self.hot_rows is not None:
            self.hot_rows.clear()
        inflight: dict[int, list[tuple[int, torch.futures.Future]]] = {s: [] for s in self.servers}
        for t, lay in zip(self.tables, self.layouts):
            if t.name not in weights:
                continue
            full = weights[t.name]
            if tuple(full.shape) != (t.num_embeddings, t.embedding_dim):
                raise ValueError(f"table {t.name}: weight of shape {tuple(full.shape)} does not fit "
                                 f"({t.num_embeddings}, {t.embedding_dim})")
            step = max(1, WRITE_CHUNK_BYTES // (4 * t.embedding_dim))
            for pos, s in enumerate(lay.servers):
                shard = full if lay.sharding == "table_wise" else full[pos :: lay.num_shards]
                for start in range(0, shard.shape[0], step):
                    chunk = shard[start : start + step].detach().to("cpu", torch.float32).contiguous()
                    window = inflight[s]
                    while window and sum(n for n, _ in window) + chunk.nbytes > WRITE_WINDOW_BYTES:
                        self._wait([(s, window.pop(0)[1])], f"loading {t.name} into {self.cid}")
                    window.append((chunk.nbytes, self._call(s, service.rpc_write_rows, self.handle, t.name, start,
                                                            chunk)))
        for s, window in inflight.items():
            self._wait([(s, f) for _, f in window], f"loading tables into {self.cid}")

    def read_tables(self, with_state: bool = False) -> dict[str, torch.Tensor] | tuple[dict, dict]:
        """Whole tables assembled from the servers (and, optionally, optimizer state per table),
        as of every step this trainer has finished (in sync mode: applied by all trainers)."""
        if self.config.dynamic is not None:
            raise ValueError(f"{self.cid} has ids: dynamic: its rows are named by ids, not numbered; read them "
                             f"with read_dynamic() (or export a checkpoint: ids and rows per table)")
        after = self.pipeline.finished_step()
        weights, states = {}, {}
        for t, lay in zip(self.tables, self.layouts):
            futs = [(s, self._call(s, service.rpc_read_shard, self.handle, t.name, after)) for s in lay.servers]
            shards = self._wait(futs, f"reading {t.name} of {self.cid}")
            full = torch.empty(t.num_embeddings, t.embedding_dim)
            st_full: dict[str, torch.Tensor] = {}
            for pos, (w, st) in enumerate(shards):
                sl = slice(None) if lay.sharding == "table_wise" else slice(pos, None, lay.num_shards)
                full[sl] = w
                for k, v in st.items():
                    if k not in st_full:
                        st_full[k] = torch.empty((t.num_embeddings, *v.shape[1:]), dtype=v.dtype)
                    st_full[k][sl] = v
            weights[t.name] = full
            states[t.name] = st_full
        return (weights, states) if with_state else weights

    def read_dynamic(self) -> dict[str, dict[str, torch.Tensor]]:
        """``ids: dynamic``: per table, every server's ids, rows, optimizer state (``state.<name>``)
        and map entries merged, ascending by id (see ``TableShard.dynamic_rows``), as of every
        step this trainer has finished."""
        if self.config.dynamic is None:
            raise ValueError(f"{self.cid} has ids: range; read_tables() reads its rows")
        after = self.pipeline.finished_step()
        out = {}
        for t, lay in zip(self.tables, self.layouts):
            futs = [(s, self._call(s, service.rpc_read_dynamic, self.handle, t.name, after)) for s in lay.servers]
            parts = self._wait(futs, f"reading {t.name} of {self.cid}")
            per_row = [k for k in parts[0] if k not in ("seen_ids", "seen_counts", "counters")]
            merged = {k: torch.cat([p[k] for p in parts]) for k in per_row + ["seen_ids", "seen_counts"]}
            order = torch.argsort(merged["ids"])
            merged.update({k: merged[k][order] for k in per_row})
            seen = torch.argsort(merged["seen_ids"])
            merged.update(seen_ids=merged["seen_ids"][seen], seen_counts=merged["seen_counts"][seen])
            merged["counters"] = sum(p["counters"] for p in parts)
            del merged["slots"]  # slot numbers are a server's own
            out[t.name] = merged
        return out

    def stats(self) -> dict[str, dict]:
        """Each server's counters for this collection."""
        futs = [(s, self._call(s, service.rpc_stats, self.handle)) for s in self.servers]
        return {self.server_names[s]: d for (s, _), d in zip(futs, self._wait(futs, f"counters of {self.cid}"))}

    # -- state dict: same keys as the local collection --------------------------------------------
    def state_keys(self, prefix: str = "") -> dict[str, str]:
        """Table name -> its key in the original module's state dict (under ``prefix``)."""
        return {t.name: f"{prefix}{self.tables_attr}.{t.name}.weight" for t in self.tables}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        keys = self.state_keys(prefix)
        for name, w in self.read_tables().items():
            destination[keys[name]] = w

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        found = {}
        for t in self.tables:
            key = f"{prefix}{self.tables_attr}.{t.name}.weight"
            if key in state_dict:
                found[t.name] = state_dict[key]
            elif strict:
                missing_keys.append(key)
        if found:
            self.write_tables(found)

    # -- forward --------------------------------------------------------------------------------
    def accepts(self, kjt: KeyedJaggedTensor) -> bool:
        """Whether ``kjt`` holds every feature this collection reads (it can be prefetched)."""
        keys = set(kjt.keys())
        return all(f in keys for f in self.router.feature_order)

    def route(self, kjt: KeyedJaggedTensor, *, step: bool = False) -> RoutedBatch:
        """``kjt`` routed; for a ``step``'s lookup of a collection pooled on its servers, with
        each server's bags under this lookup's tag."""
        tag = -1
        if step and self.pools_on_server:
            tag, self._tags = self._tags, self._tags + 1
        return self.router.route(kjt, where=self.cid, tag=tag)

    def prefetch(self, kjt: KeyedJaggedTensor) -> None:
        """Ask now for the rows of the next step's batch (see :meth:`StepPipeline.prefetch`)."""
        self.pipeline.prefetch(kjt)

    def rows(self, features: KeyedJaggedTensor) -> tuple[RoutedBatch, dict[int, torch.Tensor]]:
        """The batch routed, and each server's reply: in a training step (with gradients) this
        step's rows, leaves whose gradients go back to the servers; otherwise read as of the last
        step this trainer finished."""
        pipeline = self.pipeline
        if pipeline.current is not None and torch.is_grad_enabled():
            return pipeline.lookup(self, features)
        return self._read(features)

    def _read(self, kjt: KeyedJaggedTensor) -> tuple[RoutedBatch, dict[int, torch.Tensor]]:
        """Rows without gradient, as of the last step this trainer finished."""
        routed = self.route(kjt)
        after = self.pipeline.finished_step()
        futs = [(s, self._call(s, service.rpc_read, self.handle, after, r.tables, r.counts, r.ids))
                for s, r in routed.requests.items()]
        device = self.pipeline.device  # the rows come in host memory, as in a step
        rows = [r.to(device, non_blocking=r.is_pinned()) for r in self._wait(futs, "lookup")]
        return routed, dict(zip(routed.requests, rows))

    def extra_repr(self) -> str:
        shard = {lay.sharding for lay in self.layouts}
        return (f"cid={self.cid!r}, tables={len(self.tables)}, servers={[self.server_names[s] for s in self.servers]}, "
                f"sharding={'/'.join(sorted(shard))}, optimizer={self.config.optimizer.name}")


class RemoteEmbeddingBagCollection(RemoteCollection):
    """Drop-in for ``torchrec.EmbeddingBagCollection`` with its tables on parameter servers:
    returns the same ``KeyedTensor``; ``state_dict()`` keys ``embedding_bags.<table>.weight``."""

    tables_attr = "embedding_bags"

    def is_weighted(self) -> bool:
        return self.config.weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if self.config.weighted and features.weights_or_none() is None:
            raise BadBatchError(f"{self.cid}: the collection is weighted (is_weighted=True) but the batch holds no "
                                f"per-sample weights")
        if self.pools_on_server and wants_weight_grad(features):
            # Learned weights get their gradient only where the bags are pooled: on the trainer.
            if self.config.pool_on == "server":
                raise BadBatchError(
                    f"{self.cid}: the per-sample weights require grad, but this collection pools its bags on the "
                    f"servers, which give no gradient to the weights (only to the rows); set the module's "
                    f"pool_on: trainer in the plan, or detach the weights (weights.detach()) if they are not to "
                    f"be learned")
            self.pools_on_server = False
            logger.info("%s: trainer %d pools its bags itself from now on (pool_on: auto): its per-sample weights "
                        "require grad, which bags pooled on the servers would not give them", self.cid,
                        self.pipeline.trainer)
        routed, rows = self.rows(features)
        values = self.router.pool(routed, rows, features) if routed.bags is None else self.router.pooled(routed, rows)
        return KeyedTensor(keys=self.router.embedding_names, length_per_key=self.router.length_per_key,
                           values=values)


class RemoteEmbeddingCollection(RemoteCollection):
    """Drop-in for ``torchrec.EmbeddingCollection`` (unpooled) with its tables on parameter
    servers: returns the same ``Dict[str, JaggedTensor]`` -- per feature one row per id, the
    batch's lengths, and the ids as weights with ``need_indices`` -- and ``state_dict()`` keys
    ``embeddings.<table>.weight``. Each unique id of a batch crosses the wire once; its gradient
    is the sum over the positions it filled."""

    tables_attr = "embeddings"

    def __init__(self, config: CollectionConfig, *, pipeline: StepPipeline, server_names: list[str],
                 timeout_s: float = 300.0, need_indices: bool = False, hot_rows: int = 0) -> None:
        if any(t.pooling != "none" for t in config.tables):
            raise ValueError(f"{config.cid}: an EmbeddingCollection's tables are unpooled; got pooling "
                             f"{sorted({t.pooling for t in config.tables})}")
        super().__init__(config, pipeline=pipeline, server_names=server_names, timeout_s=timeout_s,
                         hot_rows=hot_rows)
        self._need_indices = need_indices

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self.tables[0].embedding_dim

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        routed, rows = self.rows(features)
        values = self.router.embed(routed, rows)
        jts = features.to_dict()
        return {f: JaggedTensor(values=values[f], lengths=jts[f].lengths(),
                                weights=jts[f].values() if self._need_indices else None)
                for f in self.router.feature_order}


class RemoteTable(nn.Module):
    """A plain one-table module (``nn.EmbeddingBag``, ``nn.Embedding``) on servers: a one-table
    collection underneath, and the original's one state-dict key, ``weight``."""

    def __init__(self, collection: RemoteCollection) -> None:
        super().__init__()
        # Not a registered child: its state-dict keys (embedding_bags.*, embeddings.*) are not this module's.
        object.__setattr__(self, "collection", collection)
        self.feature = collection.tables[0].feature_names[0]

    @property
    def _hybrid_pipeline(self) -> StepPipeline:
        return self.collection.pipeline

    def state_keys(self, prefix: str = "") -> dict[str, str]:
        """Table name -> its key in the original module's state dict (under ``prefix``)."""
        return {self.collection.tables[0].name: f"{prefix}weight"}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[f"{prefix}weight"] = self.collection.read_tables()[self.collection.tables[0].name]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = f"{prefix}weight"
        if key in state_dict:
            self.collection.write_tables({self.collection.tables[0].name: state_dict[key]})
        elif strict:
            missing_keys.append(key)


class RemoteEmbeddingBag(RemoteTable):
    """Drop-in for a plain ``nn.EmbeddingBag`` (sum or mean) whose one table lives on servers.

    Same call forms as the original (2-D input, or 1-D input with offsets, optional
    ``per_sample_weights``), same output, and the same ``state_dict`` key (``weight``).
    """

    def __init__(self, collection: RemoteEmbeddingBagCollection, *, include_last_offset: bool) -> None:
        super().__init__(collection)
        self.include_last_offset = include_last_offset

    @staticmethod
    def as_collection(bag: nn.EmbeddingBag, *, cid: str, path: str | None = None):
        """A one-table ``EmbeddingBagCollection`` on meta with ``bag``'s shape and pooling, its
        table named after ``path`` (the module path; default ``cid``)."""
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        if bag.mode not in ("sum", "mean"):
            raise ValueError(f"{cid}: nn.EmbeddingBag mode {bag.mode!r} is not supported on a parameter server "
                             f"(sum, mean)")
        refused = [f"{k}={v!r}" for k, v in (("padding_idx", bag.padding_idx), ("max_norm", bag.max_norm),
                                             ("scale_grad_by_freq", bag.scale_grad_by_freq))
                   if v is not None and v is not False]  # padding_idx 0 counts
        if refused:
            # The servers' pooling and optimizer take plain rows: nothing drops a padding id from
            # its bag, renormalizes rows or scales a gradient by its id's frequency.
            raise ValueError(f"{cid}: nn.EmbeddingBag with {', '.join(refused)} is not supported on a parameter server")
        name = single_table_name(cid if path is None else path)
        config = EmbeddingBagConfig(
            name=name, embedding_dim=bag.embedding_dim, num_embeddings=bag.num_embeddings, feature_names=[name],
            pooling=PoolingType.SUM if bag.mode == "sum" else PoolingType.MEAN)
        return EmbeddingBagCollection(tables=[config], is_weighted=bag.mode == "sum", device=torch.device("meta"))

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if input.dim() == 2:
            lengths = torch.full((input.shape[0],), input.shape[1], dtype=torch.long)
            values = input.reshape(-1)
        else:
            if offsets is None:
                raise ValueError("1-D input needs offsets (as nn.EmbeddingBag)")
            bounds = offsets if self.include_last_offset else torch.cat([offsets, offsets.new_tensor([input.numel()])])
            lengths = bounds.diff()
            values = input
        if self.collection.is_weighted():
            weights = per_sample_weights.reshape(-1) if per_sample_weights is not None else torch.ones(values.shape)
        elif per_sample_weights is not None:
            raise ValueError("per_sample_weights are only supported with mode='sum' (as nn.EmbeddingBag)")
        else:
            weights = None
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[self.feature], values=values, lengths=lengths, weights=weights)
        return self.collection(kjt).values()


class RemoteEmbedding(RemoteTable):
    """Drop-in for a plain ``nn.Embedding`` whose one table lives on servers: an id tensor of any
    shape ``S`` gives ``S + (embedding_dim,)``, as the original.

    With ``padding_idx`` as torch: that id's row is zero and gets no gradient -- its positions
    are not looked up at all (zeros in the output), and the servers' row is zero (written so at
    creation), so ``state_dict`` shows the zero row torch keeps.
    """

    def __init__(self, collection: RemoteEmbeddingCollection, *, padding_idx: int | None = None) -> None:
        super().__init__(collection)
        self.padding_idx = padding_idx
        self.embedding_dim = collection.tables[0].embedding_dim
        self.num_embeddings = collection.tables[0].num_embeddings

    @staticmethod
    def as_collection(emb: nn.Embedding, *, cid: str, path: str | None = None):
        """A one-table ``EmbeddingCollection`` on meta with ``emb``'s shape, its table named after
        ``path`` (the module path; default ``cid``). Refuses what the servers cannot do as torch
        does (``max_norm``, ``scale_grad_by_freq``, ``sparse``)."""
        from torchrec.modules.embedding_configs import EmbeddingConfig
        from torchrec.modules.embedding_modules import EmbeddingCollection

        refused = [f"{k}={v!r}" for k, v in (("max_norm", emb.max_norm), ("scale_grad_by_freq", emb.scale_grad_by_freq),
                                             ("sparse", emb.sparse)) if v not in (None, False)]
        if refused:
            raise ValueError(f"{cid}: nn.Embedding with {', '.join(refused)} is not supported on a parameter server "
                             f"(the servers apply their own sparse optimizer to plain rows)")
        name = single_table_name(cid if path is None else path)
        config = EmbeddingConfig(name=name, embedding_dim=emb.embedding_dim, num_embeddings=emb.num_embeddings,
                                 feature_names=[name])
        return EmbeddingCollection(tables=[config], device=torch.device("meta"))

    def zero_padding_row(self) -> None:
        """Write zeros into the ``padding_idx`` row on its server (one trainer, at creation)."""
        coll = self.collection
        if self.padding_idx is None or coll.config.dynamic is not None:
            return  # a dynamic table never sees the padding id, so it never gets a row
        t = coll.tables[0]
        server, local = coll.router.locate(0, self.padding_idx)
        coll._wait([(server, coll._call(server, service.rpc_write_rows, coll.handle, t.name, local,
                                        torch.zeros(1, t.embedding_dim)))],
                   f"zeroing padding row {self.padding_idx} of {coll.cid}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{self.feature}: nn.Embedding takes int32 or int64 ids; got {input.dtype}")
        ids = input.reshape(-1)
        keep = None
        if self.padding_idx is not None:
            keep = ids != self.padding_idx
            ids = ids[keep]
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[self.feature], values=ids,
                                                  lengths=torch.tensor([ids.numel()], dtype=torch.int32))
        rows = self.collection(kjt)[self.feature].values()
        if keep is not None:
            full = rows.new_zeros(input.numel(), self.embedding_dim)
            rows = full.index_put((keep.nonzero().squeeze(1).to(rows.device),), rows)
        return rows.view(*input.shape, self.embedding_dim)
