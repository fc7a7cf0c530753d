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
t - 1 + k: nothing at k = 1, some at k = 2 (when the server is a step ahead), the previous
steps' rows from k = 3 on.

Which rows stay: per server and embedding width, a pool of ``hot_rows`` x tables slots in
preallocated tensors, found through the native id map (:class:`hybrid.ops.id_map.IdMap`, as
dynamic tables use) by a hash of (table, id), the table and id kept beside each row and checked
on every find. Every request of a held row counts one use; a row too old for its lookup is
refreshed in place with the server's. A row not held is let in only once it has been asked for
:data:`ADMIT_AFTER` times recently (a count-min sketch of the requests, two rows of counters
a pool), so rows seen once never cost a copy; it takes a free slot,
and when none is left the least used quarter of the pool is dropped at once (one partial sort
every few steps, not one per step). Uses and the sketch halve every :data:`DECAY_STEPS` steps,
so rows that cool down make room. Every step costs a fixed number of tensor operations per
server, whatever the number of tables.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hybrid.ops import scatter_rows_
from hybrid.ops.id_map import HashIdMap, IdMap, id_hash
from hybrid.ps.protocol import Rows

DECAY_STEPS = 16
"""Steps between halvings of the use counts and of the request sketch."""
EVICT_SHARE = 4
"""A full pool drops at least 1 / EVICT_SHARE of its rows at once."""
ADMIT_AFTER = 2
"""Requests of a row (as the sketch counts them, since the last halving) before it is kept."""
SKETCH_MIN = 1 << 16
"""Counters per row of a pool's count-min sketch, at least (else the next power of two above
four times the pool's rows)."""
_TABLE_SALT = 0x9E3779B97F4A7C15 - (1 << 64)
"""Mixes the table index into the id before hashing (the golden-ratio constant, as int64)."""


@dataclass
class CacheCounters:
    """What the cache saved (per trainer, since it was made)."""

    looked_up: int = 0
    """Rows the lookups asked for (counted when their replies came)."""
    sent: int = 0
    """Rows asked of the servers (the rest came from the cache; counted when sent)."""
    hits: int = 0
    """Rows served from the cache (not sent by a server)."""
    refreshed: int = 0
    """Rows held but too old for their lookup, replaced by the server's."""
    evicted: int = 0
    """Rows dropped for others."""

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.looked_up if self.looked_up else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_ratio": self.hit_ratio}


def pool_sizes(capacity: int, tables: list[tuple[int, dict[int, int]]]) -> dict[tuple[int, int], int]:
    """(server, width) -> slots of its pool: ``capacity`` rows for each table of that width the
    server holds, or the table's rows there when fewer. ``tables``: per table index, (its
    embedding_dim, server -> rows of it that server holds)."""
    sizes: dict[tuple[int, int], int] = {}
    for dim, rows_on in tables:
        for server, rows in rows_on.items():
            if rows:
                sizes[(server, dim)] = sizes.get((server, dim), 0) + min(capacity, rows)
    return sizes


def cache_bytes(capacity: int, tables: list[tuple[int, dict[int, int]]], wire_bytes: int) -> int:
    """Bytes a trainer's cache (:func:`pool_sizes`' pools) holds at most: each slot's row and
    slot arrays (four int64s), the id map (two int64s in at least twice the slots) and the
    sketch."""
    return sum(slots * (dim * wire_bytes + 4 * 8 + 2 * 2 * 8) + 2 * _sketch_size(slots) * 4
               for (_, dim), slots in pool_sizes(capacity, tables).items())


def _sketch_size(slots: int) -> int:
    size = SKETCH_MIN
    while size < 4 * slots:
        size *= 2
    return size


