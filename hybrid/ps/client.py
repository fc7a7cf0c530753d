"""Trainer side: a module that stands in for an ``EmbeddingBagCollection`` whose tables live on
parameter servers, and returns exactly what the original returns.

Per step and per server it sends **one** lookup RPC carrying the deduplicated ids of every table
that server holds, all servers in parallel; rows come back flat, are put back in order and pooled
here (sum or mean, per-sample weights, empty bags) into the same ``KeyedTensor`` the local
collection would produce. Gradients go back through :mod:`hybrid.autograd`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from hybrid import autograd as bridge
from hybrid.log import warn_once
from hybrid.ps import channel
from hybrid.ps import server as srv
from hybrid.ps.fused import FusedPlan, FusedRoute
from hybrid.ps.optim import SparseOptimSpec
from hybrid.ps.sharding import TableLayout, TableSpec, shard_tables, table_specs
from hybrid.launch.roles import server_names

_WRITE_CHUNK_BYTES = 16 << 20


class BadIdError(ValueError):
    """An id outside its table under ``id_policy: error``; nothing was sent or changed."""


class BadBatchError(ValueError):
    """A ``KeyedJaggedTensor`` whose lengths, values and weights disagree; nothing was sent."""


def check_kjt(kjt: KeyedJaggedTensor, where: str = "") -> None:
    """Refuse a batch whose parts disagree, naming what disagrees (torch would fail deep inside
    a kernel, or silently ignore ids past the last bag)."""
    keys, lengths, values = kjt.keys(), kjt.lengths(), kjt.values()
    prefix = f"{where}: " if where else ""
    if lengths.numel() % max(len(keys), 1):
        raise BadBatchError(f"{prefix}{lengths.numel()} lengths for {len(keys)} features: expected a multiple of "
                            f"{len(keys)} (one length per feature and sample)")
    if lengths.numel() and int(lengths.min()) < 0:
        raise BadBatchError(f"{prefix}a negative bag length ({int(lengths.min())}) in feature "
                            f"{keys[int((lengths < 0).nonzero()[0]) // max(kjt.stride(), 1)]!r}")
    total = int(lengths.sum())
    if total != values.numel():
        raise BadBatchError(f"{prefix}the lengths add up to {total} ids but the batch holds {values.numel()} values; "
                            f"lengths/offsets and values disagree")
    weights = kjt.weights_or_none()
    if weights is not None and weights.numel() != values.numel():
        raise BadBatchError(f"{prefix}{weights.numel()} per-sample weights for {values.numel()} ids")


@dataclass
class _TableRoute:
    inverse: torch.Tensor  # position in the table's unique ids of every id, in feature order
    restore: torch.Tensor  # unique position -> position in the server-sorted rows
    feature_slices: list[tuple[int, int]]  # [start, end) of each feature's ids in ``inverse``


@dataclass
class _Route:
    """How one batch's ids were split over servers, and how to put the rows back."""

    tables: list[_TableRoute]
    requests: dict[int, tuple[torch.Tensor, list[int]]]  # server -> (ids, counts per held table)
    n_raw: dict[int, int]
    offsets: list[torch.Tensor]  # per input feature position (include_last_offset)
    weights: list[torch.Tensor | None]
    batch_size: int


class ServerError(RuntimeError):
    """A parameter server failed, died or did not answer in time; the message names it."""


class _Pending:
    """Lookups in flight for one batch (or, deferred, routed and waiting to be sent)."""

    def __init__(self, route: _Route, futures: dict[int, torch.futures.Future] | None, kjt,
                 names: list[str] | None = None, owner: RemoteEmbeddingBagCollection | None = None,
                 sender: Callable[[], dict[int, torch.futures.Future]] | None = None) -> None:
        self.route, self.futures, self.kjt = route, futures, kjt
        self.names = names
        self.owner = owner
        self.sender = sender

    def send(self) -> None:
        """Send a deferred lookup now (no-op once sent)."""
        if self.futures is None:
            sender, self.sender = self.sender, None
            self.futures = sender()

    def dest(self, s: int) -> bridge.PushDest:
        """Where the gradient of server ``s``'s rows goes (``rpc`` gradient push)."""
        ids, counts = self.route.requests[s]
        return bridge.PushDest(self.owner, s, ids, counts)

    def wait(self, timeout_s: float) -> dict[int, torch.Tensor]:
        self.send()
        out = {}
        for s, f in self.futures.items():
            try:
                out[s] = f.wait()
            except Exception as e:  # noqa: BLE001 - every failure of a peer gets its name
                name = self.names[s] if self.names else f"server {s}"
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                hint = " (it died or closed the connection)" if "EOF" in first or "pipe" in first or "ECONNRE" in first else ""
                raise ServerError(f"lookup on parameter server {name} failed{hint}: {first}") from e
        return out


