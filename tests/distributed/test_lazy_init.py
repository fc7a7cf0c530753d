"""Servers answer the create call before their tables' rows exist and make them on first use and
in a background fill (``hybrid.ps.server.lazy``), over real RPC: lookups of rows no one touched
yet, a whole-table read and a checkpoint taken while most rows wait, all equal the rows
``hybrid.init_tables`` gives; the fill finishes, and then every row does too."""

import time

import torch
import torch.distributed.rpc as rpc
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import hybrid
from hybrid.checkpoint import files as F
from hybrid.checkpoint import server_io
from hybrid.launch.roles import role_of
from hybrid.ps.client import RemoteEmbeddingBagCollection, make_pipeline
from tests.harness import run_distributed

SEED = 3
# Big enough that the fill is still running when the first calls come (tens of MiB a server).
TABLES = [EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=600_001, feature_names=["f0"]),
          EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=250_000, feature_names=["f1"])]


def _remote(pipeline, cid, sharding):
    meta = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
    config = RemoteEmbeddingBagCollection.config_from(
        meta, cid=cid, num_servers=2, sharding=sharding, optimizer={"name": "adagrad", "lr": 0.1}, num_trainers=1,
        init_seed=SEED)
    remote = RemoteEmbeddingBagCollection(config, pipeline=pipeline, server_names=pipeline.server_names)
    remote.create_on_servers(init="seed")
    return remote


def _left(remote) -> int:
    return sum(d["rows_to_fill"] for d in remote.stats().values())


def _lazy(rank, world_size, *, ckpt):
    role = role_of(rank, world_size, 2)
    if not role.is_trainer:
        return None
    want = hybrid.init_tables(EmbeddingBagCollection(tables=TABLES, device=torch.device("meta")), seed=SEED)
    want_w = {c.name: want.embedding_bags[c.name].weight.detach() for c in TABLES}
    pipeline = make_pipeline(trainer=0, num_servers=2, staleness=0)
    out = {}
    # Lookups right after creation: one id per bag, so each pooled value is the row itself.
    remote = _remote(pipeline, "lookups", "row_wise")
    out["left_at_lookup"] = _left(remote)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, c.num_embeddings, (512,), generator=g) for c in TABLES]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.cat(ids),
                                              lengths=torch.ones(1024, dtype=torch.int64))
    with torch.no_grad():
        got = remote(kjt)
    out["lookups_equal"] = all(torch.equal(got[c.feature_names[0]], want_w[c.name][i]) for c, i in zip(TABLES, ids))
    # The fill ends, and then every row is the initial one.
    deadline = time.monotonic() + 60
    while _left(remote) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["left_after_fill"] = _left(remote)
    out["filled_equal"] = all(torch.equal(w, want_w[n]) for n, w in remote.read_tables().items())
    # A whole-table read, and a checkpoint written by the servers, while most rows wait.
    fresh = _remote(pipeline, "read", "table_wise")
    out["left_at_read"] = _left(fresh)
    out["read_equal"] = all(torch.equal(w, want_w[n]) for n, w in fresh.read_tables().items())
    saved = _remote(pipeline, "saved", "row_wise")
    out["left_at_save"] = _left(saved)
    out["saved_equal"] = True
    for s, name in enumerate(pipeline.server_names[:2]):
        for f in rpc.rpc_sync(name, server_io.rpc_save_collection, args=("saved", ckpt, 0, -1)):
            data = F.load_tensors(ckpt, F.FileEntry(f["path"], f["size"], f["sha256"]))
            a, b = f["rows"]
            glob = torch.arange(a, b) * 2 + f["shard"]
            out["saved_equal"] &= torch.equal(data["weight"], want_w[f["table"]][glob])
            out["saved_equal"] &= bool((data["state"]["sum"] == 0).all())
    pipeline.close()
    return out


def test_rows_made_on_first_use_and_by_the_fill_equal_the_initial_rows(tmp_path):
    got = run_distributed(_lazy, 3, setup="hybrid", num_servers=2, timeout=150, ckpt=str(tmp_path))[0]
    # Each call came while the servers still had rows to make (the lazy paths ran).
    assert got["left_at_lookup"] > 0 and got["left_at_read"] > 0 and got["left_at_save"] > 0, got
    assert got["lookups_equal"], got
    assert got["left_after_fill"] == 0 and got["filled_equal"], got
    assert got["read_equal"], got
    assert got["saved_equal"], got
