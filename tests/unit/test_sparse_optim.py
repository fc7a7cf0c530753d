"""The server's row-sparse optimizers against the tests' reference implementations, and the
references against torch.optim where one exists (SGD, Adagrad; Adam when every row is touched,
where lazy per-row step counts equal the global one)."""

import pytest
import torch

from hybrid.errors import PlanError
from hybrid.ps.config import OptimizerSpec as SparseOptimSpec
from hybrid.ps.server.optim import RowSparseOptimizer
from hybrid.ps.sharding import TableSpec, shard_tables
from tests.support.sparse import ReferenceSparseOptimizer

ROWS, DIM = 12, 3


def _grads(steps: int, all_rows: bool):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        grad = torch.randn(ROWS, DIM, generator=g)
        touched = torch.ones(ROWS, dtype=torch.bool) if all_rows else torch.rand(ROWS, generator=g) < 0.4
        yield grad * touched.unsqueeze(1), touched


@pytest.mark.parametrize("name,torch_opt,all_rows", [
    ("sgd", lambda p: torch.optim.SGD([p], lr=0.1), False),
    ("adagrad", lambda p: torch.optim.Adagrad([p], lr=0.1, eps=1e-8), False),
    ("adam", lambda p: torch.optim.Adam([p], lr=0.1, eps=1e-8), True),
])
def test_reference_matches_torch_optim(name, torch_opt, all_rows):
    w0 = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    p = torch.nn.Parameter(w0.clone())
    opt = torch_opt(p)
    ref = ReferenceSparseOptimizer(name, w0.clone(), lr=0.1)
    for grad, touched in _grads(8, all_rows):
        p.grad = grad.clone()
        opt.step()
        ref.step(grad, touched)
    torch.testing.assert_close(ref.w, p.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_server_optimizer_matches_reference_on_touched_rows(name):
    w0 = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    ref = ReferenceSparseOptimizer(name, w0.clone(), lr=0.1)
    weight = w0.clone()
    opt = RowSparseOptimizer(SparseOptimSpec(name=name, lr=0.1), ROWS, DIM, huge_pages=False)
    for grad, touched in _grads(8, all_rows=False):
        rows = touched.nonzero().flatten()
        opt.commit(weight, rows, *opt.compute(weight, rows, grad[rows]))
        ref.step(grad, touched)
    torch.testing.assert_close(weight, ref.w, rtol=1e-6, atol=1e-6)
    for k, v in ref.state.items():
        torch.testing.assert_close(opt.state[k], v, rtol=1e-6, atol=1e-6)


def test_a_failing_update_changes_nothing():
    weight = torch.zeros(ROWS, DIM)
    opt = RowSparseOptimizer(SparseOptimSpec(name="adagrad", lr=0.1), ROWS, DIM, huge_pages=False)
    rows = torch.tensor([1, 4])
    with pytest.raises(FloatingPointError, match="not finite|non-finite"):
        opt.commit(weight, rows, *opt.compute(weight, rows, torch.tensor([[1.0, 2.0, float("nan")], [1.0, 1.0, 1.0]])))
    assert torch.equal(weight, torch.zeros(ROWS, DIM))
    assert torch.equal(opt.state["sum"], torch.zeros(ROWS, DIM))


def test_unknown_optimizer_is_refused_with_the_known_names():
    with pytest.raises(PlanError, match="unknown sparse optimizer 'lamb'.*rowwise_adagrad"):
        SparseOptimSpec(name="lamb")


def test_row_wise_is_cyclic_and_table_wise_balances_bytes():
    tables = [TableSpec(name=n, num_embeddings=r, embedding_dim=4, feature_names=(n,))
              for n, r in [("a", 10), ("b", 7), ("c", 3), ("d", 3)]]
    rw = shard_tables(tables, 3, "row_wise")
    assert [rw[0].rows_on(s) for s in range(3)] == [4, 3, 3]
    ids = torch.arange(10)
    assert torch.equal(rw[0].global_ids(1, rw[0].local_ids(ids[rw[0].shard_of(ids) == 1])), torch.tensor([1, 4, 7]))
    tw = shard_tables(tables, 2, "table_wise")
    # a (160 B) -> ps0, b (112 B) -> ps1, c -> ps1 (now 160 B each), d -> ps0 (tie: lower index)
    assert [lay.servers for lay in tw] == [(0,), (1,), (1,), (0,)]
    with pytest.raises(ValueError, match="servers \\[3\\] do not exist"):
        shard_tables(tables, 2, "row_wise", servers=[0, 3])
