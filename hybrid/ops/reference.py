"""Plain-torch implementations of the native operators (the fallback, and the tests' reference)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


class RowOutOfRange(IndexError):
    """``ids[position]`` (a row of table ``table``, of ``rows`` rows) is outside ``[0, rows)``."""

    def __init__(self, table: int, position: int, row: int, rows: int) -> None:
        self.table, self.position, self.row, self.rows = table, position, row, rows
        super().__init__(f"row {row} at position {position} is outside table {table} of {rows} rows")


class NonFinite(FloatingPointError):
    """A gradient or a new weight is NaN or infinite; nothing was written."""


@dataclass(kw_only=True)
class BagLayout:
    """How rows are pooled into bags: ``embedding_bag(idx, rows, offsets,
    per_sample_weights=weights, include_last_offset=True)``."""

    idx: torch.Tensor
    """Row (in the replies concatenated in server order) of every id, in bag order."""
    offsets: torch.Tensor
    """Bag bounds (``include_last_offset``)."""
    weights: torch.Tensor | None
    """Per-sample weights in ``idx``'s order."""


@dataclass(kw_only=True)
class Route(BagLayout):
    """How one batch's ids split over servers, and how to pool (or gather) the replies: the
    :class:`BagLayout`, and how the bags' gradients become the rows' -- ``embedding_bag(grad_bags,
    bags' gradients, grad_offsets, per_sample_weights=grad_scale, include_last_offset=True)``."""

    requests_ids: torch.Tensor
    """Deduplicated local row ids, server by server, table by table, ascending within a table."""
    per: torch.Tensor
    """[num_servers, num_tables] ids of each table in each server's request."""
    raw: torch.Tensor
    """[num_servers] ids before deduplication."""
    grad_bags: torch.Tensor | None
    """Backward: the bag of every id, grouped by reply row (rows in reply order); None (as the
    other ``grad_*``) for a route made with ``backward`` false."""
    grad_offsets: torch.Tensor | None
    """Backward: where each reply row's group starts in ``grad_bags`` (``include_last_offset``)."""
    grad_scale: torch.Tensor | None
    """Backward: each id's factor (its weight, or 1/len(bag) for mean), grouped as grad_bags."""
    num_unique: int


def route(ids, lengths, feature_table, row_base, shards, server_rank, *, num_servers, batch_size,
          weights=None, mean=False, sample_major=True, backward=True) -> Route:
    routed = _route(ids, lengths, feature_table, row_base, shards, server_rank, num_servers=num_servers,
                    batch_size=batch_size, weights=weights, mean=mean, sample_major=sample_major)
    return routed if backward else _without_backward(routed)


def _without_backward(routed: Route) -> Route:
    return dataclasses.replace(routed, grad_bags=None, grad_offsets=None, grad_scale=None)


def _route(ids, lengths, feature_table, row_base, shards, server_rank, *, num_servers, batch_size,
           weights=None, mean=False, sample_major=True) -> Route:
    ids = ids.to(torch.int64)
    lengths = lengths.to(torch.int64)
    total = ids.numel()
    nf = feature_table.numel()
    ntab = row_base.numel() - 1
    b = batch_size
    per_feature = lengths.view(nf, b).sum(1) if nf else lengths.new_zeros(0)
    table_of_id = torch.repeat_interleave(feature_table, per_feature, output_size=total)
    rows_of_id = (row_base[1:] - row_base[:-1]).index_select(0, table_of_id)
    bad = (ids < 0) | (ids >= rows_of_id)
    if total and bool(bad.any()):
        p = int(bad.nonzero()[0])
        raise RowOutOfRange(int(table_of_id[p]), p, int(ids[p]), int(rows_of_id[p]))
    gid = ids + row_base.index_select(0, table_of_id)
    sorted_gid, by_row = torch.sort(gid, stable=True)
    uniq, per_row = torch.unique_consecutive(sorted_gid, return_counts=True)
    ranks = torch.repeat_interleave(torch.arange(uniq.numel()), per_row, output_size=total)
    inverse = torch.empty_like(by_row).scatter_(0, by_row, ranks)
    t_u = torch.searchsorted(row_base[1:], uniq, right=True)
    local = uniq - row_base.index_select(0, t_u)
    shards_u = shards.index_select(0, t_u)
    shard_pos, local = local % shards_u, local // shards_u
    return _route_tail(local, t_u, server_rank[t_u, shard_pos], per_row, by_row, inverse, lengths, weights,
                       num_servers=num_servers, num_tables=ntab, num_features=nf, batch_size=b, mean=mean,
                       sample_major=sample_major)


