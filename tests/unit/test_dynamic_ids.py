"""Dynamic tables (``ids: dynamic``): the native id map against its plain-torch twin, and the
admission / eviction of :class:`hybrid.ps.server.dynamic.DynamicSlots` against a plain-Python
model of the documented rules (docs/dynamic_ids.md)."""

import pytest
import torch

from hybrid.errors import PlanError
from hybrid import ops
from hybrid.ops import reference
from hybrid.ops.id_map import NATIVE, HashIdMap, find_many, id_hash, update_many
from hybrid.ps.config import DynamicIds
from hybrid.ps.server import dynamic
from hybrid.ps.server.dynamic import CapacityError, DynamicSlots, commit_updates, part_of, plan_updates

native = pytest.mark.skipif(not NATIVE, reason="hybrid._C not built")


@native
def test_id_map_matches_reference_through_inserts_erases_and_growth():
    g = torch.Generator().manual_seed(0)
    m, r = HashIdMap(4), reference.IdMap()
    pool = torch.cat([torch.randint(-2**63, 2**63 - 1, (3000,), generator=g), torch.arange(-5, 5)]).unique()
    for k in range(20):
        pick = pool[torch.randperm(pool.numel(), generator=g)[:400]].unique()
        if k % 3 == 2:
            m.erase(pick)
            r.erase(pick)
        else:
            slots = torch.randint(0, 10**6, (pick.numel(),), generator=g)
            m.insert(pick, slots)
            r.insert(pick, slots)
        assert len(m) == len(r)
        assert torch.equal(m.find(pool), r.find(pool))
        assert all(torch.equal(a, b) for a, b in zip(m.items(), r.items()))
    assert len(m) > 100 and m.keys.numel() >= 2 * len(m)


@native
def test_id_maps_find_equals_the_reference_over_several_maps():
    """torch.ops.hybrid.id_maps_find (every map probed in one call) against the plain-torch
    linear probing of reference.id_maps_find, and against each map's own find, with erases
    (backward shifts) in between, ids absent and present, and an empty run."""
    g = torch.Generator().manual_seed(3)
    maps = [HashIdMap(8), HashIdMap(300), HashIdMap(16)]
    pool = torch.cat([torch.randint(-2**63, 2**63 - 1, (2000,), generator=g), torch.arange(-4, 4)]).unique()
    for k, m in enumerate(maps):
        pick = pool[torch.randperm(pool.numel(), generator=g)[:500 + 100 * k]].unique()
        m.insert(pick, torch.randint(0, 10**6, (pick.numel(),), generator=g))
        m.erase(pick[::3])
    runs = [pool[torch.randperm(pool.numel(), generator=g)[:n]] for n in (700, 0, 900)]
    ids, counts = torch.cat(runs), [r.numel() for r in runs]
    got = torch.ops.hybrid.id_maps_find([m.keys for m in maps], [m.slots for m in maps], ids, counts)
    want = reference.id_maps_find([m.keys for m in maps], [m.slots for m in maps], ids, counts)
    assert torch.equal(got, want)
    assert torch.equal(got, torch.cat([m.find(r) for m, r in zip(maps, runs)]))
    assert torch.equal(find_many(maps, ids, counts), got)
    assert bool((got >= 0).any()) and bool((got < 0).any())
    with pytest.raises(ValueError, match="counts sum to"):
        torch.ops.hybrid.id_maps_find([m.keys for m in maps], [m.slots for m in maps], ids, [1, 2, 3])
    with pytest.raises(TypeError, match="int64"):
        torch.ops.hybrid.id_maps_find([m.keys.int() for m in maps], [m.slots for m in maps], ids, counts)


