"""Plain-torch implementations of the native operators (the fallback, and the tests' reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RowOutOfRange(IndexError):
    """``ids[position]`` (a row of table ``table``, of ``rows`` rows) is outside ``[0, rows)``."""

    def __init__(self, table: int, position: int, row: int, rows: int) -> None:
        self.table, self.position, self.row, self.rows = table, position, row, rows
        super().__init__(f"row {row} at position {position} is outside table {table} of {rows} rows")


class NonFinite(FloatingPointError):
    """A gradient or a new weight is NaN or infinite; nothing was written."""


@dataclass
class Route:
    """How one batch's ids split over servers, and how to pool (or gather) the replies."""

    requests_ids: torch.Tensor
    """Deduplicated local row ids, server by server, table by table, ascending within a table."""
    per: torch.Tensor
    """[num_servers, num_tables] ids of each table in each server's request."""
    raw: torch.Tensor
    """[num_servers] ids before deduplication."""
    idx: torch.Tensor
    """Row (in the replies concatenated in server order) of every id, in bag order."""
    offsets: torch.Tensor
    """Bag bounds (``include_last_offset``)."""
    weights: torch.Tensor | None
    """Per-sample weights in ``idx``'s order."""
    grad_bags: torch.Tensor
    """Backward: the bag of every id, grouped by reply row (rows in reply order)."""
    grad_offsets: torch.Tensor
    """Backward: where each reply row's group starts in ``grad_bags`` (``include_last_offset``)."""
    grad_scale: torch.Tensor | None
    """Backward: each id's factor (its weight, or 1/len(bag) for mean), grouped as grad_bags."""
    num_unique: int


def route(ids, lengths, feature_table, row_base, shards, server_rank, *, num_servers, batch_size,
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
    rank_u = server_rank[t_u, shard_pos]
    key = rank_u * ntab + t_u
    order = torch.argsort(key, stable=True)
    per = torch.bincount(key, minlength=num_servers * ntab).view(num_servers, ntab)
    requests_ids = local.index_select(0, order)
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
        sm_lengths = lengths.view(nf, b).t().reshape(-1)
        fm_start = (lengths.cumsum(0) - lengths).view(nf, b).t().reshape(-1)
        sm_start = sm_lengths.cumsum(0) - sm_lengths
        perm = torch.arange(total) + torch.repeat_interleave(fm_start - sm_start, sm_lengths, output_size=total)
        idx = idx.index_select(0, perm)
        out_weights = weights.index_select(0, perm) if weights is not None else None
        lengths = sm_lengths
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return Route(requests_ids=requests_ids, per=per, raw=raw, idx=idx, offsets=offsets, weights=out_weights,
                 grad_bags=grad_bags, grad_offsets=grad_offsets, grad_scale=grad_scale, num_unique=uniq.numel())


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


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def sgd_rows_(tables, ids, counts, grad, *, alpha) -> None:
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
        w = w.addcdiv(grad, (acc.sqrt() + eps).unsqueeze(1), value=-lr)
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

    def __init__(self) -> None:
        self.keys = torch.empty(0, dtype=torch.int64)
        self.slots = torch.empty(0, dtype=torch.int64)

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
        keys = torch.cat([self.keys, ids.to(torch.int64)])
        order = torch.argsort(keys)
        self.keys, self.slots = keys[order], torch.cat([self.slots, slots.to(torch.int64)])[order]

    def erase(self, ids: torch.Tensor) -> None:
        """Remove ``ids`` (absent ones are skipped)."""
        keep = ~torch.isin(self.keys, ids.to(torch.int64))
        self.keys, self.slots = self.keys[keep], self.slots[keep]

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids ascending, their slots)."""
        return self.keys.clone(), self.slots.clone()
