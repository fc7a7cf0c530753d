"""The harness itself: results come back, a raising rank is named with its traceback, a hung
rank is killed within the timeout, and no child outlives its test."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import DistributedTestError, run_distributed


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item(), os.getpid()


def _raise_on_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom from rank one")
    return rank


def _hang_on_one(rank, world_size):
    if rank == 1:
        while True:
            time.sleep(0.1)
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_results_come_back_from_every_rank():
    out = run_distributed(_allreduce, 3, timeout=60)
    assert [v for v, _ in out] == [6.0, 6.0, 6.0]
    assert not any(_alive(pid) for _, pid in out)


def _cuda_state(rank, world_size):
    return torch.cuda.is_available(), torch.multiprocessing.get_start_method(allow_none=True)


def test_spawned_ranks_join_and_report_as_forked_ones_do():
    # The start the CUDA tests use: fresh interpreters, which a process that asked torch about
    # GPUs before forking could not give.
    out = run_distributed(_allreduce, 2, timeout=60, start="spawn")
    assert [v for v, _ in out] == [3.0, 3.0]
    assert not any(_alive(pid) for _, pid in out)
    assert run_distributed(_cuda_state, 1, setup="none", timeout=60, start="spawn")[0][1] == "spawn"


def test_a_raising_rank_is_named_with_its_traceback():
    with pytest.raises(DistributedTestError) as e:
        run_distributed(_raise_on_one, 2, setup="none", timeout=60)
    msg = str(e.value)
    assert "rank 1 raised" in msg
    assert "RuntimeError: boom from rank one" in msg
    assert "_raise_on_one" in msg  # the traceback, not just the message
    assert "rank 0" not in msg


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_a_hung_rank_is_killed_within_the_timeout_with_its_stack():
    run_distributed(_raise_on_one, 1, setup="none", timeout=60)  # the fork server started: not timed
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as e:
        run_distributed(_hang_on_one, 2, setup="none", timeout=5)
    elapsed = time.monotonic() - start
    msg = str(e.value)
    assert elapsed < 5 + 10, elapsed
    assert "rank 1 did not finish within the 5s timeout" in msg
    assert "_hang_on_one" in msg  # faulthandler's stack of the hung rank
