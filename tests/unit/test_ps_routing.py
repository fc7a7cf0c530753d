"""The trainer side of the parameter servers without processes: routing ids to servers and pooling
their replies equals the local ``EmbeddingBagCollection`` -- outputs and table gradients -- on the
fast path (one dimension, one pooling) and on the table-by-table path, for every layout."""

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybrid.ps.client import BadIdError, RemoteEmbeddingBagCollection
from hybrid.ps.fused import FusedRoute
from tests.support.sparse import global_batch, kjt_slice
from tests.support.sparse import test_tables as mixed_tables


def _same_dim_tables(pooling: PoolingType) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=50, feature_names=["f0"], pooling=pooling),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=30, feature_names=["f1", "f2"], pooling=pooling),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=7, feature_names=["f3"], pooling=pooling),
    ]


def _serve(remote: RemoteEmbeddingBagCollection, route, weights: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """What each server would answer: the requested rows of its held tables, flat, as leaves."""
    out = {}
    for s, (ids, counts) in route.requests.items():
        parts = []
        for ti, local in zip(remote.held[s], ids.split(counts)):
            lay = remote.layouts[ti]
            rows = lay.global_ids(lay.servers.index(s), local)
            parts.append(weights[lay.table.name][rows].reshape(-1))
        out[s] = torch.cat(parts).requires_grad_(True)
    return out


def _table_grads(remote, route, rows: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The servers' row gradients scattered back into whole tables."""
    grads = {t.name: torch.zeros(t.num_embeddings, t.embedding_dim) for t in remote.tables}
    for s, (ids, counts) in route.requests.items():
        dims = [remote.tables[ti].embedding_dim for ti in remote.held[s]]
        chunks = rows[s].grad.split([n * d for n, d in zip(counts, dims)])
        for ti, local, g, d in zip(remote.held[s], ids.split(counts), chunks, dims):
            lay = remote.layouts[ti]
            grads[lay.table.name].index_add_(0, lay.global_ids(lay.servers.index(s), local), g.view(-1, d))
    return grads


def _check(tables, *, weighted: bool, num_servers: int, sharding: str, fused: bool, key_order=None):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted)
    remote = RemoteEmbeddingBagCollection.from_collection(ebc, cid="c", num_servers=num_servers, sharding=sharding)
    assert (remote._fused is not None) == fused
    data = global_batch(3, tables, 6, weighted=weighted)
    kjt = kjt_slice(data, 0, 6, keys=key_order)
    weights = {n: b.weight.detach() for n, b in ebc.embedding_bags.items()}
    route = remote._fused.route(kjt, fix_ids=remote._fix_ids) if fused else remote._route(kjt)
    assert isinstance(route, FusedRoute) == fused
    rows = _serve(remote, route, weights)
    got = remote._pool(route, rows)
    want = ebc(kjt)
    assert got.keys() == want.keys()
    torch.testing.assert_close(got.values(), want.values(), rtol=1e-6, atol=1e-6)
    g = torch.randn_like(want.values())
    (got.values() * g).sum().backward()
    (want.values() * g).sum().backward()
    for name, grad in _table_grads(remote, route, rows).items():
        torch.testing.assert_close(grad, ebc.embedding_bags[name].weight.grad, rtol=1e-5, atol=1e-6)
    # Every distinct row went out once, to the one server that holds it.
    sent = sum(ids.numel() for ids, _ in route.requests.values())
    distinct = sum(torch.unique(torch.cat([kjt[f].values() for f in t.feature_names])).numel() for t in tables)
    assert sent == distinct


@pytest.mark.parametrize("num_servers,sharding", [(1, "row_wise"), (3, "row_wise"), (2, "table_wise")])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_fast_path_equals_the_local_collection(num_servers, sharding, pooling):
    _check(_same_dim_tables(pooling), weighted=False, num_servers=num_servers, sharding=sharding, fused=True)


@pytest.mark.parametrize("num_servers,sharding", [(1, "row_wise"), (2, "row_wise")])
def test_fast_path_weighted_and_in_another_key_order(num_servers, sharding):
    _check(_same_dim_tables(PoolingType.SUM), weighted=True, num_servers=num_servers, sharding=sharding,
           fused=True, key_order=["f3", "f1", "f0", "f2"])


@pytest.mark.parametrize("num_servers,sharding", [(1, "row_wise"), (2, "row_wise"), (2, "table_wise")])
def test_mixed_dimensions_go_table_by_table_and_equal_the_local_collection(num_servers, sharding):
    _check(mixed_tables(), weighted=False, num_servers=num_servers, sharding=sharding, fused=False)


def test_fast_path_applies_the_id_policy():
    tables = _same_dim_tables(PoolingType.SUM)
    ebc = EmbeddingBagCollection(tables=tables)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2", "f3"], values=torch.tensor([1, 2, 3, 9]), lengths=torch.tensor([1, 1, 1, 1]),
    )
    strict = RemoteEmbeddingBagCollection.from_collection(ebc, cid="c", num_servers=1)
    with pytest.raises(BadIdError, match="feature 'f3': 1 id\\(s\\) outside table 't2' of 7 rows"):
        strict._fused.route(kjt, fix_ids=strict._fix_ids)
    modulo = RemoteEmbeddingBagCollection.from_collection(ebc, cid="c", num_servers=1, id_policy="modulo")
    route = modulo._fused.route(kjt, fix_ids=modulo._fix_ids)
    ids, counts = route.requests[0]
    assert counts == [1, 2, 1] and ids.tolist() == [1, 2, 3, 2]  # 9 % 7 == 2 in t2