@pytest.mark.parametrize("kind", ["native", "reference"])
def test_update_many_erases_then_inserts_in_every_map_as_each_map_alone(kind):
    """update_many (one native call for several maps: erases, then inserts, growing a map that
    needs it) leaves every map as its own erase and insert calls do, and counts a version per
    change; the reference maps take the same calls."""
    if kind == "native" and not NATIVE:
        pytest.skip("hybrid._C not built")
    make = HashIdMap if kind == "native" else (lambda n: reference.IdMap(n))
    g = torch.Generator().manual_seed(4)
    pool = torch.cat([torch.randint(-2**63, 2**63 - 1, (3000,), generator=g), torch.arange(-4, 4)]).unique()
    maps, alone = [make(8), make(300), make(16)], [make(8), make(300), make(16)]
    for m, a in zip(maps, alone):
        first = pool[torch.randperm(pool.numel(), generator=g)[:200]].unique()
        vals = torch.randint(0, 10**6, (first.numel(),), generator=g)
        m.insert(first, vals)
        a.insert(first, vals)
    for rnd in range(4):
        erase = [pool[torch.randperm(pool.numel(), generator=g)[:n]].unique() for n in (150, 0, 90)]
        insert = [pool[torch.randperm(pool.numel(), generator=g)[:n]].unique() for n in (80, 400, 0)]
        values = [torch.randint(0, 10**6, (i.numel(),), generator=g) for i in insert]
        versions = [m.version for m in maps]
        update_many(maps, torch.cat(erase), [e.numel() for e in erase], torch.cat(insert), torch.cat(values),
                    [i.numel() for i in insert])
        for m, a, e, i, v, before in zip(maps, alone, erase, insert, values, versions):
            if e.numel():
                a.erase(e)
            if i.numel():
                a.insert(i, v)
            assert len(m) == len(a) and torch.equal(m.find(pool), a.find(pool))
            assert (m.version > before) == bool(e.numel() or i.numel())
    assert len(maps[1]) > 300  # it grew
    if kind == "native":
        with pytest.raises(ValueError, match="erase_counts sum to"):
            update_many(maps, torch.tensor([1, 2]), [1, 0, 0], torch.empty(0), torch.empty(0), [0, 0, 0])
        with pytest.raises(ValueError, match="slot values must be >= 0"):
            update_many(maps, torch.empty(0), [0, 0, 0], torch.tensor([5]), torch.tensor([-1]), [1, 0, 0])


def test_id_map_version_grows_with_every_change():
    for m in (HashIdMap(4), reference.IdMap()) if NATIVE else (reference.IdMap(),):
        v = m.version
        m.insert(torch.tensor([5, 7]), torch.tensor([0, 1]))
        assert m.version > v
        v = m.version
        m.find(torch.tensor([5]))
        assert m.version == v
        m.erase(torch.tensor([5]))
        assert m.version > v


@native
def test_id_map_finds_a_million_ids_natively():
    ids = torch.randint(-2**62, 2**62, (1 << 20,)).unique()
    m = HashIdMap()
    m.insert(ids, torch.arange(ids.numel()))
    assert torch.equal(m.find(ids), torch.arange(ids.numel()))
    assert bool((m.find(ids + 1) >= -1).all())


@native
def test_id_hash_is_fmix64_and_matches_reference():
    ids = torch.tensor([0, 1, -1, 2**62, -(2**63)], dtype=torch.int64)
    assert torch.equal(id_hash(ids), reference.id_hash(ids))
    # MurmurHash3 fmix64(1), as unsigned 0xB456BCFC34C2CB2C.
    assert int(id_hash(torch.tensor([1]))[0]) & ((1 << 64) - 1) == 0xB456BCFC34C2CB2C


class RefSlots:
    """The rules of docs/dynamic_ids.md, one id at a time, in plain Python."""

    def __init__(self, spec: DynamicIds, parts: list[int]):
        self.spec = spec
        self.slots = {p: [None] * spec.part_capacity(p) for p in parts}  # [id, last] or None
        self.seen: dict[int, int] = {}
        self.admitted = self.evicted = 0

    def where(self):
        return {e[0]: (p, i, e[1]) for p, sl in self.slots.items() for i, e in enumerate(sl) if e}

    def step(self, ids: list[int], t: int):
        spec, where = self.spec, self.where()
        for i in ids:
            if i in where:
                p, k, _ = where[i]
                self.slots[p][k][1] = t
        if spec.ttl is not None:
            for sl in self.slots.values():
                for k, e in enumerate(sl):
                    if e and e[1] < t - spec.ttl:
                        sl[k] = None
                        self.evicted += 1
        new = []
        for i in ids:
            if i in where:
                continue
            self.seen[i] = self.seen.get(i, 0) + 1
            if self.seen[i] >= spec.admit_after:
                del self.seen[i]
                new.append(i)
        parts = part_of(torch.tensor(new, dtype=torch.int64), spec.partitions).tolist()
        for p, i in sorted(zip(parts, new)):
            sl = self.slots[p]
            free = [k for k, e in enumerate(sl) if e is None]
            if free:
                k = free[0]
            else:
                old = [(e[1], e[0], k) for k, e in enumerate(sl) if e[1] < t] if spec.evict == "lru" else []
                if not old:
                    raise CapacityError("full")
                k = min(old)[2]
                self.evicted += 1
            sl[k] = [i, t]
            self.admitted += 1