def _route_tail(req, t_u, rank_u, per_row, by_row, inverse, lengths, weights, *, num_servers, num_tables,
                num_features, batch_size, mean, sample_major) -> Route:
    """What :func:`route` and :func:`route_hashed` share once each distinct (table, id) is known:
    ``req`` the value each one is asked for by (local row or raw id), ``t_u`` its table, ``rank_u``
    its server, ``per_row`` its count; ``by_row`` the id positions grouped by distinct id,
    ``inverse`` each position's distinct id."""
    total, ntab, nf, b = inverse.numel(), num_tables, num_features, batch_size
    key = rank_u * ntab + t_u
    order = torch.argsort(key, stable=True)
    per = torch.bincount(key, minlength=num_servers * ntab).view(num_servers, ntab)
    requests_ids = req.index_select(0, order)
    raw = torch.bincount(rank_u.index_select(0, inverse), minlength=num_servers)
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel())
    idx = place.index_select(0, inverse)
    # Backward groups: ids grouped by unique row (ascending), regrouped into reply-row order.
    bag_fm = torch.repeat_interleave(
        (torch.arange(nf * b).view(b, nf).t().reshape(-1) if sample_major else torch.arange(nf * b)),
        lengths, output_size=total)
    group_sizes = per_row.index_select(0, order)
    starts = torch.cat([per_row.new_zeros(1), per_row.cumsum(0)])[:-1].index_select(0, order)
    pos = torch.repeat_interleave(starts - torch.cat([group_sizes.new_zeros(1), group_sizes.cumsum(0)])[:-1],
                                  group_sizes, output_size=total) + torch.arange(total)
    members = by_row.index_select(0, pos)  # id positions, grouped by reply row
    grad_bags = bag_fm.index_select(0, members)
    grad_offsets = torch.cat([group_sizes.new_zeros(1), group_sizes.cumsum(0)])
    if mean:
        inv_len = 1.0 / lengths.clamp(min=1).to(torch.float32)
        grad_scale = torch.repeat_interleave(inv_len, lengths, output_size=total).index_select(0, members)
    else:
        grad_scale = weights.index_select(0, members) if weights is not None else None
    out_weights = weights
    if sample_major and nf > 1:
        perm = sample_major_positions(lengths, nf, b)
        idx = idx.index_select(0, perm)
        out_weights = weights.index_select(0, perm) if weights is not None else None
        lengths = lengths.view(nf, b).t().reshape(-1)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return Route(requests_ids=requests_ids, per=per, raw=raw, idx=idx, offsets=offsets, weights=out_weights,
                 grad_bags=grad_bags, grad_offsets=grad_offsets, grad_scale=grad_scale, num_unique=req.numel())


def sample_major_positions(lengths: torch.Tensor, num_features: int, batch_size: int) -> torch.Tensor:
    """Where each id of a batch in sample-major order (sample by sample, each sample's features
    in turn) sits in the feature-major order of ``lengths`` (``[num_features * batch_size]``,
    feature by feature): ``ids.index_select(0, positions)`` reorders a feature-major tensor."""
    nf, b = num_features, batch_size
    total = int(lengths.sum())
    sm_lengths = lengths.view(nf, b).t().reshape(-1)
    fm_start = (lengths.cumsum(0) - lengths).view(nf, b).t().reshape(-1)
    sm_start = sm_lengths.cumsum(0) - sm_lengths
    return torch.arange(total) + torch.repeat_interleave(fm_start - sm_start, sm_lengths, output_size=total)


def _check_rows(ids: torch.Tensor, counts: list[int], nrows: list[int]) -> None:
    p = 0
    for t, (n, rows) in enumerate(zip(counts, nrows)):
        chunk = ids[p : p + n]
        if n:
            bad = (chunk < 0) | (chunk >= rows)
            if bool(bad.any()):
                k = int(bad.nonzero()[0])
                raise RowOutOfRange(t, p + k, int(chunk[k]), rows)
        p += n


def gather_rows(tables, ids, counts, *, out=None, dtype=torch.float32) -> torch.Tensor:
    _check_rows(ids, counts, [t.shape[0] for t in tables])
    numel = sum(n * t.shape[1] for n, t in zip(counts, tables))
    out = torch.empty(numel, dtype=dtype) if out is None else out[:numel]
    p = q = 0
    for t, n in zip(tables, counts):
        d = t.shape[1]
        out[q : q + n * d].view(n, d).copy_(t.index_select(0, ids[p : p + n]))
        p += n
        q += n * d
    return out


def pool_rows(tables, ids, counts, idx, offsets, *, weights=None, mean=False, out) -> torch.Tensor:
    rows = gather_rows(tables, ids, counts).view(-1, tables[0].shape[1]) if tables else torch.empty(0, 0)
    out.view(offsets.numel() - 1, -1).copy_(torch.nn.functional.embedding_bag(
        idx, rows, offsets, mode="mean" if mean else "sum", per_sample_weights=weights, include_last_offset=True))
    return out


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def sgd_rows_(tables, ids, counts, grad, *, alpha) -> None:
    if isinstance(grad, (list, tuple)):
        grad = torch.cat([g.reshape(-1) for g in grad]) if grad else torch.empty(0)
    _check_rows(ids, counts, [t.shape[0] for t in tables])
    if grad.numel() and not _finite(grad.float()):
        raise NonFinite("non-finite gradient; nothing was applied")
    p = q = 0
    for t, n in zip(tables, counts):
        d = t.shape[1]
        if n:
            g = grad[q : q + n * d].view(n, d).float()
            r = ids[p : p + n]
            if t.dtype == torch.float32:
                t.index_add_(0, r, g, alpha=alpha)
            else:
                w = t.float()
                w.index_add_(0, r, g, alpha=alpha)
                t.copy_(w)
        p += n
        q += n * d


