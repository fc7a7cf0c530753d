"""``pool_on: server`` without processes: the plan option's checks, what a collection refuses,
where ``auto`` pools,
and both ends in this process -- a trainer's router cutting its route per server, each server's
shard pooling and un-pooling -- against the trainer-side pooling, bit for bit. The distributed
tests are in ``tests/distributed/test_ps.py`` (sync against one process) and
``tests/distributed/test_pool_on_server.py``."""
from __future__ import annotations

import logging

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybrid.plan import PlanError, plan_from_dict
from hybrid.ps.client import DistAutogradPush, RemoteEmbeddingBagCollection, RemoteEmbeddingCollection, RidingPush
from hybrid.ps.client.pipeline import StepPipeline
from hybrid.ps.client.routing import Router
from hybrid.ps.config import CollectionConfig, DynamicIds, OptimizerSpec
from hybrid.ps.server.shard import CollectionShard
from hybrid.ps.sharding import TableSpec, shard_tables
from hybrid.ps.transport import LocalTransport
from hybrid.ps.transport.rpc import RpcTransport
from tests.unit.test_plan_models import PS_RULE

# Two groups (dim 4 sum: a, c, d; dim 8 mean: b, read by two features), spread over servers.
TABLES = (TableSpec("a", 50, 4, ("fa",)), TableSpec("b", 30, 8, ("fb", "fb2"), pooling="mean"),
          TableSpec("c", 7, 4, ("fc",)), TableSpec("d", 40, 4, ("fd",)))
WEIGHTED = tuple(TableSpec(t.name, t.num_embeddings, t.embedding_dim, t.feature_names) for t in TABLES)


def _config(tables=TABLES, *, servers: int = 2, sharding: str = "table_wise", pool_on: str = "server",
            **kw) -> CollectionConfig:
    return CollectionConfig(cid="ebc", tables=tables, layouts=tuple(shard_tables(list(tables), servers, sharding)),
                            optimizer=OptimizerSpec(name="sgd", lr=0.1), num_trainers=1, pool_on=pool_on, **kw)


def _pipeline(autograd: bool = False, staleness: int = 0) -> StepPipeline:
    return StepPipeline(trainer=0, transports={}, server_names=["ps0", "ps1"],
                        push=DistAutogradPush(10.0) if autograd else RidingPush(), staleness=staleness,
                        timeout_s=10.0)


@pytest.mark.parametrize("value", ["both", "servers", True])
def test_a_bad_pool_on_names_the_key_and_the_allowed_values(value):
    with pytest.raises(PlanError, match=rf"modules\.e\.pool_on: got {value!r}.*one of 'auto', 'trainer', 'server'"):
        plan_from_dict({"modules": {"e": {**PS_RULE, "pool_on": value}}})
    assert plan_from_dict({"modules": {"e": {**PS_RULE, "pool_on": "server"}}}).modules["e"].options.pool_on == "server"


def test_a_plan_that_cannot_pool_on_its_servers_is_refused_naming_the_rule():
    def plan(**rule):
        return plan_from_dict({"topology": {"parameter_servers": 2}, "sync": {"staleness": 2},
                               "modules": {"e": {**PS_RULE, "pool_on": "server", **rule}}})

    with pytest.raises(PlanError, match=r"modules\.e\.pool_on: server needs every table whole on one "
                                        r"server; row_wise spreads") as e:
        plan(sharding="row_wise")
    assert e.value.category == "bad_value"
    with pytest.raises(PlanError, match=r"modules\.e\.pool_on: server and hot_rows do not go together"):
        plan(sharding="table_wise", hot_rows=100)
    assert plan(sharding="table_wise").modules["e"].options.pool_on == "server"
    assert plan(sharding="row_wise", servers=[1]).modules["e"].options.sharding == "row_wise"  # one server