def _state(d: DynamicSlots):
    s = d.state()
    return {int(i): (int(p), int(k), int(la)) for i, p, k, la in zip(s["ids"], s["part"], s["index"], s["last"])}


@pytest.mark.parametrize("evict,admit_after", [("lru", 1), ("lru", 2), ("ttl:1", 1), ("none", 1)])
@pytest.mark.parametrize("parts", [[0, 1, 2, 3], [1, 3]])
def test_admission_and_eviction_follow_the_rules(evict, admit_after, parts):
    spec = DynamicIds(capacity=22, admit_after=admit_after, evict=evict, partitions=4)
    dyn, ref = DynamicSlots(spec, parts, table="t", where="test"), RefSlots(spec, parts)
    g = torch.Generator().manual_seed(1)
    held = torch.tensor(parts)
    failed = 0
    for t in range(30):
        ids = torch.randint(-40, 40, (5,), generator=g) * 1_000_003 + 2**40
        ids = ids[torch.isin(part_of(ids, 4), held)].unique()
        before = _state(dyn)
        try:
            ref.step(ids.tolist(), t)
        except CapacityError:
            with pytest.raises(CapacityError, match="dynamic table 't' is full.*nothing was changed"):
                dyn.plan(ids, t)
            assert _state(dyn) == before
            failed += 1
            break
        a = dyn.plan(ids, t)
        dyn.commit(a)
        assert _state(dyn) == {i: (p, k, la) for i, (p, k, la) in ref.where().items()}, t
        assert (dyn.counters.admitted, dyn.counters.evicted) == (ref.admitted, ref.evicted)
        # Every id of the step that has a row reads it; the others are dropped.
        assert torch.equal(a.slots >= 0, torch.tensor([i in ref.where() for i in ids.tolist()]))
    if evict == "none":
        assert failed == 1
    else:
        assert dyn.counters.evicted > 0 and dyn.rows <= dyn.capacity


def test_admit_after_reads_zeros_until_admitted():
    spec = DynamicIds(capacity=8, admit_after=3, evict="lru", partitions=1)
    dyn = DynamicSlots(spec, [0], table="t", where="test")
    ids = torch.tensor([5, 7])
    for t, expect_fresh in enumerate([False, False, True]):
        slots, fresh = dyn.find(ids)
        assert bool((slots < 0).all()) and bool((fresh == expect_fresh).all())
        dyn.commit(dyn.plan(ids, t))
    assert dyn.rows == 2 and dyn.counters.admitted == 2
    assert bool((dyn.find(ids)[0] >= 0).all())


def test_plan_options_are_checked():
    with pytest.raises(PlanError, match="evict"):
        DynamicIds(capacity=10, evict="sometimes")
    with pytest.raises(PlanError, match="capacity"):
        DynamicIds(capacity=0)
    assert DynamicIds(capacity=10, evict="ttl:5").ttl == 5
    assert DynamicIds(capacity=1000).partitions == 64
    with pytest.raises(PlanError, match="admit_after: 1"):
        DynamicIds(capacity=10, admit_window=5)
    for bad in (-1, 2.5, True, "10"):
        with pytest.raises(PlanError, match="a number of steps >= 0"):
            DynamicIds(capacity=10, admit_after=2, admit_window=bad)
    assert DynamicIds(capacity=10, admit_after=2, admit_window=7).admit_window == 7


