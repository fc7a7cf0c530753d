"""``pool_on: server`` with real processes: 2 trainers + 2 servers, sync with the next batch
prefetched, tables table-wise, step messages over the TCP step connection.

Each collection pooled on its servers trains beside a twin pooled on the trainers (same tables,
seed, optimizer and batches): a weighted collection with plain SGD, and one with ``ids: dynamic``
and row-wise Adagrad. Every step's output of the pair is equal bit for bit, and so are, at the
end, every server row and its optimizer state (dynamic: ids, rows and state), and a read outside
a step, as evaluation reads. A third collection sends its bags in bfloat16 (its twin rows in
float32): half the bytes of float32 bags each way, and its first step's bags are the twin's
rounded. In async mode (one trainer, whose messages the server handles in order, so both twins
read the same rows), plain SGD applies a pooled lookup's gradient straight from its bags, and
the twins stay equal bit for bit all the same.
"""

import torch
import torch.distributed as dist

from hybrid.launch.roles import role_of
from hybrid.ps.client import make_pipeline, step
from hybrid.ps.config import DynamicIds
from tests.harness import run_distributed
from tests.support.remote import remote_of
from tests.support.sparse import global_batch, kjt_slice, make_ebc, sample_tables

STEPS, BATCH = 8, 6
DYNAMIC = DynamicIds(capacity=128, partitions=4, evict="lru")
COLLECTIONS = {
    # name: (weighted, optimizer, lr, options)
    "weighted": (True, "sgd", 0.5, {}),
    "dynamic": (False, "rowwise_adagrad", 0.1, {"dynamic": DYNAMIC}),
    "bf16": (False, "adagrad", 0.1, {"wire_dtype": "bfloat16"}),
}


def _loss(values: torch.Tensor) -> torch.Tensor:
    c = torch.linspace(-1, 1, values.shape[1])
    return ((values @ c) ** 2).mean() + values.sum(1).mean()


def _data(k: int) -> dict:
    """Step ``k``'s global batch, with per-sample weights (which unweighted collections ignore)."""
    return global_batch(k, sample_tables(), 2 * BATCH, weighted=True)


def _train(rank, world_size, *, num_servers, staleness=0):
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    t_n, me = role.num_trainers, role.index
    pipeline = make_pipeline(trainer=me, num_servers=num_servers, staleness=staleness, transport="socket")
    pairs = {}
    for name, (weighted, opt, lr, options) in COLLECTIONS.items():
        pairs[name] = [remote_of(make_ebc(seed=2, weighted=weighted), pipeline, cid=f"{name}/{pool_on}",
                                 num_servers=num_servers, sharding="table_wise", optimizer={"name": opt, "lr": lr},
                                 trainer=me, num_trainers=t_n, seed=2, pool_on=pool_on, staleness=staleness,
                                 **(options if pool_on == "server" else {**options, "wire_dtype": "float32"}))
                       for pool_on in ("server", "trainer")]
    dist.barrier()
    bags = {name: 0 for name in COLLECTIONS}
    nxt = None
    for s in range(STEPS):
        kjt = nxt if nxt is not None else kjt_slice(_data(s), me * BATCH, (me + 1) * BATCH)
        with step(pipeline) as st:
            outs = {name: [r(kjt).values() for r in pair] for name, pair in pairs.items()}
            if s + 1 < STEPS:
                nxt = kjt_slice(_data(s + 1), me * BATCH, (me + 1) * BATCH)
                st.prefetch(nxt)
            for name, (on_server, on_trainer) in outs.items():
                if name == "bf16":
                    if s == 0:  # same rows yet: the server's float32 bags, rounded once
                        assert torch.equal(on_server, on_trainer.to(torch.bfloat16).float()), name
                else:
                    assert torch.equal(on_server, on_trainer), (name, s, (on_server - on_trainer).abs().max())
            for r in pipeline.current.received:
                if r.tag >= 0:  # the servers pooled: their replies hold bags, not rows
                    bags[r.collection.cid.split("/")[0]] += r.remote.numel()
            st.backward(sum(_loss(o) for pair in outs.values() for o in pair))
    pipeline.flush()
    dist.barrier()  # every trainer's last push is in, so the last step is applied everywhere
    result = {"bags": bags}
    if me == 0:
        kjt = kjt_slice(_data(STEPS), 0, BATCH)
        for name, (on_server, on_trainer) in pairs.items():
            result[name] = on_server.stats()
            if name == "bf16":
                continue
            with torch.no_grad():  # outside a step: rows read and pooled here, as evaluation reads them
                assert torch.equal(on_server(kjt).values(), on_trainer(kjt).values()), name
            if on_server.config.dynamic is None:
                (w1, s1), (w2, s2) = on_server.read_tables(with_state=True), on_trainer.read_tables(with_state=True)
                for t in w1:
                    assert torch.equal(w1[t], w2[t]), (name, t)
                    assert all(torch.equal(s1[t][k], s2[t][k]) for k in s2[t]), (name, t)
                assert not torch.equal(w1["t0"], make_ebc(seed=2, weighted=True).embedding_bags["t0"].weight.data)
            else:
                d1, d2 = on_server.read_dynamic(), on_trainer.read_dynamic()
                for t in d2:
                    assert d1[t]["ids"].numel() > 0
                    for k in d2[t]:
                        assert torch.equal(torch.as_tensor(d1[t][k]), torch.as_tensor(d2[t][k])), (name, t, k)
    pipeline.close()
    return result


def test_pooling_on_the_servers_trains_exactly_as_pooling_on_the_trainers():
    out = run_distributed(_train, 4, setup="hybrid", num_servers=2, timeout=240)
    trainers = out[:2]
    res = trainers[0]
    per_sample = sum(t.embedding_dim * len(t.feature_names) for t in sample_tables())
    for name in COLLECTIONS:
        stats = res[name]
        # What crossed each way: the bags, pooled -- every sample's features once.
        size = 2 if name == "bf16" else 4
        assert sum(t["bags"][name] for t in trainers) == STEPS * 2 * BATCH * per_sample
        assert sum(st["bytes_out"] for st in stats.values()) == size * STEPS * 2 * BATCH * per_sample, (name, stats)
        assert sum(st["lookups"] for st in stats.values()) == STEPS * 2 * 2  # a lookup per server, trainer, step
        assert sum(st["channel_lookups"] for st in stats.values()) == STEPS * 2 * 2  # over the step connection
        assert sum(st["updates_from_bags"] for st in stats.values()) == 0  # sync: the bags are unpooled


def test_async_pooling_on_the_server_trains_exactly_as_pooling_on_the_trainer():
    out = run_distributed(_train, 2, setup="hybrid", num_servers=1, staleness=1, timeout=240)
    res = out[0]
    for name in COLLECTIONS:
        stats = res[name]
        assert sum(st["lookups"] for st in stats.values()) == STEPS
        # Plain SGD (the weighted collection) from the bags at every push; the others unpool.
        assert sum(st["updates_from_bags"] for st in stats.values()) == (STEPS if name == "weighted" else 0), (
            name, stats)
