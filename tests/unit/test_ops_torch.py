"""The sparse path's operators (:mod:`hybrid.ops`) against plain torch written out here: row
reads, SGD added in place, repeated rows summed, rows written back -- bit for bit -- and the
refusals: a row outside its table or a non-finite gradient raises and writes nothing."""

from __future__ import annotations

import pytest
import torch

from hybrid import ops


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
    assert torch.equal(out[: want.numel()], want)
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
