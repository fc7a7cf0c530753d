"""The sparse path's operators (:mod:`hybrid.ops`): every native operator against its plain-torch
twin in :mod:`hybrid.ops.reference` on random inputs, bit for bit (row dtypes, empty inputs,
repeated ids, mean and sum pooling, per-sample weights, several servers and shards); the
refusals -- a row outside its table or a non-finite gradient raises the reference's exception
and writes nothing, a wrong dtype or shape raises naming the argument -- and the fallback to the
reference when the extension does not load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from hybrid import ops
from hybrid.ops import reference as ref

REQUIRE_NATIVE = os.environ.get("HYBRID_REQUIRE_NATIVE") == "1"
native = pytest.mark.skipif(not ops.AVAILABLE, reason="hybrid._C is not built (make env builds it); "
                                                      "the operators are the reference itself")
ROW_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]


def test_the_extension_is_built():
    if not ops.AVAILABLE:
        (pytest.fail if REQUIRE_NATIVE else pytest.skip)("hybrid._C is not built")
    assert torch.ops.hybrid.isa() in ("avx2+fma", "baseline")


# -- plain torch written out (the public API, whichever implementation runs) ----------------------

def _tables(g: torch.Generator, dtype=torch.float32) -> list[torch.Tensor]:
    return [torch.randn(30, 4, generator=g).to(dtype), torch.randn(11, 3, generator=g).to(dtype)]


def _ids(g: torch.Generator, distinct: bool) -> tuple[torch.Tensor, list[int]]:
    if distinct:
        a, b = torch.randperm(30, generator=g)[:9].sort().values, torch.randperm(11, generator=g)[:5].sort().values
    else:
        a, b = torch.randint(0, 30, (9,), generator=g), torch.randint(0, 11, (5,), generator=g)
    return torch.cat([a, b]), [9, 5]


def test_gather_rows_reads_each_table_s_rows_in_order():
    g = torch.Generator().manual_seed(0)
    tables = _tables(g)
    ids, counts = _ids(g, distinct=False)
    got = ops.gather_rows(tables, ids, counts)
    want = torch.cat([t.index_select(0, i).reshape(-1) for t, i in zip(tables, ids.split(counts))])
    assert torch.equal(got, want)
    out = torch.full((200,), -1.0)
    ops.gather_rows(tables, ids, counts, out=out)  # into a given buffer (a transport's memory)
    assert torch.equal(out[: want.numel()], want) and bool((out[want.numel():] == -1).all())
    assert ops.gather_rows(tables, ids[:0], [0, 0]).numel() == 0


@pytest.mark.parametrize("distinct", [True, False])
def test_sgd_rows_adds_like_index_add_bit_for_bit(distinct):
    g = torch.Generator().manual_seed(1)
    tables = _tables(g)
    ids, counts = _ids(g, distinct)
    grad = torch.randn(9 * 4 + 5 * 3, generator=g)
    want = [t.clone() for t in tables]
    ops.sgd_rows_(tables, ids, counts, grad, alpha=-0.05)
    for w, i, gr, d in zip(want, ids.split(counts), grad.split([36, 15]), (4, 3)):
        w.index_add_(0, i, gr.view(-1, d), alpha=-0.05)
    assert all(torch.equal(a, b) for a, b in zip(tables, want))


def test_sum_rows_sums_repeats_and_scales():
    g = torch.Generator().manual_seed(2)
    ids = torch.tensor([5, 1, 5, 5, 0, 1])
    grads = torch.randn(6, 4, generator=g)
    rows, summed = ops.sum_rows(ids, grads, scale=0.5, num_rows=8)
    assert rows.tolist() == [0, 1, 5]
    want = torch.zeros(8, 4).index_add_(0, ids, grads)[rows] * 0.5
    assert torch.equal(summed, want)


def test_scatter_rows_writes_rows_back():
    dst = torch.zeros(6, 2)
    ops.scatter_rows_(dst, torch.tensor([4, 1]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert dst[4].tolist() == [1.0, 2.0] and dst[1].tolist() == [3.0, 4.0] and dst.sum() == 10


def test_a_row_outside_its_table_is_named_and_nothing_is_written():
    g = torch.Generator().manual_seed(3)
    tables = _tables(g)
    before = [t.clone() for t in tables]
    ids, counts = torch.tensor([1, 2, 3, 0, 11]), [3, 2]  # table 1 has 11 rows
    with pytest.raises(ops.RowOutOfRange) as caught:
        ops.sgd_rows_(tables, ids, counts, torch.ones(3 * 4 + 2 * 3), alpha=-1.0)
    e = caught.value
    assert (e.table, e.position, e.row, e.rows) == (1, 4, 11, 11)
    with pytest.raises(ops.RowOutOfRange):
        ops.gather_rows(tables, torch.tensor([-1]), [1, 0])
    assert all(torch.equal(a, b) for a, b in zip(tables, before))


def test_a_non_finite_gradient_or_update_raises_and_writes_nothing():
    g = torch.Generator().manual_seed(4)
    tables = _tables(g)
    before = [t.clone() for t in tables]
    grad = torch.ones(2 * 4)
    grad[5] = float("nan")
    with pytest.raises(ops.NonFinite):
        ops.sgd_rows_(tables, torch.tensor([1, 2]), [2, 0], grad, alpha=-1.0)
    assert all(torch.equal(a, b) for a, b in zip(tables, before))
    weight = torch.zeros(5, 3)
    state = {"sum": torch.zeros(5, 3)}
    with pytest.raises(ops.NonFinite):
        ops.optimizer_rows("adagrad", torch.tensor([1]), torch.tensor([[1.0, float("inf"), 0.0]]), grad_scale=1.0,
                           weight=weight, state=state, lr=0.1, eps=1e-8, weight_decay=0.0, beta1=0.9, beta2=0.999)
    assert torch.equal(weight, torch.zeros(5, 3)) and torch.equal(state["sum"], torch.zeros(5, 3))


# -- native against the reference ------------------------------------------------------------------

def _equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _layout(g: torch.Generator, *, num_servers: int, ntab: int, nf: int):
    """A random collection: tables of 1-40 rows (the last of three or more: none), 1-3 shards
    each on random servers, features mapped to tables (every table has at least one)."""
    rows = torch.randint(1, 41, (ntab,), generator=g)
    if ntab >= 3:
        rows[-1] = 0
    row_base = torch.cat([rows.new_zeros(1), rows.cumsum(0)])
    shards = torch.randint(1, 4, (ntab,), generator=g)
    width = int(shards.max())
    server_rank = torch.full((ntab, width), -1, dtype=torch.int64)
    for t in range(ntab):
        server_rank[t, : int(shards[t])] = torch.randint(0, num_servers, (int(shards[t]),), generator=g)
    feature_table = torch.cat([torch.arange(ntab), torch.randint(0, ntab, (nf - ntab,), generator=g)])
    return rows, row_base, shards, server_rank, feature_table


def _batch(g: torch.Generator, rows: torch.Tensor, feature_table: torch.Tensor, b: int, max_len: int):
    """Feature-major bags of random length (some empty; all of a table without rows), ids with
    many repeats."""
    bag_rows = rows.index_select(0, feature_table).repeat_interleave(b)
    lengths = torch.randint(0, max_len + 1, (feature_table.numel() * b,), generator=g) * (bag_rows > 0)
    per_id_rows = torch.repeat_interleave(bag_rows, lengths)
    return (torch.rand(per_id_rows.shape, generator=g) * per_id_rows).long(), lengths


def _route_both(*args, **kw) -> tuple[ops.Route, ops.Route]:
    return ops.route(*args, **kw), ref.route(*args, **kw)


@native
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pooling", ["sum", "mean", "weighted"])
@pytest.mark.parametrize("sample_major", [True, False])
def test_route_equals_the_reference(seed, pooling, sample_major):
    g = torch.Generator().manual_seed(seed)
    num_servers, ntab = 1 + seed % 3, 1 + seed % 4
    nf = ntab + seed % 3
    rows, row_base, shards, server_rank, feature_table = _layout(g, num_servers=num_servers, ntab=ntab, nf=nf)
    b = 1 + seed * 3
    ids, lengths = _batch(g, rows, feature_table, b, max_len=1 + seed)
    weights = torch.rand(ids.shape, generator=g) if pooling == "weighted" else None
    got, want = _route_both(ids, lengths, feature_table, row_base, shards, server_rank, num_servers=num_servers,
                            batch_size=b, weights=weights, mean=pooling == "mean", sample_major=sample_major)
    assert got.num_unique == want.num_unique == got.requests_ids.numel()
    for field in ("requests_ids", "per", "raw", "idx", "offsets", "weights", "grad_bags", "grad_offsets",
                  "grad_scale"):
        assert _equal(getattr(got, field), getattr(want, field)), field
    # Without the backward's index (bags the servers pool): the same route, no grad_* at all.
    for impl in (ops, ref):
        lean = impl.route(ids, lengths, feature_table, row_base, shards, server_rank, num_servers=num_servers,
                          batch_size=b, weights=weights, mean=pooling == "mean", sample_major=sample_major,
                          backward=False)
        assert lean.grad_bags is None and lean.grad_offsets is None and lean.grad_scale is None
        assert lean.num_unique == want.num_unique
        for field in ("requests_ids", "per", "raw", "idx", "offsets", "weights"):
            assert _equal(getattr(lean, field), getattr(want, field)), (impl.__name__, field)


@native
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pooling", ["sum", "mean", "weighted"])
def test_bag_rows_equals_the_reference_and_the_route_s_backward(seed, pooling):
    """A server pooling bags works out the backward's index from the bags alone: what the
    trainer's route gives (its rows' groups, in the batch's feature-major order), bit for bit --
    tables read by several features, repeated ids, empty bags included."""
    g = torch.Generator().manual_seed(seed)
    ntab = 1 + seed % 3
    nf = ntab + 1 + seed % 2  # some table is read by two features
    rows, row_base, _, _, feature_table = _layout(g, num_servers=1, ntab=ntab, nf=nf)
    rows = rows.clamp(min=1)
    row_base = torch.cat([rows.new_zeros(1), rows.cumsum(0)])
    one = torch.ones(ntab, dtype=torch.int64)
    b = 1 + seed * 3
    ids, lengths = _batch(g, rows, feature_table, b, max_len=1 + seed)
    weights = torch.rand(ids.shape, generator=g) if pooling == "weighted" else None
    route = ops.route(ids, lengths, feature_table, row_base, one, torch.zeros(ntab, 1, dtype=torch.int64),
                      num_servers=1, batch_size=b, weights=weights, mean=pooling == "mean")
    i32 = torch.int32
    kw = dict(rows=route.num_unique, features=nf, weights=route.weights, mean=pooling == "mean")
    got = ops.bag_rows(route.idx.to(i32), route.offsets.to(i32), **kw)
    want = ref.bag_rows(route.idx.to(i32), route.offsets.to(i32), **kw)
    trainer = (route.grad_bags.to(i32), route.grad_offsets.to(i32), route.grad_scale)
    for name, a, r, t in zip(("grad_bags", "grad_offsets", "grad_scale"), got, want, trainer):
        assert _equal(a, r) and _equal(a, t), name
    with pytest.raises(ValueError, match="is not one of the"):
        ops.bag_rows(torch.tensor([0, 5], dtype=i32), torch.tensor([0, 2], dtype=i32), rows=5, features=1)
    with pytest.raises(ValueError, match="not a whole number of samples of 2 features"):
        ops.bag_rows(torch.tensor([0], dtype=i32), torch.tensor([0, 0, 1, 1], dtype=i32), rows=1, features=2)
    with pytest.raises(ValueError, match="must not decrease"):
        ops.bag_rows(torch.tensor([0, 0], dtype=i32), torch.tensor([0, 2, 1, 2], dtype=i32), rows=1, features=1)


@native
def test_route_of_empty_batches_and_int32_ids_equals_the_reference():
    g = torch.Generator().manual_seed(7)
    rows, row_base, shards, server_rank, feature_table = _layout(g, num_servers=2, ntab=2, nf=3)
    kw = dict(num_servers=2, batch_size=4)
    empty = torch.zeros(0, dtype=torch.int64), torch.zeros(12, dtype=torch.int64)
    for mean in (False, True):
        got, want = _route_both(*empty, feature_table, row_base, shards, server_rank, mean=mean, **kw)
        assert got.num_unique == want.num_unique == 0
        for field in ("requests_ids", "per", "raw", "idx", "offsets", "grad_bags", "grad_offsets", "grad_scale"):
            assert _equal(getattr(got, field), getattr(want, field)), field
    ids, lengths = _batch(g, rows, feature_table, 4, max_len=3)
    got, want = _route_both(ids.int(), lengths.int(), feature_table, row_base, shards, server_rank, **kw)
    assert _equal(got.requests_ids, want.requests_ids) and _equal(got.idx, want.idx)
    one = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)  # no features at all
    got, want = _route_both(*one, feature_table[:0], row_base, shards, server_rank, **kw)
    assert _equal(got.offsets, want.offsets) and _equal(got.per, want.per)


@native
def test_route_names_the_first_id_outside_its_table_like_the_reference():
    g = torch.Generator().manual_seed(8)
    rows, row_base, shards, server_rank, feature_table = _layout(g, num_servers=2, ntab=3, nf=3)
    ids, lengths = _batch(g, rows, feature_table, 5, max_len=3)
    assert ids.numel() > 4
    ids[3], ids[-1] = -1, 10**6
    errors = []
    for fn in (ops.route, ref.route):
        with pytest.raises(ops.RowOutOfRange) as caught:
            fn(ids, lengths, feature_table, row_base, shards, server_rank, num_servers=2, batch_size=5)
        e = caught.value
        errors.append((e.table, e.position, e.row, e.rows))
    assert errors[0] == errors[1] and errors[0][1:3] == (3, -1)


@native
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pooling", ["sum", "mean", "weighted"])
@pytest.mark.parametrize("spread", ["narrow", "int64"])
def test_route_hashed_equals_the_reference(seed, pooling, spread):
    """Raw ids: a narrow range (one radix sort) and ids over the whole int64 range (the
    comparison sort); repeats, several servers and shards, both bag orders."""
    g = torch.Generator().manual_seed(seed)
    num_servers, ntab = 1 + seed % 3, 1 + seed % 4
    nf = ntab + seed % 3
    rows, _, shards, server_rank, feature_table = _layout(g, num_servers=num_servers, ntab=ntab, nf=nf)
    b = 1 + seed * 3
    ids, lengths = _batch(g, rows.clamp(min=1), feature_table, b, max_len=1 + seed)
    ids = ids * 1_000_003 - 500 if spread == "narrow" else (ids - 20) * (2**58 + 12345)
    weights = torch.rand(ids.shape, generator=g) if pooling == "weighted" else None
    for sample_major in (True, False):
        kw = dict(partitions=5 + seed, num_servers=num_servers, batch_size=b, weights=weights,
                  mean=pooling == "mean", sample_major=sample_major)
        got = ops.route_hashed(ids, lengths, feature_table, shards, server_rank, **kw)
        want = ref.route_hashed(ids, lengths, feature_table, shards, server_rank, **kw)
        assert got.num_unique == want.num_unique == got.requests_ids.numel()
        for field in ("requests_ids", "per", "raw", "idx", "offsets", "weights", "grad_bags", "grad_offsets",
                      "grad_scale"):
            assert _equal(getattr(got, field), getattr(want, field)), field
        lean = ops.route_hashed(ids, lengths, feature_table, shards, server_rank, backward=False, **kw)
        assert lean.grad_bags is None and lean.grad_offsets is None and lean.grad_scale is None
        for field in ("requests_ids", "per", "raw", "idx", "offsets", "weights"):
            assert _equal(getattr(lean, field), getattr(want, field)), field
    empty = torch.zeros(0, dtype=torch.int64), torch.zeros(nf * 2, dtype=torch.int64)
    kw = dict(partitions=3, num_servers=num_servers, batch_size=2)
    got = ops.route_hashed(*empty, feature_table, shards, server_rank, **kw)
    want = ref.route_hashed(*empty, feature_table, shards, server_rank, **kw)
    assert got.num_unique == want.num_unique == 0 and _equal(got.offsets, want.offsets) and _equal(got.per, want.per)


@native
@pytest.mark.parametrize("table_dtype", ROW_DTYPES)
@pytest.mark.parametrize("admit_after", [1, 3])
def test_dynamic_rows_equals_the_reference(table_dtype, admit_after):
    """Rows with a slot, the initial value of ids admitted now, zeros for the others."""
    g = torch.Generator().manual_seed(11)
    weights = [torch.randn(20, d, generator=g).to(table_dtype) for d in (4, 7, 1)]
    counts = [9, 0, 6]
    ids = torch.randint(-2**62, 2**62, (15,), generator=g)
    slots = torch.randint(-1, 20, (15,), generator=g)
    seen = torch.randint(-1, 4, (15,), generator=g) if admit_after > 1 else torch.empty(0, dtype=torch.int64)
    kw = dict(admit_after=admit_after, keys=[7, 2**32 - 1, 0], bounds=[0.1, 0.5, 1 / 3])
    numel = 9 * 4 + 6 * 1
    got, want = torch.full((numel + 3,), 9.0), torch.full((numel + 3,), 9.0)
    hits = ops.dynamic_rows(weights, ids, slots, seen, counts, out=got, **kw)
    hits_ref = ref.dynamic_rows(weights, ids, slots, seen, counts, out=want, **kw)
    assert torch.equal(got, want) and torch.equal(hits, hits_ref)
    assert hits.tolist() == [int((slots[:9] >= 0).sum()), 0, int((slots[9:] >= 0).sum())]


@native
@pytest.mark.parametrize("runs", [1, 2, 3, 4, 7, 16])
def test_merge_ids_equals_the_reference(runs):
    """Ascending runs per table (some empty, some ids in several runs) merged into each table's
    distinct ids, and every input id's index among them."""
    g = torch.Generator().manual_seed(runs)
    chunks, counts = [], []
    for t in range(4):
        for r in range(runs):
            n = 0 if (t, r) == (2, 0) else int(torch.randint(0, 12, (1,), generator=g))
            c = (torch.randperm(30, generator=g)[:n].sort().values - 15) * (2**59 + 7)
            if (t, r) == (3, runs - 1) and n:  # the int64 extremes, which the tournament keys must order
                c = torch.cat([torch.tensor([-(2**63)]), c[1:-1], torch.tensor([2**63 - 1])]) if n > 1 else c
            chunks.append(c)
            counts.append(c.numel())
    ids = torch.cat(chunks)
    got, want = ops.merge_ids(ids, counts, runs=runs), ref.merge_ids(ids, counts, runs=runs)
    assert all(_equal(a, b) for a, b in zip(got, want)), (got, want)
    assert torch.equal(got[0].index_select(0, got[2]), ids)
    with pytest.raises(ValueError, match="distinct and ascending"):
        ops.merge_ids(torch.tensor([3, 1]), [2], runs=1)