@pytest.mark.parametrize("case,match", [
    ("row_wise", r"pool_on: server needs every table whole on one server; \['a', 'b', 'c', 'd'\] are split"),
    ("unpooled", r"pool_on: server pools bags: an unpooled collection"),
    ("hot_rows", r"pool_on: server and hot_rows do not go together"),
    ("dist_autograd", r"pool_on: server needs runtime.gradient_push: rpc"),
])
def test_what_a_collection_pooled_on_its_servers_refuses(case, match):
    kw = {}
    config = _config(sharding="row_wise") if case == "row_wise" else _config()
    if case == "unpooled":
        tables = tuple(TableSpec(t.name, t.num_embeddings, 4, t.feature_names, pooling="none") for t in TABLES)
        config = _config(tables)
        cls = RemoteEmbeddingCollection
    else:
        cls = RemoteEmbeddingBagCollection
    pipeline = _pipeline(autograd=case == "dist_autograd", staleness=1 if case == "hot_rows" else 0)
    if case == "hot_rows":
        config = _config(staleness=1)
        kw["hot_rows"] = 10
    with pytest.raises(PlanError, match=match) as e:
        cls(config, pipeline=pipeline, server_names=["ps0", "ps1"], **kw)
    assert e.value.key == "pool_on"


def test_auto_pools_on_the_servers_only_where_every_one_is_across_the_network_and_can_pool():
    """``auto`` (the default): pooled on the servers when each of the collection's servers is
    reached over a network connection (TCP, RPC) and nothing stands in the way; on the trainer
    where one shares its memory (in process, shared memory) or where ``server`` would be
    refused -- silently, as a choice, not an error."""
    assert CollectionConfig.__dataclass_fields__["pool_on"].default == "auto"
    assert plan_from_dict({"modules": {"e": PS_RULE}}).modules["e"].options.pool_on == "auto"
    remote = {0: RpcTransport("ps0", timeout_s=1.0), 1: RpcTransport("ps1", timeout_s=1.0)}
    near = {0: RpcTransport("ps0", timeout_s=1.0), 1: LocalTransport("ps1")}
    assert not any(t.shares_memory for t in remote.values()) and near[1].shares_memory

    def pools(config=None, *, transports=remote, autograd=False, cls=RemoteEmbeddingBagCollection, **kw) -> bool:
        pipeline = _pipeline(autograd=autograd, staleness=config.staleness if config else 0)
        pipeline.transports = transports
        config = config or _config(pool_on="auto")
        return cls(config, pipeline=pipeline, server_names=["ps0", "ps1"], **kw).pools_on_server

    assert pools()
    assert not pools(transports=near)
    assert not pools(_config(pool_on="trainer"))
    assert pools(_config(pool_on="server"), transports=near)  # asked for: wherever the servers are
    assert not pools(_config(sharding="row_wise", pool_on="auto"))
    assert not pools(_config(pool_on="auto", staleness=1), hot_rows=10)
    assert not pools(autograd=True)
    unpooled = tuple(TableSpec(t.name, t.num_embeddings, 4, t.feature_names, pooling="none") for t in TABLES)
    assert not pools(_config(unpooled, pool_on="auto"), cls=RemoteEmbeddingCollection)


