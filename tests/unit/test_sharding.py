"""Table placement (:func:`hybrid.ps.sharding.shard_tables`) and the rows each shard holds."""

from __future__ import annotations

import random

import pytest

from hybrid.ps.config import held_rows
from hybrid.ps.sharding import TableSpec, shard_tables


def _greedy(tables: list[TableSpec], servers: list[int]) -> dict[str, int]:
    """Table-wise placement as specified: largest table first (then by name), onto the server with
    the fewest bytes so far, ties to the one listed first."""
    load = {s: 0 for s in servers}
    placed = {}
    for t in sorted(tables, key=lambda t: (-t.nbytes, t.name)):
        target = min(servers, key=lambda s: (load[s], servers.index(s)))
        placed[t.name] = target
        load[target] += t.nbytes
    return placed


def test_table_wise_places_the_largest_table_on_the_least_loaded_server_ties_by_listed_order():
    rng = random.Random(0)
    for _ in range(50):
        tables = [TableSpec(f"t{i}", rng.choice([10, 20, 20, 40, 7]), rng.choice([4, 8]), (f"f{i}",))
                  for i in range(rng.randint(1, 12))]
        servers = rng.sample(range(9), rng.randint(1, 9))
        layouts = shard_tables(tables, 9, "table_wise", servers)
        assert [lay.table.name for lay in layouts] == [t.name for t in tables]  # table order kept
        assert {lay.table.name: lay.servers[0] for lay in layouts} == _greedy(tables, servers)
    # equal tables go round the servers in the order listed
    same = [TableSpec(f"t{i}", 10, 4, (f"f{i}",)) for i in range(4)]
    assert [lay.servers for lay in shard_tables(same, 3, "table_wise", [2, 0, 1])] == [(2,), (0,), (1,), (2,)]


def test_row_wise_shards_hold_every_row_once_also_over_many_servers():
    for rows, servers in [(10, 3), (2, 5), (100_003, 20_000)]:
        (lay,) = shard_tables([TableSpec("t", rows, 4, ("f",))], servers, "row_wise")
        (dim, held), = held_rows([lay], None)
        assert dim == 4 and sum(held.values()) == rows
        for k in (0, 1, servers - 1):  # global rows k, k + S, ...
            assert held[lay.servers[k]] == lay.shard_rows(k) == lay.rows_on(lay.servers[k]) == len(range(k, rows, servers))


def test_a_server_listed_twice_is_refused():
    with pytest.raises(ValueError, match=r"servers \[0, 1, 0\] name a server more than once"):
        shard_tables([TableSpec("t", 10, 4, ("f",))], 2, "table_wise", [0, 1, 0])