@native
@pytest.mark.parametrize("runs", [1, 2, 3])
def test_sum_runs_equals_the_reference_and_sum_rows(runs):
    """Each table's runs of ascending ids (dims differ by table, a run may be empty) merged, then
    their gradient rows summed per distinct id: the reference's result, bit for bit, and what
    sum_rows gives for the same ids and rows."""
    g = torch.Generator().manual_seed(20 + runs)
    dims = [4, 16, 7, 32]
    chunks, counts, grads = [], [], []
    for t, d in enumerate(dims):
        for r in range(runs):
            n = 0 if (t, r) == (2, 0) else int(torch.randint(1, 40, (1,), generator=g))
            chunks.append(torch.randperm(60, generator=g)[:n].sort().values)
            counts.append(n)
            grads.append(torch.randn(n, d, generator=g))
    uniq, per, inverse = ops.merge_ids(torch.cat(chunks), counts, runs=runs)
    for scale in (1.0, 0.5, 1 / 3):
        flat, got = ops.sum_runs(grads, inverse, per.tolist(), [runs] * len(dims), scale=scale)
        want_flat, want = ref.sum_runs(grads, inverse, per.tolist(), [runs] * len(dims), scale=scale)
        assert _equal(flat, want_flat) and len(got) == len(dims) and all(_equal(a, b) for a, b in zip(got, want))
        assert torch.equal(torch.cat([t.reshape(-1) for t in got]), flat)
        for t, (d, ids) in enumerate(zip(dims, uniq.split(per.tolist()))):
            mine = range(t * runs, (t + 1) * runs)
            _, summed = ops.sum_rows(torch.cat([chunks[j] for j in mine]), torch.cat([grads[j] for j in mine]),
                                     scale=scale, num_rows=60)
            assert got[t].shape == (ids.numel(), d) and torch.equal(got[t], summed)
    gap = ([torch.ones(1, 2)], torch.tensor([1]), [2], [1])  # distinct id 0 has no row: zeros
    assert _equal(ops.sum_runs(*gap, scale=0.5)[0], ref.sum_runs(*gap, scale=0.5)[0])
    assert ops.sum_runs(*gap, scale=0.5)[0].tolist() == [0.0, 0.0, 0.5, 0.5]
    with pytest.raises(ValueError, match="distinct ids"):
        ops.sum_runs([torch.ones(1, 2)], torch.tensor([5]), [1], [1], scale=1.0)


