"""A trainer's hot-row cache (``hot_rows``, async mode): the most used rows of earlier lookups,
served again while the staleness bound lets a lookup read them.

Under ``sync.staleness`` k >= 1 a server answers a lookup of step t once every trainer's pushes
through step t - 1 - k are applied, and its reply says through which step they are: the rows'
*version* v (:mod:`hybrid.ps.protocol`). A row received with version v is as good as a fresh one
for every lookup of a step t with v >= t - 1 - k, so for those the trainer asks its server only
for the rows it does not hold fresh enough, and puts the two together in the order of its
request: pooling, gradients and pushes see the whole request, as without the cache. Each server
still gets a gradient for every row the trainer used.

With the next batch prefetched during the current step (as the training loop does), the rows a
lookup of step t gets reflect the pushes through about t - 2, so they serve lookups up to step
t - 1 + k: nothing at k = 1, the previous step's rows at k = 2, and so on.

Which rows stay: at most ``hot_rows`` per table and server, in slots of preallocated tensors
found through the native id map (:class:`hybrid.ops.id_map.IdMap`, as dynamic tables use). Every
request of an id counts one use; a row is refreshed in place whenever a request finds it too
old; a new id takes a free slot, else the slot of the least used row, so rows asked for in most
steps stay and rare ones pass through. Uses halve every
:data:`DECAY_STEPS` steps, so rows that cool down make room.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybrid.ops.id_map import IdMap
from hybrid.ps.protocol import Rows

DECAY_STEPS = 100
"""Steps between halvings of the use counts."""


@dataclass
class CacheCounters:
    """What the cache saved (per trainer, since it was made)."""

    looked_up: int = 0
    """Rows the lookups asked for."""
    sent: int = 0
    """Rows asked of the servers (the rest came from the cache; counted when sent)."""
    hits: int = 0
    """Of those, rows served from the cache (not sent by a server)."""
    refreshed: int = 0
    """Rows held but too old for their lookup, replaced by the server's."""
    evicted: int = 0
    """Rows dropped for more used ones."""

    def as_dict(self) -> dict:
        return {"looked_up": self.looked_up, "sent": self.sent, "hits": self.hits, "refreshed": self.refreshed,
                "evicted": self.evicted,
                "hit_ratio": self.hits / self.looked_up if self.looked_up else 0.0}


class _Table:
    """The cached rows of one table from one server."""

    def __init__(self, capacity: int, dim: int, dtype: torch.dtype) -> None:
        self.capacity = capacity
        self.map = IdMap(capacity)
        self.ids = torch.empty(capacity, dtype=torch.int64)
        self.rows = torch.empty(capacity, dim, dtype=dtype)
        self.version = torch.full((capacity,), -1, dtype=torch.int64)
        self.uses = torch.zeros(capacity, dtype=torch.int64)
        self.filled = 0
        """Slots ``[0, filled)`` hold rows."""


@dataclass
class _TablePlan:
    """One table's share of a request: which ids the cache serves, from which slots."""

    table: int
    ids: torch.Tensor
    slots: torch.Tensor
    """Each id's slot, -1 where the cache does not hold it."""
    hit: torch.Tensor
    """Served from the cache (held, and fresh enough)."""


@dataclass
class CacheSplit:
    """What :meth:`HotRows.split` kept back from a request: put back by :meth:`HotRows.join`."""

    server: int
    step: int
    request: Rows
    """The whole request, as routed."""
    sent: Rows
    """What went to the server (the request less the hits)."""
    tables: list[_TablePlan] = field(default_factory=list)