def test_auto_says_why_a_trainer_across_the_network_pools_itself(caplog):
    """Where every server is across the network but ``server`` would be refused, ``auto`` pools on
    the trainer and says why in one line (the fix is often one plan key); nothing where a server
    shares the trainer's memory, the servers pool, or the collection has no bags."""
    from hybrid.log import logger

    remote = {0: RpcTransport("ps0", timeout_s=1.0), 1: RpcTransport("ps1", timeout_s=1.0)}

    def said(config, *, transports=remote, cls=RemoteEmbeddingBagCollection) -> list[str]:
        pipeline = _pipeline()
        pipeline.transports = transports
        caplog.clear()
        level, propagate = logger.level, logger.propagate
        logger.addHandler(caplog.handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # caught once, by the handler above
        try:
            cls(config, pipeline=pipeline, server_names=["ps0", "ps1"])
        finally:
            logger.removeHandler(caplog.handler)
            logger.setLevel(level)
            logger.propagate = propagate
        return [r.getMessage() for r in caplog.records]

    assert said(_config(sharding="row_wise", pool_on="auto")) == [
        "ebc: trainer 0 pools its bags itself (pool_on: auto); its servers, across the network, would send fewer "
        "bytes pooling them, but pool_on: server needs every table whole on one server; ['a', 'b', 'c', 'd'] are "
        "split over servers (sharding: table_wise, or one server)"]
    assert said(_config(sharding="row_wise", pool_on="auto"),
                transports={0: RpcTransport("ps0", timeout_s=1.0), 1: LocalTransport("ps1")}) == []
    assert said(_config(pool_on="auto")) == []  # pooled on the servers
    assert said(_config(sharding="row_wise", pool_on="trainer")) == []  # asked for
    unpooled = tuple(TableSpec(t.name, t.num_embeddings, 4, t.feature_names, pooling="none") for t in TABLES)
    assert said(_config(unpooled, pool_on="auto"), cls=RemoteEmbeddingCollection) == []


def _batch(weighted: bool, seed: int = 0, empty_group: bool = False) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys = [f for t in TABLES for f in t.feature_names]
    b = 5
    lengths = torch.randint(0, 4, (len(keys) * b,), generator=g)
    lengths[3] = 0  # an empty bag, and a feature with none at all
    lengths[b * 3 : b * 4] = 0
    if empty_group:  # the dim-8 group's two features (fb, fb2) have no id at all
        lengths[b : b * 3] = 0
    rows = {f: t.num_embeddings for t in TABLES for f in t.feature_names}
    values = torch.cat([torch.randint(0, rows[f], (int(n),), generator=g)
                        for f, n in zip(keys, lengths.view(len(keys), b).sum(1))])
    weights = torch.rand(values.shape, generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights)


def _shards(config: CollectionConfig) -> dict[int, CollectionShard]:
    out = {}
    for s in config.servers:
        out[s] = CollectionShard(config, s, start_step=0, huge_pages=False)
        for t in out[s].tables:
            t.initialize(5)
    return out


@pytest.mark.parametrize("servers,weighted,dynamic,empty_group", [
    (2, False, False, False), (2, True, False, False), (1, False, False, False), (3, False, True, False),
    (2, False, False, True), (1, True, False, True)])
def test_servers_pool_and_unpool_as_the_trainer_does_bit_for_bit(servers, weighted, dynamic, empty_group):
    tables = WEIGHTED if weighted else TABLES
    dyn = {"dynamic": DynamicIds(capacity=64, partitions=4)} if dynamic else {}
    config = _config(tables, servers=servers, weighted=weighted, **dyn)
    router, shards = Router(config), _shards(config)
    kjt = _batch(weighted, empty_group=empty_group)
    routed = router.route(kjt, where="test", tag=7)
    # Trainer-side pooling: the servers' rows, pooled here (a route without a tag: one with the
    # backward's index, which a tagged route leaves to the servers).
    mine = router.route(kjt, where="test")
    assert routed.routes[0].grad_bags is None and mine.routes[0].grad_bags is not None
    assert all(torch.equal(mine.requests[s].ids, routed.requests[s].ids) for s in config.servers)
    rows = {s: shards[s].gather(mine.requests[s]).detach().requires_grad_(True) for s in config.servers}
    expected = router.pool(mine, rows)
    # Server-side: each server pools its bags; the trainer puts the blocks side by side.
    replies = {}
    for s in config.servers:
        bags = routed.bags[s]
        assert bags.tag == 7
        replies[s] = torch.empty(bags.numel())
        shards[s].gather_pooled(0, routed.requests[s], bags, replies[s], step=0)
    replies = {s: r.requires_grad_(True) for s, r in replies.items()}
    got = router.pooled(routed, replies)
    assert got.shape == expected.shape == (5, sum(t.embedding_dim * len(t.feature_names) for t in tables))
    assert torch.equal(got, expected)
    c = torch.linspace(-1, 1, got.shape[1])
    ((expected @ c) ** 2).sum().backward()
    ((got @ c) ** 2).sum().backward()
    for s in config.servers:
        rows_back, grad = shards[s].unpool(0, 7, replies[s].grad.reshape(-1), step=0)
        assert rows_back.tables == routed.requests[s].tables and torch.equal(rows_back.ids, routed.requests[s].ids)
        assert grad.dtype == torch.float32 and torch.equal(grad, rows[s].grad.reshape(-1)), s
        assert shards[s].pooled[0] == {}  # the lookup's bags were used once, then dropped
        assert shards[s].counters.bytes_out == (rows[s].numel() + replies[s].numel()) * 4  # both replies


def test_a_push_drops_older_unused_lookups_and_an_unknown_tag_fails_the_collection():
    config = _config(servers=1)
    router, shard = Router(config), _shards(config)[0]
    for tag in (3, 4, 5):  # 3 and 4: prefetched, then a different batch came (never pushed)
        routed = router.route(_batch(False, seed=tag), where="test", tag=tag)
        shard.gather_pooled(1, routed.requests[0], routed.bags[0], torch.empty(routed.bags[0].numel()), step=0)
    assert sorted(shard.pooled[1]) == [3, 4, 5]
    shard.unpool(1, 5, torch.zeros(routed.bags[0].numel()), step=0)
    assert shard.pooled[1] == {}
    with pytest.raises(RuntimeError, match="trainer 1 pushed the gradient of pooled lookup 4, which this server "
                                           "does not hold"):
        shard.unpool(1, 4, torch.zeros(routed.bags[0].numel()), step=0)
    assert shard.failed is not None  # the step can never complete: waiting lookups get the error


def test_a_push_keeps_the_lookups_of_later_steps_whatever_their_tags():
    """An async step that prefetches the next batch before its own lookup (not prefetched: the
    first step) gives the later step's lookup the smaller tag: the push of the earlier step
    keeps it, and drops only lookups of earlier steps."""
    config = _config(servers=1)
    router, shard = Router(config), _shards(config)[0]
    for tag, step in ((0, 1), (1, 0), (2, 0)):  # 1: discarded for another batch of step 0
        routed = router.route(_batch(False, seed=tag), where="test", tag=tag)
        shard.gather_pooled(1, routed.requests[0], routed.bags[0], torch.empty(routed.bags[0].numel()), step=step)
    shard.unpool(1, 2, torch.zeros(routed.bags[0].numel()), step=0)
    assert sorted(shard.pooled[1]) == [0]
    routed = router.route(_batch(False, seed=3), where="test", tag=3)
    shard.gather_pooled(1, routed.requests[0], routed.bags[0], torch.empty(routed.bags[0].numel()), step=1)
    shard.unpool(1, 0, torch.zeros(routed.bags[0].numel()), step=1)  # tag 3: another lookup of step 1
    assert sorted(shard.pooled[1]) == [3] and shard.failed is None


def test_bfloat16_on_the_wire_rounds_the_pooled_bags_once():
    config = _config(servers=1, wire_dtype="bfloat16")
    ref = _config(servers=1)
    routed = Router(config).route(_batch(False), where="test", tag=0)
    out = torch.empty(routed.bags[0].numel(), dtype=torch.bfloat16)
    _shards(config)[0].gather_pooled(0, routed.requests[0], routed.bags[0], out, step=0)
    full = torch.empty(routed.bags[0].numel())
    _shards(ref)[0].gather_pooled(0, routed.requests[0], routed.bags[0], full, step=0)
    assert torch.equal(out, full.to(torch.bfloat16)) and not torch.equal(out.float(), full)
