"""``wire_dtype: bfloat16`` with real processes: 2 trainers + 2 servers, sync, row-wise.

One run trains several remote collections at once on the same batches -- pooled and unpooled,
range and dynamic ids, float32 and bfloat16 storage -- each with rows and gradients in bfloat16 on
the wire, plus a float32-wire twin of the first. At every step each trainer checks that the rows
it received are the servers' rows rounded to bfloat16, bit for bit; at the end trainer 0 checks
that every server row and its optimizer state equal, bit for bit, one process that rounds the same
way (the rows to bfloat16 before the forward, each trainer's row gradients to bfloat16 before the
update; the float32 twin against one process that does not round), reads
rows outside a step as evaluation does, and the servers' byte counters show 2 bytes per element
each way where the float32 twin shows 4.
"""

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from hybrid.launch.roles import role_of
from hybrid.ps.client import RemoteCollection, make_pipeline, step
from hybrid.ps.client.routing import Router
from hybrid.ps.config import DynamicIds
from hybrid.ps.protocol import Rows
from hybrid.ps.server.shard import CollectionShard
from tests.harness import run_distributed
from tests.support.remote import remote_of
from tests.support import sparse
from tests.support.sparse import global_batch, kjt_slice

STEPS, BATCH = 6, 6
DYNAMIC = DynamicIds(capacity=256, partitions=4)
COLLECTIONS = {
    # name: (pooled, optimizer, lr, options)
    "bag": (True, "rowwise_adagrad", 0.1, {"wire_dtype": "bfloat16"}),
    "bag32": (True, "rowwise_adagrad", 0.1, {"wire_dtype": "float32"}),
    "bag_dynamic": (True, "sgd", 0.5, {"wire_dtype": "bfloat16", "dynamic": DYNAMIC}),
    "seq_bf16_rows": (False, "adam", 0.05, {"wire_dtype": "bfloat16", "storage_dtype": "bfloat16"}),
    "seq_dynamic": (False, "adagrad", 0.1, {"wire_dtype": "bfloat16", "dynamic": DYNAMIC}),
}


def _module(pooled: bool):
    tables = sparse.sample_tables()
    if pooled:
        return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    # torchrec's EmbeddingCollection takes one embedding dim for all its tables.
    return EmbeddingCollection(tables=[EmbeddingConfig(name=t.name, embedding_dim=4, num_embeddings=t.num_embeddings,
                                                       feature_names=t.feature_names) for t in tables],
                               device=torch.device("meta"))


def _loss(pooled: bool, values: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
    """A trainer's loss, a mean over its ``BATCH`` samples (pooled: ``[batch, dims]``; unpooled:
    per feature the rows of its ids)."""
    if pooled:
        c = torch.linspace(-1, 1, values.shape[1])
        return ((values @ c) ** 2).mean() + values.sum(1).mean()
    return sum(((v @ torch.linspace(-1, 1, v.shape[1])) ** 2).sum() + v.sum() for v in values.values()) / BATCH


def _values(pooled: bool, out):
    return out.values() if pooled else {f: jt.values() for f, jt in out.items()}


class Rounded:
    """The reference: every row in one shard in this process (float32 on its wire), each trainer's
    part of a step done in turn and rounded as ``wire_dtype: bfloat16`` rounds -- the rows it reads
    to bfloat16 before the forward, its rows' gradients to bfloat16 before the push."""

    def __init__(self, module, name: str, optimizer: str, lr: float, num_trainers: int, options: dict) -> None:
        self.pooled = hasattr(module, "embedding_bag_configs")
        self.rounds = options["wire_dtype"] == "bfloat16"
        opts = {k: v for k, v in options.items() if k != "wire_dtype"}
        config = RemoteCollection.config_from(module, cid=f"ref/{name}", num_servers=1, num_trainers=num_trainers,
                                              optimizer={"name": optimizer, "lr": lr}, **opts)
        self.router = Router(config)
        self.shard = CollectionShard(config, 0, start_step=0, huge_pages=False)
        for t in self.shard.tables:
            t.initialize(config.init_seed)

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).float() if self.rounds else x

    def rows(self, rows: Rows, *, update: bool = True) -> torch.Tensor:
        """The rows of ``rows`` (ids as one server holding everything numbers them) as sent
        (``update`` false: as an evaluation reads them)."""
        return self._round(self.shard.gather(rows, update=update))

    def forward(self, kjt, *, update: bool = True):
        routed = self.router.route(kjt, where="reference")
        rows = self.rows(routed.requests[0], update=update).requires_grad_(True)
        out = self.router.pool if self.pooled else self.router.embed
        return routed, rows, out(routed, {0: rows})

    def step(self, kjts: list, s: int) -> None:
        for k, kjt in enumerate(kjts):
            routed, rows, values = self.forward(kjt)
            _loss(self.pooled, values).backward()
            self.shard.push(k, s, [(routed.requests[0], self._round(rows.grad))])