@pytest.mark.parametrize("kind", ["native", "reference"])
def test_a_cleared_id_map_is_empty_takes_new_ids_and_counts_a_version(kind):
    if kind == "native" and not NATIVE:
        pytest.skip("hybrid._C not built")
    m = HashIdMap(4) if kind == "native" else reference.IdMap()
    ids = torch.arange(0, 3000, 7, dtype=torch.int64) * 1_000_003
    m.insert(ids, torch.arange(ids.numel()))
    v = m.version
    m.clear()
    assert len(m) == 0 and m.version > v
    assert bool((m.find(ids) == -1).all()) and m.items()[0].numel() == 0
    if kind == "native":
        assert m.keys.numel() == 16  # the grown table's memory went
    m.insert(ids[:5], torch.arange(5))
    assert torch.equal(m.find(ids[:6]), torch.tensor([0, 1, 2, 3, 4, -1]))


_FIELDS = ("slots", "new_ids", "new_slots", "evicted", "seen_ids", "seen_counts", "admitted_seen")
_STATE = ("slot_id", "occupied", "last", "count", "fill")


def _queues_in_order(d: DynamicSlots) -> int:
    """Checks every eviction queue a part has: its live entries are the part's rows by (last
    step, id). Returns how many parts have one."""
    have = 0
    for p in range(d.spec.partitions):
        if int(d.lru_head[p]) < 0:
            continue
        have += 1
        k = torch.arange(int(d.lru_head[p]), int(d.lru_tail[p]))
        j = d.lru_queue[k].long()
        live = j[d.lru_pos[j].long() == k]
        rows = (d.occupied & (d.slot_part == p)).nonzero().squeeze(1)
        rows = rows[torch.argsort(d.slot_id[rows], stable=True)]
        rows = rows[torch.argsort(d.last[rows], stable=True)]
        assert torch.equal(live, rows), (p, live, rows)
    return have


def _plan_and_commit(tables, ids, t, monkeypatch, *, twin=None, **commit):
    """One step of ``tables`` (with ``twin``'s plain-torch operators where given): every
    table's admission fields, or the CapacityError's message."""
    with monkeypatch.context() as m:
        if twin is not None:
            m.setattr(dynamic.ops, "dynamic_plan", twin.dynamic_plan)
            m.setattr(dynamic.ops, "dynamic_commit_", twin.dynamic_commit_)
        try:
            adm = plan_updates(tables, ids, t)
        except CapacityError as e:
            return str(e)
        commit_updates(tables, adm, **commit)
        return [[getattr(a, f) for f in _FIELDS] for a in adm]


def _same_outcome(native, plain, t) -> None:
    assert type(native) is type(plain), (t, native, plain)
    if isinstance(native, str):
        assert native == plain
    else:
        for a, b in zip(native, plain):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (t, a, b)


@pytest.mark.skipif(not ops.AVAILABLE, reason="hybrid._C not built")
@pytest.mark.parametrize("evict,admit_after", [("lru", 1), ("lru", 2), ("ttl:2", 1), ("ttl:1", 2), ("none", 1)])
def test_plan_and_commit_of_several_tables_equal_the_reference(evict, admit_after, monkeypatch):
    """ops.dynamic_plan / dynamic_commit_ (every table in one call) against their plain-torch
    twins: the same admissions, evictions, sightings and slot state step after step, and the
    same CapacityError (first table, then part) with nothing changed."""
    spec = DynamicIds(capacity=40, admit_after=admit_after, evict=evict, partitions=4)
    parts = [[0, 1, 2, 3], [1, 3], [0, 2, 3]]

    def build():
        return [DynamicSlots(spec, p, table=f"t{k}", where="test") for k, p in enumerate(parts)]

    native, plain = build(), build()
    rows = {id(d): torch.zeros(d.capacity, 3, dtype=torch.bfloat16) for d in native + plain}
    keys, bounds = [5, 6, 2**32 - 1], [0.5, 0.25, 1 / 3]
    g = torch.Generator().manual_seed(3)
    failed = 0
    for t in range(40):
        ids = []
        for p in parts:
            i = torch.randint(-30, 30, (int(torch.randint(0, 14, (1,), generator=g)),), generator=g) * 7919 + 2**41
            ids.append(i[torch.isin(part_of(i, 4), torch.tensor(p))].unique())
        outcome = [_plan_and_commit(tables, ids, t, monkeypatch, twin=twin, weights=[rows[id(d)] for d in tables],
                                    keys=keys, bounds=bounds)
                   for tables, twin in ((native, None), (plain, reference))]
        failed += isinstance(outcome[0], str)
        _same_outcome(*outcome, t)
        for a, b in zip(native, plain):
            assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in _STATE), t
            _queues_in_order(a)
            assert torch.equal(rows[id(a)], rows[id(b)])
            assert all(torch.equal(x, y) for x, y in zip(a.map.items(), b.map.items()))
            assert all(torch.equal(x, y) for x, y in zip(a.seen.items(), b.seen.items()))
            assert (a.counters.admitted, a.counters.evicted) == (b.counters.admitted, b.counters.evicted)
    assert failed > 0 if evict == "none" else sum(d.counters.evicted for d in native) > 0