def unpool_bags(grad, groups) -> torch.Tensor:
    """The row gradients of a lookup pooled on a server from its bags' gradients (``grad``,
    float32, group after group), as the trainer's pooling backward computes them: per group
    ``(bags, dim, grad_bags, grad_offsets, grad_scale)`` (:func:`bag_rows`), ``embedding_bag``
    over the bags' gradients; flat, group after group."""
    out, pos = [], 0
    for bags, dim, grad_bags, grad_offsets, grad_scale in groups:
        g = grad[pos : pos + bags * dim].view(bags, dim)
        pos += bags * dim
        out.append(torch.nn.functional.embedding_bag(grad_bags, g, grad_offsets, mode="sum",
                                                     per_sample_weights=grad_scale,
                                                     include_last_offset=True).reshape(-1))
    if not out:
        return grad.new_zeros(0)
    return out[0] if len(out) == 1 else torch.cat(out)


def sgd_bags_(tables, ids, counts, grad, groups, *, alpha) -> None:
    sgd_rows_(tables, ids, counts, unpool_bags(grad, groups), alpha=alpha)


def sum_rows(ids, grads, *, scale, num_rows):
    _check_rows(ids, [ids.numel()], [num_rows])
    rows, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(rows.numel(), grads.shape[1]).index_add_(0, inverse, grads.float())
    if scale != 1.0:
        summed.mul_(scale)
    return rows, summed


def optimizer_rows(kind, rows, grads, *, grad_scale, weight, state, lr, eps, weight_decay, beta1, beta2):
    _check_rows(rows, [rows.numel()], [weight.shape[0]])
    w = weight.index_select(0, rows).float()
    grad = grads.float()
    if grad_scale != 1.0:
        grad = grad * grad_scale
    if rows.numel() == 0:
        return w, {k: v.index_select(0, rows) for k, v in state.items()}
    if weight_decay:
        grad = grad.add(w, alpha=weight_decay)
    new_state: dict[str, torch.Tensor] = {}
    if kind == "sgd":
        w = w.add(grad, alpha=-lr)
    elif kind == "adagrad":
        acc = state["sum"].index_select(0, rows).addcmul(grad, grad)
        w = w.addcdiv(grad, acc.sqrt().add(eps), value=-lr)
        new_state["sum"] = acc
    elif kind == "rowwise_adagrad":
        acc = state["sum"].index_select(0, rows) + grad.pow(2).mean(dim=1)
        root = acc.double().sqrt().float()  # correctly rounded (torch's float32 sqrt is MKL's, not always)
        w = w.addcdiv(grad, (root + eps).unsqueeze(1), value=-lr)
        new_state["sum"] = acc
    elif kind == "adam":
        k = state["step"].index_select(0, rows) + 1
        m = state["exp_avg"].index_select(0, rows).lerp(grad, 1 - beta1)
        v = state["exp_avg_sq"].index_select(0, rows).mul(beta2).addcmul(grad, grad, value=1 - beta2)
        k64 = k.double()
        step_size = (lr / (1 - torch.pow(beta1, k64))).float().unsqueeze(1)
        bc2_sqrt = torch.sqrt(1 - torch.pow(beta2, k64)).float().unsqueeze(1)
        w = w - step_size * (m / (v.sqrt() / bc2_sqrt).add(eps))
        new_state.update(exp_avg=m, exp_avg_sq=v, step=k)
    else:
        raise ValueError(f"unknown optimizer {kind!r}")
    if not _finite(w):
        raise NonFinite(f"{kind} update produced non-finite weights for "
                        f"{int((~torch.isfinite(w)).any(1).sum())} rows; nothing was applied")
    return w, new_state


def optimizer_step_(kind, weights, states, rows, grads, grad_scales, *, lr, eps, weight_decay, beta1, beta2) -> None:
    """Table by table, :func:`optimizer_rows`; every table's rows computed and checked, then written."""
    computed = []
    for t, (weight, state, r, g, scale) in enumerate(zip(weights, states, rows, grads, grad_scales, strict=True)):
        try:
            computed.append(optimizer_rows(kind, r, g, grad_scale=scale, weight=weight, state=state, lr=lr, eps=eps,
                                           weight_decay=weight_decay, beta1=beta1, beta2=beta2))
        except RowOutOfRange as e:
            raise RowOutOfRange(t, e.position, e.row, e.rows) from None
    for weight, state, r, (w, new_state) in zip(weights, states, rows, computed):
        if r.numel():
            scatter_rows_(weight, r, w)
            for k, v in new_state.items():
                scatter_rows_(state[k], r, v)


