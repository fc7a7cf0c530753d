"""Splitting a batch's ids over the servers, and putting the servers' rows back in order.

A collection's tables are grouped by (embedding dimension, pooling); each group is routed by one
call of :func:`hybrid.ops.route`: every table's ids offset into one row space and deduplicated
by a single sort, each unique row assigned to its server (cyclic row-wise: ``row % shards`` and
``row // shards``; table-wise is the one-shard case), and every id mapped to its row in the
servers' replies. The groups' requests to one server travel together (:class:`Rows` lists the
tables), so a server gets one request per collection whatever the mix of tables. In the usual
case (DLRM: one dimension, one pooling) there is one group.

Pooling (:class:`PooledRows`) is one ``embedding_bag`` over every bag of a group, bags ordered
sample by sample so that its output is already the ``KeyedTensor`` layout; its backward is one
more ``embedding_bag`` -- the bags' gradients as the table, one bag per reply row listing the
bags its ids fell in -- with no id-sized copy and no second sort. Per-sample weights that require
grad (computed by the model, say a learned weight per position) take part in the graph: the
batch's weights, reordered sample by sample by an ``index_select``, are the pooling's weights,
and each one's gradient is its bag's gradient dotted with its row, by torch's own
``embedding_bag`` backward for per-sample weights.

A collection pooled on its servers (``pool_on: server``; every table whole on one server) sends
each server, with a step's lookup, the bags of the features it holds (:class:`Bags`: the same
route's forward cut to that server's rows and bags) and gets back the pooled bags, ``[batch, features x
dim]`` per group; :meth:`Router.pooled` puts the servers' blocks side by side in the
collection's feature order. Outside a step (evaluation) the rows come back and are pooled here.

Unpooled tables (an ``EmbeddingCollection``'s, pooling ``none``) are routed the same way, ids
kept in the batch's (feature-major) order: :meth:`Router.embed` gives every id its reply row by
one ``embedding`` lookup, whose backward sums the gradients of an id's positions into its one
reply row, so a server gets one gradient per unique row exactly as for bags.

A table's id -> (server, local row) mapping lives here alone (:class:`TableGroup`'s constants
and :func:`hybrid.ops.route`); the collection stand-ins never compute it.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybrid import ops
from hybrid.ops import reference
from hybrid.errors import InputError
from hybrid.ps.config import CollectionConfig, TableSpec
from hybrid.ps.protocol import BagGroup, Bags, Rows


class BadIdError(InputError):
    """An id outside its table under ``id_policy: error``; nothing was sent or changed (a data
    mistake: exit code 2 in a run)."""


class BadBatchError(InputError):
    """A ``KeyedJaggedTensor`` whose lengths, values and weights disagree, or whose per-sample
    weights ask for a gradient the servers' tables do not give; nothing was sent."""


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


class TableGroup:
    """Tables of one collection that share their dimension and pooling, with the constant
    inputs of :func:`hybrid.ops.route` for them."""

    def __init__(self, config: CollectionConfig, tables: list[int]) -> None:
        self.tables = tables
        specs = [config.tables[i] for i in tables]
        self.specs = specs
        self.dim = specs[0].embedding_dim
        self.pooling = specs[0].pooling
        self.features = [f for t in specs for f in t.feature_names]
        nrows = torch.tensor([t.num_embeddings for t in specs], dtype=torch.int64)
        self.row_base = torch.cat([nrows.new_zeros(1), nrows.cumsum(0)])
        layouts = [config.layouts[i] for i in tables]
        self.shards = torch.tensor([lay.num_shards for lay in layouts], dtype=torch.int64)
        rank = {s: r for r, s in enumerate(config.servers)}
        width = max(lay.num_shards for lay in layouts)
        self.server_rank = torch.tensor(
            [[rank[lay.servers[k]] if k < lay.num_shards else -1 for k in range(width)] for lay in layouts],
            dtype=torch.int64)
        self.feature_table = torch.tensor([k for k, t in enumerate(specs) for _ in t.feature_names],
                                          dtype=torch.int64)
        # pool_on: server (every table on one server): the group's features each server holds, by
        # position in the group, per server rank; and the one rank holding all of them, if any.
        feature_rank = [rank[lay.servers[0]] for lay, t in zip(layouts, specs) for _ in t.feature_names]
        self.columns_on = [[j for j, r in enumerate(feature_rank) if r == k] for k in range(len(config.servers))]
        self.sole_rank = feature_rank[0] if feature_rank and len(set(feature_rank)) == 1 else None