def _random_kjt(g: torch.Generator, tables, n: int, *, weighted: bool, bad: bool) -> KeyedJaggedTensor:
    """``n`` samples: bag lengths 0..4 (a third empty, sometimes a whole feature empty), ids in
    range, or with ``bad`` also negative and past the end."""
    keys = [f for t in tables for f in t.feature_names]
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    lengths, values = [], []
    for f in keys:
        ln = torch.randint(0, 5, (n,), generator=g) * (torch.rand(n, generator=g) > 0.33)
        if float(torch.rand(1, generator=g)) < 0.15:
            ln = torch.zeros(n, dtype=torch.int64)
        lo, hi = (-3, rows[f] + 3) if bad else (0, rows[f])
        lengths.append(ln)
        values.append(torch.randint(lo, hi, (int(ln.sum()),), generator=g))
    v = torch.cat(values)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=v, lengths=torch.cat(lengths),
        weights=torch.rand(v.numel(), generator=g) if weighted else None)


def test_seeded_fuzz_routing_and_pooling_equal_the_local_collection_or_refuse_bad_ids():
    """Random batches (empty bags, empty features, bad ids, weights, both pooling modes, 1-3
    servers, both shardings, fast and table-by-table paths): the remote collection pools exactly
    what the local one does and gives the rows the local one's gradients, or -- only for ids outside a table under id_policy=error -- raises
    BadIdError before anything is sent; under modulo it equals the local one on the wrapped ids."""
    g = torch.Generator().manual_seed(1234)
    outcomes = {"equal": 0, "refused": 0, "wrapped": 0}
    for case in range(60):
        weighted = case % 3 == 0
        pooling = PoolingType.SUM if weighted or case % 2 else PoolingType.MEAN
        tables = _same_dim_tables(pooling) if case % 4 or weighted else mixed_tables()  # weights: sum only
        num_servers = 1 + case % 3
        sharding = "table_wise" if case % 5 == 0 and num_servers <= len(tables) else "row_wise"
        policy = "modulo" if case % 7 == 0 else "error"
        bad = case % 2 == 1
        kjt = _random_kjt(g, tables, 1 + case % 6, weighted=weighted, bad=bad)
        torch.manual_seed(case)
        ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted)
        remote = RemoteEmbeddingBagCollection.from_collection(ebc, cid="c", num_servers=num_servers,
                                                               sharding=sharding, id_policy=policy)
        table_of = {f: t for t in tables for f in t.feature_names}
        out_of_range = any(((kjt[f].values() < 0) | (kjt[f].values() >= table_of[f].num_embeddings)).any()
                           for f in kjt.keys())
        route_fn = (lambda k: remote._fused.route(k, fix_ids=remote._fix_ids)) if remote._fused else remote._route
        if out_of_range and policy == "error":
            with pytest.raises(BadIdError, match="outside table"):
                route_fn(kjt)
            outcomes["refused"] += 1
            continue
        if out_of_range:  # modulo: the local collection on the wrapped ids
            wrapped = torch.cat([torch.remainder(kjt[f].values(), table_of[f].num_embeddings) for f in kjt.keys()])
            ref_kjt = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=wrapped, lengths=kjt.lengths(),
                                                          weights=kjt.weights_or_none())
            outcomes["wrapped"] += 1
        else:
            ref_kjt = kjt
            outcomes["equal"] += 1
        route = route_fn(kjt)
        weights = {n: b.weight.detach() for n, b in ebc.embedding_bags.items()}
        rows = _serve(remote, route, weights)
        got = remote._pool(route, rows)
        want = ebc(ref_kjt)
        assert got.keys() == want.keys(), case
        torch.testing.assert_close(got.values(), want.values(), rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"case {case}: {m}")
        # And the rows' gradients: the local collection's, row by row.
        gout = torch.randn(want.values().shape, generator=g)
        (got.values() * gout).sum().backward()
        (want.values() * gout).sum().backward()
        for name, grad in _table_grads(remote, route, rows).items():
            want_grad = ebc.embedding_bags[name].weight.grad
            want_grad = torch.zeros_like(grad) if want_grad is None else want_grad
            torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"case {case} table {name} gradient: {m}")
    assert all(outcomes.values()), outcomes  # every branch was exercised


@pytest.mark.parametrize("values,lengths,weights,message", [
    ([1, 2, 3], [1, 1, 1, 1], None, "the lengths add up to 4 ids but the batch holds 3 values"),
    ([1, 2, 3, 4, 5], [1, 1, 1, 1], None, "the lengths add up to 4 ids but the batch holds 5 values"),
    ([1, 2, 3, 4], [1, 1, 3, -1], None, "a negative bag length \\(-1\\) in feature 'f1'"),
    ([1, 2, 3, 4], [1, 1, 1, 1], [0.5, 0.5], "2 per-sample weights for 4 ids"),
])
def test_a_batch_whose_lengths_and_values_disagree_is_refused_before_anything_is_sent(values, lengths, weights,
                                                                                       message):
    from hybrid.ps.client import BadBatchError

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=50, feature_names=[f"f{i}"])
              for i in range(2)]
    remote = RemoteEmbeddingBagCollection.from_collection(
        EmbeddingBagCollection(tables=tables, is_weighted=weights is not None), cid="c", num_servers=1)
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor(values), lengths=torch.tensor(lengths),
                            weights=None if weights is None else torch.tensor(weights))
    with pytest.raises(BadBatchError, match=message):
        remote._send(None, kjt)  # no RPC is initialized: the check must come first