def _counts(g: torch.Generator, tables: list[torch.Tensor], n: int) -> tuple[torch.Tensor, list[int]]:
    counts = [int(c) for c in torch.randint(0, n + 1, (len(tables),), generator=g)]
    counts[-1] = 0 if len(tables) > 1 else counts[-1]  # a table asked for nothing
    ids = torch.cat([torch.randint(0, t.shape[0], (c,), generator=g) for t, c in zip(tables, counts)])
    return ids, counts


def _row_tables(g: torch.Generator, dtype: torch.dtype, dims=(4, 7, 64, 1)) -> list[torch.Tensor]:
    return [torch.randn(int(torch.randint(1, 50, (1,), generator=g)), d, generator=g).to(dtype) for d in dims]


@native
@pytest.mark.parametrize("table_dtype", ROW_DTYPES)
@pytest.mark.parametrize("out_dtype", ROW_DTYPES)
def test_gather_rows_equals_the_reference(table_dtype, out_dtype):
    g = torch.Generator().manual_seed(10)
    tables = _row_tables(g, table_dtype)
    ids, counts = _counts(g, tables, 40)
    got = ops.gather_rows(tables, ids, counts, dtype=out_dtype)
    assert _equal(got, ref.gather_rows(tables, ids, counts, dtype=out_dtype))
    out_n, out_r = torch.full((got.numel() + 5,), 7.0).to(out_dtype), torch.full((got.numel() + 5,), 7.0).to(out_dtype)
    ops.gather_rows(tables, ids, counts, out=out_n)
    ref.gather_rows(tables, ids, counts, out=out_r)
    assert _equal(out_n, out_r)
    assert _equal(ops.gather_rows(tables, ids[:0], [0] * len(tables)), torch.empty(0, dtype=torch.float32))


@native
@pytest.mark.parametrize("table_dtype", ROW_DTYPES)
@pytest.mark.parametrize("out_dtype", ROW_DTYPES)
@pytest.mark.parametrize("pooling", ["sum", "mean", "weighted"])
def test_pool_rows_equals_the_reference(table_dtype, out_dtype, pooling):
    """Bags pooled straight from the tables equal embedding_bag over the gathered rows, bit for
    bit: every row width the kernel specializes and others, empty bags, rows repeated in a bag,
    a -0.0 (a bag of it alone pools to +0.0, as embedding_bag's sum from zero), on one thread
    and split over two."""
    g = torch.Generator().manual_seed(12)
    for dim in (1, 3, 16, 32, 64, 100, 128):
        tables = [torch.randn(int(torch.randint(1, 40, (1,), generator=g)), dim, generator=g).to(table_dtype)
                  for _ in range(3)]
        tables[0][0, 0] = -0.0
        ids, counts = _counts(g, tables, 30)
        ids[0], counts = 0, counts if counts[0] else [1, *counts[1:]]
        ids = ids if sum(counts) == ids.numel() else torch.cat([torch.zeros(1, dtype=torch.int64), ids])
        nrows = ids.numel()
        lengths = torch.randint(0, 7, (300,), generator=g)
        lengths[:2] = torch.tensor([1, 0])  # the -0.0 row alone, then an empty bag
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
        idx = torch.randint(0, nrows, (int(offsets[-1]),), generator=g, dtype=torch.int32)
        idx[0] = 0
        weights = torch.randn(idx.numel(), generator=g) if pooling == "weighted" else None
        want = torch.full((300 * dim,), 7.0).to(out_dtype)
        ref.pool_rows(tables, ids, counts, idx, offsets, weights=weights, mean=pooling == "mean", out=want)
        previous = torch.get_num_threads()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                got = torch.full((300 * dim,), 7.0).to(out_dtype)
                ops.pool_rows(tables, ids, counts, idx, offsets, weights=weights, mean=pooling == "mean", out=got)
            finally:
                torch.set_num_threads(previous)
            assert _equal(got, want), (dim, threads)


@native
def test_pool_rows_names_a_row_outside_its_table_and_refuses_a_bad_index():
    g = torch.Generator().manual_seed(13)
    tables = [torch.randn(5, 4, generator=g), torch.randn(6, 4, generator=g)]
    offsets = torch.tensor([0, 2, 3], dtype=torch.int32)
    idx = torch.tensor([0, 2, 1], dtype=torch.int32)
    out = torch.empty(8)
    with pytest.raises(ops.RowOutOfRange) as e:
        ops.pool_rows(tables, torch.tensor([1, 4, 6]), [2, 1], idx, offsets, out=out)
    assert (e.value.table, e.value.row) == (1, 6)
    with pytest.raises(ValueError, match=r"idx\[1\] = 3 is not one of the 3 rows"):
        ops.pool_rows(tables, torch.tensor([1, 4, 5]), [2, 1], torch.tensor([0, 3, 1], dtype=torch.int32), offsets,
                      out=out)
    with pytest.raises(ValueError, match="mean"):
        ops.pool_rows(tables, torch.tensor([1, 4, 5]), [2, 1], idx, offsets, weights=torch.ones(3), mean=True,
                      out=out)
    with pytest.raises(ValueError, match="at least one table"):
        ops.pool_rows([], torch.empty(0, dtype=torch.int64), [], torch.empty(0, dtype=torch.int32),
                      torch.zeros(3, dtype=torch.int32), out=out)