class HotRows:
    """The hot-row cache of one remote collection on one trainer (see the module docstring).
    ``dims``: each table's width (by table index); rows are kept in ``dtype`` (the wire dtype)."""

    def __init__(self, capacity: int, staleness: int, dims: list[int], dtype: torch.dtype) -> None:
        if capacity < 1 or staleness < 1:
            raise ValueError(f"a hot-row cache needs capacity >= 1 and staleness >= 1, got {capacity} and {staleness}")
        self.capacity, self.staleness, self.dims, self.dtype = capacity, staleness, list(dims), dtype
        self.tables: dict[tuple[int, int], _Table] = {}
        self.counters = CacheCounters()
        self.decayed_at = 0

    def clear(self) -> None:
        """Forget every row (the servers' rows were replaced: a checkpoint loaded, tables written)."""
        self.tables.clear()

    def split(self, server: int, request: Rows, step: int) -> tuple[Rows, CacheSplit]:
        """The part of ``request`` (ids of a lookup of ``step`` to ``server``) to send: the ids
        the cache does not hold with a version >= step - 1 - staleness. Counts each id's use."""
        if step - self.decayed_at >= DECAY_STEPS:
            for t in self.tables.values():
                t.uses.bitwise_right_shift_(1)
            self.decayed_at = step
        need = step - 1 - self.staleness
        plans, sent = [], []
        for index, ids in zip(request.tables, request.ids.split(list(request.counts))):
            t = self.tables.get((server, index))
            if t is None or t.filled == 0 or ids.numel() == 0:
                plans.append(_TablePlan(index, ids, torch.full_like(ids, -1), torch.zeros_like(ids, dtype=torch.bool)))
                sent.append(ids)
                continue
            slots = t.map.find(ids)
            held = slots >= 0
            t.uses.index_add_(0, slots[held], torch.ones(int(held.sum()), dtype=torch.int64))
            hit = held & (t.version.index_select(0, slots.clamp(min=0)) >= need)
            plans.append(_TablePlan(index, ids, slots, hit))
            sent.append(ids[~hit])
        rows = Rows(list(request.tables), [x.numel() for x in sent],
                    torch.cat(sent) if len(sent) > 1 else sent[0] if sent else request.ids)
        self.counters.sent += rows.ids.numel()
        return rows, CacheSplit(server, step, request, rows, plans)

    def join(self, split: CacheSplit, reply: torch.Tensor, version: int) -> torch.Tensor:
        """The rows of the whole request (flat, table by table, as a server would send them):
        ``reply`` (the server's rows for ``split.sent``, whose pushes are in through step
        ``version``) with the cached rows put back in place; the reply's rows are kept."""
        out = []
        sent = reply.split([n * self.dims[p.table] for n, p in zip(split.sent.counts, split.tables)])
        for plan, got in zip(split.tables, sent):
            dim = self.dims[plan.table]
            got = got.view(-1, dim)
            n_hit = int(plan.hit.sum())
            self.counters.looked_up += plan.ids.numel()
            self.counters.hits += n_hit
            if n_hit:
                t = self.tables[(split.server, plan.table)]
                rows = torch.empty(plan.ids.numel(), dim, dtype=got.dtype)
                rows[plan.hit] = t.rows.index_select(0, plan.slots[plan.hit])
                rows[~plan.hit] = got
            else:
                rows = got
            out.append(rows.reshape(-1))
            miss = ~plan.hit
            self._keep(split.server, plan.table, plan.ids[miss], plan.slots[miss], got, version)
        return torch.cat(out) if len(out) != 1 else out[0]

    def _keep(self, server: int, index: int, ids: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
              version: int) -> None:
        """Put the server's rows of ``ids`` (``slots``: where the cache holds them, -1 if not) in."""
        if ids.numel() == 0:
            return
        t = self.tables.get((server, index))
        if t is None:
            t = self.tables[(server, index)] = _Table(self.capacity, self.dims[index], self.dtype)
        held = slots >= 0
        if bool(held.any()):  # too old: refreshed in place
            at = slots[held]
            t.rows.index_copy_(0, at, rows[held])
            t.version.index_fill_(0, at, version)
            self.counters.refreshed += int(held.sum())
        new = ~held
        if not bool(new.any()):
            return
        ids, rows = ids[new], rows[new]
        old, n = t.filled, ids.numel()
        free = t.capacity - old
        take = torch.arange(old, old + min(free, n), dtype=torch.int64)
        if n > free:  # full: the least used rows make room
            victims = torch.topk(t.uses[:old], min(n - free, old), largest=False).indices
            t.map.erase(t.ids.index_select(0, victims))
            self.counters.evicted += victims.numel()
            take = torch.cat([take, victims])
        t.filled = old + min(free, n)
        ids, rows = ids[: take.numel()], rows[: take.numel()]
        t.ids.index_copy_(0, take, ids)
        t.rows.index_copy_(0, take, rows)
        t.version.index_fill_(0, take, version)
        t.uses.index_fill_(0, take, 1)
        t.map.insert(ids, take)
