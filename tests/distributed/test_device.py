"""Remote collections on a GPU trainer: the rows arrive on the trainer's device, pooled outputs and
their gradients match a local collection on that device, and the servers (on the host) train the
same rows. Runs where CUDA is available; skipped elsewhere."""

import pytest
import torch
import torch.distributed as dist

from hybrid.launch.roles import role_of
from hybrid.ps.client import make_pipeline, step
from tests.harness import run_distributed
from tests.support.remote import remote_of
from tests.support.sparse import global_batch, kjt_slice, make_ebc, test_tables

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def _on_gpu(rank, world_size):
    role = role_of(rank, world_size, 1)
    if not role.is_trainer:
        return None
    device = torch.device("cuda", 0)
    ebc = make_ebc(seed=0)
    pipeline = make_pipeline(trainer=0, num_servers=1, staleness=0, device=device)
    remote = remote_of(ebc, pipeline, cid="g", num_servers=1, optimizer={"name": "sgd", "lr": 0.5})
    local = make_ebc(seed=0).to(device)
    kjt = kjt_slice(global_batch(0, test_tables(), 8), 0, 8)
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
    pipeline.close()
    dist.barrier()
    return True


def test_rows_reach_the_trainer_s_gpu_and_train_as_a_local_collection_there():
    assert run_distributed(_on_gpu, 2, setup="hybrid", num_servers=1, timeout=120)[0]
