"""Where each embedding row lives: table-wise or row-wise over a set of parameter servers.

Row-wise sharding is cyclic: global row ``r`` of a table lives on ``servers[r % S]`` at local row
``r // S``. Cyclic rather than contiguous blocks because real id distributions are skewed towards
small ids (Zipf); blocks would put every hot row on the first server.

Table-wise sharding puts each whole table on one server, balancing bytes greedily (largest table
to the least-loaded server), ties broken by server order, so the layout is deterministic.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from hybrid.ps.config import SHARDINGS, Sharding, TableSpec


@dataclass(frozen=True)
class TableLayout:
    """The placement of one table: which servers hold it and how rows map to them."""

    table: TableSpec
    sharding: Sharding
    servers: tuple[int, ...]
    """Global server indices (``ps<i>``) holding shards; one server for table-wise."""

    @property
    def num_shards(self) -> int:
        return len(self.servers)

    def rows_on(self, server: int) -> int:
        """Rows of this table held by ``server`` (0 if it holds none)."""
        if server not in self.servers:
            return 0
        return self.shard_rows(self.servers.index(server))

    def shard_rows(self, k: int) -> int:
        """Rows of shard ``k`` (the one on ``servers[k]``): global rows ``k, k + S, ...``."""
        if self.sharding == "table_wise":
            return self.table.num_embeddings
        s = self.num_shards
        return (self.table.num_embeddings - k + s - 1) // s

    def shard_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Shard position (index into ``servers``) of each global id."""
        if self.sharding == "table_wise":
            return torch.zeros_like(ids)
        return ids % self.num_shards

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Row index inside its shard of each global id."""
        if self.sharding == "table_wise":
            return ids
        return ids // self.num_shards

    def global_ids(self, shard_pos: int, local: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`local_ids` for rows of shard ``shard_pos``."""
        if self.sharding == "table_wise":
            return local
        return local * self.num_shards + shard_pos


def shard_tables(
    tables: list[TableSpec],
    num_servers: int,
    sharding: Sharding,
    servers: list[int] | None = None,
) -> list[TableLayout]:
    """Place ``tables`` on ``servers`` (default: all ``num_servers``), in table order."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {', '.join(map(repr, SHARDINGS))}, got {sharding!r}")
    servers = list(range(num_servers)) if servers is None else list(servers)
    if not servers:
        raise ValueError("no parameter server to place the tables on")
    if len(set(servers)) != len(servers):
        raise ValueError(f"servers {servers} name a server more than once")
    bad = [s for s in servers if not 0 <= s < num_servers]
    if bad:
        raise ValueError(f"servers {bad} do not exist: there are {num_servers} (ps0..ps{num_servers - 1})")
    if sharding == "row_wise":
        return [TableLayout(t, "row_wise", tuple(servers)) for t in tables]
    # A heap of (bytes placed, position in ``servers``): the least-loaded server, first listed
    # on a tie, in O(log S) a table.
    heap = [(0, k) for k in range(len(servers))]
    placed: dict[str, int] = {}
    for t in sorted(tables, key=lambda t: (-t.nbytes, t.name)):
        load, k = heapq.heappop(heap)
        placed[t.name] = servers[k]
        heapq.heappush(heap, (load + t.nbytes, k))
    return [TableLayout(t, "table_wise", (placed[t.name],)) for t in tables]
