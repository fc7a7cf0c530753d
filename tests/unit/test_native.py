"""The native kernels (``hybrid/ps/_kernels.c``) against the torch code they replace, and how
they are built: the same routes, rows and SGD updates; bad ids and non-finite gradients refused
before anything is written; a missing compiler or a shared cache directory handled as
``runtime.native_kernels`` says."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from hybrid.ps import native
from hybrid.ps.client import RemoteEmbeddingBagCollection
from hybrid.ps.optim import SparseOptimSpec
from hybrid.ps.server import CollectionShard
from hybrid.ps.sharding import TableSpec, shard_tables
from tests.unit.test_ps_routing import _random_kjt


@pytest.fixture
def kernels_mode():
    """Restore the process-wide mode (and a built library) after a test that changes it."""
    yield
    native.configure(mode="off")
    native.configure(mode="auto")


def _route(remote, kjt, mode: str):
    native.configure(mode=mode)
    return remote._fused.route(kjt, fix_ids=remote._fix_ids)


def test_the_kernels_build_here():
    assert native.lib() is not None, "this machine has a C compiler: runtime.native_kernels auto must use it"


@pytest.mark.parametrize("case", range(40))
def test_native_route_sends_what_the_torch_route_sends_and_pools_the_same(case, kernels_mode):
    g = torch.Generator().manual_seed(case)
    weighted = case % 3 == 0
    pooling = PoolingType.SUM if weighted or case % 2 else PoolingType.MEAN
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=50, feature_names=["f0"], pooling=pooling),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=3000, feature_names=["f1", "f2"],
                           pooling=pooling),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=7, feature_names=["f3"], pooling=pooling),
    ]
    num_servers = 1 + case % 3
    sharding = "table_wise" if case % 5 == 0 and num_servers <= len(tables) else "row_wise"
    remote = RemoteEmbeddingBagCollection.from_collection(
        EmbeddingBagCollection(tables=tables, is_weighted=weighted), cid="c", num_servers=num_servers,
        sharding=sharding, id_policy="modulo" if case % 4 == 0 else "error")
    kjt = _random_kjt(g, tables, 1 + case % 9, weighted=weighted, bad=case % 4 == 0)
    ours, ref = _route(remote, kjt, "on"), _route(remote, kjt, "off")
    assert ours.grad_order is None
    assert ours.n_raw == ref.n_raw
    for s in ref.requests:
        assert torch.equal(ours.requests[s][0], ref.requests[s][0]) and ours.requests[s][1] == ref.requests[s][1]
    assert torch.equal(ours.idx, ref.idx) and torch.equal(ours.offsets, ref.offsets)
    if ref.weights is not None:
        assert torch.equal(ours.weights, ref.weights)
    # Pooled values and the rows' gradients (the backward's groups come in another order).
    rows = torch.randn(sum(ids.numel() for ids, _ in ref.requests.values()) * 4, generator=g)
    gout = torch.randn(kjt.stride(), len(remote.feature_order) * 4, generator=g)
    results = []
    for route in (ours, ref):
        r = {s: part.clone().requires_grad_(True) for s, part in
             zip(remote.servers, rows.split([ids.numel() * 4 for ids, _ in route.requests.values()]))}
        out = remote._fused.pool(route, r)
        out.backward(gout.view_as(out))
        results.append((out.detach(), torch.cat([r[s].grad for s in remote.servers])))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-6, atol=1e-6)


TABLES = [TableSpec("a", 5000, 8, ("fa",)), TableSpec("b", 300, 8, ("fb",)), TableSpec("c", 70, 8, ("fc",))]


def _shard(num_trainers: int = 1) -> CollectionShard:
    shard = CollectionShard(cid="ebc", server=0, layouts=shard_tables(TABLES, 1, "table_wise"),
                            optimizer=SparseOptimSpec(name="sgd", lr=0.1), num_trainers=num_trainers, staleness=0,
                            gradient_scaling="mean", start_step=0)
    for t in shard.tables:
        t.init_uniform(3)
    return shard


def _ids(g: torch.Generator, distinct: bool) -> tuple[torch.Tensor, list[int]]:
    if distinct:
        parts = [torch.randperm(t.num_embeddings, generator=g)[: 40].sort().values for t in TABLES]
    else:
        parts = [torch.randint(0, t.num_embeddings, (40,), generator=g) for t in TABLES]
    return torch.cat(parts), [40] * len(TABLES)


@pytest.mark.parametrize("distinct", [True, False])
def test_native_rows_and_sgd_equal_torch_bit_for_bit(distinct, kernels_mode):
    g = torch.Generator().manual_seed(5)
    parts = []
    for _ in range(2):  # one push per trainer, the step applied once both are in
        ids, counts = _ids(g, distinct)
        parts.append((ids, counts, torch.randn(sum(n * t.embedding_dim for n, t in zip(counts, TABLES)), generator=g)))
    results = {}
    for mode in ("on", "off"):
        native.configure(mode=mode)
        shard = _shard(num_trainers=2)
        rows = shard.gather(parts[0][0], parts[0][1])
        for trainer, part in enumerate(parts):
            shard.push_parts(trainer, 0, [part])
        results[mode] = (rows, [t.weight.clone() for t in shard.tables])
    assert torch.equal(results["on"][0], results["off"][0])
    for a, b in zip(results["on"][1], results["off"][1]):
        assert torch.equal(a, b)
    # and it is the SGD of the mean of two trainers' gradients, rows added in order
    ref = _shard(num_trainers=2)
    for k, t in enumerate(ref.tables):
        for ids, counts, grad in parts:
            gk = grad.split([n * s.embedding_dim for n, s in zip(counts, TABLES)])[k].view(-1, t.dim)
            t.weight.index_add_(0, ids.split(counts)[k], gk, alpha=-0.1 * 0.5)
        assert torch.equal(results["on"][1][k], t.weight)


def test_native_refuses_a_bad_row_or_a_nonfinite_gradient_and_writes_nothing(kernels_mode):
    native.configure(mode="on")
    g = torch.Generator().manual_seed(9)
    shard = _shard()
    ids, counts = _ids(g, True)
    grad = torch.randn(sum(n * t.embedding_dim for n, t in zip(counts, TABLES)), generator=g)
    before = [t.weight.clone() for t in shard.tables]
    bad = ids.clone()
    bad[45] = 300  # table b has rows 0..299
    with pytest.raises(IndexError, match="row 300 is outside this server's 300 rows of table 'b'"):
        shard.gather(bad, counts)
    with pytest.raises(IndexError, match="row 300 is outside this server's 300 rows of table 'b'"):
        shard.push_parts(0, 0, [(bad, counts, grad)])
    for a, b in zip(before, shard.tables):
        assert torch.equal(a, b.weight)
    shard = _shard()  # a failed update fails the collection: a fresh one for the next case
    nan = grad.clone()
    nan[-1] = float("nan")  # the last row of the last table: the first tables must stay untouched too
    with pytest.raises(FloatingPointError, match="non-finite gradients for 1 rows; nothing was applied"):
        shard.push_parts(0, 0, [(ids, counts, nan)])
    for a, b in zip(before, shard.tables):
        assert torch.equal(a, b.weight)


def test_without_a_compiler_auto_falls_back_with_a_warning_and_on_refuses(tmp_path, monkeypatch, caplog,
                                                                           kernels_mode):
    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native.configure(mode="off")
    logging.getLogger("hybrid").propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="hybrid"):
            native.configure(mode="auto")
        assert native.lib() is None
        assert "native kernels unavailable, using the torch code instead" in caplog.text
        assert "no-such-cc" in caplog.text
    finally:
        logging.getLogger("hybrid").propagate = False
    native.configure(mode="off")
    with pytest.raises(native.NativeKernelError, match="runtime.native_kernels is 'on'.*no C compiler"):
        native.configure(mode="on")
    # and a route under auto without kernels is the torch one
    monkeypatch.setenv("CC", "cc")


def test_a_compile_error_is_reported_with_the_compilers_words(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path))
    broken = tmp_path / "_kernels.c"
    broken.write_text("int oops( {\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    with pytest.raises(native.NativeKernelError, match="failed to compile _kernels.c: .*error"):
        native.build()
    assert [p.name for p in tmp_path.iterdir()] == ["_kernels.c"], "a failed build leaves no file behind"


def test_a_cache_directory_others_may_write_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    monkeypatch.setenv("HYBRID_CACHE_DIR", str(d))
    with pytest.raises(native.NativeKernelError, match="not private to this user"):
        native.build()
    fresh = tmp_path / "fresh"
    monkeypatch.setenv("HYBRID_CACHE_DIR", str(fresh))
    path = native.build()
    assert path.parent == fresh and oct(fresh.stat().st_mode & 0o777) == "0o700"
    assert native.build() == path  # cached: the same source and command build once


def test_runtime_option_names_a_bad_mode():
    from hybrid.launch.init import RuntimeOptions
    from hybrid.plan.errors import PlanError

    with pytest.raises(PlanError, match="native_kernels.*'fast'.*auto, on, off"):
        RuntimeOptions(native_kernels="fast")


def _run_optimizer(mode: str, name: str, weight_decay: float, trainers: int, steps: int = 4):
    """A shard trained ``steps`` sync steps by ``trainers`` overlapping pushes per step."""
    native.configure(mode=mode)
    shard = CollectionShard(cid="ebc", server=0, layouts=shard_tables(TABLES, 1, "table_wise"),
                            optimizer=SparseOptimSpec(name=name, lr=0.05, weight_decay=weight_decay),
                            num_trainers=trainers, staleness=0, gradient_scaling="mean", start_step=0)
    for t in shard.tables:
        t.init_uniform(3)
    g = torch.Generator().manual_seed(11)
    for step in range(steps):
        for trainer in range(trainers):
            ids, counts = _ids(g, True)
            grad = torch.randn(sum(n * t.embedding_dim for n, t in zip(counts, TABLES)), generator=g)
            shard.push_parts(trainer, step, [(ids, counts, grad)])
    return [t.weight.clone() for t in shard.tables], [{k: v.clone() for k, v in t.optim.state.items()}
                                                      for t in shard.tables]


@pytest.mark.parametrize("name", ["adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weight_decay,trainers", [(0.0, 1), (0.0, 2), (0.01, 2)])
def test_native_optimizers_equal_torch_to_float32_rounding(name, weight_decay, trainers, kernels_mode):
    (w_on, s_on), (w_off, s_off) = (_run_optimizer(m, name, weight_decay, trainers) for m in ("on", "off"))
    for a, b in zip(w_on, w_off):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(s_on, s_off):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name} state {k}: {m}")
    assert any(not torch.equal(a, b) for a, b in zip(w_on, _run_optimizer("off", name, weight_decay, trainers,
                                                                            steps=0)[0])), "nothing was trained"


def test_native_sum_of_repeated_rows_equals_index_add_bit_for_bit():
    lib = native.lib()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (500,), generator=g)
    grads = torch.randn(500, 8, generator=g)
    rows, summed, bad = torch.empty_like(ids), torch.empty_like(grads), torch.empty(1, dtype=torch.int64)
    nu = lib.hy_sum_rows(500, ids.data_ptr(), grads.data_ptr(), 8, 0.5, 97, rows.data_ptr(), summed.data_ptr(),
                         bad.data_ptr())
    uniq, inverse = torch.unique(ids, return_inverse=True)
    ref = torch.zeros(uniq.numel(), 8).index_add_(0, inverse, grads).mul_(0.5)
    assert nu == uniq.numel() and torch.equal(rows[:nu], uniq) and torch.equal(summed[:nu], ref)


@pytest.mark.parametrize("name", ["adagrad", "rowwise_adagrad", "adam"])
def test_native_optimizer_refuses_a_nonfinite_update_and_writes_nothing(name, kernels_mode):
    native.configure(mode="on")
    shard = CollectionShard(cid="ebc", server=0, layouts=shard_tables(TABLES, 1, "table_wise"),
                            optimizer=SparseOptimSpec(name=name, lr=0.05), num_trainers=1, staleness=0,
                            gradient_scaling="mean", start_step=0)
    for t in shard.tables:
        t.init_uniform(3)
    before = [(t.weight.clone(), {k: v.clone() for k, v in t.optim.state.items()}) for t in shard.tables]
    g = torch.Generator().manual_seed(4)
    ids, counts = _ids(g, True)
    grad = torch.randn(sum(n * t.embedding_dim for n, t in zip(counts, TABLES)), generator=g)
    grad[-1] = float("inf")  # the last table's last row: the first tables' updates must not land either
    with pytest.raises(FloatingPointError, match=f"{name} update produced non-finite weights for 1 rows; nothing"):
        shard.push_parts(0, 0, [(ids, counts, grad)])
    for (w, st), t in zip(before, shard.tables):
        assert torch.equal(w, t.weight) and all(torch.equal(v, t.optim.state[k]) for k, v in st.items())
