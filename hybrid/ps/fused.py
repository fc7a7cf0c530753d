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
  ``[batch, features * dim]``.
- **Backward.** The gradient of a unique row is the sum of the gradients of the bags its ids
  fell in (times the id's weight, or ``1 / len(bag)`` for mean): itself an ``embedding_bag``,
  with the bags' gradients as the table and one "bag" per unique row listing the bags of its
  ids. The sort that deduplicates the ids already groups them by row, so routing keeps that
  grouping and the backward is one fused ``embedding_bag`` call: no id-sized gradient copy and
  no second sort (``index_add_`` sorts its index again), several times cheaper on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybrid.ps import native
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
    weights: torch.Tensor | None
    """Per-sample weights (weighted collections)."""
    grad_bags: torch.Tensor
    """Backward: the bag of every id, ids grouped by unique row (rows ascending)."""
    grad_offsets: torch.Tensor
    """Backward: where each unique row's group starts in ``grad_bags`` (``include_last_offset``)."""
    grad_scale: torch.Tensor | None
    """Backward: what each id's contribution is scaled by, grouped as ``grad_bags``: its weight,
    or ``1 / len(bag)`` for mean."""
    grad_order: torch.Tensor | None
    """Backward: unique row -> its row in the replies (several servers), or ``None`` (same)."""
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
        kernels = native.lib() if total and ids.device.type == "cpu" else None
        if kernels is not None and (weights is None or weights.dtype == torch.float32):
            route = self._route_native(kernels, ids, lengths, weights, counts, b)
            if route is None:  # an id outside its table: the policy decides, then route again
                route = self._route_native(kernels, fix_ids(ids, counts), lengths, weights, counts, b)
            if route is not None:
                return route
        per_table = torch.zeros(len(self.tables), dtype=torch.int64).index_add_(
            0, self.feature_table, torch.tensor(counts, dtype=torch.int64))
        base = torch.repeat_interleave(self.row_base[:-1], per_table, output_size=total)
        gid = ids + base
        if total and bool(((ids < 0) | (gid >= torch.repeat_interleave(self.row_base[1:], per_table, output_size=total))).any()):
            ids = fix_ids(ids, counts)
            gid = ids + base
        # One sort deduplicates and groups the ids by row (kept for the backward).
        sorted_gid, by_row = _sort(gid)
        uniq, per_row = torch.unique_consecutive(sorted_gid, return_counts=True)
        ranks = torch.repeat_interleave(torch.arange(uniq.numel()), per_row, output_size=total)
        inverse = torch.empty_like(by_row).scatter_(0, by_row, ranks)
        t_u = torch.searchsorted(self.row_base[1:], uniq, right=True)
        local = uniq - self.row_base.index_select(0, t_u)
        ntab, nsrv = len(self.tables), len(self.servers)
        if nsrv == 1:
            per = torch.bincount(t_u, minlength=ntab).tolist()
            s = self.servers[0]
            requests = {s: (local, [per[ti] for ti in self.held[s]])}
            n_raw = {s: total}
            idx = inverse
            grad_order = None
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
            grad_order = order
        # Bags sample-major (sample, feature), so the pooled rows are already the KeyedTensor's
        # [batch, features * dim] and no transpose is paid forward or backward: the ids arrive
        # feature-major and are permuted once here.
        nf = len(counts)
        # Sample-major bag of every id (ids still feature-major): feature f, sample s -> s * nf + f.
        sm_bag = torch.arange(nf * b).view(b, nf).t().reshape(-1)
        bag_fm = torch.repeat_interleave(sm_bag, lengths, output_size=total)
        grad_bags = bag_fm.index_select(0, by_row)
        grad_offsets = torch.cat([per_row.new_zeros(1), per_row.cumsum(0)])
        if self.mode == "mean":
            inv_len = 1.0 / lengths.clamp(min=1).to(torch.float32)  # feature-major bags
            grad_scale = torch.repeat_interleave(inv_len, lengths, output_size=total).index_select(0, by_row)
        else:
            grad_scale = weights.index_select(0, by_row) if weights is not None else None
        if nf > 1:
            sm_lengths = lengths.view(nf, b).t().reshape(-1)
            fm_start = (lengths.cumsum(0) - lengths).view(nf, b).t().reshape(-1)
            sm_start = sm_lengths.cumsum(0) - sm_lengths
            perm = torch.arange(total) + torch.repeat_interleave(fm_start - sm_start, sm_lengths, output_size=total)
            idx = idx.index_select(0, perm)
            weights = weights.index_select(0, perm) if weights is not None else None
            lengths = sm_lengths
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        return FusedRoute(requests=requests, n_raw=n_raw, idx=idx, offsets=offsets, weights=weights,
                          grad_bags=grad_bags, grad_offsets=grad_offsets, grad_scale=grad_scale,
                          grad_order=grad_order, mode=self.mode, batch_size=b)

    def _route_native(self, kernels, ids: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None,
                      counts: list[int], b: int) -> FusedRoute | None:
        """:meth:`route` in one call of the native kernel ``hy_route`` (same outputs; the
        backward's groups come in the replies' row order, so no ``grad_order``); ``None`` if an
        id lies outside its table."""
        n, nf = ids.numel(), len(counts)
        ntab, nsrv = len(self.tables), len(self.servers)
        ids, lengths = ids.contiguous(), lengths.contiguous()
        i64 = dict(dtype=torch.int64)
        req, idx, grad_bags = torch.empty(n, **i64), torch.empty(n, **i64), torch.empty(n, **i64)
        per, raw, bad = torch.empty(nsrv * ntab, **i64), torch.empty(nsrv, **i64), torch.empty(1, **i64)
        offsets, grad_offsets = torch.empty(nf * b + 1, **i64), torch.empty(n + 1, **i64)
        w = weights.contiguous() if weights is not None else None
        weights_sm = torch.empty(n) if w is not None else None
        grad_scale = torch.empty(n) if w is not None or self.mode == "mean" else None
        ptr = native.ptr
        nu = kernels.hy_route(
            n, ptr(ids), nf, b, ptr(lengths), ptr(self.feature_table), ntab, ptr(self.row_base), ptr(self.shards),
            ptr(self.server_rank), self.server_rank.shape[1], nsrv, ptr(w), ptr(req), ptr(per), ptr(raw), ptr(idx),
            ptr(offsets), ptr(weights_sm), ptr(grad_bags), ptr(grad_offsets), ptr(grad_scale), ptr(bad))
        if nu == native.BAD_ID:
            return None
        if nu < 0:
            raise RuntimeError(f"native route failed (code {nu}) on a batch of {n} ids")
        per_rows = per.view(nsrv, ntab).tolist()
        raw = raw.tolist()
        chunks = req[:nu].split([sum(r) for r in per_rows])
        requests = {s: (chunks[r], [per_rows[r][ti] for ti in self.held[s]]) for r, s in enumerate(self.servers)}
        return FusedRoute(requests=requests, n_raw={s: raw[r] for r, s in enumerate(self.servers)}, idx=idx,
                          offsets=offsets, weights=weights_sm, grad_bags=grad_bags,
                          grad_offsets=grad_offsets[: nu + 1], grad_scale=grad_scale, grad_order=None,
                          mode=self.mode, batch_size=b)

    def pool(self, route: FusedRoute, rows: dict[int, torch.Tensor]) -> torch.Tensor:
        """The collection's pooled values ``[batch, features * dim]`` from the servers' replies."""
        d = self.dim
        parts = [rows[s].view(-1, d) for s in self.servers]
        table_rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = _PooledRows.apply(table_rows, route)
        return out.view(route.batch_size, -1)


def _sort(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(keys, stable=True)`` for int64 keys: sorted keys and their positions.

    On CPU the position is packed into the low bits of each key and the packed keys are sorted
    by value alone (numpy's vectorized sort), about four times faster than ``torch.sort``, which
    sorts (key, index) pairs; ties come out by position, as a stable sort's do. Negative keys,
    keys too large to share 62 bits with a position, and other devices take ``torch.sort``.
    """
    n = keys.numel()
    bits = max(n - 1, 1).bit_length()
    if keys.device.type != "cpu" or n == 0:
        return torch.sort(keys, stable=True)
    lo, hi = torch.aminmax(keys)
    if int(lo) < 0 or int(hi).bit_length() + bits > 62:
        return torch.sort(keys, stable=True)
    packed = np.sort((keys << bits).add_(torch.arange(n)).numpy())
    packed = torch.from_numpy(packed)
    return packed >> bits, packed & ((1 << bits) - 1)


class _PooledRows(torch.autograd.Function):
    """``embedding_bag`` forward; backward: one ``embedding_bag`` of the bags' gradients, a
    "bag" per unique row (see the module docstring)."""

    @staticmethod
    def forward(ctx, rows, route):  # noqa: D401
        ctx.route = route
        return F.embedding_bag(route.idx, rows, route.offsets, mode=route.mode, per_sample_weights=route.weights,
                               include_last_offset=True)

    @staticmethod
    def backward(ctx, grad):
        r = ctx.route
        # A strided gradient would take a slow path; the bags' gradients are the "table".
        rows_grad = F.embedding_bag(r.grad_bags, grad.contiguous(), r.grad_offsets, mode="sum",
                                    per_sample_weights=r.grad_scale, include_last_offset=True)
        if r.grad_order is not None:
            rows_grad = rows_grad.index_select(0, r.grad_order)
        return rows_grad, None