class RemoteEmbeddingBagCollection(nn.Module):
    """Drop-in for ``torchrec.EmbeddingBagCollection`` with its tables on parameter servers.

    Build it with :meth:`from_collection`; the composer does. ``state_dict()`` yields the same
    keys as the original (``embedding_bags.<table>.weight``), fetched from the servers.
    """

    def __init__(
        self,
        *,
        cid: str,
        tables: list[TableSpec],
        layouts: list[TableLayout],
        num_servers: int,
        optimizer: SparseOptimSpec,
        id_policy: str = "error",
        is_weighted: bool = False,
        trainer: int = 0,
        num_trainers: int = 1,
        staleness: int = 0,
        gradient_scaling: str = "mean",
        timeout_s: float = 300.0,
    ) -> None:
        super().__init__()
        if id_policy not in ("error", "modulo"):
            raise ValueError(f"id_policy must be 'error' or 'modulo', got {id_policy!r}")
        self.cid = cid
        self.tables = tables
        self.layouts = layouts
        self.num_servers = num_servers
        self.optimizer = optimizer
        self.id_policy = id_policy
        self._is_weighted = is_weighted
        self.trainer = trainer
        self.num_trainers = num_trainers
        self.staleness = staleness
        self.gradient_scaling = gradient_scaling
        self.timeout_s = timeout_s
        self.server_names = server_names(num_servers)
        self.embedding_names = [n for names in get_embedding_names_by_table(tables) for n in names]
        self.feature_order = [f for t in tables for f in t.feature_names]
        self.length_per_key = [t.embedding_dim for t in tables for _ in t.feature_names]
        # Servers in request order, and for each the indices of the tables it holds.
        self.servers = sorted({s for lay in layouts for s in lay.servers})
        self.held = {s: [i for i, lay in enumerate(layouts) if s in lay.servers] for s in self.servers}
        # Tables of one dimension and pooling (the usual case) take the fast path of one
        # deduplication and one pooling kernel for all of them; others go table by table.
        self._fused = FusedPlan.build(tables, layouts, self.servers, self.feature_order, is_weighted=is_weighted)
        self._channels: dict[int, channel.TrainerEnd | None] = {}

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_collection(
        cls,
        ebc: nn.Module,
        *,
        cid: str,
        num_servers: int,
        sharding: str = "row_wise",
        servers: list[int] | None = None,
        optimizer: SparseOptimSpec | dict | None = None,
        **kwargs,
    ) -> RemoteEmbeddingBagCollection:
        specs = table_specs(ebc.embedding_bag_configs())
        layouts = shard_tables(specs, num_servers, sharding, servers)
        return cls(
            cid=cid,
            tables=specs,
            layouts=layouts,
            num_servers=num_servers,
            optimizer=SparseOptimSpec.from_any(optimizer or {}),
            is_weighted=ebc.is_weighted(),
            **kwargs,
        )

    def create_on_servers(self, init_from: nn.Module | None = None, *, start_step: int | None = None,
                          init_seed: int = 0) -> None:
        """Create the shards on the servers (call on one trainer, then barrier the trainers).

        With ``init_from`` (the original collection, materialized), its weights are copied so the
        hybrid model starts exactly where the plain one does; without it (or on meta), each
        server initializes its own shards (TorchRec's uniform init) and no table crosses the wire.
        """
        if start_step is None:
            rt = bridge.runtime()
            start_step = rt.next_step if rt is not None else 0
        weights = None
        if init_from is not None:
            w = {t.name: init_from.embedding_bags[t.name].weight for t in self.tables}
            if not any(v.is_meta for v in w.values()):
                weights = w
        futs = [
            rpc.rpc_async(
                self.server_names[s],
                srv.rpc_create,
                args=(self.cid, s, self.layouts, vars(self.optimizer), self.num_trainers,
                      self.staleness, self.gradient_scaling, start_step,
                      None if weights is not None else init_seed),
                timeout=self.timeout_s,
            )
            for s in self.servers
        ]
        for f in futs:
            f.wait()
        if weights is not None:
            self.write_tables({n: w.detach().cpu() for n, w in weights.items()})

    def write_tables(self, weights: dict[str, torch.Tensor]) -> None:
        """Overwrite whole tables on the servers (chunked; a load, not a training step)."""
        futs = []
        for t, lay in zip(self.tables, self.layouts):
            if t.name not in weights:
                continue
            full = weights[t.name]
            if tuple(full.shape) != (t.num_embeddings, t.embedding_dim):
                raise ValueError(
                    f"table {t.name}: weight of shape {tuple(full.shape)} does not fit "
                    f"({t.num_embeddings}, {t.embedding_dim})"
                )
            for pos, s in enumerate(lay.servers):
                shard = full if lay.sharding == "table_wise" else full[pos :: lay.num_shards]
                step = max(1, _WRITE_CHUNK_BYTES // (4 * t.embedding_dim))
                for start in range(0, shard.shape[0], step):
                    futs.append(
                        rpc.rpc_async(
                            self.server_names[s], srv.rpc_write_rows,
                            args=(self.cid, t.name, start, shard[start : start + step].contiguous()),
                            timeout=self.timeout_s,
                        )
                    )
        for f in futs:
            f.wait()

    def read_tables(self, with_state: bool = False) -> dict[str, torch.Tensor] | tuple[dict, dict]:
        """Whole tables assembled from the servers (and, optionally, optimizer state per table),
        as of every step this trainer has finished (in sync mode: applied by all trainers)."""
        after = self._finished_step()
        weights, states = {}, {}
        for t, lay in zip(self.tables, self.layouts):
            shards = [
                rpc.rpc_async(self.server_names[s], srv.rpc_read_shard, args=(self.cid, t.name, after),
                              timeout=self.timeout_s)
                for s in lay.servers
            ]
            shards = [f.wait() for f in shards]
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

    def _finished_step(self) -> int:
        """The last step this trainer finished (its gradients delivered), or -1."""
        rt = bridge.runtime()
        if rt is None:
            return -1
        if rt.current is not None:
            if rt.owed is not None:
                rt.owed.flush()  # the read waits for the previous step, which waits for this push
            return rt.current.step - 1
        rt.wait_pushed()
        return rt.next_step - 1

    def stats(self) -> dict[str, dict]:
        """Each server's counters for this collection."""
        futs = {self.server_names[s]: rpc.rpc_async(self.server_names[s], srv.rpc_stats, args=(self.cid,))
                for s in self.servers}
        return {n: f.wait() for n, f in futs.items()}

    def is_weighted(self) -> bool:
        return self._is_weighted

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

    # -- routing ---------------------------------------------------------------------------------
    def _route(self, kjt: KeyedJaggedTensor) -> _Route:
        keys = kjt.keys()
        index = {k: i for i, k in enumerate(keys)}
        missing = [f for f in self.feature_order if f not in index]
        if missing:
            raise ValueError(f"input KeyedJaggedTensor lacks features {missing}; it has {keys}")
        values = kjt.values().split(kjt.length_per_key())
        lengths = kjt.lengths().view(len(keys), -1)
        b = kjt.stride()
        weights = kjt.weights().split(kjt.length_per_key()) if self._is_weighted else [None] * len(keys)
        per_server: dict[int, list[torch.Tensor | None]] = {s: [None] * len(self.tables) for s in self.servers}
        tables, offsets, wts = [], [], []
        n_raw = {s: 0 for s in self.servers}
        for ti, (t, lay) in enumerate(zip(self.tables, self.layouts)):
            ids_f = []
            for f in t.feature_names:
                v = values[index[f]]
                ids_f.append(self._check_ids(v, f, t))
                offsets.append(torch.cat([lengths.new_zeros(1), torch.cumsum(lengths[index[f]], 0)]))
                wts.append(weights[index[f]])
            ids = torch.cat(ids_f) if len(ids_f) > 1 else ids_f[0]
            uniq, inverse = torch.unique(ids, return_inverse=True)
            slices, start = [], 0
            for v in ids_f:
                slices.append((start, start + v.numel()))
                start += v.numel()
            if lay.sharding == "table_wise":
                s = lay.servers[0]
                per_server[s][ti] = uniq
                n_raw[s] += ids.numel()
                restore = None
            else:
                pos = lay.shard_of(uniq)
                order = torch.argsort(pos, stable=True)
                counts = torch.bincount(pos, minlength=lay.num_shards).tolist()
                local = lay.local_ids(uniq[order])
                raw = torch.bincount(lay.shard_of(ids), minlength=lay.num_shards).tolist()
                for k, chunk in enumerate(local.split(counts)):
                    per_server[lay.servers[k]][ti] = chunk
                    n_raw[lay.servers[k]] += raw[k]
                restore = torch.empty_like(order)
                restore[order] = torch.arange(order.numel())
            tables.append(_TableRoute(inverse=inverse, restore=restore, feature_slices=slices))
        requests = {}
        for s in self.servers:
            chunks = [per_server[s][ti] for ti in self.held[s]]
            requests[s] = (torch.cat(chunks), [c.numel() for c in chunks])
        return _Route(tables=tables, requests=requests, n_raw=n_raw, offsets=offsets, weights=wts,
                      batch_size=b)

    def _check_ids(self, v: torch.Tensor, feature: str, t: TableSpec) -> torch.Tensor:
        if v.numel() == 0:
            return v
        lo, hi = int(v.min()), int(v.max())
        if lo >= 0 and hi < t.num_embeddings:
            return v
        if self.id_policy == "modulo":
            return torch.remainder(v, t.num_embeddings)
        bad_mask = (v < 0) | (v >= t.num_embeddings)
        bad = v[bad_mask]
        shown = ", ".join(str(int(x)) for x in bad[:5]) + (", ..." if bad.numel() > 5 else "")
        raise BadIdError(
            f"feature {feature!r}: {bad.numel()} id(s) outside table {t.name!r} of {t.num_embeddings} "
            f"rows [0, {t.num_embeddings}): {shown} (first at position {int(bad_mask.nonzero()[0])} of the "
            f"feature's ids); nothing was sent. Fix the data, or set the plan's id_policy: modulo "
            f"to take ids modulo the table size"
        )

    def _fix_ids(self, ids: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Ids (every feature's, in collection order) after ``id_policy``, for the fast path."""
        table_of = {f: t for t in self.tables for f in t.feature_names}
        return torch.cat([self._check_ids(v, f, table_of[f]) for v, f in zip(ids.split(counts), self.feature_order)])

    def _send(self, rstep: bridge.RemoteStep | None, kjt: KeyedJaggedTensor, *, defer: bool = False) -> _Pending:
        """Route ``kjt`` and send its lookups (for ``rstep``; ``None``: a plain read). ``defer``:
        route now, send when the step before ``rstep`` pushes its gradients (or when the rows
        are first waited for), carrying that push."""
        check_kjt(kjt, where=self.cid)
        if self._fused is not None and not (self._is_weighted and kjt.weights().requires_grad):
            route = self._fused.route(kjt, fix_ids=self._fix_ids)
        else:
            route = self._route(kjt)
        if rstep is None:
            futs = {
                s: rpc.rpc_async(self.server_names[s], srv.rpc_read,
                                 args=(self.cid, self._finished_step(), ids, counts), timeout=self.timeout_s)
                for s, (ids, counts) in route.requests.items()
            }
            return _Pending(route, futs, kjt, self.server_names)

        owed = bridge.runtime().owed  # None under dist_autograd

        def send(_ctx_id: int | None) -> dict[int, torch.futures.Future]:
            # rpc mode: each lookup carries the gradients this trainer still owes that server,
            # through the shared-memory channel where there is one (runtime.ps_channel).
            futures = {}
            for s, (ids, counts) in route.requests.items():
                pushes = owed.take(self, s) if owed is not None else None
                fut = None
                if pushes is not None and channel.mode() != "rpc":
                    end = self._channel(s)
                    if end is not None:
                        fut = end.send(*channel.encode_lookup(rstep.step, route.n_raw[s], ids, counts, pushes))
                if fut is None:
                    fut = rpc.rpc_async(
                        self.server_names[s], srv.rpc_lookup,
                        args=(self.cid, self.trainer, rstep.step, ids, counts, route.n_raw[s], pushes),
                        timeout=self.timeout_s,
                    )
                futures[s] = fut
            return futures

        def sender() -> dict[int, torch.futures.Future]:
            futures = rstep.call(send).result(timeout=self.timeout_s)
            rstep.sent = True
            return futures

        if defer:
            pending = _Pending(route, None, kjt, self.server_names, self, sender)
            rstep.deferred.append(pending)
        else:
            pending = _Pending(route, sender(), kjt, self.server_names, self)
        rstep.inflight.append(pending)
        return pending

    def _channel(self, s: int) -> channel.TrainerEnd | None:
        """The shared-memory channel to server ``s``, opened on first use; ``None`` where there
        is none (another host, or it could not be set up: then RPC, with one warning)."""
        if s not in self._channels:
            try:
                self._channels[s] = channel.TrainerEnd.open(self.server_names[s], self.cid, self.trainer,
                                                            self.timeout_s)
            except Exception as e:  # noqa: BLE001 - RPC still works; say why once
                warn_once(f"{self.cid}: no shared-memory channel to {self.server_names[s]}, lookups go over "
                          f"RPC: {e}")
                self._channels[s] = None
        return self._channels[s]

    def push_to(self, server: int, steps: list[tuple[int, list]]) -> torch.futures.Future:
        """Send server ``server`` this trainer's row gradients on their own (``rpc`` push):
        ``steps`` is ``[(step, [(ids, counts, grad), ...]), ...]``, one part per lookup."""
        return rpc.rpc_async(self.server_names[server], srv.rpc_push, args=(self.cid, self.trainer, steps),
                             timeout=self.timeout_s)

    def prefetch(self, kjt: KeyedJaggedTensor, ahead: int = 1) -> None:
        """Look up the rows of the batch that step ``current + ahead`` will use ahead of time.

        With staleness >= ``ahead`` the lookups go out now and the rows arrive while this step
        computes. In sync mode (staleness 0; ``rpc`` push) the next step's rows can only be read
        once every trainer's gradients of this step are applied, so the ids are routed now and
        the lookup goes out together with this step's gradient push, in the same message: the
        server applies the step, reads the rows and answers while this trainer finishes its
        backward and optimizer step, and the next forward finds its rows waiting."""
        rt = bridge.runtime()
        if rt is None:
            return
        rstep = rt.ahead(ahead)
        defer = rt.direct and rt.current is not None and ahead == 1 and self.staleness == 0
        rstep.prefetched[self.cid] = self._send(rstep, kjt, defer=defer)

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        rt = bridge.runtime()
        rstep = rt.current if rt is not None and torch.is_grad_enabled() else None
        t0 = time.perf_counter()
        pending = rstep.prefetched.pop(self.cid, None) if rstep is not None else None
        if pending is not None and pending.kjt is not features:
            pending = None  # a different batch than the one prefetched: its rows are discarded
        if pending is None:
            pending = self._send(rstep, features)
        rows = pending.wait(self.timeout_s)
        if rstep is not None:
            rstep.inflight.remove(pending)
            rows = {s: rstep.add_pair(r, pending.dest(s)) for s, r in rows.items()}
            rstep.times.lookup += time.perf_counter() - t0
        return self._pool(pending.route, rows)

    def _pool(self, route: _Route | FusedRoute, rows: dict[int, torch.Tensor]) -> KeyedTensor:
        if isinstance(route, FusedRoute):
            values = self._fused.pool(route, rows)
            return KeyedTensor(keys=self.embedding_names, length_per_key=self.length_per_key, values=values)
        per_table: list[list[torch.Tensor]] = [[] for _ in self.tables]
        for s in self.servers:
            ids, counts = route.requests[s]
            held = self.held[s]
            dims = [self.tables[ti].embedding_dim for ti in held]
            parts = rows[s].split([n * d for n, d in zip(counts, dims)])
            for ti, part, d in zip(held, parts, dims):
                per_table[ti].append(part.view(-1, d))
        pooled, f_pos = [], 0
        for t, lay, tr, chunks in zip(self.tables, self.layouts, route.tables, per_table):
            # Chunks arrive in shard order (servers sorted as lay.servers is); restore unique order.
            chunks = [chunks[self.servers_rank(lay, k)] for k in range(lay.num_shards)] if lay.num_shards > 1 else chunks
            table_rows = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
            if tr.restore is not None:
                table_rows = table_rows.index_select(0, tr.restore)
            mode = t.pooling
            for start, end in tr.feature_slices:
                w = route.weights[f_pos]
                pooled.append(
                    F.embedding_bag(
                        tr.inverse[start:end], table_rows, route.offsets[f_pos], mode=mode,
                        per_sample_weights=w, include_last_offset=True,
                    )
                )
                f_pos += 1
        values = torch.cat(pooled, dim=1) if pooled else torch.empty(route.batch_size, 0)
        return KeyedTensor(keys=self.embedding_names, length_per_key=self.length_per_key, values=values)

    def servers_rank(self, lay: TableLayout, shard_pos: int) -> int:
        """Index, among the chunks gathered for a table (in ``self.servers`` order), of a shard."""
        s = lay.servers[shard_pos]
        held_servers = [x for x in self.servers if x in lay.servers]
        return held_servers.index(s)

    def extra_repr(self) -> str:
        shard = {lay.sharding for lay in self.layouts}
        return (f"cid={self.cid!r}, tables={len(self.tables)}, servers={[self.server_names[s] for s in self.servers]}, "
                f"sharding={'/'.join(sorted(shard))}, optimizer={self.optimizer.name}")


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

    @classmethod
    def from_module(cls, bag: nn.EmbeddingBag, *, cid: str, **kwargs) -> RemoteEmbeddingBag:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

        if bag.mode not in ("sum", "mean"):
            raise ValueError(f"{cid}: nn.EmbeddingBag mode {bag.mode!r} is not supported on a parameter server (sum, mean)")
        if bag.padding_idx is not None or bag.max_norm is not None:
            raise ValueError(f"{cid}: padding_idx and max_norm are not supported on a parameter server")
        name = cid.replace(".", "_") or "weight"
        config = EmbeddingBagConfig(
            name=name, embedding_dim=bag.embedding_dim, num_embeddings=bag.num_embeddings,
            feature_names=[name], pooling=PoolingType.SUM if bag.mode == "sum" else PoolingType.MEAN,
        )
        specs = table_specs([config])
        num_servers = kwargs.pop("num_servers")
        layouts = shard_tables(specs, num_servers, kwargs.pop("sharding", "row_wise"), kwargs.pop("servers", None))
        coll = RemoteEmbeddingBagCollection(
            cid=cid, tables=specs, layouts=layouts, num_servers=num_servers,
            optimizer=SparseOptimSpec.from_any(kwargs.pop("optimizer", None) or {}),
            is_weighted=bag.mode == "sum", **kwargs,
        )
        return cls(coll, include_last_offset=bag.include_last_offset)

    def create_on_servers(self, init_from: nn.EmbeddingBag | None = None, **kwargs) -> None:
        self.collection.create_on_servers(None, **kwargs)
        if init_from is not None and not init_from.weight.is_meta:
            self.collection.write_tables({self.collection.tables[0].name: init_from.weight.detach().cpu()})

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