@pytest.mark.skipif(not ops.AVAILABLE, reason="hybrid._C not built")
@pytest.mark.parametrize("evict", ["lru", "ttl:3"])
def test_eviction_lists_choose_as_the_reference_sorts_through_churn_and_a_restore(evict, monkeypatch):
    """The native plan walks each part's eviction queue instead of sorting its slots: over a long
    stream of mostly new ids (every part full, rows evicted or expired every step, holes left by
    expiry), the same admissions and evictions as the plain-torch twin, which sorts every step,
    and every queue in (last step, id) order -- also after the state goes through a checkpoint
    halfway (restore drops the queues; the plan sorts them again)."""
    spec = DynamicIds(capacity=96, evict=evict, partitions=6)
    held = [0, 2, 3, 5]

    def build():
        return DynamicSlots(spec, held, table="t", where="test")

    native, plain = build(), build()
    g = torch.Generator().manual_seed(11)
    evicted, holes, queued = 0, False, 0
    for t in range(120):
        pool = torch.randint(0, 400, (40,), generator=g) * 104729 - 2**40  # a few recur, most are new
        ids = pool[torch.isin(part_of(pool, spec.partitions), torch.tensor(held))].unique()
        outcome = [_plan_and_commit([table], [ids], t, monkeypatch, twin=twin)
                   for table, twin in ((native, None), (plain, reference))]
        _same_outcome(*outcome, t)
        if not isinstance(outcome[0], str):
            evicted += outcome[0][0][3].numel()
        # A checkpoint keeps the rows, not what free slots held before or how far a part was ever
        # filled: from the restore on, those may differ (free places are taken lowest first either way).
        state = [f for f in _STATE if t <= 60 or f not in ("fill", "slot_id")]
        assert all(torch.equal(getattr(native, f), getattr(plain, f)) for f in state), t
        assert torch.equal(native.slot_id[native.occupied], plain.slot_id[plain.occupied]), t
        holes |= bool((plain.count < plain.fill).any())
        queued = max(queued, _queues_in_order(native))
        if t == 60:  # through a checkpoint: the saved rows put back into a fresh table
            st = native.state()
            native = build()
            native.restore(st["ids"], st["slots"], st["last"])
            native.counters = plain.counters
            assert all(torch.equal(getattr(native, f), getattr(plain, f)) for f in _STATE if f not in ("fill", "slot_id"))
    assert evicted > 100 and queued == len(held)  # every part has had to evict or expire
    if evict == "lru":
        assert int(plain.count.sum()) == plain.capacity  # every part full: each new id evicts a row
    else:
        assert holes  # expired rows leave free places below fill, taken lowest first


