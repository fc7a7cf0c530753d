"""Linux scheduling policies ``init_hybrid`` sets.

``runtime.gloo_loop_batch``: a trainer's gloo event-loop thread runs under ``SCHED_BATCH`` (the
default) or as gloo started it (false); servers, outside the trainers' group, have none. The
all-reduce still sums. Its effect on speed is measured by ``benchmarks.allreduce``.

``runtime.server_batch``: every thread of a parameter server -- its RPC threads and the thread
that serves a trainer's TCP step connection, started when the trainer connects -- runs under
``SCHED_BATCH`` (the default) or as started (false). Its effect on speed is measured by
``benchmarks.run --server-policy``.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from hybrid.launch.init import GLOO_LOOP_THREAD, RuntimeOptions
from hybrid.launch.roles import role_of
from hybrid.ps.client import make_pipeline, step
from tests.harness import run_distributed
from tests.support.remote import remote_of
from tests.support.sparse import global_batch, kjt_slice, make_ebc, sample_tables


def _loop_policies(rank, world_size, num_servers):
    if not role_of(rank, world_size, num_servers).is_trainer:
        return None
    policies = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == GLOO_LOOP_THREAD:
                policies.append(os.sched_getscheduler(int(tid)))
    x = torch.full((1000,), float(dist.get_rank() + 1))
    dist.all_reduce(x)
    return policies, bool((x == 3).all())


def _on_trainers(fn, option: str, batch: bool) -> tuple[list, int]:
    """``fn``'s results on the 2 trainers of a job with 1 server and ``runtime.<option>`` set to
    ``batch``; the policy that asks for."""
    got = run_distributed(fn, 3, setup="hybrid", num_servers=1, timeout=90,
                          _runtime=RuntimeOptions(rpc_timeout_s=30, **{option: batch}))
    trainers = [g for g in got if g is not None]
    assert len(trainers) == 2
    return trainers, os.SCHED_BATCH if batch else os.SCHED_OTHER


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "stock"])
def test_trainers_gloo_event_loop_runs_under_the_policy_runtime_asks_for(batch):
    trainers, want = _on_trainers(_loop_policies, "gloo_loop_batch", batch)
    for policies, summed in trainers:
        assert policies and all(p == want for p in policies), (policies, want)
        assert summed


def _thread_policies() -> dict[int, int]:
    """On a server: every thread's policy, by thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getscheduler(int(tid))
        except OSError:  # ended meanwhile
            pass
    return out


def _server_policies(rank, world_size, num_servers):
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    before = rpc.rpc_sync("ps0", _thread_policies)
    # A step over a TCP step connection: the server starts a thread for this trainer's messages.
    pipeline = make_pipeline(trainer=role.index, num_servers=num_servers, staleness=0, gradient_push="rpc",
                             transport="socket")
    tables = sample_tables()
    remote = remote_of(make_ebc(seed=0), pipeline, cid="c", num_servers=num_servers, sharding="row_wise",
                       optimizer={"name": "sgd", "lr": 0.1}, trainer=role.index, num_trainers=role.num_trainers)
    dist.barrier()  # the collection is on its server before either trainer looks it up
    kjt = kjt_slice(global_batch(0, tables, 2 * 4), role.index * 4, (role.index + 1) * 4)
    with step(pipeline) as st:
        st.backward(remote(kjt).values().sum())
    pipeline.flush()
    stats = remote.stats()
    after = rpc.rpc_sync("ps0", _thread_policies)
    dist.barrier()
    pipeline.close()
    return before, after, stats


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "stock"])
def test_every_thread_of_a_server_runs_under_the_policy_runtime_asks_for(batch):
    trainers, want = _on_trainers(_server_policies, "server_batch", batch)
    for before, after, stats in trainers:
        assert stats["ps0"]["channel_lookups"] >= 1, stats  # the step went over the step connection
        started = set(after) - set(before)
        assert started, (before, after)  # the step connections' threads, among others
        assert all(p == want for p in after.values()), (after, want)