def _as_one_server(remote, server: int, rows: Rows) -> Rows:
    """``rows`` of a lookup ``server`` answered, numbered as one server holding every row does."""
    if remote.config.dynamic is not None:
        return rows  # raw ids
    ids = [remote.layouts[t].global_ids(remote.layouts[t].servers.index(server), i)
           for t, i in zip(rows.tables, rows.ids.split(rows.counts))]
    return Rows(list(rows.tables), list(rows.counts), torch.cat(ids))


def _train(rank, world_size, *, num_servers, push, prefetch, lookups):
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    t_n, me = role.num_trainers, role.index
    pipeline = make_pipeline(trainer=me, num_servers=num_servers, staleness=0, gradient_push=push, transport=lookups)
    # A channel's reply is used in place until the reply two messages later on that channel: the
    # rows received are kept aside here, to be compared after the step's later lookups.
    receive = pipeline._receive

    def kept(state, lk, server, remote):
        local = receive(state, lk, server, remote)
        state.received[-1].remote = remote.clone()
        return local

    pipeline._receive = kept
    remotes, refs = {}, {}
    for name, (pooled, opt, lr, options) in COLLECTIONS.items():
        module = _module(pooled)
        remotes[name] = remote_of(module, pipeline, cid=name, num_servers=num_servers, optimizer={"name": opt, "lr": lr},
                                  trainer=me, num_trainers=t_n, **options)
        refs[name] = Rounded(module, name, opt, lr, t_n, options)
    dist.barrier()
    sent = {name: {"ids": 0, "elements": 0} for name in COLLECTIONS}
    nxt = None
    for s in range(STEPS):
        data = global_batch(s, sparse.sample_tables(), t_n * BATCH)
        kjt = nxt if nxt is not None else kjt_slice(data, me * BATCH, (me + 1) * BATCH)
        with step(pipeline) as st:
            outs = {n: r(kjt) for n, r in remotes.items()}
            if prefetch and s + 1 < STEPS:
                nxt = kjt_slice(global_batch(s + 1, sparse.sample_tables(), t_n * BATCH), me * BATCH, (me + 1) * BATCH)
                st.prefetch(nxt)
            for r in pipeline.current.received:
                name = r.collection.cid
                want = torch.bfloat16 if COLLECTIONS[name][3]["wire_dtype"] == "bfloat16" else torch.float32
                assert r.remote.dtype == want, (name, r.remote.dtype)
                expect = refs[name].rows(_as_one_server(r.collection, r.server, r.rows))
                assert torch.equal(r.remote.float(), expect), (name, s, (r.remote.float() - expect).abs().max())
                sent[name]["ids"] += r.rows.ids.numel()
                sent[name]["elements"] += r.remote.numel()
            st.backward(sum(_loss(COLLECTIONS[n][0], _values(COLLECTIONS[n][0], o)) for n, o in outs.items()))
        for ref in refs.values():
            ref.step([kjt_slice(data, k * BATCH, (k + 1) * BATCH) for k in range(t_n)], s)
    pipeline.flush()
    dist.barrier()  # every trainer's last push is in, so the last step is applied everywhere
    result = {"sent": sent}
    if me == 0:
        kjt = kjt_slice(global_batch(STEPS, sparse.sample_tables(), BATCH), 0, BATCH)
        for name, remote in remotes.items():
            ref = refs[name]
            result[name] = {"stats": remote.stats()}  # the training steps' bytes alone
            with torch.no_grad():  # outside a step: rows read as evaluation reads them
                got = _values(ref.pooled, remote(kjt))
                expect = ref.forward(kjt, update=False)[2]
            torch.testing.assert_close(got, expect, rtol=0, atol=0, msg=lambda m: f"{name} read: {m}")
            _compare(name, remote, ref)
        result["twins"] = [remotes[n].read_tables() for n in ("bag", "bag32")]
    pipeline.close()
    return result


