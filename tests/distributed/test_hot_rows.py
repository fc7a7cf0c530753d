"""The trainers' hot-row cache in async mode, with real processes: rows put back from the cache
equal the servers' rows exactly, the cache serves rows, and training with it converges; and
so they do, with and without the cache, over each step channel and pooled on the servers, when
a step prefetches the next batch before it reads its own rows."""

import pytest

import time

import torch
import torch.distributed as dist

from hybrid.launch.roles import role_of
from hybrid.ps.client import make_pipeline, step
from tests.harness import run_distributed
from tests.support.remote import remote_of
from tests.support.sparse import make_ebc, teacher_task, sample_tables

B = 16
K = 3


def _cached(rank, world_size, *, num_servers):
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    tables = sample_tables()
    local = make_ebc(seed=0)  # the rows every server starts from
    pipeline = make_pipeline(trainer=role.index, num_servers=num_servers, staleness=K)
    opts = dict(num_servers=num_servers, optimizer={"name": "sgd", "lr": 0.3}, trainer=role.index,
                num_trainers=role.num_trainers, staleness=K, hot_rows=16)
    # "still" gets zero gradients (its rows never change: what the cache puts back must equal
    # the initial rows exactly); "trained" learns a task.
    still, trained = remote_of(local, pipeline, cid="still", **opts), remote_of(local, pipeline, cid="trained", **opts)
    dist.barrier()
    batch, head, opt = teacher_task(tables, trainer=role.index, num_trainers=role.num_trainers, batch=B)

    losses, mismatched = [], []
    nxt = batch(0)
    for s in range(60):
        kjt, y = nxt
        # Every push so far applied before this step prefetches the next: the versions the
        # replies carry, and so what the caches may serve, do not depend on the machine's load.
        pipeline.flush()
        dist.barrier()
        with step(pipeline, optimizer=opt) as st:
            kept = still(kjt)
            out = trained(kjt)
            nxt = batch(s + 1)
            st.prefetch(nxt[0])
            with torch.no_grad():
                if not torch.equal(kept.values(), local(kjt).values()):
                    mismatched.append(s)
            loss = ((head(out.values()).squeeze(1) - y) ** 2).mean() + 0.0 * kept.values().sum()
            st.backward(loss)
        losses.append(loss.item())
    pipeline.flush()
    dist.barrier()
    stats = None
    if role.index == 0:  # each trainer's last prefetch (of a step never run) may still be unanswered
        deadline = time.monotonic() + 10
        while (stats := trained.stats()["ps0"])["answered"] < 2 * 61 and time.monotonic() < deadline:
            time.sleep(0.05)
    counters = {c.cid: c.hot_rows.counters.as_dict() for c in (still, trained)}
    pipeline.close()
    return losses, mismatched, counters, stats


def test_hot_rows_put_back_the_servers_rows_and_train_within_the_bound():
    out = run_distributed(_cached, 3, setup="hybrid", num_servers=1, timeout=150)
    for losses, mismatched, counters, _ in out[:2]:
        assert mismatched == [], mismatched
        for cid, c in counters.items():
            assert c["hits"] > 0.2 * c["looked_up"], (cid, c)  # the tiny tables repeat their ids
            assert c["refreshed"] > 0, (cid, c)
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        assert last < 0.5 * first, (first, last)
    stats = out[0][3]
    assert stats["max_lag"] <= K, stats
    # The server sent exactly the rows the caches did not hold (the last prefetches included).
    assert stats["rows_served"] == sum(cs["trained"]["sent"] for _, _, cs, _ in out[:2]), stats


def _prefetch_first(rank, world_size, *, num_servers, transport, hot_rows, pool_on):
    """Each async step sends the next batch's lookup before it reads its own rows (two replies
    of a trainer's channel then arrive before the first is read); returns the steps whose rows
    of the never-updated collection differ from its initial rows."""
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    tables = sample_tables()
    local = make_ebc(seed=0)
    pipeline = make_pipeline(trainer=role.index, num_servers=num_servers, staleness=K, transport=transport)
    opts = dict(num_servers=num_servers, optimizer={"name": "sgd", "lr": 0.3}, trainer=role.index,
                num_trainers=role.num_trainers, staleness=K, hot_rows=hot_rows, pool_on=pool_on)
    still, trained = remote_of(local, pipeline, cid="still", **opts), remote_of(local, pipeline, cid="trained", **opts)
    dist.barrier()
    batch, head, opt = teacher_task(tables, trainer=role.index, num_trainers=role.num_trainers, batch=B)
    mismatched = []
    nxt = batch(0)
    for s in range(30):
        kjt, y = nxt
        with step(pipeline, optimizer=opt) as st:
            nxt = batch(s + 1)
            st.prefetch(nxt[0])
            kept = still(kjt)
            out = trained(kjt)
            with torch.no_grad():
                if not torch.equal(kept.values(), local(kjt).values()):
                    mismatched.append(s)
            st.backward(((head(out.values()).squeeze(1) - y) ** 2).mean() + 0.0 * kept.values().sum())
    pipeline.flush()
    dist.barrier()
    pipeline.close()
    return mismatched


@pytest.mark.parametrize("transport,hot_rows,pool_on", [("auto", 0, "trainer"), ("socket", 0, "trainer"),
                                                         ("auto", 4, "trainer"), ("socket", 0, "server")],
                         ids=["shared-memory", "tcp", "shared-memory-cached", "tcp-pooled-on-server"])
def test_a_step_that_prefetches_before_it_reads_gets_its_own_rows(transport, hot_rows, pool_on):
    out = run_distributed(_prefetch_first, 3, setup="hybrid", num_servers=1, timeout=150, transport=transport,
                          hot_rows=hot_rows, pool_on=pool_on)
    assert out[:2] == [[], []], out[:2]
