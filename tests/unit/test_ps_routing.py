"""The trainer side of the parameter servers without processes: routing ids to servers and pooling
their replies equals the local ``EmbeddingBagCollection`` -- outputs and table gradients -- with
one table group (one dimension, one pooling) and several, for every layout."""

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybrid.ps.client import BadIdError, RemoteEmbeddingBagCollection
from hybrid.ps.client.routing import Router
from tests.support.sparse import global_batch, kjt_slice
from tests.support.sparse import sample_tables as mixed_tables


def _same_dim_tables(pooling: PoolingType) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=50, feature_names=["f0"], pooling=pooling),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=30, feature_names=["f1", "f2"], pooling=pooling),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=7, feature_names=["f3"], pooling=pooling),
    ]


def _router(ebc, *, num_servers: int, sharding: str = "row_wise", id_policy: str = "error") -> Router:
    config = RemoteEmbeddingBagCollection.config_from(ebc, cid="c", num_servers=num_servers, sharding=sharding,
                                                      optimizer={"name": "sgd"}, num_trainers=1, id_policy=id_policy)
    return Router(config)


def _serve(router: Router, routed, weights: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """What each server would answer: the requested rows of its tables, flat, as leaves."""
    out = {}
    for s, req in routed.requests.items():
        parts = []
        for ti, local in zip(req.tables, req.ids.split(req.counts)):
            lay = router.config.layouts[ti]
            rows = lay.global_ids(lay.servers.index(s), local)
            parts.append(weights[lay.table.name][rows].reshape(-1))
        out[s] = (torch.cat(parts) if parts else torch.zeros(0)).requires_grad_(True)
    return out


def _table_grads(router: Router, routed, rows: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The servers' row gradients scattered back into whole tables."""
    tables = router.config.tables
    grads = {t.name: torch.zeros(t.num_embeddings, t.embedding_dim) for t in tables}
    for s, req in routed.requests.items():
        dims = [tables[ti].embedding_dim for ti in req.tables]
        chunks = rows[s].grad.split([n * d for n, d in zip(req.counts, dims)])
        for ti, local, g, d in zip(req.tables, req.ids.split(req.counts), chunks, dims):
            lay = router.config.layouts[ti]
            grads[lay.table.name].index_add_(0, lay.global_ids(lay.servers.index(s), local), g.view(-1, d))
    return grads


def _check(tables, *, weighted: bool, num_servers: int, sharding: str, groups: int, key_order=None):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted)
    router = _router(ebc, num_servers=num_servers, sharding=sharding)
    assert len(router.groups) == groups
    data = global_batch(3, tables, 6, weighted=weighted)
    kjt = kjt_slice(data, 0, 6, keys=key_order)
    weights = {n: b.weight.detach() for n, b in ebc.embedding_bags.items()}
    routed = router.route(kjt, where="c")
    rows = _serve(router, routed, weights)
    got = router.pool(routed, rows)
    want = ebc(kjt)
    assert router.embedding_names == want.keys()
    torch.testing.assert_close(got, want.values(), rtol=1e-6, atol=1e-6)
    g = torch.randn_like(want.values())
    (got * g).sum().backward()
    (want.values() * g).sum().backward()
    for name, grad in _table_grads(router, routed, rows).items():
        torch.testing.assert_close(grad, ebc.embedding_bags[name].weight.grad, rtol=1e-5, atol=1e-6)
    # Every distinct row went out once, to the one server that holds it.
    sent = sum(req.ids.numel() for req in routed.requests.values())
    distinct = sum(torch.unique(torch.cat([kjt[f].values() for f in t.feature_names])).numel() for t in tables)
    assert sent == distinct


@pytest.mark.parametrize("num_servers,sharding", [(1, "row_wise"), (3, "row_wise"), (2, "table_wise")])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_one_group_equals_the_local_collection(num_servers, sharding, pooling):
    _check(_same_dim_tables(pooling), weighted=False, num_servers=num_servers, sharding=sharding, groups=1)


@pytest.mark.parametrize("num_servers,sharding", [(1, "row_wise"), (2, "row_wise")])
def test_weighted_and_in_another_key_order(num_servers, sharding):
    _check(_same_dim_tables(PoolingType.SUM), weighted=True, num_servers=num_servers, sharding=sharding,
           groups=1, key_order=["f3", "f1", "f0", "f2"])


@pytest.mark.parametrize("num_servers,sharding", [(1, "row_wise"), (2, "row_wise"), (2, "table_wise")])
def test_mixed_dimensions_go_group_by_group_and_equal_the_local_collection(num_servers, sharding):
    tables = mixed_tables()
    kinds = {(t.embedding_dim, t.pooling) for t in tables}
    _check(tables, weighted=False, num_servers=num_servers, sharding=sharding, groups=len(kinds))


def test_routing_applies_the_id_policy():
    tables = _same_dim_tables(PoolingType.SUM)
    ebc = EmbeddingBagCollection(tables=tables)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2", "f3"], values=torch.tensor([1, 2, 3, 9]), lengths=torch.tensor([1, 1, 1, 1]),
    )
    strict = _router(ebc, num_servers=1)
    with pytest.raises(BadIdError, match="feature 'f3': 1 id\\(s\\) outside table 't2' of 7 rows"):
        strict.route(kjt, where="c")
    modulo = _router(ebc, num_servers=1, id_policy="modulo")
    req = modulo.route(kjt, where="c").requests[0]
    assert req.counts == [1, 2, 1] and req.ids.tolist() == [1, 2, 3, 2]  # 9 % 7 == 2 in t2


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
    servers, both shardings, one table group and several): the remote collection pools exactly
    what the local one does and gives the rows the local one's gradients, or -- only for ids outside a table under id_policy=error -- raises
    BadIdError before anything is sent; under modulo it equals the local one on the wrapped ids.
    Per-sample weights require grad and get the local one's gradients."""
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
        router = _router(ebc, num_servers=num_servers, sharding=sharding, id_policy=policy)
        table_of = {f: t for t in tables for f in t.feature_names}
        out_of_range = any(((kjt[f].values() < 0) | (kjt[f].values() >= table_of[f].num_embeddings)).any()
                           for f in kjt.keys())
        route_fn = lambda k: router.route(k, where="c")  # noqa: E731
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
        rows = _serve(router, route, weights)
        if weighted:  # per-sample weights that require grad, in both
            kjt, ref_kjt = (KeyedJaggedTensor.from_lengths_sync(
                keys=k.keys(), values=k.values(), lengths=k.lengths(),
                weights=k.weights().detach().clone().requires_grad_()) for k in (kjt, ref_kjt))
        got = router.pool(route, rows, kjt)
        want = ebc(ref_kjt)
        assert router.embedding_names == want.keys(), case
        torch.testing.assert_close(got, want.values(), rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"case {case}: {m}")
        # And the rows' gradients: the local collection's, row by row.
        gout = torch.randn(want.values().shape, generator=g)
        (got * gout).sum().backward()
        (want.values() * gout).sum().backward()
        for name, grad in _table_grads(router, route, rows).items():
            want_grad = ebc.embedding_bags[name].weight.grad
            want_grad = torch.zeros_like(grad) if want_grad is None else want_grad
            torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"case {case} table {name} gradient: {m}")
        if weighted:  # and the weights' gradients, torch's own bit for bit
            assert torch.equal(kjt.weights().grad, ref_kjt.weights().grad), case
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
    router = _router(EmbeddingBagCollection(tables=tables, is_weighted=weights is not None), num_servers=1)
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor(values), lengths=torch.tensor(lengths),
                            weights=None if weights is None else torch.tensor(weights))
    with pytest.raises(BadBatchError, match=message):
        router.route(kjt, where="c")  # routing comes before anything is sent


