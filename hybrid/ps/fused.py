"""The trainer's fast path: one deduplication over every table, one pooling kernel for every
feature, and a cheap backward.

Used by :class:`hybrid.ps.client.RemoteEmbeddingBagCollection` when its tables share one
embedding dimension and one pooling (the DLRM case); otherwise the client routes and pools table
by table. The wire protocol is the same either way: per server, the deduplicated local row ids of
each table it holds, in table order, and back the rows in that order.

- **Route.** Each id is offset by its table's first row in one global row space, so a single
  ``torch.unique`` deduplicates every table at once (sorted: table by table, ids ascending).
  Owner server and local row follow arithmetically from the table's layout (cyclic row-wise:
  ``row % shards`` and ``row // shards``; table-wise is the one-shard case). A stable sort by
  ``(server, table)`` gives each server its request; its inverse maps every id straight to its
  row in the servers' replies, concatenated -- the rows themselves are never permuted.
- **Pool.** One ``embedding_bag`` over all bags, ordered sample by sample (the ids are permuted
  once when routed), so its output is already the ``KeyedTensor`` layout
  ``[batch, features * dim]``. Its backward is one ``index_add_`` of the bags' gradients
  into the unique rows, about five times cheaper on CPU than ``embedding_bag``'s own dense
  backward (which sorts the ids again).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybrid.ps.sharding import TableLayout, TableSpec


@dataclass
class FusedRoute:
    """How one batch's ids were split over servers (fast path), and how to pool the replies."""

    requests: dict[int, tuple[torch.Tensor, list[int]]]
    """server -> (local row ids of every held table, in table order; count per held table)."""
    n_raw: dict[int, int]
    """server -> ids before deduplication (for the servers' unique-ratio counter)."""
    idx: torch.Tensor
    """Row of every id (bag by bag) in the replies concatenated by server."""
    offsets: torch.Tensor
    """Bag boundaries, bags ordered (sample, feature) (``include_last_offset``)."""
    bag_of_id: torch.Tensor
    """Bag of every id."""
    weights: torch.Tensor | None
    """Per-sample weights (weighted collections)."""
    grad_scale: torch.Tensor | None
    """What each id's row gradient is scaled by: its weight, or ``1 / len(bag)`` for mean."""
    mode: str
    batch_size: int


