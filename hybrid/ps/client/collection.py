"""Trainer side: modules that stand in for embedding collections whose tables live on servers,
and return exactly what the originals return.

:class:`RemoteEmbeddingBagCollection` replaces a torchrec ``EmbeddingBagCollection``,
:class:`RemoteEmbeddingBag` a plain ``nn.EmbeddingBag``. In a training step their lookups go
through the model's :class:`~hybrid.ps.client.pipeline.StepPipeline` (one message per server,
gradients pushed back); outside one (evaluation, ``torch.no_grad()``) they read the rows as of the
last step this trainer finished. Creating tables, loading given weights, ``state_dict`` and the
counters go over RPC, the control plane.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from hybrid.errors import PlanError
from hybrid.ps.client.pipeline import StepPipeline, _server_error
from hybrid.ps.client.routing import BadBatchError, BadIdError, RoutedBatch, Router
from hybrid.ps.config import CollectionConfig, OptimizerSpec, collection_handle, table_specs
from hybrid.ps.server import service
from hybrid.ps.sharding import shard_tables
from hybrid.ps.transport import call

WRITE_CHUNK_BYTES = 16 << 20
"""Rows written to a server per message when loading given weights."""
WRITE_WINDOW_BYTES = 64 << 20
"""At most this much of a load in flight per server (bounded memory on both ends)."""

__all__ = ["BadBatchError", "BadIdError", "RemoteEmbeddingBag", "RemoteEmbeddingBagCollection"]


class RemoteEmbeddingBagCollection(nn.Module):
    """Drop-in for ``torchrec.EmbeddingBagCollection`` with its tables on parameter servers.

    ``state_dict()`` yields the same keys as the original (``embedding_bags.<table>.weight``),
    fetched from the servers.
    """

    def __init__(self, config: CollectionConfig, *, pipeline: StepPipeline, server_names: list[str],
                 timeout_s: float = 300.0) -> None:
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
        object.__setattr__(self, "pipeline", pipeline)  # not a submodule
        pipeline.collections.append(self)

    @property
    def _hybrid_pipeline(self) -> StepPipeline:
        return self.pipeline

    @staticmethod
    def config_from(ebc: nn.Module, *, cid: str, num_servers: int, sharding: str = "row_wise",
                    servers: list[int] | None = None, optimizer: OptimizerSpec | dict, num_trainers: int,
                    **options) -> CollectionConfig:
        """The :class:`CollectionConfig` of a local ``EmbeddingBagCollection`` (real or on meta)."""
        specs = table_specs(ebc.embedding_bag_configs())
        if ebc.is_weighted() and any(t.pooling == "mean" for t in specs):
            raise ValueError(f"{cid}: per-sample weights with mean pooling are not supported "
                             f"(torch's embedding_bag refuses them)")
        opt = optimizer if isinstance(optimizer, OptimizerSpec) else OptimizerSpec(**optimizer)
        return CollectionConfig(cid=cid, tables=tuple(specs), layouts=tuple(shard_tables(specs, num_servers, sharding,
                                                                                         servers)),
                                optimizer=opt, num_trainers=num_trainers, weighted=ebc.is_weighted(), **options)

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

    def is_weighted(self) -> bool:
        return self.config.weighted

    # -- state dict: same keys as the local collection --------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, w in self.read_tables().items():
            destination[f"{prefix}embedding_bags.{name}.weight"] = w

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        found = {}
        for t in self.tables:
            key = f"{prefix}embedding_bags.{t.name}.weight"
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

    def route(self, kjt: KeyedJaggedTensor) -> RoutedBatch:
        return self.router.route(kjt, where=self.cid)

    def prefetch(self, kjt: KeyedJaggedTensor) -> None:
        """Ask now for the rows of the next step's batch (see :meth:`StepPipeline.prefetch`)."""
        self.pipeline.prefetch(kjt)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        pipeline = self.pipeline
        if pipeline.current is not None and torch.is_grad_enabled():
            routed, rows = pipeline.lookup(self, features)
        else:
            routed, rows = self._read(features)
        return KeyedTensor(keys=self.router.embedding_names, length_per_key=self.router.length_per_key,
                           values=self.router.pool(routed, rows))

    def _read(self, kjt: KeyedJaggedTensor) -> tuple[RoutedBatch, dict[int, torch.Tensor]]:
        """Rows without gradient, as of the last step this trainer finished."""
        routed = self.route(kjt)
        after = self.pipeline.finished_step()
        futs = [(s, self._call(s, service.rpc_read, self.handle, after, r.tables, r.counts, r.ids))
                for s, r in routed.requests.items()]
        return routed, dict(zip(routed.requests, self._wait(futs, "lookup")))

    def extra_repr(self) -> str:
        shard = {lay.sharding for lay in self.layouts}
        return (f"cid={self.cid!r}, tables={len(self.tables)}, servers={[self.server_names[s] for s in self.servers]}, "
                f"sharding={'/'.join(sorted(shard))}, optimizer={self.config.optimizer.name}")


class RemoteEmbeddingBag(nn.Module):
    """Drop-in for a plain ``nn.EmbeddingBag`` (sum or mean) whose one table lives on servers.

    Same call forms as the original (2-D input, or 1-D input with offsets, optional
    ``per_sample_weights``), same output, and the same ``state_dict`` key (``weight``).
    """

    def __init__(self, collection: RemoteEmbeddingBagCollection, *, include_last_offset: bool) -> None:
        super().__init__()
        # Not a registered child: its state-dict keys (embedding_bags.*) are not this module's.
        object.__setattr__(self, "collection", collection)
        self.include_last_offset = include_last_offset
        self.feature = collection.tables[0].feature_names[0]

    @property
    def _hybrid_pipeline(self) -> StepPipeline:
        return self.collection.pipeline

    @staticmethod
    def as_collection(bag: nn.EmbeddingBag, *, cid: str):
        """A one-table ``EmbeddingBagCollection`` on meta with ``bag``'s shape and pooling."""
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        if bag.mode not in ("sum", "mean"):
            raise ValueError(f"{cid}: nn.EmbeddingBag mode {bag.mode!r} is not supported on a parameter server "
                             f"(sum, mean)")
        if bag.padding_idx is not None or bag.max_norm is not None:
            raise ValueError(f"{cid}: padding_idx and max_norm are not supported on a parameter server")
        name = cid.replace(".", "_").replace("/", "_") or "weight"
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

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[f"{prefix}weight"] = self.collection.read_tables()[self.collection.tables[0].name]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = f"{prefix}weight"
        if key in state_dict:
            self.collection.write_tables({self.collection.tables[0].name: state_dict[key]})
        elif strict:
            missing_keys.append(key)
