"""GPU trainers. Remote collections: the rows arrive on the trainer's device, pooled outputs and
their gradients match a local collection on that device, and the servers (on the host) train the
same rows. ``hybrid train``'s loop: batches go to the trainer's device and a run (NCCL among the
trainers) matches one CPU process. Runs where CUDA is available; skipped elsewhere."""

import json

import pytest
import torch
import torch.distributed as dist

from hybrid.launch.roles import role_of
from hybrid.ps.client import make_pipeline, step
from tests.distributed.test_train import STEPS, _overrides, reference_losses
from tests.harness import run_distributed
from tests.support.cli import REPO
from tests.support.remote import remote_of
from tests.support import sparse
from tests.support.sparse import global_batch, kjt_slice, make_ebc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def _on_gpu(rank, world_size, *, pool_on):
    role = role_of(rank, world_size, 1)
    if not role.is_trainer:
        return None
    device = torch.device("cuda", 0)
    ebc = make_ebc(seed=0)
    pipeline = make_pipeline(trainer=0, num_servers=1, staleness=0, device=device)
    remote = remote_of(ebc, pipeline, cid="g", num_servers=1, optimizer={"name": "sgd", "lr": 0.5}, pool_on=pool_on)
    local = make_ebc(seed=0).to(device)
    kjt = kjt_slice(global_batch(0, sparse.sample_tables(), 8), 0, 8)
    with step(pipeline) as s:
        out = remote(kjt)
        assert out.values().device == device
        want = local(kjt.to(device))
        torch.testing.assert_close(out.values(), want.values(), rtol=1e-6, atol=1e-6)
        s.backward(out.values().pow(2).sum())
    want.values().pow(2).sum().backward()
    got = remote.read_tables()
    for name, bag in local.embedding_bags.items():
        expect = (bag.weight.detach() - 0.5 * bag.weight.grad).cpu()
        torch.testing.assert_close(got[name], expect, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # outside a step (evaluation): the trained rows, on the trainer's GPU
        for bag in local.embedding_bags.values():
            bag.weight -= 0.5 * bag.weight.grad
        read = remote(kjt).values()
        assert read.device == device
        torch.testing.assert_close(read, local(kjt.to(device)).values(), rtol=1e-5, atol=1e-6)
    pipeline.close()
    dist.barrier()
    return True


@pytest.mark.parametrize("pool_on", ["trainer", "server"])
def test_rows_reach_the_trainer_s_gpu_and_train_as_a_local_collection_there(pool_on):
    """``pool_on: server``: the servers' pooled bags reach the GPU instead of rows."""
    assert run_distributed(_on_gpu, 2, setup="hybrid", num_servers=1, timeout=120, start="spawn", pool_on=pool_on)[0]


def _train(rank, world_size, *, tmp, overrides):
    from hybrid.launch.roles import role_of
    from hybrid.train.loop import load_run, run_process

    plan, cfg, _, resolved = load_run(str(REPO / "conf/plans/dlrm.yaml"), str(REPO / "conf/train/dlrm.yaml"),
                                      overrides, world_size)
    # The job as `hybrid train` runs it (backend auto: NCCL among the trainers on a GPU machine).
    return run_process(role_of(rank, world_size, 1), plan, cfg, resolved, init_method=f"file://{tmp}/rdzv")


def test_hybrid_train_moves_batches_to_the_gpu_and_matches_one_cpu_process(tmp_path):
    # compose puts the dense modules on the GPU: a batch left in host memory would fail the first
    # forward, so a finished run shows that the loop moved every batch (train and eval).
    out = tmp_path / "run"
    over = _overrides("dlrm", out)
    assert run_distributed(_train, 2, setup="none", timeout=240, start="spawn", tmp=str(tmp_path),
                           overrides=over) == [0, 0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in rows if r["kind"] == "train"]
    assert len(got) == STEPS and [r["step"] for r in rows if r["kind"] == "eval"] == [0, 3, STEPS]
    want = reference_losses("dlrm", over, world_size=2)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)
