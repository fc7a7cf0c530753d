"""``runtime.gloo_loop_batch``: after ``init_hybrid`` a trainer's gloo event-loop thread runs under
``SCHED_BATCH`` (the default) or as gloo started it (false); servers, outside the trainers' group,
have none. The all-reduce still sums. Its effect on speed is measured by ``benchmarks.allreduce``."""

import os

import pytest
import torch
import torch.distributed as dist

from hybrid.launch.init import GLOO_LOOP_THREAD, RuntimeOptions
from hybrid.launch.roles import role_of
from tests.harness import run_distributed


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


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "stock"])
def test_trainers_gloo_event_loop_runs_under_the_policy_runtime_asks_for(batch):
    got = run_distributed(_loop_policies, 3, setup="hybrid", num_servers=1, timeout=60,
                          _runtime=RuntimeOptions(rpc_timeout_s=30, gloo_loop_batch=batch))
    trainers = [g for g in got if g is not None]
    assert len(trainers) == 2
    want = os.SCHED_BATCH if batch else os.SCHED_OTHER
    for policies, summed in trainers:
        assert policies and all(p == want for p in policies), (policies, want)
        assert summed
