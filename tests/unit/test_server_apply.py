"""When a server applies a sync step's gradients (a ``CollectionShard`` built in this process, no
RPC): once every trainer's push of the step is in -- plain SGD adding each push in trainer order
(whatever order they arrive in), the other optimizers summing first -- so that no lookup of the
step reads part of its update; lookups of the next step wait for the whole step."""
from __future__ import annotations

import pytest
import torch

from hybrid.ps.config import CollectionConfig, OptimizerSpec
from hybrid.ps.protocol import Rows
from hybrid.ps.server.shard import CollectionShard
from hybrid.ps.sharding import TableSpec, shard_tables

TABLES = [TableSpec("a", 50, 4, ("fa",)), TableSpec("b", 30, 4, ("fb",))]


def _shard(spec: OptimizerSpec, storage_dtype: str = "float32") -> CollectionShard:
    config = CollectionConfig(cid="ebc", tables=tuple(TABLES), layouts=tuple(shard_tables(TABLES, 1, "table_wise")),
                              optimizer=spec, num_trainers=2, staleness=0, gradient_scaling="mean",
                              storage_dtype=storage_dtype)
    shard = CollectionShard(config, 0, start_step=0, huge_pages=False)
    for t in shard.tables:  # as rpc_create does; the weights are torch.empty until then
        t.initialize(7)
    return shard