@pytest.mark.parametrize("num_servers,sharding,key_order", [(1, "row_wise", None), (3, "row_wise", ["s3", "s1", "s0", "s2"]),
                                                            (2, "table_wise", None)])
def test_unpooled_rows_and_gradients_equal_the_local_embedding_collection(num_servers, sharding, key_order):
    """``Router.embed``: each id's row in batch order (empty and long sequences), and each unique
    row's gradient the sum over its positions, sent once."""
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    torch.manual_seed(0)
    tables = [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=50, feature_names=["s0"]),
              EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=30, feature_names=["s1", "s2"]),
              EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=7, feature_names=["s3"])]
    ec = EmbeddingCollection(tables=tables)
    config = RemoteEmbeddingBagCollection.config_from(ec, cid="c", num_servers=num_servers, sharding=sharding,
                                                      optimizer={"name": "sgd"}, num_trainers=1)
    assert {t.pooling for t in config.tables} == {"none"}
    router = Router(config)
    data = global_batch(5, tables, 6, max_len=3)
    data["s1"][0][2] = 0
    data["s1"] = (torch.cat([data["s1"][0][:5], torch.tensor([40])]),
                  torch.cat([data["s1"][1][: int(data["s1"][0][:5].sum())], torch.randint(0, 30, (40,))]), None)
    kjt = kjt_slice(data, 0, 6, keys=key_order)
    weights = {n: e.weight.detach() for n, e in ec.embeddings.items()}
    routed = router.route(kjt, where="c")
    rows = _serve(router, routed, weights)
    got = router.embed(routed, rows)
    want = ec(kjt)
    assert list(got) == [f for t in tables for f in t.feature_names] == list(want)
    loss_got, loss_want = 0, 0
    for f in want:
        torch.testing.assert_close(got[f], want[f].values(), rtol=0, atol=0)
        g = torch.randn_like(got[f])
        loss_got, loss_want = loss_got + (got[f] * g).sum(), loss_want + (want[f].values() * g).sum()
    loss_got.backward()
    loss_want.backward()
    for name, grad in _table_grads(router, routed, rows).items():
        torch.testing.assert_close(grad, ec.embeddings[name].weight.grad, rtol=1e-5, atol=1e-6)
    sent = sum(req.ids.numel() for req in routed.requests.values())
    distinct = sum(torch.unique(torch.cat([kjt[f].values() for f in t.feature_names])).numel() for t in tables)
    assert sent == distinct < kjt.values().numel()