@native
@pytest.mark.parametrize("table_dtype", ROW_DTYPES)
@pytest.mark.parametrize("grad_dtype", ROW_DTYPES)
def test_sgd_rows_equals_the_reference(table_dtype, grad_dtype):
    g = torch.Generator().manual_seed(11)
    tables = _row_tables(g, table_dtype)
    ids, counts = _counts(g, tables, 60)  # many repeats: tables hold 1-49 rows
    grad = torch.randn(sum(c * t.shape[1] for c, t in zip(counts, tables)), generator=g).to(grad_dtype)
    got, want = [t.clone() for t in tables], [t.clone() for t in tables]
    ops.sgd_rows_(got, ids, counts, grad, alpha=-0.37)
    ref.sgd_rows_(want, ids, counts, grad, alpha=-0.37)
    assert all(_equal(a, b) for a, b in zip(got, want))
    ops.sgd_rows_(got, ids[:0], [0] * len(tables), grad[:0], alpha=-0.37)
    assert all(_equal(a, b) for a, b in zip(got, want))


@native
@pytest.mark.parametrize("grad_dtype", ROW_DTYPES)
@pytest.mark.parametrize("ids_kind", ["repeats", "ascending", "empty"])
def test_sum_rows_equals_the_reference(grad_dtype, ids_kind):
    g = torch.Generator().manual_seed(12)
    n = {"repeats": 300, "ascending": 40, "empty": 0}[ids_kind]
    ids = torch.randint(0, 50, (n,), generator=g)
    if ids_kind == "ascending":  # one trainer's deduplicated ids
        ids = torch.randperm(100, generator=g)[:n].sort().values
    grads = torch.randn(n, 13, generator=g).to(grad_dtype)
    for scale in (1.0, 0.5, 1 / 3):
        got = ops.sum_rows(ids, grads, scale=scale, num_rows=100)
        want = ref.sum_rows(ids, grads, scale=scale, num_rows=100)
        assert _equal(got[0], want[0]) and _equal(got[1], want[1])


def _state(g: torch.Generator, kind: str, rows: int, dim: int) -> dict[str, torch.Tensor]:
    if kind == "adagrad":
        return {"sum": torch.rand(rows, dim, generator=g)}
    if kind == "rowwise_adagrad":
        return {"sum": torch.rand(rows, generator=g)}
    if kind == "adam":
        return {"exp_avg": torch.randn(rows, dim, generator=g) * 0.1,
                "exp_avg_sq": torch.rand(rows, dim, generator=g) * 0.01,
                "step": torch.randint(0, 40, (rows,), generator=g).float()}
    return {}


@native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim", [1, 3, 16, 64, 100])
@pytest.mark.parametrize("decay_scale", [(0.0, 1.0), (0.01, 0.5)])
def test_optimizer_rows_equals_the_reference(kind, dim, decay_scale):
    weight_decay, grad_scale = decay_scale
    g = torch.Generator().manual_seed(13 + dim)
    weight = torch.randn(200, dim, generator=g)
    state = _state(g, kind, 200, dim)
    rows = torch.randperm(200, generator=g)[:77]
    grads = torch.randn(77, dim, generator=g)
    for beta1, beta2 in ((0.9, 0.999), (0.3, 0.5)):  # lerp's weight below and above 1/2
        hyper = dict(grad_scale=grad_scale, weight=weight, state=state, lr=0.05, eps=1e-8,
                     weight_decay=weight_decay, beta1=beta1, beta2=beta2)
        w_n, s_n = ops.optimizer_rows(kind, rows, grads, **hyper)
        w_r, s_r = ref.optimizer_rows(kind, rows, grads, **hyper)
        assert _equal(w_n, w_r)
        assert s_n.keys() == s_r.keys() and all(_equal(s_n[k], s_r[k]) for k in s_r)


@native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("weight_dtype", ROW_DTYPES)
@pytest.mark.parametrize("grad_dtype", ROW_DTYPES)
def test_optimizer_rows_of_16_bit_rows_and_no_rows_equal_the_reference(kind, weight_dtype, grad_dtype):
    g = torch.Generator().manual_seed(14)
    weight = torch.randn(60, 24, generator=g).to(weight_dtype)
    state = _state(g, kind, 60, 24)
    rows = torch.randperm(60, generator=g)[:33]
    grads = torch.randn(33, 24, generator=g).to(grad_dtype)
    hyper = dict(grad_scale=1.0, weight=weight, state=state, lr=0.1, eps=1e-6, weight_decay=0.0,
                 beta1=0.9, beta2=0.999)
    for r, gr in ((rows, grads), (rows[:0], grads[:0])):
        w_n, s_n = ops.optimizer_rows(kind, r, gr, **hyper)
        w_r, s_r = ref.optimizer_rows(kind, r, gr, **hyper)
        assert _equal(w_n, w_r) and all(_equal(s_n[k], s_r[k]) for k in s_r)


@native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim", [3, 16, 32, 64, 128])
@pytest.mark.parametrize("threads", [1, 2])
def test_optimizer_step_in_place_equals_the_reference(kind, dim, threads):
    """Ascending rows (a server's pushes) take the in-place path: chunks of rows (row-wise
    Adagrad: one pass over them, its row length a compile-time constant for 16, 32, 64 and 128
    floats, its float32 rows in vectors of 8, read at run time for 3), state and weights read
    ahead, an undo log. Several chunks and tasks, a 16-bit table beside float32 ones, weight
    decay; then a non-finite new weight in the last table restores every table."""
    if kind in ("sgd", "rowwise_adagrad"):  # the others' in place needs MKL's square root
        assert torch.ops.hybrid.in_place_lanes(kind, dim) in (8, 16)
    g = torch.Generator().manual_seed(31 + dim)
    sizes, counts = (3000, 700, 50), (1300, 513, 0)
    weights = [torch.randn(n, dim, generator=g) for n in sizes]
    weights[1] = weights[1].to(torch.bfloat16)
    states = [_state(g, kind, n, dim) for n in sizes]
    rows = [torch.randperm(n, generator=g)[:c].sort().values for n, c in zip(sizes, counts)]
    grads = [torch.randn(c, dim, generator=g) for c in counts]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for decay in (0.0, 0.01):
            hyper = dict(lr=0.05, eps=1e-8, weight_decay=decay, beta1=0.9, beta2=0.999)
            want_w, want_s = [w.clone() for w in weights], [{k: v.clone() for k, v in s.items()} for s in states]
            ref.optimizer_step_(kind, want_w, want_s, rows, grads, [1.0, 0.5, 1.0], **hyper)
            ops.optimizer_step_(kind, weights, states, rows, grads, [1.0, 0.5, 1.0], **hyper)
            assert all(_equal(a, b) for a, b in zip(weights, want_w))
            assert all(_equal(a[k], b[k]) for a, b in zip(states, want_s) for k in b)
        before_w, before_s = [w.clone() for w in weights], [{k: v.clone() for k, v in s.items()} for s in states]
        bad = [gr.clone() for gr in grads]
        bad[1][400, 0] = float("inf")
        with pytest.raises(ops.NonFinite, match=f"row {int(rows[1][400])}"):
            ops.optimizer_step_(kind, weights, states, rows, bad, [1.0, 0.5, 1.0], lr=0.05, eps=1e-8,
                                weight_decay=0.0, beta1=0.9, beta2=0.999)
        assert all(_equal(a, b) for a, b in zip(weights, before_w))
        assert all(_equal(a[k], b[k]) for a, b in zip(states, before_s) for k in b)
    finally:
        torch.set_num_threads(previous)


@native
@pytest.mark.parametrize("threads", [1, 2])
def test_row_wise_adagrad_in_place_counts_every_non_finite_row_and_restores_every_row(threads):
    """Row-wise Adagrad checks its new weights once per window of rows written: two non-finite
    rows in one window and a third far after it are all counted, the first named, and every
    row of both tables is as it was, on one thread and split over two."""
    g = torch.Generator().manual_seed(32)
    weights = [torch.randn(5000, 32, generator=g), torch.randn(300, 32, generator=g)]
    states = [_state(g, "rowwise_adagrad", n, 32) for n in (5000, 300)]
    rows = [torch.randperm(5000, generator=g)[:4000].sort().values, torch.arange(0, 300, 2)]
    grads = [torch.randn(4000, 32, generator=g), torch.randn(150, 32, generator=g)]
    grads[0][1001, 5] = float("nan")
    grads[0][1003, 0] = float("inf")
    grads[0][3900, 31] = float("-inf")
    before_w, before_s = [w.clone() for w in weights], [{k: v.clone() for k, v in s.items()} for s in states]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.raises(ops.NonFinite, match=f"for 3 rows \\(the first: row {int(rows[0][1001])}\\)"):
            ops.optimizer_step_("rowwise_adagrad", weights, states, rows, grads, [1.0, 1.0], lr=0.05, eps=1e-8,
                                weight_decay=0.0, beta1=0.9, beta2=0.999)
    finally:
        torch.set_num_threads(previous)
    assert all(_equal(a, b) for a, b in zip(weights, before_w))
    assert all(_equal(a[k], b[k]) for a, b in zip(states, before_s) for k in b)