def _part(seed: int) -> tuple[Rows, torch.Tensor]:
    """A trainer's deduplicated push: ascending ids per table, one gradient row each (flat)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randperm(t.num_embeddings, generator=g)[:6].sort().values for t in TABLES]
    grad = torch.randn(sum(6 * t.embedding_dim for t in TABLES), generator=g)
    return Rows([0, 1], [6, 6], torch.cat(ids)), grad


def _push(shard: CollectionShard, trainer: int, step: int, parts) -> None:
    """As the server does: the push, then the lookups it made answerable."""
    shard.push(trainer, step, parts)
    for fn, err in shard.ready_waiters():
        fn(err)


def _weights(shard: CollectionShard) -> list[torch.Tensor]:
    return [t.weight.clone() for t in shard.tables]


def test_sync_sgd_applies_a_step_once_every_push_is_in_and_a_late_lookup_reads_the_step_before():
    shard = _shard(OptimizerSpec(name="sgd", lr=0.1))
    w0 = _weights(shard)
    answered = []
    shard.when_ready(0, answered.append)  # a lookup of step 1 (needs step 0 complete)

    p0, p1 = _part(1), _part(2)
    _push(shard, 0, 0, [p0])
    # Trainer 1's lookup of step 0 may reach the server after trainer 0's push of step 0 (the
    # first step's lookups carry no push; a slow trainer): it must read the tables before step 0.
    rows, _ = p1
    ids, counts = rows.ids, rows.counts
    late = shard.gather(rows)
    want = torch.cat([w[i].reshape(-1) for w, i in zip(w0, ids.split(counts))])
    assert torch.equal(late, want), "a lookup of step 0 read part of step 0's update"
    assert all(torch.equal(a, b) for a, b in zip(w0, _weights(shard)))
    assert shard.complete_through == -1 and answered == [] and shard.counters.updates_applied == 0

    _push(shard, 1, 0, [p1])
    assert shard.complete_through == 0 and answered == [None] and shard.counters.updates_applied == 1
    # The same numbers as adding both pushes row by row, trainer 0's first, at the mean's scale.
    for k, (t, w) in enumerate(zip(TABLES, w0)):
        ref = w.clone()
        for part, grad in (p0, p1):
            ids, counts = part.ids, part.counts
            rows = ids.split(counts)[k]
            g = grad.split([n * s.embedding_dim for n, s in zip(counts, TABLES)])[k].view(-1, t.embedding_dim)
            ref.index_add_(0, rows, g, alpha=-0.1 * 0.5)
        assert torch.equal(shard.tables[k].weight, ref)


def test_sync_adagrad_waits_for_the_last_push_and_sums_first():
    shard = _shard(OptimizerSpec(name="adagrad", lr=0.1))
    w0 = _weights(shard)
    _push(shard, 0, 0, [_part(1)])
    assert all(torch.equal(a, b) for a, b in zip(w0, _weights(shard))), "adagrad applied half a step"
    assert shard.complete_through == -1
    _push(shard, 1, 0, [_part(2)])
    assert any(not torch.equal(a, b) for a, b in zip(w0, _weights(shard)))
    assert shard.complete_through == 0 and shard.counters.updates_applied == 1


@pytest.mark.parametrize("storage_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_16_bit_storage_is_the_float32_update_rounded_once(storage_dtype, name):
    """``storage_dtype``: half the bytes per row; the state and the arithmetic stay float32, and
    each new row is the float32 result rounded to nearest once."""
    dtype = getattr(torch, storage_dtype)
    low, full = _shard(OptimizerSpec(name=name, lr=0.1), storage_dtype), _shard(OptimizerSpec(name=name, lr=0.1))
    for a, b in zip(low.tables, full.tables):
        assert a.weight.dtype == dtype and a.weight.element_size() == 2
        assert torch.equal(a.weight, b.weight.to(dtype))  # the initial rows, rounded
        b.weight.copy_(a.weight.float())  # both start from the same values
    full.accumulates = low.accumulates  # SGD on 16-bit rows sums a step's pushes first: so here too
    for step in range(3):
        for shard in (low, full):
            _push(shard, 0, step, [_part(10 * step + 1)])
            _push(shard, 1, step, [_part(10 * step + 2)])
        for a, b in zip(low.tables, full.tables):
            assert torch.equal(a.weight, b.weight.to(dtype)), (name, step, a.name)
            assert all(torch.equal(a.optim.state[k], v.float()) or name == "sgd" for k, v in b.optim.state.items())
            b.weight.copy_(a.weight.float())  # the next step from the stored (rounded) rows
            for k, v in a.optim.state.items():
                b.optim.state[k].copy_(v)
    rows = _part(1)[0]
    assert low.gather(rows).dtype == torch.float32  # rows reach the trainers as float32
    assert low.config.bytes_on(0) == {"a": 50 * (4 * 2 + 4 * {"sgd": 0, "adagrad": 4, "rowwise_adagrad": 1,
                                                                 "adam": 9}[name]),
                                       "b": 30 * (4 * 2 + 4 * {"sgd": 0, "adagrad": 4, "rowwise_adagrad": 1,
                                                                 "adam": 9}[name])}



def _dynamic_shard(name: str, admit_after: int, *, capacity: int = 24, admit_window: int = 0,
                   staleness: int = 0) -> CollectionShard:
    from hybrid.ps.config import DynamicIds

    config = CollectionConfig(cid="ebc", tables=tuple(TABLES), layouts=tuple(shard_tables(TABLES, 1, "table_wise")),
                              optimizer=OptimizerSpec(name=name, lr=0.1), num_trainers=2, staleness=staleness,
                              gradient_scaling="mean",
                              dynamic=DynamicIds(capacity=capacity, evict="lru", partitions=4, admit_after=admit_after,
                                                 admit_window=admit_window))
    return CollectionShard(config, 0, start_step=0, huge_pages=False)


def _raw_part(seed: int) -> tuple[Rows, torch.Tensor]:
    """A trainer's push of raw ids: per table a few distinct ascending ids out of 40 (new ids
    keep coming, the parts fill up and evict)."""
    g = torch.Generator().manual_seed(seed)
    ids = [(torch.randperm(40, generator=g)[:7] * 1_000_003 - 20).sort().values for _ in TABLES]
    grad = torch.randn(sum(7 * t.embedding_dim for t in TABLES), generator=g)
    return Rows([0, 1], [7, 7], torch.cat(ids)), grad


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
@pytest.mark.parametrize("admit_after", [1, 2])
@pytest.mark.parametrize("early", [False, True])
def test_dynamic_update_reuses_its_lookups_slots_only_while_the_maps_are_unchanged(monkeypatch, name, admit_after,
                                                                                    early):
    """The update of a step takes the slots and sightings its lookups found instead of probing
    the id maps again -- and the result is the same as probing. ``early``: every lookup of step
    t + 1 is answered before the update of step t (as under staleness >= 1), so what it found is
    stale by the update and must not be used."""
    from hybrid.ps.server import dynamic

    probes = []
    real = dynamic._found
    monkeypatch.setattr(dynamic, "_found", lambda *a: probes.append(1) or real(*a))
    reuse, probe = _dynamic_shard(name, admit_after), _dynamic_shard(name, admit_after)
    steps = 8
    parts = {(t, r): _raw_part(100 * t + r) for t in range(steps + 1) for r in range(2)}
    for shard, keep in ((reuse, True), (probe, False)):
        probes.clear()
        rows = {}
        for r in range(2):  # the first step's lookups
            rows[0, r] = shard.gather(parts[0, r][0], step=0 if keep else None)
        for t in range(steps):
            if early:
                for r in (0, 1) if t % 2 else (1, 0):  # lookups in either order, pushes always 0, 1
                    rows[t + 1, r] = shard.gather(parts[t + 1, r][0], step=t + 1 if keep else None)
            _push(shard, 0, t, [parts[t, 0]])
            _push(shard, 1, t, [parts[t, 1]])
            if not early:
                for r in (0, 1) if t % 2 else (1, 0):
                    rows[t + 1, r] = shard.gather(parts[t + 1, r][0], step=t + 1 if keep else None)
        if keep:
            # Lookups probe once each; an update probes only where its lookups' slots went stale.
            assert len(probes) == 2 * (steps + 1) + (steps - 1 if early else 0)
            assert not shard.looked_up or min(shard.looked_up) > steps - 1
            got = rows
        else:
            assert len(probes) == 2 * (steps + 1) + steps
    for t, r in rows:
        assert torch.equal(got[t, r], rows[t, r]), (t, r)
    for a, b in zip(reuse.tables, probe.tables):
        da, db = a.dynamic_rows(), b.dynamic_rows()
        assert set(da) == set(db)
        for k in da:
            assert torch.equal(da[k], db[k]), (a.name, k)
        assert a.dynamic.counters == b.dynamic.counters
    assert sum(t.dynamic.counters.evicted for t in reuse.tables) > 0


@pytest.mark.parametrize("admit_after", [1, 2])
def test_a_dynamic_sgd_step_planned_from_its_lookups_equals_one_planned_when_its_pushes_come(admit_after):
    """Sync plain SGD: the update of a step whose lookups were planned ahead (admissions and each
    lookup's slots, while the trainers compute) leaves the same rows, maps and counters as the
    same steps applied without a plan -- with lookups and pushes in either trainer order, rows
    evicted, and (admit_after 2) ids that get no row yet."""
    steps = 8
    parts = {(t, r): _raw_part(100 * t + r) for t in range(steps) for r in range(2)}
    shards = {}
    for planned in (True, False):
        shard = _dynamic_shard("sgd", admit_after)
        for t in range(steps):
            order = (0, 1) if t % 2 else (1, 0)
            for r in order:
                shard.gather(parts[t, r][0], step=t)
            if planned:
                shard.plan_ahead(t)
            for r in reversed(order):
                _push(shard, r, t, [parts[t, r]])
        shards[planned] = shard
    assert shards[True].counters.plans_used == steps and shards[False].counters.plans_used == 0
    for a, b in zip(shards[True].tables, shards[False].tables):
        da, db = a.dynamic_rows(), b.dynamic_rows()
        assert set(da) == set(db) and all(torch.equal(da[k], db[k]) for k in da), a.name
        assert a.dynamic.counters == b.dynamic.counters and a.dynamic.counters.evicted > 0, a.name


@pytest.mark.parametrize("kind", ["range", "dynamic", "dynamic-admit2"])
def test_sync_sgd_adds_the_pushes_in_trainer_order_whatever_order_they_arrive_in(kind):
    """Plain SGD adds each trainer's push straight into the rows (dynamic tables: into the
    admitted ids' slots), trainer 0's first: the same bits whichever push arrives first, while
    adding them in the other order gives different bits."""
    def shard():
        if kind == "range":
            return _shard(OptimizerSpec(name="sgd", lr=0.1))
        return _dynamic_shard("sgd", 2 if kind.endswith("admit2") else 1)

    make = _part if kind == "range" else _raw_part
    steps = 6
    parts = {(t, r): make(100 * t + r) for t in range(steps) for r in range(2)}
    got = {}
    for first in (0, 1):
        s = shard()
        for t in range(steps):
            for r in (first, 1 - first):
                _push(s, r, t, [parts[t, r]])
        got[first] = s
    for a, b in zip(got[0].tables, got[1].tables):
        if a.dynamic is None:
            assert torch.equal(a.weight, b.weight), a.name
            continue
        da, db = a.dynamic_rows(), b.dynamic_rows()
        assert set(da) == set(db) and all(torch.equal(da[k], db[k]) for k in da), a.name
        assert a.dynamic.counters == b.dynamic.counters and a.dynamic.counters.admitted > 0
    if kind == "range":  # the order matters to the bits: the result is trainer 0's push first
        for k, (t, w) in enumerate(zip(TABLES, _weights(shard()))):
            refs = []
            for order in ((0, 1), (1, 0)):
                ref = w.clone()
                for step in range(steps):
                    for r in order:
                        rows, grad = parts[step, r]
                        g = grad.split([n * s.embedding_dim for n, s in zip(rows.counts, TABLES)])[k]
                        ref.index_add_(0, rows.ids.split(rows.counts)[k], g.view(-1, t.embedding_dim),
                                       alpha=-0.1 * 0.5)
                refs.append(ref)
            assert torch.equal(got[0].tables[k].weight, refs[0]) and not torch.equal(refs[0], refs[1]), t.name


@pytest.mark.parametrize("owned", [False, True])
def test_a_sync_push_kept_without_a_copy_borrows_its_tensors_until_made_its_own(owned):
    """``keeps_copy=False`` (a channel message whose answer waits for the step): the kept push
    reads the transport's memory when the step is applied; ``own_pending`` (the answer failed
    first) copies it out, so later writes to that memory change nothing."""
    ref, shard = _shard(OptimizerSpec(name="sgd", lr=0.1)), _shard(OptimizerSpec(name="sgd", lr=0.1))
    p0, p1 = _part(1), _part(2)
    _push(ref, 0, 0, [p0])
    _push(ref, 1, 0, [p1])
    frame = (Rows(p0[0].tables, p0[0].counts, p0[0].ids.clone()), p0[1].clone())  # the "channel's" memory
    shard.push(0, 0, [frame], keeps_copy=False)
    if owned:
        shard.own_pending(0, 0)
    frame[1].mul_(3.0)  # the transport reuses its memory for the next message
    _push(shard, 1, 0, [p1])
    same = all(torch.equal(a, b) for a, b in zip(_weights(ref), _weights(shard)))
    assert same == owned


def _window_shard(admit_window: int, staleness: int = 0) -> CollectionShard:
    """Plain SGD, admit_after 2, room for every id the window tests bring."""
    return _dynamic_shard("sgd", 2, capacity=1000, admit_window=admit_window, staleness=staleness)


def _ids_part(ids_a: list[int], ids_b: list[int]) -> tuple[Rows, torch.Tensor]:
    ids = [torch.tensor(sorted(ids_a), dtype=torch.int64), torch.tensor(sorted(ids_b), dtype=torch.int64)]
    return Rows([0, 1], [len(ids_a), len(ids_b)], torch.cat(ids)), torch.ones(4 * (len(ids_a) + len(ids_b)))


def _rows_of(shard: CollectionShard) -> list[set[int]]:
    return [set(t.dynamic.map.items()[0].tolist()) for t in shard.tables]


def test_admit_window_counts_sightings_within_windows_of_steps_and_forgets_them_at_each_windows_end():
    """admit_after 2, admit_window 3 (windows: steps 0-2, 3-5, ...), two trainers, sync: an id
    seen in two steps of one window gets a row; one seen in the last step of a window and the
    first of the next does not (its sighting was forgotten when every push of step 2 was in,
    not at the first trainer's); and the sightings' memory stays that of one window while
    fresh ids keep coming, where without a window it grows with every id."""
    shard = _window_shard(3)
    ids = {0: [5, 77], 1: [5], 2: [9], 3: [9, 11], 4: [11]}  # table a's ids per step (table b: id + 1000)
    for t in range(5):
        part = _ids_part(ids[t], [i + 1000 for i in ids[t]])
        _push(shard, 0, t, [part])
        if t == 2:  # one push of the window's last step is in: nothing is forgotten yet (77; 5
            assert [len(tb.dynamic.seen) for tb in shard.tables] == [1, 1]  # has a row, 9 waits for the step)
        _push(shard, 1, t, [part])
        if t == 2:
            assert [len(tb.dynamic.seen) for tb in shard.tables] == [0, 0]
    assert _rows_of(shard) == [{5, 11}, {1005, 1011}]  # 9 was seen in steps 2 and 3: two windows

    bounded, unbounded = _window_shard(4), _window_shard(0)
    most = 0
    for t in range(40):  # 3 fresh ids a step, each seen once
        part = _ids_part([3 * t, 3 * t + 1, 3 * t + 2], [10**6 + t])
        for shard in (bounded, unbounded):
            _push(shard, 0, t, [part])
            _push(shard, 1, t, [part])
        most = max(most, len(bounded.tables[0].dynamic.seen))
    # Between steps: the ids of at most the window's first three steps (its last forgets all).
    assert most == 3 * 3 and len(unbounded.tables[0].dynamic.seen) == 40 * 3
    assert not any(_rows_of(bounded)) and not any(_rows_of(unbounded))



def test_admit_window_in_async_mode_closes_once_every_trainers_pushes_through_its_last_step_are_in():
    """Staleness 1: each push is applied as it arrives, and the window (steps 0-1) closes when the
    slower trainer's push of step 1 is in -- after the faster one's push of step 2, whose
    sightings go with it."""
    shard = _window_shard(2, staleness=1)
    for t, ids in ((0, [1, 2]), (1, [3]), (2, [4])):
        _push(shard, 0, t, [_ids_part(ids, [])])
    assert len(shard.tables[0].dynamic.seen) == 4
    _push(shard, 1, 0, [_ids_part([1], [])])  # 1: a second sighting in the window: a row
    assert _rows_of(shard)[0] == {1} and len(shard.tables[0].dynamic.seen) == 3
    _push(shard, 1, 1, [_ids_part([5], [])])
    assert len(shard.tables[0].dynamic.seen) == 0 and shard.complete_through == 1
    _push(shard, 1, 2, [_ids_part([4], [])])  # 4's sighting of step 2 was forgotten: one now
    assert _rows_of(shard)[0] == {1} and len(shard.tables[0].dynamic.seen) == 1


def test_rows_served_counts_training_lookups_not_evaluation_reads():
    """What a run's summary prints per step (the unique ratio rows_served / ids_requested, bytes
    out) covers training lookups only: an evaluation read (``update=False``) counts nothing."""
    shard = _shard(OptimizerSpec(name="sgd", lr=0.1))
    rows, _ = _part(0)
    shard.gather(rows, step=0)
    sent = shard.counters.bytes_out
    assert shard.counters.rows_served == 12 and sent > 0
    shard.gather(rows, update=False)
    assert shard.counters.rows_served == 12 and shard.counters.bytes_out == sent