def _one_dynamic_table(kind, monkeypatch, *, dim, optimizer, **options):
    """A one-table collection of dynamic ids on one shard in this process, reading rows with the
    native ``dynamic_rows`` or its twin (``kind``); returns the shard and a function that routes
    a list of ids of feature ``f`` into the shard's request."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from hybrid.ops import reference
    from hybrid.ps.client.collection import RemoteEmbeddingBagCollection
    from hybrid.ps.client.routing import Router
    from hybrid.ps.server.shard import CollectionShard

    if kind == "native" and not ops.AVAILABLE:
        pytest.skip("hybrid._C not built")
    if kind == "reference":
        monkeypatch.setattr(dynamic.ops, "dynamic_rows", reference.dynamic_rows)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=100,
                                                            feature_names=["f"])], device=torch.device("meta"))
    config = RemoteEmbeddingBagCollection.config_from(ebc, cid="c", num_servers=1, optimizer={"name": optimizer, "lr": 0.1},
                                                      num_trainers=1, dynamic=DynamicIds(capacity=16, partitions=2),
                                                      **options)
    router = Router(config)

    def request(ids):
        return router.route(KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=torch.tensor(ids), lengths=torch.tensor([len(ids)])), where="test").requests[0]

    return CollectionShard(config, 0, start_step=0, huge_pages=False), request


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["native", "reference"])
def test_the_lookup_that_admits_an_id_reads_the_row_its_update_creates(storage, kind, monkeypatch):
    """With ``storage_dtype`` 16-bit, a new row holds its initial value rounded into the table's
    dtype; the lookup of the step that admits the id reads that value, not the float32 one, and
    so does every later lookup (a zero gradient leaves the row as it is)."""
    shard, route = _one_dynamic_table(kind, monkeypatch, dim=5, optimizer="adam", storage_dtype=storage)
    request = route([5, -7, 1 << 62])
    first = shard.gather(request, step=0).clone()
    shard.push(0, 0, [(request, torch.zeros_like(first))])
    assert torch.equal(first, shard.gather(request, step=1))
    table = shard.tables[0]
    slots, _ = table.dynamic.find(request.ids)
    assert table.weight.dtype == getattr(torch, storage)
    assert torch.equal(first.view(3, 5), table.weight.index_select(0, slots).float())


@pytest.mark.parametrize("evict", ["lru", "none", "ttl:3"])
def test_a_full_table_names_the_fix_for_its_evict_policy(evict):
    """A full part's error, as a trainer reports it, advises ``evict: lru`` only to a table
    that does not evict by it already (under lru a part is full when every row of it was
    touched in the step)."""
    from hybrid.ps.client.pipeline import TableFullError, _server_error

    dyn = DynamicSlots(DynamicIds(capacity=2, evict=evict, partitions=1), [0], table="t", where="ebc on ps0")
    dyn.commit(dyn.plan(torch.tensor([1, 2]), 0))
    with pytest.raises(CapacityError) as raised:
        dyn.plan(torch.tensor([1, 2, 3]), 0 if evict == "lru" else 1)
    err = _server_error("gradient push", "ps0", RuntimeError(f"ps0: {raised.value}\nTraceback ..."))
    assert isinstance(err, TableFullError)
    assert str(err).startswith("gradient push on parameter server ps0: ebc on ps0: dynamic table 't' is full")
    assert str(err).endswith("nothing was changed. Raise the plan's capacity" +
                             ("" if evict == "lru" else " or set evict: lru")), str(err)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("admit_after", [1, 2])
def test_a_trainer_with_no_ids_for_a_server_takes_part_in_the_step(optimizer, admit_after):
    """Sync, two trainers: in some steps one trainer's batch (or both) has no id on the server's
    tables, and its lookup and push hold none. The step applies, and the tables equal one
    trainer's given both batches together (gradients summed, so the sums are exact)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from hybrid.ps.client.collection import RemoteEmbeddingBagCollection
    from hybrid.ps.client.routing import Router
    from hybrid.ps.server.shard import CollectionShard

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t{k}", embedding_dim=4, num_embeddings=100,
                                                            feature_names=[f"f{k}"]) for k in range(2)],
                                 device=torch.device("meta"))
    spec = DynamicIds(capacity=32, partitions=2, admit_after=admit_after, evict="lru")

    def shard_of(trainers):
        config = RemoteEmbeddingBagCollection.config_from(
            ebc, cid="c", num_servers=1, optimizer={"name": optimizer, "lr": 0.5}, num_trainers=trainers,
            dynamic=spec, gradient_scaling="sum")
        return Router(config), CollectionShard(config, 0, start_step=0, huge_pages=False)

    def kjt(f0, f1):
        return KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.tensor(f0 + f1, dtype=torch.long),
                                                   lengths=torch.tensor([len(f0), len(f1)]))

    steps = [(([1, 2], [3]), ([], [])), (([], []), ([], [])), (([1], []), ([], [5, 1])), (([], []), ([9, 2], [3])),
             (([4, 5, 6], [7]), ([8, 10], [11, 12, 13]))]
    router, two = shard_of(2)
    ref_router, one = shard_of(1)
    for s, batches in enumerate(steps):
        looked = []
        for trainer, (f0, f1) in enumerate(batches):
            request = router.route(kjt(f0, f1), where="test").requests[0]
            looked.append((request, two.gather(request, step=s)))
        two.plan_ahead(s)
        for trainer, (request, rows) in enumerate(looked):
            two.push(trainer, s, [(request, torch.ones_like(rows))])
        routed = ref_router.route(kjt(*(a + b for a, b in zip(*batches))), where="test")
        rows = one.gather(routed.requests[0], step=s).clone().requires_grad_(True)
        ref_router.pool(routed, {0: rows}).sum().backward()
        one.push(0, s, [(routed.requests[0], rows.grad)])
    assert two.complete_through == len(steps) - 1
    for a, b in zip(two.tables, one.tables):
        got, want = a.dynamic_rows(), b.dynamic_rows()
        assert got["ids"].numel() > 0
        for k in ("ids", "part", "index", "last", "seen_ids", "seen_counts", "rows"):
            assert torch.equal(got[k], want[k]), (a.name, k, got[k], want[k])


