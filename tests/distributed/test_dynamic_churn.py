"""Memory under churn: a stream with 10x more distinct ids than a dynamic table's capacity
(``evict: lru``), 1 trainer + 1 server: the server's resident memory stays within 10% of its
size after warm-up, and every id beyond capacity is counted as an eviction."""

import torch
import torch.distributed.rpc as rpc
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybrid.launch.roles import role_of
from hybrid.ps.client import make_pipeline, step
from hybrid.ps.config import DynamicIds
from tests.harness import run_distributed
from tests.support.remote import remote_of

CAPACITY, PER_STEP, STEPS, WARMUP = 40_000, 8_000, 50, 10  # 400,000 distinct ids, 10x capacity


def _rss() -> int:
    """This process's resident bytes (run on the server)."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb * 1024


def _churn(rank, world_size, *, num_servers):
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    pipeline = make_pipeline(trainer=0, num_servers=num_servers, staleness=0)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=32, num_embeddings=CAPACITY,
                                                            feature_names=["f"])], device=torch.device("meta"))
    remote = remote_of(ebc, pipeline, cid="churn", num_servers=1, optimizer={"name": "rowwise_adagrad", "lr": 0.1},
                       dynamic=DynamicIds(capacity=CAPACITY, evict="lru"))
    rss = []
    for s in range(STEPS):
        # Fresh ids every step, scattered over the int64 range.
        ids = (torch.arange(s * PER_STEP, (s + 1) * PER_STEP) * 0x9E3779B97F4A7C15 % (2**62)) - 2**61
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.ones(PER_STEP, dtype=torch.long))
        with step(pipeline) as st:
            st.backward(remote(kjt).values().sum())
        if s + 1 >= WARMUP:
            pipeline.flush()
            rss.append(rpc.rpc_sync(pipeline.server_names[0], _rss))
    pipeline.flush()
    stats = remote.stats()
    tables = remote.read_dynamic()
    pipeline.close()
    return {"rss": rss, "stats": stats, "rows": tables["t"]["ids"].numel()}


def test_server_memory_stays_flat_under_churn():
    out = run_distributed(_churn, 2, setup="hybrid", num_servers=1, timeout=240)[0]
    rss = out["rss"]
    assert max(rss) <= 1.10 * rss[0], [r >> 20 for r in rss]
    d = out["stats"]["ps0"]["dynamic"]["t"]
    assert d["admitted"] == STEPS * PER_STEP
    assert d["evicted"] == STEPS * PER_STEP - CAPACITY
    assert d["rows"] == CAPACITY == out["rows"]
    assert d["hit_ratio"] == 0.0  # every id was new
