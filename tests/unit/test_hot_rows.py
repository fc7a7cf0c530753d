"""The trainer's hot-row cache (hybrid.ps.client.cache), against a simulated server: what it
keeps back from a request, how it puts the rows back, the staleness bound, and which rows stay."""

import pytest
import torch

from hybrid.plan import plan_from_dict
from hybrid.plan.errors import PlanError
from hybrid.ps.client.cache import DECAY_STEPS, HotRows
from hybrid.ps.protocol import Rows

DIMS = [2, 3]
TABLES = [(dim, {0: 1000}) for dim in DIMS]
"""Per table: width, and rows server 0 holds."""


def _value(table: int, ids: torch.Tensor, version: int) -> torch.Tensor:
    """The simulated server's row of ``ids`` at ``version``: [id, table, version, ...]."""
    cols = torch.stack([ids.float(), torch.full_like(ids, table).float(), torch.full_like(ids, version).float()], 1)
    return cols[:, : DIMS[table]]


def _rows(request: dict[int, list[int]]) -> Rows:
    tables = sorted(request)
    return Rows(tables, [len(request[t]) for t in tables],
                torch.cat([torch.tensor(request[t], dtype=torch.int64) for t in tables]))


def _serve(rows: Rows, version: int) -> torch.Tensor:
    """What a server at ``version`` answers for ``rows``: flat, table by table."""
    parts = [_value(t, ids, version).reshape(-1) for t, ids in zip(rows.tables, rows.ids.split(rows.counts))]
    return torch.cat(parts) if parts else torch.empty(0)


def _lookup(cache: HotRows, request: dict[int, list[int]], step: int, version: int) -> tuple[torch.Tensor, Rows]:
    full = _rows(request)
    sent, split = cache.split(0, full, step)
    return cache.join(split, _serve(sent, version), version), sent