@native
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adam"])
def test_rows_split_over_threads_equal_the_reference(kind):
    g = torch.Generator().manual_seed(15)
    weight = torch.randn(30000, 32, generator=g)
    state = _state(g, kind, 30000, 32)
    rows = torch.randperm(30000, generator=g)[:9000]  # several tasks of rows
    grads = torch.randn(9000, 32, generator=g)
    grads[7001, 3] = float("inf")  # the failure found in a later task is still the first
    grads[8500, 0] = float("nan")
    hyper = dict(grad_scale=1.0, weight=weight, state=state, lr=0.1, eps=1e-8, weight_decay=0.0, beta1=0.9,
                 beta2=0.999)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        good = torch.ones(9000, dtype=torch.bool)
        good[[7001, 8500]] = False
        w_n, s_n = ops.optimizer_rows(kind, rows[good], grads[good], **hyper)
        w_r, s_r = ref.optimizer_rows(kind, rows[good], grads[good], **hyper)
        assert _equal(w_n, w_r) and all(_equal(s_n[k], s_r[k]) for k in s_r)
        with pytest.raises(ops.NonFinite, match=f"for 2 rows .*row {int(rows[7001])}"):
            ops.optimizer_rows(kind, rows, grads, **hyper)
        tables = [weight, weight[:7].clone(), weight[:100].to(torch.bfloat16)]  # tasks span tables
        ids = torch.randint(0, 7, (20000,), generator=g)
        for counts in ([15000, 0, 5000], [1, 1, 19998], [20000, 0, 0]):
            assert _equal(ops.gather_rows(tables, ids, counts), ref.gather_rows(tables, ids, counts))
    finally:
        torch.set_num_threads(threads)