class FusedPlan:
    """The constant part of the fast path for one collection: tables, layouts, server ranks."""

    def __init__(self, tables: list[TableSpec], layouts: list[TableLayout], servers: list[int],
                 feature_order: list[str], *, is_weighted: bool) -> None:
        self.tables = tables
        self.dim = tables[0].embedding_dim
        self.mode = tables[0].pooling
        self.is_weighted = is_weighted
        self.feature_order = feature_order
        self.servers = servers
        self.held = {s: [i for i, lay in enumerate(layouts) if s in lay.servers] for s in servers}
        nrows = torch.tensor([t.num_embeddings for t in tables], dtype=torch.int64)
        self.num_rows = nrows
        self.row_base = torch.cat([nrows.new_zeros(1), nrows.cumsum(0)])
        self.shards = torch.tensor([lay.num_shards for lay in layouts], dtype=torch.int64)
        self.sharded = bool((self.shards > 1).any())
        rank = {s: r for r, s in enumerate(servers)}
        width = max(lay.num_shards for lay in layouts)
        self.server_rank = torch.tensor(
            [[rank[lay.servers[k]] if k < lay.num_shards else -1 for k in range(width)] for lay in layouts],
            dtype=torch.int64,
        )
        # Table of each feature position in ``feature_order``.
        self.feature_table = torch.tensor([ti for ti, t in enumerate(tables) for _ in t.feature_names],
                                          dtype=torch.int64)

    @classmethod
    def build(cls, tables: list[TableSpec], layouts: list[TableLayout], servers: list[int],
              feature_order: list[str], *, is_weighted: bool) -> FusedPlan | None:
        """The plan, or ``None`` where the fast path does not apply (mixed dimensions or
        poolings, or mean pooling with per-sample weights, which ``embedding_bag`` refuses)."""
        if not tables:
            return None
        if len({t.embedding_dim for t in tables}) != 1 or len({t.pooling for t in tables}) != 1:
            return None
        if is_weighted and tables[0].pooling != "sum":
            return None
        return cls(tables, layouts, servers, feature_order, is_weighted=is_weighted)

    def route(self, kjt: KeyedJaggedTensor, *,
              fix_ids: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> FusedRoute:
        """Split ``kjt``'s ids over the servers. ``fix_ids(ids, counts)`` (``counts``: ids per
        feature) is called only when some id lies outside its table; it returns the ids to use
        or raises."""
        keys = kjt.keys()
        b = kjt.stride()
        lpk = kjt.length_per_key()
        if keys == self.feature_order:
            values, lengths = kjt.values(), kjt.lengths().to(torch.int64)
            weights = kjt.weights() if self.is_weighted else None
            counts = lpk
        else:
            index = {k: i for i, k in enumerate(keys)}
            pos = [index[f] for f in self.feature_order]
            vals = kjt.values().split(lpk)
            values = torch.cat([vals[p] for p in pos])
            lengths = kjt.lengths().view(len(keys), -1)[pos].reshape(-1).to(torch.int64)
            weights = torch.cat([kjt.weights().split(lpk)[p] for p in pos]) if self.is_weighted else None
            counts = [lpk[p] for p in pos]
        total = sum(counts)
        if values.numel() != total:  # trailing values past the lengths, as KeyedJaggedTensor allows
            values = values[:total]
            weights = weights[:total] if weights is not None else None
        ids = values.to(torch.int64)
        per_table = torch.zeros(len(self.tables), dtype=torch.int64).index_add_(
            0, self.feature_table, torch.tensor(counts, dtype=torch.int64))
        base = torch.repeat_interleave(self.row_base[:-1], per_table, output_size=total)
        gid = ids + base
        if total and bool(((ids < 0) | (gid >= torch.repeat_interleave(self.row_base[1:], per_table, output_size=total))).any()):
            ids = fix_ids(ids, counts)
            gid = ids + base
        uniq, inverse = torch.unique(gid, return_inverse=True)
        t_u = torch.searchsorted(self.row_base[1:], uniq, right=True)
        local = uniq - self.row_base.index_select(0, t_u)
        ntab, nsrv = len(self.tables), len(self.servers)
        if nsrv == 1:
            per = torch.bincount(t_u, minlength=ntab).tolist()
            s = self.servers[0]
            requests = {s: (local, [per[ti] for ti in self.held[s]])}
            n_raw = {s: total}
            idx = inverse
        else:
            if self.sharded:
                shards = self.shards.index_select(0, t_u)
                shard_pos, local = local % shards, local // shards
            else:
                shard_pos = torch.zeros_like(local)
            rank_u = self.server_rank[t_u, shard_pos]
            key = rank_u * ntab + t_u
            order = torch.argsort(key, stable=True)
            per = torch.bincount(key, minlength=nsrv * ntab).view(nsrv, ntab)
            chunks = local.index_select(0, order).split(per.sum(1).tolist())
            per = per.tolist()
            requests = {s: (chunks[r], [per[r][ti] for ti in self.held[s]]) for r, s in enumerate(self.servers)}
            raw = torch.bincount(rank_u.index_select(0, inverse), minlength=nsrv).tolist()
            n_raw = {s: raw[r] for r, s in enumerate(self.servers)}
            place = torch.empty_like(order)
            place[order] = torch.arange(order.numel())
            idx = place.index_select(0, inverse)
        # Bags sample-major (sample, feature), so the pooled rows are already the KeyedTensor's
        # [batch, features * dim] and no transpose is paid forward or backward: the ids arrive
        # feature-major and are permuted once here.
        nf = len(counts)
        if nf > 1:
            sm_lengths = lengths.view(nf, b).t().reshape(-1)
            fm_start = (lengths.cumsum(0) - lengths).view(nf, b).t().reshape(-1)
            sm_start = sm_lengths.cumsum(0) - sm_lengths
            perm = torch.arange(total) + torch.repeat_interleave(fm_start - sm_start, sm_lengths, output_size=total)
            idx = idx.index_select(0, perm)
            weights = weights.index_select(0, perm) if weights is not None else None
            lengths = sm_lengths
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        bag_of_id = torch.repeat_interleave(torch.arange(nf * b), lengths, output_size=total)
        grad_scale = weights
        if self.mode == "mean":
            grad_scale = (1.0 / lengths.clamp(min=1).to(torch.float32)).index_select(0, bag_of_id)
        return FusedRoute(requests=requests, n_raw=n_raw, idx=idx, offsets=offsets, bag_of_id=bag_of_id,
                          weights=weights, grad_scale=grad_scale, mode=self.mode, batch_size=b)

    def pool(self, route: FusedRoute, rows: dict[int, torch.Tensor]) -> torch.Tensor:
        """The collection's pooled values ``[batch, features * dim]`` from the servers' replies."""
        d = self.dim
        parts = [rows[s].view(-1, d) for s in self.servers]
        table_rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = _PooledRows.apply(table_rows, route.idx, route.offsets, route.bag_of_id, route.weights,
                                route.grad_scale, route.mode)
        return out.view(route.batch_size, -1)


class _PooledRows(torch.autograd.Function):
    """``embedding_bag`` forward; backward: one ``index_add_`` into the unique rows."""

    @staticmethod
    def forward(ctx, rows, idx, offsets, bag_of_id, weights, grad_scale, mode):  # noqa: D401
        ctx.save_for_backward(idx, bag_of_id, grad_scale)
        ctx.num_rows = rows.shape[0]
        return F.embedding_bag(idx, rows, offsets, mode=mode, per_sample_weights=weights, include_last_offset=True)

    @staticmethod
    def backward(ctx, grad):
        idx, bag_of_id, grad_scale = ctx.saved_tensors
        g = grad.contiguous().index_select(0, bag_of_id)  # a strided grad takes a slow path
        if grad_scale is not None:
            g.mul_(grad_scale.unsqueeze(1))
        rows_grad = torch.zeros(ctx.num_rows, grad.shape[1], dtype=grad.dtype).index_add_(0, idx, g)
        return rows_grad, None, None, None, None, None, None