@dataclass
class RoutedBatch:
    """One batch of one collection, routed: what to ask each server, and how to pool the replies."""

    requests: dict[int, Rows]
    """Server -> the rows to ask it for (every group's, tables listed)."""
    num_raw: dict[int, int]
    """Server -> ids before deduplication."""
    routes: list[ops.Route]
    """Per group."""
    splits: dict[int, list[int]]
    """Server -> floats of its reply that belong to each group, in group order."""
    batch_size: int
    counts: list[list[int] | None] = dataclasses.field(default_factory=list)
    """Per group: ids per feature (unpooled groups; ``None`` for pooled ones)."""
    bags: dict[int, Bags] | None = None
    """Server -> what it pools (``pool_on: server``, a step's lookup): its replies are pooled bags."""
    tag: int = -1
    """The lookup's :attr:`Bags.tag` (-1: not pooled on the servers)."""


class Router:
    """Routes a collection's batches and pools the replies (trainer side)."""

    def __init__(self, config: CollectionConfig) -> None:
        self.config = config
        self.servers = list(config.servers)
        by_kind: dict[tuple[int, str], list[int]] = {}
        for i, t in enumerate(config.tables):
            by_kind.setdefault((t.embedding_dim, t.pooling), []).append(i)
        self.groups = [TableGroup(config, idx) for idx in by_kind.values()]
        self.feature_order = [f for t in config.tables for f in t.feature_names]
        self.table_of_feature = {f: t for t in config.tables for f in t.feature_names}
        self.embedding_names = [f for f in self.feature_order]
        self.length_per_key = [t.embedding_dim for t in config.tables for _ in t.feature_names]
        # Columns of the groups' outputs, concatenated in group order, in collection feature order.
        where, col = {}, 0
        for g in self.groups:
            for f in g.features:
                where[f] = (col, g.dim)
                col += g.dim
        self.columns = _permutation(where, self.feature_order)
        # Pooled on the servers: each server's reply is its groups' blocks, [batch, its features
        # of the group x dim] each; the blocks side by side, servers in order, then these columns.
        self.blocks: dict[int, list[int]] = {}
        where, col = {}, 0
        for r, s in enumerate(self.servers):
            self.blocks[s] = []
            for g in self.groups:
                if g.columns_on[r]:
                    self.blocks[s].append(len(g.columns_on[r]) * g.dim)
                    for j in g.columns_on[r]:
                        where[g.features[j]] = (col, g.dim)
                        col += g.dim
        self.pooled_columns = _permutation(where, self.feature_order) if col else None

    def locate(self, table: int, row: int) -> tuple[int, int]:
        """(server, row in that server's shard) of global row ``row`` of table ``table`` (the
        control plane's single-row writes; batches go through :meth:`route`)."""
        lay = self.config.layouts[table]
        ids = torch.tensor([row], dtype=torch.int64)
        return lay.servers[int(lay.shard_of(ids)[0])], int(lay.local_ids(ids)[0])

    # -- forward --------------------------------------------------------------------------------
    def route(self, kjt: KeyedJaggedTensor, *, where: str, tag: int = -1) -> RoutedBatch:
        """The batch routed; with ``tag`` >= 0 (``pool_on: server``) each server's bags too, under
        that tag."""
        routed = self._route(kjt, where=where, backward=tag < 0)  # servers that pool work out their own
        if tag >= 0:
            routed.tag = tag
            routed.bags = {s: Bags(tag, self._bag_groups(routed, r)) for r, s in enumerate(self.servers)}
        return routed

    def _bag_groups(self, routed: RoutedBatch, r: int) -> list[BagGroup]:
        """Server rank ``r``'s bags: per group with features there, the group's route cut to the
        server's rows and bags, bags numbered sample by sample over its features."""
        out = []
        b = routed.batch_size
        i32 = torch.int32
        for g, route in zip(self.groups, routed.routes):
            cols = g.columns_on[r]
            if not cols:
                continue
            common = dict(dim=g.dim, mean=g.pooling == "mean", features=len(cols))
            if g.sole_rank == r:  # the whole group is here: the route as it is
                out.append(BagGroup(rows=route.num_unique, idx=route.idx.to(i32), offsets=route.offsets.to(i32),
                                    weights=route.weights, **common))
                continue
            per = route.per.sum(1)
            start, n = int(per[:r].sum()), int(per[r])
            wanted = torch.zeros(len(g.features), dtype=torch.bool)
            wanted[cols] = True
            bag_mask = wanted.repeat(b)
            lengths = route.offsets.diff()
            entries = torch.repeat_interleave(bag_mask, lengths, output_size=route.idx.numel())
            out.append(BagGroup(
                rows=n, idx=(route.idx[entries] - start).to(i32),
                offsets=torch.cat([lengths.new_zeros(1), lengths[bag_mask].cumsum(0)]).to(i32),
                weights=None if route.weights is None else route.weights[entries], **common))
        return out

    def _route(self, kjt: KeyedJaggedTensor, *, where: str, backward: bool = True) -> RoutedBatch:
        check_kjt(kjt, where=where)
        missing = [f for f in self.feature_order if f not in kjt.keys()]
        if missing:
            raise ValueError(f"{where}: the input KeyedJaggedTensor lacks features {missing}; it has {kjt.keys()}")
        b = kjt.stride()
        routed_groups = [self._route_group(g, kjt, b, backward) for g in self.groups]
        routes = [r for r, _ in routed_groups]
        requests, num_raw, splits = {}, {}, {}
        for r, s in enumerate(self.servers):
            tables, counts, ids, split = [], [], [], []
            raw = 0
            for g, route in zip(self.groups, routes):
                per = route.per[r].tolist()
                start = int(route.per[:r].sum())
                ids.append(route.requests_ids[start : start + sum(per)])
                for k, n in enumerate(per):
                    if n:
                        tables.append(g.tables[k])
                        counts.append(n)
                split.append(sum(per) * g.dim)
                raw += int(route.raw[r])
            requests[s] = Rows(tables, counts, ids[0] if len(ids) == 1 else torch.cat(ids))
            num_raw[s], splits[s] = raw, split
        return RoutedBatch(requests=requests, num_raw=num_raw, routes=routes, splits=splits, batch_size=b,
                           counts=[c for _, c in routed_groups])

    def _route_group(self, g: TableGroup, kjt: KeyedJaggedTensor, b: int,
                     backward: bool = True) -> tuple[ops.Route, list[int] | None]:
        """The group's route (with the backward's index unless ``backward`` is false), and for an
        unpooled group its ids per feature. Pooled groups order their bags sample by sample (the
        ``KeyedTensor`` layout); unpooled ones keep the ids in feature-major order, each
        feature's a contiguous run."""
        # A weighted collection's batch without weights is routed for its ids alone (a
        # prefetch of the raw batch, whose weights the model computes in its forward).
        weighted = self.config.weighted and kjt.weights_or_none() is not None
        values, lengths, weights = _features(kjt, g.features, weighted=weighted)
        args = (g.feature_table, g.row_base, g.shards, g.server_rank)
        unpooled = g.pooling == "none"
        kw = dict(num_servers=len(self.servers), batch_size=b, weights=weights, mean=g.pooling == "mean",
                  sample_major=not unpooled, backward=backward)
        counts = lengths.view(len(g.features), b).sum(1).tolist() if unpooled else None
        if self.config.dynamic is not None:
            return ops.route_hashed(values, lengths, g.feature_table, g.shards, g.server_rank,
                                    partitions=self.config.dynamic.partitions, **kw), counts
        try:
            return ops.route(values, lengths, *args, **kw), counts
        except ops.RowOutOfRange:
            values = self._fix_ids(g, values, lengths, b)
            return ops.route(values, lengths, *args, **kw), counts

    def _fix_ids(self, g: TableGroup, values: torch.Tensor, lengths: torch.Tensor, b: int) -> torch.Tensor:
        """The group's ids under ``id_policy`` once some id is outside its table: wrapped
        (``modulo``), or a :class:`BadIdError` naming the feature (``error``)."""
        counts = lengths.view(len(g.features), b).sum(1).tolist()
        fixed = []
        for f, v in zip(g.features, values.split(counts)):
            t = self.table_of_feature[f]
            fixed.append(self._check_ids(v, f, t))
        return torch.cat(fixed) if fixed else values

    def _check_ids(self, v: torch.Tensor, feature: str, t: TableSpec) -> torch.Tensor:
        if v.numel() == 0:
            return v
        if int(v.min()) >= 0 and int(v.max()) < t.num_embeddings:
            return v
        if self.config.id_policy == "modulo":
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

    def pool(self, routed: RoutedBatch, rows: dict[int, torch.Tensor],
             kjt: KeyedJaggedTensor | None = None) -> torch.Tensor:
        """The collection's pooled values ``[batch, sum of feature dims]`` (collection feature
        order) from each server's reply; differentiable in ``kjt``'s per-sample weights too where
        they require grad (``kjt``: the batch ``routed`` was routed from, or an equal copy)."""
        outs = []
        parts = self._parts(routed, rows)
        learned = self.config.weighted and kjt is not None and wants_weight_grad(kjt)
        for k, (g, route) in enumerate(zip(self.groups, routed.routes)):
            table_rows = self._group_rows(parts, k, g)
            route = _on_device(route, table_rows.device)
            weights = self._sample_major_weights(kjt, g, routed.batch_size).to(table_rows.device) if learned else None
            pooled = PooledRows.apply(table_rows, route, g.pooling, weights)
            outs.append(pooled.view(routed.batch_size, len(g.features) * g.dim))
        values = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.columns is None:
            return values
        return values.index_select(1, self.columns.to(values.device, non_blocking=True))

    @staticmethod
    def _sample_major_weights(kjt: KeyedJaggedTensor, g: TableGroup, b: int) -> torch.Tensor:
        """Group ``g``'s per-sample weights of ``kjt`` in its route's (sample-major) order, as a
        function of ``kjt.weights()`` (their gradient flows back to it)."""
        _, lengths, weights = _features(kjt, g.features, weighted=True)
        if len(g.features) == 1:
            return weights
        return weights.index_select(0, reference.sample_major_positions(lengths, len(g.features), b))

    def pooled(self, routed: RoutedBatch, replies: dict[int, torch.Tensor]) -> torch.Tensor:
        """The collection's pooled values ``[batch, sum of feature dims]`` (collection feature
        order) from each server's pooled bags (``pool_on: server``), widened to float32 inside the
        graph as :meth:`_group_rows` widens rows."""
        b = routed.batch_size
        blocks = []
        for s in self.servers:
            reply, pos = replies[s].to(torch.float32), 0
            for width in self.blocks[s]:
                blocks.append(reply[pos : pos + b * width].view(b, width))
                pos += b * width
        values = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        if self.pooled_columns is None:
            return values
        return values.index_select(1, self.pooled_columns.to(values.device, non_blocking=True))

    def embed(self, routed: RoutedBatch, rows: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Feature -> its ids' rows ``[ids of the feature, dim]`` in the batch's order (an
        unpooled collection), from each server's reply. The backward sums the gradients of each
        unique row's positions into its reply row."""
        out: dict[str, torch.Tensor] = {}
        parts = self._parts(routed, rows)
        for k, (g, route) in enumerate(zip(self.groups, routed.routes)):
            table_rows = self._group_rows(parts, k, g)
            values = F.embedding(route.idx.to(table_rows.device, non_blocking=True), table_rows)
            out.update(zip(g.features, values.split(routed.counts[k])))
        return out

    def _parts(self, routed: RoutedBatch, rows: dict[int, torch.Tensor]) -> dict[int, tuple[torch.Tensor, ...]]:
        """Each server's reply cut into its groups' rows. A reply of one group is used whole: its
        gradient is then the leaf's own, not a copy assembled by ``split``'s backward."""
        return {s: (rows[s],) if len(routed.splits[s]) == 1 else rows[s].split(routed.splits[s])
                for s in self.servers}

    def _group_rows(self, parts: dict[int, tuple[torch.Tensor, ...]], k: int, g: TableGroup) -> torch.Tensor:
        """Group ``k``'s reply rows ``[unique rows, dim]``, servers in order (the route's row order),
        in float32, the dense graph's dtype. Replies come in the collection's ``wire_dtype``; the
        widening is part of the graph, so its backward rounds each row's gradient back to the
        wire dtype (to nearest, ties to even) once, in the reply's own leaf, whence it is pushed."""
        chunks = [parts[s][k].view(-1, g.dim) for s in self.servers]
        rows = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        return rows.to(torch.float32)


def _permutation(where: dict[str, tuple[int, int]], order: list[str]) -> torch.Tensor | None:
    """The columns that put features laid out as ``where`` says (feature -> first column, width)
    in ``order``; None when they already are."""
    perm = [c for f in order for c in range(where[f][0], where[f][0] + where[f][1])]
    return None if perm == list(range(len(perm))) else torch.tensor(perm, dtype=torch.int64)


def _features(kjt: KeyedJaggedTensor, features: list[str], *, weighted: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Ids, lengths (feature-major) and weights of ``features``, in that order, in host memory
    (routing runs on the host; a batch already on a GPU trainer's device is copied back)."""
    keys = kjt.keys()
    lpk = kjt.length_per_key()
    if keys == features:
        total = sum(lpk)
        values, lengths = kjt.values()[:total], kjt.lengths()
        weights = kjt.weights()[:total] if weighted else None
    else:
        index = {k: i for i, k in enumerate(keys)}
        pos = [index[f] for f in features]
        vals = kjt.values().split(lpk + [kjt.values().numel() - sum(lpk)])
        values = torch.cat([vals[p] for p in pos])
        lengths = kjt.lengths().view(len(keys), -1)[pos].reshape(-1)
        weights = None
        if weighted:
            ws = kjt.weights().split(lpk + [kjt.weights().numel() - sum(lpk)])
            weights = torch.cat([ws[p] for p in pos])
    cpu = torch.device("cpu")
    return (values.to(cpu, torch.int64), lengths.to(cpu, torch.int64),
            None if weights is None else weights.to(cpu))


def _on_device(route: ops.Route, device: torch.device) -> ops.Route:
    """``route`` with its pooling tensors on ``device`` (routing runs on the host)."""
    if route.idx.device == device:
        return route
    moved = {f.name: getattr(route, f.name).to(device, non_blocking=True)
             for f in dataclasses.fields(route) if isinstance(getattr(route, f.name), torch.Tensor)}
    return dataclasses.replace(route, **moved)


def wants_weight_grad(kjt: KeyedJaggedTensor) -> bool:
    """Whether ``kjt``'s per-sample weights require grad in a pass that records gradients."""
    weights = kjt.weights_or_none()
    return weights is not None and weights.requires_grad and torch.is_grad_enabled()


class PooledRows(torch.autograd.Function):
    """``embedding_bag`` forward; backward: one ``embedding_bag`` of the bags' gradients, a
    "bag" per reply row (see the module docstring), and where ``weights`` (the route's per-sample
    weights, in its order, as a tensor of the graph) require grad, theirs."""

    @staticmethod
    def forward(ctx, rows, route, mode, weights=None):  # noqa: D401
        ctx.route = route
        if weights is not None:
            ctx.save_for_backward(rows)
        return F.embedding_bag(route.idx, rows, route.offsets, mode=mode,
                               per_sample_weights=route.weights if weights is None else weights,
                               include_last_offset=True)

    @staticmethod
    def backward(ctx, grad):
        r = ctx.route
        grad = grad.contiguous()  # a strided gradient would take a slow path
        # The bags' gradients are the "table".
        rows_grad = F.embedding_bag(r.grad_bags, grad, r.grad_offsets, mode="sum",
                                    per_sample_weights=r.grad_scale, include_last_offset=True)
        weights_grad = None
        if ctx.needs_input_grad[3]:
            # Each weight's gradient: its bag's gradient dotted with its row, as torch's
            # embedding_bag computes it (bit for bit: the same operator on the same vectors).
            (rows,) = ctx.saved_tensors
            bounds = r.offsets
            bag_of = torch.repeat_interleave(torch.arange(bounds.numel() - 1, device=bounds.device), bounds.diff(),
                                             output_size=r.idx.numel())
            weights_grad = torch.ops.aten._embedding_bag_per_sample_weights_backward(
                grad, rows, r.idx, bounds[:-1], bag_of, 0)  # mode 0: sum
        return rows_grad, None, None, weights_grad