@native
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_sgd_rows_over_threads_keeps_the_order_of_a_table_listed_twice(table_dtype):
    g = torch.Generator().manual_seed(20)
    a, b = torch.randn(50, 8, generator=g).to(table_dtype), torch.randn(9, 8, generator=g).to(table_dtype)
    counts = [3000, 3000, 3000]
    ids = torch.cat([torch.randint(0, 50, (3000,), generator=g), torch.randint(0, 9, (3000,), generator=g),
                     torch.randint(0, 50, (3000,), generator=g)])
    grad = torch.randn(9000 * 8, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, want = [a.clone(), b.clone()], [a.clone(), b.clone()]
        ops.sgd_rows_([got[0], got[1], got[0]], ids, counts, grad, alpha=-0.1)
        ref.sgd_rows_([want[0], want[1], want[0]], ids, counts, grad, alpha=-0.1)
        assert all(_equal(x, y) for x, y in zip(got, want))
    finally:
        torch.set_num_threads(threads)


@native
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_sgd_rows_takes_one_gradient_tensor_per_contribution(table_dtype):
    """Two contributions to two tables (each table listed once per contribution), their
    gradients as two tensors: the same bits as one joined tensor and as the reference, over
    threads; a tensor that ends inside a table's rows is refused, and nothing is written."""
    g = torch.Generator().manual_seed(21)
    a, b = torch.randn(40, 4, generator=g).to(table_dtype), torch.randn(30, 4, generator=g).to(table_dtype)
    counts = [500, 300, 500, 300]
    ids = torch.cat([torch.randint(0, n, (c,), generator=g) for n, c in zip([40, 30, 40, 30], counts)])
    grads = [torch.randn(800 * 4, generator=g), torch.randn(800 * 4, generator=g)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        split, joined, want = [a.clone(), b.clone()], [a.clone(), b.clone()], [a.clone(), b.clone()]
        ops.sgd_rows_([split[0], split[1], split[0], split[1]], ids, counts, grads, alpha=-0.1)
        ops.sgd_rows_([joined[0], joined[1], joined[0], joined[1]], ids, counts, torch.cat(grads), alpha=-0.1)
        ref.sgd_rows_([want[0], want[1], want[0], want[1]], ids, counts, grads, alpha=-0.1)
        assert all(_equal(x, y) and _equal(x, z) for x, y, z in zip(split, joined, want))
        assert not _equal(split[0], a)
    finally:
        torch.set_num_threads(threads)
    before = [t.clone() for t in split]
    with pytest.raises(ValueError, match=r"table 1's 1200 gradient elements cross the end of grads\[0\]"):
        ops.sgd_rows_([split[0], split[1], split[0], split[1]], ids, counts, [grads[0][:2400], torch.cat(
            [grads[0][2400:], grads[1]])], alpha=-0.1)
    assert all(_equal(x, y) for x, y in zip(split, before))


@native
@pytest.mark.parametrize("dst_dtype", ROW_DTYPES)
@pytest.mark.parametrize("src_dtype", ROW_DTYPES)
def test_scatter_rows_equals_the_reference(dst_dtype, src_dtype):
    g = torch.Generator().manual_seed(16)
    for shape, src_shape in (((40, 6), (17, 6)), ((40,), (17,))):  # weight rows, per-row state
        dst = torch.randn(*shape, generator=g).to(dst_dtype)
        rows = torch.randperm(40, generator=g)[:17]
        src = torch.randn(*src_shape, generator=g).to(src_dtype)
        got, want = dst.clone(), dst.clone()
        ops.scatter_rows_(got, rows, src)
        ref.scatter_rows_(want, rows, src)
        assert _equal(got, want)


@native
@pytest.mark.parametrize("out_dtype", ROW_DTYPES)
def test_initial_rows_equals_the_reference(out_dtype):
    # Rows in any order, past 2**32 (the high half of the id is hashed too), over threads, and a
    # non-contiguous out (a column slice).
    g = torch.Generator().manual_seed(21)
    rows = torch.cat([torch.randperm(5000, generator=g), torch.tensor([2**32 + 7, 2**40 + 1, 0])])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dim in (1, 5, 32):
            got, want = (torch.empty(rows.numel(), dim, dtype=out_dtype) for _ in range(2))
            ops.initial_rows_(got, rows, key=0x9E3779B9, bound=0.0141)
            ref.initial_rows_(want, rows, key=0x9E3779B9, bound=0.0141)
            assert _equal(got, want), dim
            assert float(want.float().abs().max()) <= 0.0141 and float(want.float().std()) > 0.005
    finally:
        torch.set_num_threads(threads)
    wide, want = torch.zeros(50, 8, dtype=out_dtype), torch.zeros(50, 4, dtype=out_dtype)
    ops.initial_rows_(wide[:, 2:6], torch.arange(50), key=3, bound=0.5)
    ref.initial_rows_(want, torch.arange(50), key=3, bound=0.5)
    assert _equal(wide[:, 2:6], want) and not wide[:, :2].any() and not wide[:, 6:].any()


@native
def test_each_operator_names_an_id_outside_its_table_like_the_reference_and_writes_nothing():
    g = torch.Generator().manual_seed(17)
    tables = _row_tables(g, torch.float32, dims=(4, 3))
    rows0 = tables[0].shape[0]
    ids, counts = torch.tensor([0, rows0, 1, 2]), [3, 1]
    grad = torch.ones(3 * 4 + 3)
    weight, state = tables[0], {"sum": torch.zeros(rows0)}
    calls = {
        "gather_rows": lambda m, ts: m.gather_rows(ts, ids, counts),
        "sgd_rows_": lambda m, ts: m.sgd_rows_(ts, ids, counts, grad, alpha=-1.0),
        "sum_rows": lambda m, ts: m.sum_rows(torch.tensor([1, -2, 0]), torch.ones(3, 2), scale=1.0, num_rows=5),
        "optimizer_rows": lambda m, ts: m.optimizer_rows(
            "rowwise_adagrad", torch.tensor([1, rows0 + 3]), torch.ones(2, 4), grad_scale=1.0, weight=ts[0],
            state=state, lr=0.1, eps=1e-8, weight_decay=0.0, beta1=0.9, beta2=0.999),
    }
    for name, call in calls.items():
        fields = []
        for module in (ops, ref):
            ts = [t.clone() for t in tables]
            with pytest.raises(ops.RowOutOfRange) as caught:
                call(module, ts)
            e = caught.value
            fields.append((e.table, e.position, e.row, e.rows))
            assert all(_equal(a, b) for a, b in zip(ts, tables)), name
        assert fields[0] == fields[1], name
    dst = weight.clone()
    with pytest.raises(IndexError):  # the reference's index_copy_ raises IndexError, a base of RowOutOfRange
        ops.scatter_rows_(dst, torch.tensor([0, rows0]), torch.ones(2, 4))
    assert _equal(dst, weight)


@native
@pytest.mark.parametrize("table_dtype", ROW_DTYPES)
def test_sgd_rows_refuses_non_finite_gradients_and_writes_nothing(table_dtype):
    g = torch.Generator().manual_seed(18)
    tables = _row_tables(g, table_dtype, dims=(4, 3))
    ids, counts = _counts(g, tables[:1], 10)
    ids, counts = torch.cat([ids, torch.tensor([0, 1])]), counts + [2]
    for bad in (float("nan"), float("inf"), -float("inf")):
        grad = torch.randn(counts[0] * 4 + 6, generator=g)
        grad[-2] = bad
        before = [t.clone() for t in tables]
        for module in (ops, ref):
            with pytest.raises(ops.NonFinite):
                module.sgd_rows_(tables, ids, counts, grad, alpha=-1.0)
            assert all(_equal(a, b) for a, b in zip(tables, before))


@native
@pytest.mark.parametrize("grad_dtype", ROW_DTYPES)
def test_sgd_rows_counts_the_non_finite_gradient_rows_of_a_long_gradient(grad_dtype):
    """The check scans a gradient in vectors before it counts rows: values anywhere in a long
    gradient (inside the vectors, in the last partial one) are found, counted once per row, and
    the first is named; nothing is written."""
    g = torch.Generator().manual_seed(22)
    table = torch.randn(2000, 8, generator=g)
    ids = torch.randperm(2000, generator=g)[:1203]
    before = table.clone()
    for bad in ((5, 1, float("nan")), (6, 0, float("inf")), (7, 2, -float("inf")), (900, 7, float("inf")),
                (900, 0, -float("inf")), (1202, 7, float("nan"))):  # each of the scan's 4 vectors, the tail
        grad = torch.randn(1203, 8, generator=g)
        grad[bad[0], bad[1]] = bad[2]
        with pytest.raises(ops.NonFinite, match=f"in 1 rows \\(the first: position {bad[0]}, table 0\\)"):
            ops.sgd_rows_([table], ids, [1203], grad.to(grad_dtype).reshape(-1), alpha=-1.0)
    grad = torch.randn(1203, 8, generator=g)
    grad[[17, 400, 401], 3] = float("inf")
    with pytest.raises(ops.NonFinite, match="in 3 rows \\(the first: position 17, table 0\\)"):
        ops.sgd_rows_([table], ids, [1203], grad.to(grad_dtype).reshape(-1), alpha=-1.0)
    assert torch.equal(table, before)


@native
def test_optimizer_rows_refuses_a_non_finite_new_weight_like_the_reference():
    weight = torch.zeros(5, 3)
    weight[2, 1] = float("inf")  # the row's update is not finite although its gradient is
    for kind in KINDS:
        state = _state(torch.Generator().manual_seed(19), kind, 5, 3)
        for module in (ops, ref):
            with pytest.raises(ops.NonFinite):
                module.optimizer_rows(kind, torch.tensor([0, 2]), torch.ones(2, 3), grad_scale=1.0, weight=weight,
                                      state=state, lr=0.1, eps=1e-8, weight_decay=0.0, beta1=0.9, beta2=0.999)


@native
def test_hot_rows_find_counts_as_the_tensor_operations_do():
    """``hybrid::hot_rows_find_`` (the hot-row cache's find) against the cache's tensor
    operations on two copies of one pool: held, stale, absent and hash-colliding rows, and keys
    that share sketch counters (each sees every request of the call)."""
    import copy

    from hybrid.ps.client.cache import HotRows, _keys
    from hybrid.ps.protocol import Rows

    g = torch.Generator().manual_seed(3)
    cache = HotRows(64, staleness=2, tables=[(4, {0: 500}), (4, {0: 500})], dtype=torch.float32)
    for step in range(6):  # fill the pool through the cache itself, rows of versions 1..6
        ids = [torch.unique(torch.randint(0, 60, (40,), generator=g)) for _ in range(2)]
        request = Rows([0, 1], [len(i) for i in ids], torch.cat(ids))
        sent, split = cache.split(0, request, step + 3)
        cache.join(split, torch.randn(sent.ids.numel() * 4, generator=g), step + 1)
    pool = cache.pools[(0, 4)]
    assert 0 < pool.capacity - pool.n_free and pool.sketch.sum() > 0
    ids = torch.cat([torch.arange(0, 80), torch.arange(0, 80)])  # held, not held, both tables
    tables = torch.cat([torch.zeros(80, dtype=torch.int64), torch.ones(80, dtype=torch.int64)])
    keys = _keys(ids, tables)
    width = pool.sketch.shape[1]
    colliding = torch.tensor([7, 7 + width, 7 + 2 * width, (5 << 32) + 9, (5 << 32) + 11])  # share a counter
    keys = torch.cat([keys, colliding])
    ids = torch.cat([ids, torch.full((5,), 999)])
    tables = torch.cat([tables, torch.zeros(5, dtype=torch.int64)])
    held_key = int(pool.map.items()[0][0])  # a key the map holds, asked for another row: a miss
    keys, ids, tables = torch.cat([keys, torch.tensor([held_key])]), torch.cat([ids, torch.tensor([777])]), \
        torch.cat([tables, torch.tensor([1])])
    twin = copy.deepcopy(pool)
    hits, first = {}, None
    for need in (0, 3, 5, 100):
        got = pool.find_and_count(keys, ids, tables, need)
        first = got if first is None else first
        want = twin.find_and_count_reference(keys, ids, tables, need)
        for a, b in zip(got, want):
            assert torch.equal(a, b), need
        assert torch.equal(pool.uses, twin.uses) and torch.equal(pool.sketch, twin.sketch)
        hits[need] = int(got[1].sum())
    slots = got[0]
    assert (slots >= 0).any() and (slots < 0).any() and slots[-6:].eq(-1).all()  # the last six are misses
    assert first[2][160:163].all()  # first asked for, but three keys on one pair of counters: 3 >= 2
    assert hits[0] == int((slots >= 0).sum()) > hits[5] > 0 == hits[100]  # versions 1..6 against need


@native
def test_hot_rows_find_refuses_a_slot_outside_its_pool_before_counting_anything():
    from hybrid.ops.id_map import HashIdMap

    m = HashIdMap(8)
    m.insert(torch.tensor([5, 6]), torch.tensor([1, 9]))  # slot 9: beyond a pool of 4
    uses, sketch, pool = torch.zeros(4, dtype=torch.int64), torch.zeros(2, 16, dtype=torch.int32), torch.zeros(
        4, dtype=torch.int64)
    with pytest.raises(ValueError, match="the map holds slot 9 of a pool of 4"):
        torch.ops.hybrid.hot_rows_find_(m.keys, m.slots, torch.tensor([5, 6]), torch.zeros(2, dtype=torch.int64),
                                        torch.zeros(2, dtype=torch.int64), pool, pool.clone(), pool.clone(), uses,
                                        sketch, 0, 2)
    assert not uses.any() and not sketch.any()


# -- refusals of malformed arguments (TORCH_CHECK in the operators) ----------------------------------

@native
def test_a_wrong_dtype_raises_type_error_naming_the_argument():
    t = [torch.randn(10, 4)]
    ids = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="ids must be int64, got Float"):
        ops.gather_rows(t, ids.float(), [2])
    with pytest.raises(TypeError, match=r"tables\[0\] must be float32, bfloat16 or float16, got Double"):
        ops.gather_rows([t[0].double()], ids, [2])
    with pytest.raises(TypeError, match="out must be float32, bfloat16 or float16, got Int"):
        ops.gather_rows(t, ids, [2], out=torch.zeros(8, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"grads\[0\] must be float32, bfloat16 or float16, got Double"):
        ops.sgd_rows_(t, ids, [2], torch.ones(8, dtype=torch.float64), alpha=-1.0)
    with pytest.raises(TypeError, match=r"state\[0\] must be float32, got Double"):
        ops.optimizer_rows("adagrad", ids, torch.ones(2, 4), grad_scale=1.0, weight=t[0],
                           state={"sum": torch.zeros(10, 4, dtype=torch.float64)}, lr=0.1, eps=1e-8,
                           weight_decay=0.0, beta1=0.9, beta2=0.999)
    with pytest.raises(TypeError, match="weights must be float32, got Double"):
        ops.route(ids, torch.tensor([2]), torch.tensor([0]), torch.tensor([0, 10]), torch.tensor([1]),
                  torch.tensor([[0]]), num_servers=1, batch_size=1, weights=torch.ones(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="feature_table must be int64, got Int"):
        torch.ops.hybrid.route(ids, torch.tensor([2]), torch.tensor([0], dtype=torch.int32), torch.tensor([0, 10]),
                               torch.tensor([1]), torch.tensor([[0]]), 1, 1, None, False, True)


@native
def test_a_wrong_shape_or_layout_raises_value_error_naming_the_argument():
    t = [torch.randn(10, 4)]
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="counts sum to 3 but ids holds 2"):
        ops.gather_rows(t, ids, [3])
    with pytest.raises(ValueError, match="counts has 2 entries for 1 tables"):
        ops.gather_rows(t, ids, [1, 1])
    with pytest.raises(ValueError, match="out holds 4 elements; the rows need 8"):
        ops.gather_rows(t, ids, [2], out=torch.zeros(4))
    with pytest.raises(ValueError, match=r"tables\[0\] must be contiguous"):
        ops.sgd_rows_([torch.randn(4, 10).t()], ids, [2], torch.ones(8), alpha=-1.0)
    with pytest.raises(ValueError, match="grads hold 6 elements; the rows need 8"):
        ops.sgd_rows_(t, ids, [2], torch.ones(6), alpha=-1.0)
    with pytest.raises(ValueError, match=r"grads must be \[len\(ids\), dim\]"):
        ops.sum_rows(ids, torch.ones(3, 4), scale=1.0, num_rows=10)
    with pytest.raises(ValueError, match=r"grads must be \[len\(rows\), dim\] = \[2, 4\]"):
        ops.optimizer_rows("sgd", ids, torch.ones(2, 5), grad_scale=1.0, weight=t[0], state={}, lr=0.1, eps=1e-8,
                           weight_decay=0.0, beta1=0.9, beta2=0.999)
    with pytest.raises(ValueError, match=r"state\[0\] must be \[10\] \(one value per row\)"):
        ops.optimizer_rows("rowwise_adagrad", ids, torch.ones(2, 4), grad_scale=1.0, weight=t[0],
                           state={"sum": torch.zeros(10, 4)}, lr=0.1, eps=1e-8, weight_decay=0.0, beta1=0.9,
                           beta2=0.999)
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        ops.optimizer_rows("lamb", ids, torch.ones(2, 4), grad_scale=1.0, weight=t[0], state={}, lr=0.1, eps=1e-8,
                           weight_decay=0.0, beta1=0.9, beta2=0.999)
    with pytest.raises(ValueError, match="optimizer kind must be one of sgd, adagrad, rowwise_adagrad, adam"):
        torch.ops.hybrid.optimizer_rows("lamb", ids, torch.ones(2, 4), 1.0, t[0], [], 0.1, 1e-8, 0.0, 0.9, 0.999)
    with pytest.raises(ValueError, match="optimizer kind must be one of sgd, adagrad, rowwise_adagrad, adam"):
        torch.ops.hybrid.in_place_lanes("lamb", 4)
    with pytest.raises(ValueError, match="dim must be positive, got 0"):
        torch.ops.hybrid.in_place_lanes("sgd", 0)
    with pytest.raises(ValueError, match=r"src must be \[len\(rows\), dim\] = \[2, 4\]"):
        ops.scatter_rows_(t[0], ids, torch.ones(2, 3))
    with pytest.raises(ValueError, match="lengths sum to 3 but ids holds 2"):
        ops.route(ids, torch.tensor([3]), torch.tensor([0]), torch.tensor([0, 10]), torch.tensor([1]),
                  torch.tensor([[0]]), num_servers=1, batch_size=1)
    with pytest.raises(ValueError, match=r"server_rank\[0, 0\] = 3 is not a server in \[0, 2\)"):
        ops.route(ids, torch.tensor([2]), torch.tensor([0]), torch.tensor([0, 10]), torch.tensor([1]),
                  torch.tensor([[3]]), num_servers=2, batch_size=1)
    with pytest.raises(ValueError, match="ids must be on the CPU, got meta"):
        torch.ops.hybrid.gather_rows(t, ids.to("meta"), [2], torch.zeros(8))


# -- the fallback ------------------------------------------------------------------------------------

def test_without_the_extension_the_reference_runs_after_one_warning():
    code = textwrap.dedent("""
        import sys, warnings
        sys.modules["hybrid._C"] = None  # as if the extension were not built
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import hybrid.ops as ops
            import hybrid.ops  # a second import warns no more
        from hybrid.ops import reference
        assert not ops.AVAILABLE
        assert len(caught) == 1 and caught[0].category is RuntimeWarning, caught
        assert str(caught[0].message).startswith(
            "hybrid.ops: hybrid._C does not load (import of hybrid._C halted; None in sys.modules); using the "
            "plain-torch operators of hybrid.ops.reference"), caught[0].message
        assert all(getattr(ops, n) is getattr(reference, n) for n in
                   ("route", "route_hashed", "gather_rows", "sgd_rows_", "sum_rows", "optimizer_rows",
                    "scatter_rows_", "dynamic_plan", "dynamic_commit_", "dynamic_rows"))
        # A server's dynamic table runs on the reference map and operators.
        import torch
        from hybrid.ops.id_map import IdMap
        from hybrid.ps.config import DynamicIds
        from hybrid.ps.server.dynamic import DynamicSlots, commit_updates, plan_updates
        slots = DynamicSlots(DynamicIds(capacity=8, partitions=2), [0, 1], table="t", where="test", huge_pages=True)
        assert IdMap is reference.IdMap and isinstance(slots.map, reference.IdMap)
        ids = torch.tensor([-5, 3, 1 << 40])
        commit_updates([slots], plan_updates([slots], [ids], 0))
        assert slots.map.find(ids).ge(0).all() and slots.counters.admitted == 3
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_die_with_parent_sets_the_kernel_s_parent_death_signal():
    """The operator asks the kernel for the signal (read back with prctl(PR_GET_PDEATHSIG) in a
    child process); a number that is no signal is refused; the plain-torch twin does nothing."""
    from hybrid.ops import reference

    code = ("import ctypes, signal\n"
            "from hybrid import ops\n"
            "assert ops.die_with_parent(int(signal.SIGTERM)) is ops.AVAILABLE\n"
            "got = ctypes.c_int(0)\n"
            "assert ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0) == 0\n"  # PR_GET_PDEATHSIG
            "print(got.value)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert int(res.stdout) == (int(signal.SIGTERM) if ops.AVAILABLE else 0)
    for impl in (ops, reference):
        with pytest.raises(ValueError, match="signal must be a signal number in 1..64, got 0"):
            impl.die_with_parent(0)
    assert reference.die_with_parent(int(signal.SIGTERM)) is False


# -- criteo_parse ---------------------------------------------------------------------------------

def _criteo_text(rng, lines: int) -> bytes:
    """Criteo lines of every kind the format allows (blanks, signs, values past 2**62, hex of any
    length and case) and, in about a third, one field it does not; some end in ``\\r``."""
    def dense():
        return rng.choice(["", str(rng.randint(-3, 5000)), "+7", "-0", "9" * rng.randint(17, 40)])

    def cat():
        return rng.choice(["", f"{rng.getrandbits(32):08x}", f"{rng.getrandbits(32):08X}", "0", "f" * rng.randint(9, 40)])

    out = []
    for _ in range(lines):
        fields = [rng.choice(["0", "1"]), *(dense() for _ in range(13)), *(cat() for _ in range(26))]
        if rng.random() < 0.35:
            j = rng.randrange(40)
            fields[j] = rng.choice(["2", "", "-"] if j == 0 else ["1a", "-", " 5", "+", "5 "] if j <= 13
                                   else ["xyz", "0x1f", "1_0", " f", "-1"])
            if rng.random() < 0.3:
                fields = fields[:rng.randint(0, 39)] if rng.random() < 0.5 else fields + ["0"]
        line = "\t".join(fields) + rng.choice(["", "", "", "\r", "\r\r"])
        out.append(line if rng.random() > 0.02 else "")
    text = "\n".join(out)
    return (text + ("\n" if rng.random() < 0.7 else "")).encode()


@native
def test_criteo_parse_matches_reference_on_seeded_fuzz():
    import random

    good = bad = 0
    for seed in range(40):
        rng = random.Random(seed)
        rows = [rng.choice([1, 7, 1000, 2**31 + 11, 2**62 + 3, 2**63 - 1]) for _ in range(26)]
        text = _criteo_text(rng, rng.randint(0, 60))
        t = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)
        got, want = ops.criteo_parse(t, rows), ref.criteo_parse(t, rows)
        for g, w, name in zip(got, want, ("status", "labels", "dense", "ids")):
            assert g.dtype == w.dtype and torch.equal(g, w), (seed, name)
        bad += int(got[0].sum())
        good += len(got[0]) - int(got[0].sum())
    assert good > 500 and bad > 300, (good, bad)


@pytest.mark.parametrize("impl", [ops, ref], ids=["public", "reference"])
def test_criteo_parse_values_and_refusals(impl):
    line = "\t".join(["1", "-4", "+12", "", *["9" * 30] * 10, "ff", "", "FFFFFFFFFFFFFFFFFFFF", *["0"] * 23]) + "\r\n"
    text = (line + "0\tbad\n\n").encode()
    status, labels, dense, ids = impl.criteo_parse(torch.frombuffer(bytearray(text), dtype=torch.uint8), [10] * 26)
    assert status.tolist() == [0, 1, 1] and labels.tolist() == [1.0, 0.0, 0.0]
    assert dense[0].tolist() == [0, 12, 0, *[2**62] * 10]
    assert ids[0].tolist()[:3] == [255 % 10, 0, (16**20 - 1) % 10] and not dense[1:].any() and not ids[1:].any()
    with pytest.raises(TypeError, match="text must be uint8"):
        impl.criteo_parse(torch.zeros(3, dtype=torch.int32), [10] * 26)
    with pytest.raises(ValueError, match="rows must"):
        impl.criteo_parse(torch.zeros(3, dtype=torch.uint8), [10] * 25)


# -- csv_records_end ------------------------------------------------------------------------------

def _csv_text(rng) -> bytes:
    """A few CSV lines of fields quoted every way pyarrow reads: plain, quoted with commas,
    doubled quotes and line breaks inside, a quote inside an unquoted field, text after a
    closing quote, an unclosed quote; CRLF or LF, empty lines, the last line ending or not."""
    fields = ["1", "abc", '"q"', '"a,b"', '"x""y"', '"l1\nl2"', 'a"b', '"c"d', '""', "", '"', 'e"', '"\r\n"', " "]
    lines = [",".join(rng.choice(fields) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 8))]
    text = rng.choice(["\n", "\r\n"]).join(lines)
    return (text + ("\n" if rng.random() < 0.5 else "")).encode()


def _csv_parse(text: bytes) -> list:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    if not text:
        return []
    return pacsv.read_csv(
        pa.BufferReader(text),
        read_options=pacsv.ReadOptions(column_names=["a", "b", "c", "d"], block_size=len(text) + 1, use_threads=False),
        parse_options=pacsv.ParseOptions(invalid_row_handler=lambda row: "skip"),
        convert_options=pacsv.ConvertOptions(column_types={k: pa.string() for k in "abcd"}, strings_can_be_null=False,
                                             quoted_strings_can_be_null=False)).to_pylist()


@native
def test_csv_records_end_matches_reference_and_cuts_where_pyarrow_ends_a_record():
    """Native and reference agree on seeded fuzz; and pyarrow reads the text cut there as it
    reads it whole, so the cut is where pyarrow ends a record."""
    import random

    cuts = 0
    for seed in range(1500):
        text = _csv_text(random.Random(seed))
        t = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)
        end = ops.csv_records_end(t)
        assert end == ref.csv_records_end(t), (seed, text)
        if end > 0:
            assert text[end - 1:end] == b"\n", (seed, text, end)
            assert _csv_parse(text) == _csv_parse(text[:end]) + _csv_parse(text[end:]), (seed, text, end)
            cuts += 1
    assert cuts > 800, cuts


@pytest.mark.parametrize("impl", [ops, ref], ids=["public", "reference"])
def test_csv_records_end_values_and_refusals(impl):
    def end(text: bytes) -> int:
        return impl.csv_records_end(torch.frombuffer(bytearray(text), dtype=torch.uint8))

    assert end(b"a,b\n1,2\n") == 8 and end(b"a,b\n1,2") == 4 and end(b"1,2") == -1
    assert end(b'1,"a\nb",3\n2,') == 10  # the first line break is inside quotes
    assert end(b'1,"a""\nb",3\n') == 12  # "" is a quote inside the field
    assert end(b'1,a"b\n"c\nd",e\n') == 14  # a quote inside an unquoted field is text
    assert end(b'1,"a"b\nc\n') == 9  # after a closing quote the field goes on unquoted
    assert end(b'1,"a\nb') == -1 and end(b'"\r\n') == -1
    with pytest.raises(TypeError, match="text must be uint8"):
        impl.csv_records_end(torch.zeros(3, dtype=torch.int32))


def _bagged_lookup(g: torch.Generator, dtype: torch.dtype, pooling: str):
    """A lookup pooled on a server, as :meth:`CollectionShard.gather_pooled` keeps it: groups of
    tables sharing a dim (32: the kernel's vector path; 3: its scalar one; one group with no row
    here), each table's distinct rows, random bags over the group's rows (empty ones too), the
    backward's index (:func:`ops.bag_rows`), and the bags' gradients."""
    tables, ids, counts, groups, grads = [], [], [], [], []
    for dim, ntab in ((32, 2), (3, 1), (8, 0)):
        rows = 0
        for _ in range(ntab):
            t = torch.randn(60, dim, generator=g).to(dtype)
            n = int(torch.randint(1, 40, (1,), generator=g))
            tables.append(t)
            ids.append(torch.randperm(60, generator=g)[:n])
            counts.append(n)
            rows += n
        bags = 12
        lengths = torch.randint(0, 5, (bags,), generator=g) if rows else torch.zeros(bags, dtype=torch.int64)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        idx = torch.randint(0, max(rows, 1), (int(lengths.sum()),), generator=g).to(torch.int32)
        weights = torch.rand(idx.shape, generator=g) * 4 if pooling == "weighted" else None
        gb, go, gs = ops.bag_rows(idx, offsets, rows=rows, features=3 if bags % 3 == 0 else 1, weights=weights,
                                  mean=pooling == "mean")
        groups.append((bags, dim, gb, go, gs))
        grads.append(torch.randn(bags * dim, generator=g) * 5)
    return tables, torch.cat(ids), counts, groups, torch.cat(grads)


@native
@pytest.mark.parametrize("table_dtype", ROW_DTYPES)
@pytest.mark.parametrize("pooling", ["sum", "mean", "weighted"])
def test_sgd_bags_equals_unpooling_then_sgd_rows_bit_for_bit(table_dtype, pooling):
    """Plain SGD straight from a pooled lookup's bag gradients writes what ``embedding_bag`` over
    them and then ``sgd_rows_`` write (the reference), bit for bit."""
    g = torch.Generator().manual_seed(40 + ROW_DTYPES.index(table_dtype))
    tables, ids, counts, groups, grad = _bagged_lookup(g, table_dtype, pooling)
    want = [t.clone() for t in tables]
    ref.sgd_bags_(want, ids, counts, grad, groups, alpha=-0.3)
    assert not all(_equal(a, b) for a, b in zip(want, tables))
    ops.sgd_bags_(tables, ids, counts, grad, groups, alpha=-0.3)
    assert all(_equal(a, b) for a, b in zip(tables, want))


@native
def test_sgd_bags_refuses_a_non_finite_row_gradient_and_writes_nothing():
    """A bag gradient that is not finite, or finite ones whose sum is not (float32 overflow), is
    named as ``sgd_rows_`` names it on the unpooled rows; a row outside its table too; nothing is
    written either way."""
    g = torch.Generator().manual_seed(47)
    tables, ids, counts, groups, grad = _bagged_lookup(g, torch.float32, "sum")
    before = [t.clone() for t in tables]
    _, _, gb, go, _ = groups[0]
    row = int(torch.argmax(go[1:] - go[:-1]))  # a row in two or more bags
    assert int(go[row + 1] - go[row]) >= 2
    first, second = int(gb[go[row]]), int(gb[go[row] + 1])
    for bad in ("nan", "inf", "overflow"):
        spoilt = grad.clone()
        if bad == "overflow":
            spoilt[first * 32 + 5] = spoilt[second * 32 + 5] = 3e38
        else:
            spoilt[first * 32 + 5] = float(bad)
        rows = ref.unpool_bags(spoilt, groups)
        with pytest.raises(ops.NonFinite) as want:
            ops.sgd_rows_([t.clone() for t in tables], ids, counts, rows, alpha=-1.0)
        with pytest.raises(ops.NonFinite) as got:
            ops.sgd_bags_(tables, ids, counts, spoilt, groups, alpha=-1.0)
        assert str(got.value) == str(want.value)
        assert all(_equal(a, b) for a, b in zip(tables, before))
    bad_ids = ids.clone()
    bad_ids[counts[0] + 1] = 60
    with pytest.raises(ops.RowOutOfRange, match="row 60 at position .* outside table 1 of 60 rows"):
        ops.sgd_bags_(tables, bad_ids, counts, grad, groups, alpha=-1.0)
    assert all(_equal(a, b) for a, b in zip(tables, before))
    with pytest.raises(ValueError, match="grad holds 515 elements; the groups' bags need more"):
        ops.sgd_bags_(tables, ids, counts, grad[:-1], groups, alpha=-1.0)