def _tables(flat: torch.Tensor, request: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    tables = sorted(request)
    parts = flat.split([len(request[t]) * DIMS[t] for t in tables])
    return {t: p.view(-1, DIMS[t]) for t, p in zip(tables, parts)}


def test_rows_come_back_in_request_order_from_the_cache_and_the_server():
    cache = HotRows(16, staleness=2, tables=TABLES, dtype=torch.float32)
    first = {0: [1, 4, 9], 1: [2, 5]}
    got, sent = _lookup(cache, first, step=4, version=3)  # seen once: not kept yet
    assert sent.counts == [3, 2] and cache.counters.hits == 0 and not cache.pools[(0, 2)].map.find(
        torch.tensor([1])).ge(0).any()
    got, sent = _lookup(cache, first, step=5, version=3)  # asked for again: kept
    assert sent.counts == [3, 2] and cache.counters.hits == 0
    # step 6 under k = 2 reads rows of version >= 3: ids held come from the cache, the rest from the server
    second = {0: [0, 4, 9, 12], 1: [5, 7]}
    got, sent = _lookup(cache, second, step=6, version=4)
    assert sent.tables == [0, 1] and sent.counts == [2, 1]
    assert sent.ids.tolist() == [0, 12, 7]
    rows = _tables(got, second)
    assert rows[0][:, 0].tolist() == [0, 4, 9, 12] and rows[0][:, 1].tolist() == [0, 0, 0, 0]
    assert rows[0][:, 0].tolist() == second[0] and rows[1][:, 0].tolist() == second[1]
    assert torch.equal(rows[0][[1, 2], :2], _value(0, torch.tensor([4, 9]), 3)[:, :2])  # cached, version 3
    assert torch.equal(rows[0][[0, 3]], _value(0, torch.tensor([0, 12]), 4))  # from the server, version 4
    assert rows[1][:, 2].tolist() == [3, 4]
    assert cache.counters.hits == 3 and cache.counters.looked_up == 16


def test_a_row_older_than_the_bound_is_asked_for_again_and_refreshed():
    cache = HotRows(16, staleness=2, tables=TABLES, dtype=torch.float32)
    _lookup(cache, {0: [1, 2]}, step=4, version=2)
    _lookup(cache, {0: [1, 2]}, step=5, version=2)
    got, sent = _lookup(cache, {0: [1, 2]}, step=6, version=3)  # needs version >= 3
    assert sent.ids.tolist() == [1, 2] and cache.counters.refreshed == 2
    assert _tables(got, {0: [1, 2]})[0][:, 1].tolist() == [0, 0]
    got, sent = _lookup(cache, {0: [1, 2]}, step=7, version=9)  # needs >= 4: held at 3, asked again
    assert sent.ids.numel() == 2
    got, sent = _lookup(cache, {0: [2]}, step=8, version=9)  # needs >= 5: held at 9
    assert sent.ids.numel() == 0 and sent.counts == [0]
    assert got.view(-1, 2).tolist() == [[2.0, 0.0]]


@pytest.mark.parametrize("staleness", [1, 2, 4])
def test_every_row_served_is_within_the_staleness_bound(staleness):
    """Random requests against a server whose rows carry their version: whatever comes from
    the cache has a version >= step - 1 - staleness, and equals what the server had then."""
    g = torch.Generator().manual_seed(staleness)
    cache = HotRows(8, staleness=staleness, tables=TABLES, dtype=torch.float32)
    version = 0
    for step in range(1, 200):
        version = max(version, step - 1 - staleness) + int(torch.randint(0, 2, (1,), generator=g))
        ids = torch.unique(torch.randint(0, 20, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g))
        got, _ = _lookup(cache, {1: ids.tolist()}, step=step, version=min(version, step - 1))
        rows = got.view(-1, 3)
        assert rows[:, 0].tolist() == ids.float().tolist()
        assert bool((rows[:, 2] >= step - 1 - staleness).all()), (step, rows)
    assert cache.counters.hits > 0


def test_the_most_used_rows_stay_and_the_rest_pass_through():
    cache = HotRows(4, staleness=3, tables=TABLES, dtype=torch.float32)
    for step in range(1, 40):  # cold ids come in two steps running, then never again
        cold = [100 + step, 200 + step, 99 + step, 199 + step]
        _lookup(cache, {0: sorted([1, 2] + cold)}, step=step, version=step - 1)
    assert cache.counters.evicted > 0
    hits = cache.counters.hits
    _, sent = _lookup(cache, {0: [1, 2]}, step=40, version=39)
    assert sent.ids.numel() == 0 and cache.counters.hits == hits + 2  # the hot pair is still held
    assert len(cache.pools[(0, 2)].map) == 4


def test_uses_decay_and_clear_forgets_everything():
    cache = HotRows(4, staleness=2, tables=TABLES, dtype=torch.float32)
    for step in range(1, 6):
        _lookup(cache, {0: [1]}, step=step, version=step - 1)
    pool = cache.pools[(0, 2)]
    before = int(pool.uses[:1])
    _lookup(cache, {0: [1]}, step=DECAY_STEPS + 6, version=DECAY_STEPS + 5)
    assert before >= 4 and int(pool.uses[:1]) <= before // 2 + 1
    cache.clear()
    _, sent = _lookup(cache, {0: [1]}, step=DECAY_STEPS + 7, version=DECAY_STEPS + 6)
    assert sent.ids.tolist() == [1]


def test_a_plan_refuses_hot_rows_in_sync_mode():
    plan = {"topology": {"parameter_servers": 1},
            "modules": {"sparse": {"strategy": "parameter_server", "optimizer": {"name": "sgd", "lr": 0.1},
                                   "hot_rows": 1000}}}
    with pytest.raises(PlanError, match=r"modules\.sparse\.hot_rows: got 1000.*sync\.staleness >= 2"):
        plan_from_dict(plan)
    plan_from_dict({**plan, "sync": {"staleness": 2}})
    with pytest.raises(PlanError, match=r"hot_rows: got -1"):
        plan_from_dict({**plan, "modules": {"sparse": {**plan["modules"]["sparse"], "hot_rows": -1}}})


def test_pools_hold_at_most_the_rows_their_server_has_and_their_bytes_are_counted():
    from hybrid.ps.client.cache import cache_bytes, pool_sizes

    tables = [(4, {0: 10, 1: 9}), (4, {0: 100}), (8, {1: 3})]
    assert pool_sizes(50, tables) == {(0, 4): 10 + 50, (1, 4): 9, (1, 8): 3}
    per_slot = {4: 4 * 4 + 4 * 8 + 32, 8: 8 * 4 + 4 * 8 + 32}
    sketch = 2 * (1 << 16) * 4
    assert cache_bytes(50, tables, 4) == 60 * per_slot[4] + 9 * per_slot[4] + 3 * per_slot[8] + 3 * sketch


def test_a_split_keeps_its_rows_while_other_lookups_join_before_it():
    """A prefetch sent before the current step's rows are in (``s.prefetch`` called first in a
    step, or lookups several steps ahead) is split before another lookup's join: that join may
    let rows in and drop the ones the split counted as hits, and the split's rows must still be
    its own ids', at the versions it found them."""
    cache = HotRows(4, staleness=3, tables=TABLES, dtype=torch.float32)
    held = {0: [1, 2, 3, 4], 1: [1, 2]}
    for s in range(1, 4):
        _lookup(cache, held, step=s, version=s - 1)  # held from their second request
    early = _rows(held)
    sent, split = cache.split(0, early, step=5)  # every row fresh enough: nothing asked for
    assert sent.ids.numel() == 0
    for _ in range(2):  # other ids, asked for twice, come in and take the held rows' slots
        _lookup(cache, {0: [10, 11, 12, 13], 1: [10, 11, 12, 13]}, step=4, version=3)
    assert cache.counters.evicted > 0
    got = _tables(cache.join(split, _serve(sent, 4), 4), held)
    for t, ids in held.items():  # kept from their second request, at step 2
        assert torch.equal(got[t], _value(t, torch.tensor(ids), 1)), (t, got[t])


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_lookups_split_ahead_of_their_joins_get_their_own_rows(ahead):
    """Random requests whose splits run ``ahead`` lookups before their joins, against a server
    whose rows carry their version: every row put back is its own id's and table's, within the
    staleness bound, and the pools' slots stay consistent with their maps."""
    g = torch.Generator().manual_seed(ahead)
    cache = HotRows(6, staleness=4, tables=TABLES, dtype=torch.float32)
    waiting = []
    for step in range(1, 120):
        request = {t: torch.unique(torch.randint(0, 16, (int(torch.randint(1, 9, (1,), generator=g)),),
                                                 generator=g)).tolist() for t in (0, 1)}
        full = _rows(request)
        waiting.append((request, step, *cache.split(0, full, step)))
        if len(waiting) > ahead:
            request, s, sent, split = waiting.pop(0)
            version = s - 1
            got = _tables(cache.join(split, _serve(sent, version), version), request)
            for t, ids in request.items():
                assert got[t][:, 0].tolist() == [float(i) for i in ids], (step, t, got[t])
                if DIMS[t] > 1:
                    assert got[t][:, 1].tolist() == [float(t)] * len(ids)
                if DIMS[t] > 2:
                    assert bool((got[t][:, 2] >= s - 1 - 4).all()), (step, got[t])
    for pool in cache.pools.values():
        held = torch.nonzero(pool.tables >= 0).squeeze(1)
        assert len(pool.map) == held.numel()
        assert torch.equal(pool.find(_keys_of(pool, held), pool.ids[held], pool.tables[held]), held)
    assert cache.counters.hits > 0 and cache.counters.evicted > 0


def _keys_of(pool, slots: torch.Tensor) -> torch.Tensor:
    from hybrid.ps.client.cache import _keys

    return _keys(pool.ids.index_select(0, slots), pool.tables.index_select(0, slots))