def _keys(ids: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    return id_hash(ids ^ (tables * _TABLE_SALT))


class _Pool:
    """The cached rows of one width from one server."""

    def __init__(self, capacity: int, dim: int, dtype: torch.dtype) -> None:
        self.capacity = capacity
        self.map = IdMap(capacity)
        self.ids = torch.empty(capacity, dtype=torch.int64)
        self.tables = torch.full((capacity,), -1, dtype=torch.int64)
        """-1: a free slot."""
        self.rows = torch.empty(capacity, dim, dtype=dtype)
        self.version = torch.full((capacity,), -1, dtype=torch.int64)
        self.uses = torch.zeros(capacity, dtype=torch.int64)
        self.sketch = torch.zeros(2, _sketch_size(capacity), dtype=torch.int32)
        """Requests per hashed (table, id), two hashes; an id's count is the smaller."""
        self.free = torch.arange(capacity - 1, -1, -1, dtype=torch.int64)
        """A stack of free slots: the first ``n_free`` entries, its top at ``n_free - 1``."""
        self.n_free = capacity

    def count(self, keys: torch.Tensor) -> torch.Tensor:
        """Count one more request of each key (distinct); their counts."""
        mask = self.sketch.shape[1] - 1
        at = [keys & mask, (keys >> 32) & mask]
        ones = torch.ones(keys.numel(), dtype=torch.int32)
        for row, i in zip(self.sketch, at):
            row.index_add_(0, i, ones)
        return torch.minimum(self.sketch[0].index_select(0, at[0]), self.sketch[1].index_select(0, at[1]))

    def find_and_count(self, keys: torch.Tensor, ids: torch.Tensor, tables: torch.Tensor,
                       need: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For requested (table, id) pairs (``keys`` their hashes): each one's slot (-1 where not
        held), whether it is a hit (held with a version >= ``need``), and whether it is asked
        for often enough to be let in; counts a use of each held row and a request of each key.
        One native operator (``hybrid::hot_rows_find_``) where the map is the native one."""
        if isinstance(self.map, HashIdMap):
            return torch.ops.hybrid.hot_rows_find_(self.map.keys, self.map.slots, keys, ids, tables, self.ids,
                                                   self.tables, self.version, self.uses, self.sketch, need,
                                                   ADMIT_AFTER)
        return self.find_and_count_reference(keys, ids, tables, need)

    def find_and_count_reference(self, keys: torch.Tensor, ids: torch.Tensor, tables: torch.Tensor,
                                 need: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`find_and_count` in tensor operations (without the native extension)."""
        s = self.find(keys, ids, tables)
        held = s >= 0
        self.uses.index_add_(0, s[held], torch.ones(int(held.sum()), dtype=torch.int64))
        hit = held & (self.version.index_select(0, s.clamp(min=0)) >= need)
        return s, hit, self.count(keys) >= ADMIT_AFTER

    def find(self, keys: torch.Tensor, ids: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Each (table, id)'s slot (``keys`` their hashes), -1 where not held."""
        slots = self.map.find(keys)
        at = slots.clamp(min=0)
        held = (slots >= 0) & (self.ids.index_select(0, at) == ids) & (self.tables.index_select(0, at) == tables)
        return torch.where(held, slots, -1)

    def take(self, n: int) -> tuple[torch.Tensor, int]:
        """Up to ``n`` free slots (dropping the least used rows when too few are free), and how
        many rows were dropped."""
        dropped = 0
        if n > self.n_free:
            occupied = self.capacity - self.n_free
            k = min(occupied, max(n - self.n_free, self.capacity // EVICT_SHARE))
            uses = self.uses.masked_fill(self.tables < 0, torch.iinfo(torch.int64).max)
            victims = torch.topk(uses, k, largest=False).indices
            self.map.erase(_keys(self.ids.index_select(0, victims), self.tables.index_select(0, victims)))
            self.tables.index_fill_(0, victims, -1)
            self.free[self.n_free : self.n_free + k] = victims
            self.n_free += k
            dropped = k
        n = min(n, self.n_free)
        slots = self.free[self.n_free - n : self.n_free].flip(0)
        self.n_free -= n
        return slots, dropped


@dataclass
class CacheSplit:
    """What :meth:`HotRows.split` kept back from one request: put back by :meth:`HotRows.join`."""

    server: int
    request: Rows
    """The whole request, as routed."""
    sent: Rows
    """What went to the server (the request less the hits)."""
    tables: torch.Tensor
    """Each requested id's table index."""
    slots: torch.Tensor
    """Each requested id's slot in its pool, -1 where not held."""
    hit: torch.Tensor
    """Served from the cache (held, and fresh enough)."""
    keys: torch.Tensor
    """Each requested id's hash with its table."""
    admit: torch.Tensor
    """Asked for often enough to be kept."""
    kept: dict[int, torch.Tensor]
    """Width -> the hits' rows of that width, in request order, copied out when the split was
    made: another lookup's reply, put in before this one's, may drop their slots for other rows."""
    generation: int
    """:attr:`HotRows.generation` when the split was made: where it has moved on, the slots of
    the ids not served are looked up again before the reply's rows go in."""


class HotRows:
    """The hot-row cache of one remote collection on one trainer (see the module docstring):
    ``capacity`` rows per table and server at most; ``tables``, per table index, its width and
    the rows each server holds of it (:func:`pool_sizes`); rows are kept in ``dtype`` (the wire
    dtype)."""

    def __init__(self, capacity: int, staleness: int, tables: list[tuple[int, dict[int, int]]],
                 dtype: torch.dtype) -> None:
        if capacity < 1 or staleness < 1:
            raise ValueError(f"a hot-row cache needs capacity >= 1 and staleness >= 1, got {capacity} and {staleness}")
        self.capacity, self.staleness, self.dtype = capacity, staleness, dtype
        self.dims = torch.tensor([dim for dim, _ in tables], dtype=torch.int64)
        self.sizes = pool_sizes(capacity, tables)
        """(server, width) -> slots of its pool."""
        self.one_width = len({dim for dim, _ in tables}) == 1
        self.pools: dict[tuple[int, int], _Pool] = {}
        self.counters = CacheCounters()
        self.decayed_at = 0
        self.generation = 0
        """Counts the changes of which row a slot holds (rows let in, others dropped, pools
        cleared). A lookup's split and its join may have other lookups' joins between them (a
        prefetch sent before the current step's rows are in, lookups several steps ahead), which
        is how a join knows its split's slots may be out of date."""

    def clear(self) -> None:
        """Forget every row (the servers' rows were replaced: a checkpoint loaded, tables written)."""
        self.pools.clear()
        self.generation += 1

    def _pool(self, server: int, dim: int) -> _Pool:
        pool = self.pools.get((server, dim))
        if pool is None:
            pool = self.pools[(server, dim)] = _Pool(self.sizes.get((server, dim), 1), dim, self.dtype)
        return pool

    def _groups(self, server: int, tables: torch.Tensor):
        """(pool, the elements of ``tables`` it serves: None for all) per width present."""
        if self.one_width:
            return [(self._pool(server, int(self.dims[0])), None)]
        widths = self.dims.index_select(0, tables)
        present = torch.unique(widths).tolist()
        if len(present) == 1:
            return [(self._pool(server, present[0]), None)]
        return [(self._pool(server, d), (widths == d).nonzero().flatten()) for d in present]

    def split(self, server: int, request: Rows, step: int) -> tuple[Rows, CacheSplit]:
        """The part of ``request`` (ids of a lookup of ``step`` to ``server``) to send: the ids
        the cache does not hold with a version >= step - 1 - staleness. Counts each held id's use."""
        if step - self.decayed_at >= DECAY_STEPS:
            for pool in self.pools.values():
                pool.uses.bitwise_right_shift_(1)
                pool.sketch.bitwise_right_shift_(1)
            self.decayed_at = step
        need = step - 1 - self.staleness
        n = request.ids.numel()
        # Each id's table, as its place in request.tables, then as the table's index.
        position = torch.repeat_interleave(torch.arange(len(request.tables)),
                                           torch.tensor(list(request.counts), dtype=torch.int64), output_size=n)
        tables = torch.tensor(list(request.tables), dtype=torch.int64)[position]
        slots = torch.full((n,), -1, dtype=torch.int64)
        hit = torch.zeros(n, dtype=torch.bool)
        admit = torch.zeros(n, dtype=torch.bool)
        keys = _keys(request.ids, tables)
        kept = {}
        for pool, sel in self._groups(server, tables) if n else []:
            ids, tab, k = (request.ids, tables, keys) if sel is None else (request.ids[sel], tables[sel], keys[sel])
            s, h, a = pool.find_and_count(k, ids, tab, need)
            kept[pool.rows.shape[1]] = pool.rows.index_select(0, s[h])
            if sel is None:
                slots, hit, admit = s, h, a
            else:
                slots[sel], hit[sel], admit[sel] = s, h, a
        miss = ~hit
        per_table = torch.bincount(position[miss], minlength=len(request.tables))
        sent = Rows(list(request.tables), per_table.tolist(), request.ids[miss])
        self.counters.sent += sent.ids.numel()
        return sent, CacheSplit(server, request, sent, tables, slots, hit, keys, admit, kept, self.generation)

    def join(self, split: CacheSplit, reply: torch.Tensor, version: int) -> torch.Tensor:
        """The rows of the whole request (flat, table by table, as a server would send them):
        ``reply`` (the server's rows for ``split.sent``, whose pushes are in through step
        ``version``) with the held rows put back in place; the reply's rows are kept."""
        request, hit, slots = split.request, split.hit, split.slots
        if not request.tables:
            return reply
        self.counters.looked_up += request.ids.numel()
        self.counters.hits += int(hit.sum())
        widths = self.dims[list(request.tables)]
        miss = torch.nonzero(~hit).squeeze(1)
        if split.generation != self.generation:
            self._find_again(split, miss)
        if self.one_width or bool((widths == widths[0]).all()):  # one width: whole-tensor moves
            dim = int(widths[0])
            pool = self._pool(split.server, dim)
            got = reply.view(-1, dim)
            full = got
            if miss.numel() < request.ids.numel():
                full = torch.empty(request.ids.numel(), dim, dtype=reply.dtype)
                scatter_rows_(full, miss, got)
                scatter_rows_(full, torch.nonzero(hit).squeeze(1), split.kept[dim])
            self._keep(split, pool, miss, got, version)
            return full.reshape(-1)
        out, sent, start = [], 0, 0  # several widths: table by table
        got_rows = []
        served = dict.fromkeys(split.kept, 0)  # width -> its kept rows put back so far
        for index, n, m in zip(request.tables, request.counts, split.sent.counts):
            dim = int(self.dims[index])
            got = reply[sent : sent + m * dim].view(m, dim)
            sent += m * dim
            h = hit[start : start + n]
            rows = torch.empty(n, dim, dtype=reply.dtype)
            if n - m:
                rows[h] = split.kept[dim][served[dim] : served[dim] + n - m]
                served[dim] += n - m
            rows[~h] = got
            out.append(rows.reshape(-1))
            got_rows.append(got)
            start += n
        for pool, sel in self._groups(split.server, split.tables.index_select(0, miss)):
            rows = torch.cat([g for g, i in zip(got_rows, request.tables) if int(self.dims[i]) == pool.rows.shape[1]])
            self._keep(split, pool, miss if sel is None else miss.index_select(0, sel), rows, version)
        return torch.cat(out)

    def _find_again(self, split: CacheSplit, miss: torch.Tensor) -> None:
        """The slots of the ids at positions ``miss`` as the pools hold them now (rows let in or
        dropped since ``split`` was made), so that the reply refreshes only rows still held
        and lets in only rows not held."""
        split.slots.index_fill_(0, miss, -1)
        if miss.numel() == 0:
            return
        for pool, sel in self._groups(split.server, split.tables.index_select(0, miss)):
            at = miss if sel is None else miss.index_select(0, sel)
            split.slots[at] = pool.find(split.keys.index_select(0, at), split.request.ids.index_select(0, at),
                                        split.tables.index_select(0, at))

    def _keep(self, split: CacheSplit, pool: _Pool, pick: torch.Tensor, rows: torch.Tensor, version: int) -> None:
        """Put the server's ``rows`` of the requested ids at positions ``pick`` (ascending, all of
        ``pool``'s width) in: refresh those held, let in those asked for often enough."""
        if pick.numel() == 0:
            return
        slots = split.slots.index_select(0, pick)
        held = torch.nonzero(slots >= 0).squeeze(1)
        if held.numel():  # too old: refreshed in place
            at = slots.index_select(0, held)
            scatter_rows_(pool.rows, at, rows.index_select(0, held))
            pool.version.index_fill_(0, at, version)
            self.counters.refreshed += at.numel()
        new = torch.nonzero((slots < 0) & split.admit.index_select(0, pick)).squeeze(1)
        if new.numel() == 0:
            return
        take, dropped = pool.take(new.numel())
        self.counters.evicted += dropped
        self.generation += 1
        new = new[: take.numel()]
        at = pick.index_select(0, new)
        keys = split.keys.index_select(0, at)
        pool.ids.index_copy_(0, take, split.request.ids.index_select(0, at))
        pool.tables.index_copy_(0, take, split.tables.index_select(0, at))
        scatter_rows_(pool.rows, take, rows.index_select(0, new))
        pool.version.index_fill_(0, take, version)
        pool.uses.index_fill_(0, take, 1)
        pool.map.insert(keys, take)