def scatter_rows_(dst, rows, src) -> None:
    dst.index_copy_(0, rows, src.to(dst.dtype))


_M32 = 0xFFFFFFFF
_INIT_CHUNK = 1 << 16
"""Elements hashed at once by :func:`initial_rows_`: temporaries of a few hundred KiB, which the
allocator keeps (4M-element ones cost a page fault per page, ten times the arithmetic)."""


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``x`` in ``[0, 2**32)``, without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """The lowbias32 finalizer of ``h`` in ``[0, 2**32)``: every input bit moves every output bit."""
    h = h ^ (h >> 16)
    h = mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def initial_rows_(out, rows, *, key, bound) -> None:
    cols = torch.arange(out.shape[1], dtype=torch.int64)
    step = max(1, _INIT_CHUNK // max(out.shape[1], 1))
    for start in range(0, rows.numel(), step):
        r = rows[start : start + step].unsqueeze(1)
        h = fmix32((r & _M32) ^ key)
        h = fmix32(h ^ ((r >> 32) & _M32))
        h = fmix32(h ^ cols)
        u = (h >> 8).to(torch.float32) * (2.0 / (1 << 24)) - 1.0  # [-1, 1), exact in float32
        out[start : start + step] = u * bound


def populate_(memory: torch.Tensor, *, huge_pages: bool = False, collapse: bool = False) -> bool:
    """Plain torch cannot ask the kernel for pages: nothing is done (the pages come at the first
    write) and the contents, as with the native operator, stay as they are."""
    return False


def die_with_parent(signal: int) -> bool:
    """Plain torch cannot ask the kernel for a parent-death signal: nothing is done."""
    if not 1 <= int(signal) <= 64:
        raise ValueError(f"signal must be a signal number in 1..64, got {signal}")
    return False


_U64 = (1 << 64) - 1


def _as_signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_C1, _C2 = _as_signed(0xFF51AFD7ED558CCD), _as_signed(0xC4CEB9FE1A85EC53)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def id_hash(ids: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finalizer (fmix64) of each id, as int64; int64 products wrap as the
    unsigned ones do."""
    k = ids.to(torch.int64)
    k = k ^ _shr(k, 33)
    k = k * _C1
    k = k ^ _shr(k, 33)
    k = k * _C2
    return k ^ _shr(k, 33)


class IdMap:
    """Raw int64 id -> row slot, as sorted arrays (``searchsorted``): the twin of
    :class:`hybrid.ops.id_map.IdMap`'s hash table, with the same methods and results."""

    def __init__(self, capacity: int = 0, *, empty=None) -> None:
        """``capacity`` and ``empty`` as the hash table takes them; sorted arrays grow as ids come."""
        self.keys = torch.empty(0, dtype=torch.int64)
        self.slots = torch.empty(0, dtype=torch.int64)
        self.version = 0
        """Counts the calls that may have changed the map (inserts, erases)."""

    def __len__(self) -> int:
        return self.keys.numel()

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's slot, -1 where absent."""
        ids = ids.to(torch.int64).reshape(-1)
        if not len(self):
            return torch.full_like(ids, -1)
        pos = torch.searchsorted(self.keys, ids).clamp(max=len(self) - 1)
        return torch.where(self.keys[pos] == ids, self.slots[pos], -1)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Map distinct ``ids`` to ``slots`` (an id already present is remapped)."""
        self.erase(ids)
        self.version += 1
        keys = torch.cat([self.keys, ids.to(torch.int64)])
        order = torch.argsort(keys)
        self.keys, self.slots = keys[order], torch.cat([self.slots, slots.to(torch.int64)])[order]

    def erase(self, ids: torch.Tensor) -> None:
        """Remove ``ids`` (absent ones are skipped)."""
        self.version += 1
        keep = ~torch.isin(self.keys, ids.to(torch.int64))
        self.keys, self.slots = self.keys[keep], self.slots[keep]

    def clear(self) -> None:
        """Remove every id."""
        self.version += 1
        self.keys = torch.empty(0, dtype=torch.int64)
        self.slots = torch.empty(0, dtype=torch.int64)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids ascending, their slots)."""
        return self.keys.clone(), self.slots.clone()


def id_map_find(keys: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The slot of each id in the open-addressing table ``keys`` / ``slots`` of
    :class:`hybrid.ops.id_map.HashIdMap` (power-of-two size, ``slots == -1`` empty, linear
    probing from ``fmix64(id)``), -1 where absent: every id's probe advanced one entry per round."""
    ids = ids.to(torch.int64).reshape(-1)
    mask = keys.numel() - 1
    out = torch.full_like(ids, -1)
    pos = id_hash(ids) & mask
    todo = torch.arange(ids.numel())
    while todo.numel():
        k, s = keys[pos[todo]], slots[pos[todo]]
        hit = (s >= 0) & (k == ids[todo])
        out[todo[hit]] = s[hit]
        todo = todo[(s >= 0) & ~hit]
        pos[todo] = (pos[todo] + 1) & mask
    return out


def id_maps_find(keys: list[torch.Tensor], slots: list[torch.Tensor], ids: torch.Tensor,
                 counts: list[int]) -> torch.Tensor:
    """:func:`id_map_find` over several maps: ``ids`` holds, map after map, ``counts[t]`` ids to
    find in map ``t``; their slots in the same order."""
    if len(keys) != len(counts) or len(slots) != len(counts):
        raise ValueError(f"keys, slots and counts must have one entry per map, got {len(keys)}, {len(slots)} "
                         f"and {len(counts)}")
    if sum(counts) != ids.numel():
        raise ValueError(f"counts sum to {sum(counts)} but ids holds {ids.numel()}")
    parts = [id_map_find(k, s, i) for k, s, i in zip(keys, slots, ids.reshape(-1).split(list(counts)))]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def route_hashed(ids, lengths, feature_table, shards, server_rank, *, partitions, num_servers, batch_size,
                 weights=None, mean=False, sample_major=True, backward=True) -> Route:
    """:func:`route` for raw int64 ids (``ids: dynamic``): deduplicated by (table, id), each
    distinct id sent as itself to the server of its part (``fmix64(id) mod partitions``, part
    ``p`` on shard ``p % shards``), ascending within a table."""
    routed = _route_hashed(ids, lengths, feature_table, shards, server_rank, partitions=partitions,
                           num_servers=num_servers, batch_size=batch_size, weights=weights, mean=mean,
                           sample_major=sample_major)
    return routed if backward else _without_backward(routed)


def _route_hashed(ids, lengths, feature_table, shards, server_rank, *, partitions, num_servers, batch_size,
                  weights=None, mean=False, sample_major=True) -> Route:
    ids = ids.to(torch.int64)
    lengths = lengths.to(torch.int64)
    total = ids.numel()
    nf, b = feature_table.numel(), batch_size
    ntab = shards.numel()
    per_feature = lengths.view(nf, b).sum(1) if nf else lengths.new_zeros(0)
    table_of_id = torch.repeat_interleave(feature_table, per_feature, output_size=total)
    by_row = torch.argsort(ids, stable=True)
    by_row = by_row[torch.argsort(table_of_id[by_row], stable=True)]
    s_tab, s_id = table_of_id[by_row], ids[by_row]
    first = torch.ones(total, dtype=torch.bool)
    first[1:] = (s_tab[1:] != s_tab[:-1]) | (s_id[1:] != s_id[:-1])
    ranks = torch.cumsum(first, 0) - 1
    starts = first.nonzero().squeeze(1)
    uniq, t_u = s_id[starts], s_tab[starts]
    per_row = torch.diff(torch.cat([starts, starts.new_tensor([total])]))
    inverse = torch.empty_like(by_row).scatter_(0, by_row, ranks)
    shard_pos = torch.remainder(id_hash(uniq), partitions) % shards.index_select(0, t_u)
    return _route_tail(uniq, t_u, server_rank[t_u, shard_pos], per_row, by_row, inverse, lengths, weights,
                       num_servers=num_servers, num_tables=ntab, num_features=nf, batch_size=b, mean=mean,
                       sample_major=sample_major)


# -- dynamic tables (ids: dynamic) ----------------------------------------------------------------
# Each table's slot state is an object with the tensors of hybrid.ps.server.dynamic.DynamicSlots:
# slot_id, occupied (bool), last (per slot); count, fill, part_base, part_cap (per part);
# slot_part, slot_index (per slot, fixed).


class PartFull(Exception):
    """Part ``part`` of table ``table`` has no row to give to the ``need`` ids admitted into it."""

    def __init__(self, table: int, part: int, need: int) -> None:
        self.table, self.part, self.need = table, part, need
        super().__init__(f"part {part} of table {table} is full ({need} new rows needed)")


class ForeignPart(Exception):
    """``ids[position]`` (of table ``table``) belongs to a part these slots do not hold."""

    def __init__(self, table: int, position: int) -> None:
        self.table, self.position = table, position
        super().__init__(f"id at position {position} of table {table} belongs to a part not held here")


_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass
class DynamicPlan:
    """One update of several dynamic tables, decided by :func:`dynamic_plan`: per table (table
    ``t``'s entries of each list are the ``sizes[t]``-long run after the earlier tables')."""

    slots: torch.Tensor
    """Each id's slot after the update; -1: not admitted."""
    sizes: torch.Tensor
    """[tables, 4]: the lengths of each table's new_ids, evicted, seen_ids, admitted_seen."""
    new_ids: torch.Tensor
    """Ids getting a row: ascending, or by (part, id) where a part needed the full choice."""
    new_slots: torch.Tensor
    evicted: torch.Tensor
    """Slots whose row goes (expired under ttl, or taken for a new id), ascending."""
    seen_ids: torch.Tensor
    seen_counts: torch.Tensor
    """Sightings of the ids not admitted yet (admit_after > 1)."""
    admitted_seen: torch.Tensor
    """Ids leaving the sightings (admitted now)."""


def _plan_table(s, ids, slots, seen, t: int, off: int, *, step, partitions, admit_after, evict, ttl):
    present = slots >= 0
    touched = slots[present]
    expired = _EMPTY
    if evict == "ttl":
        old = s.occupied & (s.last < step - ttl)
        old[touched] = False
        expired = old.nonzero().squeeze(1)
    new_pos = (~present).nonzero().squeeze(1)
    seen_ids = seen_counts = admitted_seen = _EMPTY
    if admit_after > 1 and new_pos.numel():
        counts = seen[new_pos].clamp(min=0) + 1
        ok = counts >= admit_after
        seen_ids, seen_counts = ids[new_pos[~ok]], counts[~ok]
        new_pos = new_pos[ok]
        admitted_seen = ids[new_pos]
    new = ids[new_pos]
    new_slots = taken = _EMPTY
    if new.numel():
        part = torch.remainder(id_hash(new), partitions)
        foreign = s.part_base[part] < 0
        if bool(foreign.any()):
            raise ForeignPart(t, off + int(new_pos[foreign][0]))
        need = torch.bincount(part, minlength=partitions)
        needy = need > 0
        if not expired.numel() and bool((s.count[needy] == s.fill[needy]).all()) and \
                bool((need[needy] <= s.part_cap[needy] - s.fill[needy]).all()):
            # No holes, room enough: the lowest free slots are the next unused ones, taken by the
            # part's new ids in ascending order (rank inside the part: a running count).
            order = torch.argsort(part, stable=True)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(order.numel()) - (torch.cumsum(need, 0) - need)[part[order]]
            new_slots = s.part_base[part] + s.fill[part] + rank
        else:
            order = torch.argsort(part, stable=True)  # ids ascending within each part
            new, part, new_pos = new[order], part[order], new_pos[order]
            new_slots, taken = _choose(s, t, need, touched, expired, step=step, partitions=partitions, evict=evict)
        slots[new_pos] = new_slots
    evicted = torch.unique(torch.cat([expired, taken]))
    return slots, (new, new_slots, evicted, seen_ids, seen_counts, admitted_seen)


def _choose(s, t: int, need, touched, expired, *, step, partitions, evict):
    """Slots for the new ids (by part, ascending within a part): per part, free slots lowest
    place first, then (lru) the rows touched longest ago, ties by smaller id; the slots and
    those of them whose row goes. Raises :class:`PartFull`."""
    cand = (need[s.slot_part] > 0).nonzero().squeeze(1)
    occ = s.occupied[cand].clone()
    if expired.numel():
        occ &= ~torch.isin(cand, expired)  # expired rows count as free
    c_last = s.last[cand].clone()
    c_last[torch.isin(cand, touched)] = step
    c_last = torch.where(occ, c_last, -1)
    tie = torch.where(occ, s.slot_id[cand], s.slot_index[cand])
    o = torch.argsort(tie, stable=True)
    o = o[torch.argsort(c_last[o], stable=True)]
    o = o[torch.argsort(s.slot_part[cand[o]], stable=True)]
    cand, occ, c_last = cand[o], occ[o], c_last[o]
    c_part = s.slot_part[cand]
    # Candidates come part by part, each part's slots all there: rank inside the part.
    held = s.part_cap * (need > 0)
    rank = torch.arange(cand.numel()) - (torch.cumsum(held, 0) - held)[c_part]
    pick = rank < need[c_part]
    got = torch.bincount(c_part[pick], minlength=partitions)
    usable = ~occ[pick] | ((c_last[pick] < step) if evict == "lru" else torch.zeros_like(occ[pick]))
    short = (got < need).nonzero()
    if short.numel():
        raise PartFull(t, int(short[0]), int(need[int(short[0])]))
    if not bool(usable.all()):
        p = int(s.slot_part[cand[pick][~usable][0]])
        raise PartFull(t, p, int(need[p]))
    new_slots = cand[pick]
    return new_slots, new_slots[s.occupied[new_slots]]


def dynamic_plan(tables, ids, found, seen, counts, *, step, partitions, admit_after, evict, ttl) -> DynamicPlan:
    slots_out, sizes, lists = [], [], [[] for _ in range(6)]
    off = 0
    for t, (s, n) in enumerate(zip(tables, counts)):
        slots, parts = _plan_table(s, ids[off : off + n], found[off : off + n].clone(),
                                   seen[off : off + n] if admit_after > 1 else None, t, off, step=step,
                                   partitions=partitions, admit_after=admit_after, evict=evict, ttl=ttl)
        slots_out.append(slots)
        for acc, x in zip(lists, parts):
            acc.append(x)
        sizes.append([parts[0].numel(), parts[2].numel(), parts[3].numel(), parts[5].numel()])
        off += n
    flat = [torch.cat(x) if x else _EMPTY for x in lists]
    return DynamicPlan(torch.cat(slots_out) if slots_out else _EMPTY,
                       torch.tensor(sizes, dtype=torch.int64).view(len(counts), 4), *flat)


def bag_rows(idx, offsets, *, rows, features, weights=None, mean=False):
    i32 = torch.int32
    lengths = offsets.diff().to(torch.int64)
    nbags = lengths.numel()
    if nbags % features:
        raise ValueError(f"{nbags} bags are not a whole number of samples of {features} features")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
        raise ValueError(f"idx holds rows outside [0, {rows})")
    bag = torch.repeat_interleave(torch.arange(nbags), lengths, output_size=idx.numel())
    samples = nbags // features
    # Ids in the batch's feature-major order (feature, sample, place in the bag), then grouped
    # by row, that order kept.
    feature_major = torch.argsort((bag % features) * samples + bag // features, stable=True)
    by_row = feature_major.index_select(0, torch.argsort(idx.index_select(0, feature_major), stable=True))
    grad_bags = bag.index_select(0, by_row).to(i32)
    grad_offsets = torch.cat([torch.zeros(1, dtype=torch.int64),
                              torch.bincount(idx.to(torch.int64), minlength=rows).cumsum(0)]).to(i32)
    if weights is not None:
        scale = weights.index_select(0, by_row)
    elif mean:
        scale = (1.0 / lengths.clamp(min=1).to(torch.float32)).index_select(0, bag).index_select(0, by_row)
    else:
        scale = None
    return grad_bags, grad_offsets, scale


def merge_ids(ids, counts, *, runs):
    per_table = [sum(counts[t * runs : (t + 1) * runs]) for t in range(len(counts) // runs)]
    uniq, per, inverse, base = [], [], [], 0
    for chunk in ids.split(per_table):
        u, inv = torch.unique(chunk, sorted=True, return_inverse=True)
        uniq.append(u)
        per.append(u.numel())
        inverse.append(inv + base)
        base += u.numel()
    cat = lambda x: torch.cat(x) if x else _EMPTY  # noqa: E731
    return cat(uniq), torch.tensor(per, dtype=torch.int64), cat(inverse)


def sum_runs(grads, inverse, per, runs, *, scale):
    out, j, e, base = [], 0, 0, 0
    for n_u, n_r in zip(per, runs):
        dim = grads[j].shape[1] if n_r else 0
        acc = torch.zeros(n_u, dim)
        for g in grads[j : j + n_r]:
            k = g.shape[0]
            acc.index_add_(0, inverse[e : e + k] - base, g)
            e += k
        j += n_r
        out.append(acc * scale if scale != 1.0 else acc)
        base += n_u
    flat = torch.cat([t.reshape(-1) for t in out]) if out else torch.zeros(0)
    return flat, _table_views(flat, per, [t.shape[1] for t in out])


def _table_views(flat, per, dims):
    """``flat`` split into each table's ``[per[t], dims[t]]`` rows (views)."""
    return [v.view(n, d) for v, n, d in zip(flat.split([n * d for n, d in zip(per, dims)]), per, dims)]


def dynamic_commit_(tables, plan: DynamicPlan, counts, *, step, weights=(), keys=(), bounds=()) -> torch.Tensor:
    sizes = plan.sizes.tolist()
    slots = plan.slots.split(list(counts))
    new_ids, new_slots = plan.new_ids.split([z[0] for z in sizes]), plan.new_slots.split([z[0] for z in sizes])
    evicted = plan.evicted.split([z[1] for z in sizes])
    out = []
    for t, (s, sl, ni, ns, ev) in enumerate(zip(tables, slots, new_ids, new_slots, evicted)):
        partitions = s.count.numel()
        out.append(s.slot_id[ev].clone())
        if ev.numel():
            s.count -= torch.bincount(s.slot_part[ev], minlength=partitions)
            s.occupied[ev] = False
            s.last[ev] = -1
        if ni.numel():
            s.slot_id[ns] = ni
            s.occupied[ns] = True
            parts = s.slot_part[ns]
            s.count += torch.bincount(parts, minlength=partitions)
            s.fill.scatter_reduce_(0, parts, s.slot_index[ns] + 1, reduce="amax")
            if weights:
                init = torch.empty(ni.numel(), weights[t].shape[1])
                initial_rows_(init, ni, key=keys[t], bound=bounds[t])
                scatter_rows_(weights[t], ns, init)
        s.last[sl[sl >= 0]] = step
        s.drop_queues()  # the native operators' eviction queues, not kept here
    return torch.cat(out) if out else _EMPTY


def dynamic_rows(weights, ids, slots, seen, counts, *, admit_after, keys, bounds, out) -> torch.Tensor:
    hits = []
    p = q = 0
    for t, (w, n) in enumerate(zip(weights, counts)):
        dim = w.shape[1]
        o = out[q : q + n * dim].view(n, dim)
        s = slots[p : p + n]
        hit = s >= 0
        fresh = ~hit if admit_after <= 1 else ~hit & (seen[p : p + n].clamp(min=0) + 1 >= admit_after)
        o.zero_()
        o[hit] = w.index_select(0, s[hit]).float()
        if bool(fresh.any()):  # in the table's dtype: the value the admitted row will hold
            init = torch.empty(int(fresh.sum()), dim, dtype=w.dtype)
            initial_rows_(init, ids[p : p + n][fresh], key=keys[t], bound=bounds[t])
            o[fresh] = init.float()
        hits.append(int(hit.sum()))
        p, q = p + n, q + n * dim
    return torch.tensor(hits, dtype=torch.int64)


_CRITEO_DENSE, _CRITEO_SPARSE, _CRITEO_BIG = 13, 26, 1 << 62


def _criteo_line(line: bytes, rows) -> tuple[float, list[int], list[int]] | None:
    """One Criteo line's (label, dense, ids), or None when it is malformed (hybrid/data/criteo.py)."""
    fields = line.split(b"\t")
    if len(fields) != 1 + _CRITEO_DENSE + _CRITEO_SPARSE or fields[0] not in (b"0", b"1"):
        return None
    dense = []
    for v in fields[1:1 + _CRITEO_DENSE]:
        digits = v[1:] if v[:1] in (b"+", b"-") else v
        if v and not (digits and digits.isdigit()):
            return None
        dense.append(min(max(int(v), 0), _CRITEO_BIG) if v else 0)
    ids = []
    for v, m in zip(fields[1 + _CRITEO_DENSE:], rows):
        if v and not all(c in b"0123456789abcdefABCDEF" for c in v):
            return None
        ids.append(int(v, 16) % m if v else 0)
    return float(fields[0] == b"1"), dense, ids


def criteo_parse(text: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lines of Criteo TSV bytes (uint8; each line ends at ``\\n``, the last may not; trailing
    ``\\r`` ignored): per line a status (int8, 1: malformed), the label (float32), the dense
    values (int64 ``[n, 13]``: blank and negative 0, at most ``2**62``) and the ids (int64
    ``[n, 26]``: the hex value modulo ``rows[f]``, blank 0); a malformed line's values are 0."""
    if text.dtype != torch.uint8:
        raise TypeError(f"text must be uint8; got {text.dtype}")
    rows = [int(r) for r in rows]
    if len(rows) != _CRITEO_SPARSE or min(rows) <= 0:
        raise ValueError(f"rows must hold {_CRITEO_SPARSE} positive tables' rows; got {rows}")
    data = text.numpy().tobytes()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the text ended with a newline
    bad = (None, [0] * _CRITEO_DENSE, [0] * _CRITEO_SPARSE)
    parsed = [_criteo_line(line.rstrip(b"\r"), rows) or bad for line in lines]
    n = len(parsed)
    return (torch.tensor([p[0] is None for p in parsed], dtype=torch.int8),
            torch.tensor([p[0] or 0.0 for p in parsed], dtype=torch.float32),
            torch.tensor([p[1] for p in parsed], dtype=torch.int64).reshape(n, _CRITEO_DENSE),
            torch.tensor([p[2] for p in parsed], dtype=torch.int64).reshape(n, _CRITEO_SPARSE))


def csv_records_end(text: torch.Tensor) -> int:
    """The offset just past the last ``\\n`` of CSV bytes (uint8, starting where a record starts)
    that ends a record as pyarrow's parser reads them -- a quote opens a field only at its start,
    ``""`` is a quote inside a quoted field, a line break inside one does not end the record,
    what follows a closing quote belongs to the field up to a comma or a line break, ``\\r`` ends
    a line -- or -1 when no record ends in ``text``."""
    if text.dtype != torch.uint8:
        raise TypeError(f"text must be uint8; got {text.dtype}")
    if text.dim() != 1:
        raise ValueError("text must be a contiguous 1-D CPU tensor")
    data = text.numpy().tobytes()
    state, end, i = "start", -1, 0
    while i < len(data):
        c = data[i]
        if state == "quoted":
            i = data.find(b'"', i)
            if i < 0:
                return end
            state = "after_quote"
        elif state == "after_quote" and c == 0x22:
            state = "quoted"
        elif state in ("unquoted", "after_quote"):
            if c in (0x2C, 0x0D):
                state = "start"
            elif c == 0x0A:
                state, end = "start", i + 1
            else:
                state = "unquoted"
        elif c == 0x22:
            state = "quoted"
        elif c == 0x0A:
            end = i + 1
        elif c not in (0x2C, 0x0D):
            state = "unquoted"
        i += 1
    return end