def test_compose_takes_a_dynamic_table_s_rows_from_the_servers_whatever_the_module_holds():
    """``init_tables``: a dynamic table's rows are made when ids are admitted, from (seed,
    table, id), so a module's numbered rows are never copied: ``auto`` gives ``server`` even for
    real weights, ``module`` is refused naming the fix; range tables keep ``auto``'s choice."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from hybrid.compose import _table_source

    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=50, feature_names=["f"])]
    real, meta = (EmbeddingBagCollection(tables=tables, device=torch.device(d)) for d in ("cpu", "meta"))
    assert _table_source(real, "ebc", "auto", dynamic=True) == "server"
    assert _table_source(meta, "ebc", "auto", dynamic=True) == "server"
    assert _table_source(real, "ebc", "server", dynamic=True) == "server"
    with pytest.raises(ValueError, match="ebc: ids: dynamic tables have no numbered rows to copy.*init_tables='server'"):
        _table_source(real, "ebc", "module", dynamic=True)
    assert _table_source(real, "ebc", "auto") == "module" and _table_source(meta, "ebc", "auto") == "server"


@pytest.mark.parametrize("kind", ["native", "reference"])
def test_a_lookup_outside_training_reads_zeros_for_ids_without_a_row(kind, monkeypatch):
    """Evaluation reads (``update=False``: no update follows them) give an id without a row
    zeros -- what a model exported from the table holds for it -- even where a training lookup
    would read the initial value its update is about to write (admit_after 1), and they leave
    the hit counters alone; ids with a row read it either way."""
    shard, request = _one_dynamic_table(kind, monkeypatch, dim=4, optimizer="sgd")
    table = shard.tables[0].dynamic
    old, new = request([3, 9]), request([3, 9, 11])  # 11 never seen
    assert shard.gather(new, update=False).abs().sum() == 0 and table.counters.looked_up == 0  # nothing has a row yet
    rows = shard.gather(old, step=0)
    assert rows.abs().sum() > 0 and table.counters.looked_up == 2  # the step admits 3 and 9: initial values
    shard.push(0, 0, [(old, torch.ones_like(rows))])
    trained = shard.gather(old, update=False).view(2, 4)
    got = shard.gather(new, update=False).view(3, 4)
    assert torch.equal(got[:2], trained) and torch.equal(got[2], torch.zeros(4))
    assert table.counters.looked_up == 2 and table.counters.hits == 0
    assert shard.gather(new, step=1).view(3, 4)[2].abs().sum() > 0  # a training lookup: 11's initial value
