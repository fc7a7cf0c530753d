"""Servers create their own table shards: 1, 2 and 3 servers, table-wise and row-wise, start from
bit-identical rows, the rows ``hybrid.init_tables`` gives a local collection with the same seed;
given weights written in small bounded chunks arrive whole."""

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import hybrid
from hybrid.launch.roles import role_of
from hybrid.ps.client import RemoteEmbeddingBagCollection, make_pipeline
from tests.harness import run_distributed
from tests.support import sparse

SEED = 5
LAYOUTS = [(sharding, servers) for sharding in ("table_wise", "row_wise") for servers in ([0], [1, 2], [0, 1, 2])]


def _tables():
    # Row counts that 2 and 3 do not divide, and a table of one row.
    return [*sparse.sample_tables(), EmbeddingBagConfig(name="t3", embedding_dim=3, num_embeddings=1, feature_names=["f4"])]


def _created(rank, world_size):
    role = role_of(rank, world_size, 3)
    if not role.is_trainer:
        return None
    pipeline = make_pipeline(trainer=0, num_servers=3, staleness=0)
    meta = EmbeddingBagCollection(tables=_tables(), device=torch.device("meta"))
    out = {}
    for k, (sharding, servers) in enumerate(LAYOUTS):
        config = RemoteEmbeddingBagCollection.config_from(
            meta, cid=f"c{k}", num_servers=3, sharding=sharding, servers=servers,
            optimizer={"name": "sgd", "lr": 0.1}, num_trainers=1, init_seed=SEED)
        remote = RemoteEmbeddingBagCollection(config, pipeline=pipeline, server_names=pipeline.server_names)
        remote.create_on_servers(init="seed")
        out[(sharding, tuple(servers))] = remote.read_tables()
    # bfloat16 storage: the same rows, rounded.
    config = RemoteEmbeddingBagCollection.config_from(
        meta, cid="bf16", num_servers=3, sharding="row_wise", optimizer={"name": "sgd", "lr": 0.1}, num_trainers=1,
        init_seed=SEED, storage_dtype="bfloat16")
    low = RemoteEmbeddingBagCollection(config, pipeline=pipeline, server_names=pipeline.server_names)
    low.create_on_servers(init="seed")
    out["bf16"] = low.read_tables()
    # Given weights (pretrained tables) stream in bounded chunks: here 256 B per message, at most
    # 1 KiB in flight per server, so every table takes many messages.
    from hybrid.ps.client import collection

    collection.WRITE_CHUNK_BYTES, collection.WRITE_WINDOW_BYTES = 256, 1024
    given = {c.name: torch.randn(c.num_embeddings, c.embedding_dim) for c in _tables()}
    remote.write_tables(given)
    out["given"] = (remote.read_tables(), given)
    pipeline.close()
    return out


def test_one_two_and_three_servers_start_from_the_rows_init_tables_gives():
    got = run_distributed(_created, 4, setup="hybrid", num_servers=3, timeout=90)[0]
    want = hybrid.init_tables(EmbeddingBagCollection(tables=_tables(), device=torch.device("meta")), seed=SEED)
    written, given = got.pop("given")
    low = got.pop("bf16")
    assert all(torch.equal(written[n], given[n]) for n in given)
    assert len(got) == len(LAYOUTS)
    for layout, tables in got.items():
        assert set(tables) == {"t0", "t1", "t2", "t3"}, layout
        for name, w in tables.items():
            assert torch.equal(w, want.embedding_bags[name].weight.detach()), (layout, name)
    for name, w in low.items():
        assert torch.equal(w, want.embedding_bags[name].weight.detach().bfloat16().float()), name
    # The seed matters, and the values are TorchRec's default init: uniform in +-sqrt(1 / rows).
    other = sparse.make_ebc(seed=SEED + 1)
    assert not torch.equal(other.embedding_bags["t0"].weight, want.embedding_bags["t0"].weight)
    for c in _tables():
        w = want.embedding_bags[c.name].weight
        assert float(w.abs().max()) <= (1 / c.num_embeddings) ** 0.5
    assert float(want.embedding_bags["t0"].weight.std()) > 0.5 * (1 / 50) ** 0.5 / 3**0.5