def _compare(name: str, remote, ref: Rounded) -> None:
    """The servers' rows and optimizer state equal the reference's."""
    if remote.config.dynamic is None:
        weights, states = remote.read_tables(with_state=True)
        for t in ref.shard.tables:
            pairs = [("rows", weights[t.name], t.weight.float())]
            pairs += [(k, states[t.name][k], v) for k, v in t.optim.state.items()]
            for k, g, e in pairs:
                torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"{name} {t.name} {k}: {m}")
        return
    got = remote.read_dynamic()
    for t in ref.shard.tables:
        e = t.dynamic_rows()
        g = got[t.name]
        assert torch.equal(g["ids"], e["ids"]), (name, t.name)
        for k in ["rows"] + [k for k in e if k.startswith("state.")]:
            torch.testing.assert_close(g[k], e[k], rtol=0, atol=0, msg=lambda m: f"{name} {t.name} {k}: {m}")


@pytest.mark.parametrize(
    "push,prefetch,lookups",
    [("rpc", True, "auto"), ("rpc", False, "rpc"), ("dist_autograd", False, "auto")],
    ids=["riding-shm-prefetch", "riding-rpc", "dist_autograd"],
)
def test_bfloat16_wire_rounds_rows_and_gradients_once_and_halves_the_bytes(push, prefetch, lookups):
    """``riding``: gradients ride on the next message (with the next step's prefetched lookups
    through shared memory, or alone over RPC); ``dist_autograd``: ``dist_autograd.backward``
    delivers them, lookups over RPC."""
    out = run_distributed(_train, 4, setup="hybrid", num_servers=2, timeout=240, push=push, prefetch=prefetch,
                          lookups=lookups)
    trainers = out[:2]
    res = trainers[0]
    for name, (_, _, _, options) in COLLECTIONS.items():
        stats = res[name]["stats"]
        ids = sum(t["sent"][name]["ids"] for t in trainers)
        elements = sum(t["sent"][name]["elements"] for t in trainers)
        size = 2 if options["wire_dtype"] == "bfloat16" else 4
        # Out: the rows, `size` bytes an element. In: the lookups' ids (8 bytes) and one gradient
        # element per row element.
        assert len(stats) == 2, stats
        assert sum(st["rows_served"] for st in stats.values()) == ids > 0, (name, stats)
        assert sum(st["bytes_out"] for st in stats.values()) == size * elements, (name, stats)
        assert sum(st["bytes_in"] for st in stats.values()) == 8 * ids + size * elements, (name, stats)
        # Trainers and servers share this host: the riding push's messages went through shared memory.
        channel = sum(st["channel_lookups"] for st in stats.values())
        assert (channel > 0) == (push == "rpc" and lookups == "auto"), (name, stats)
    # The twins looked up the same rows on the same batches: half the bytes per row each way.
    bf16, f32 = res["bag"]["stats"], res["bag32"]["stats"]
    for server in bf16:
        assert bf16[server]["rows_served"] == f32[server]["rows_served"] > 0
        assert 2 * bf16[server]["bytes_out"] == f32[server]["bytes_out"]
    grad_bytes = {n: sum(st["bytes_in"] for st in res[n]["stats"].values())
                  - 8 * sum(t["sent"][n]["ids"] for t in trainers) for n in ("bag", "bag32")}
    assert 2 * grad_bytes["bag"] == grad_bytes["bag32"] > 0, grad_bytes
    # And they trained apart: the comparisons above tell rounded training from unrounded.
    low, full = res["twins"]
    assert max(float((low[t] - full[t]).abs().max()) for t in full) > 1e-4
