"""First end-to-end check of the machinery hybrid stands on: 2 trainers + 1 server, a
RemoteModule embedding on the server, a DDP dense layer on the trainers, one distributed-autograd
step; the server's table must change in exactly the rows the trainers looked up."""

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.harness import run_distributed

ROWS, DIM = 50, 4
IDS = {0: [3, 7, 7, 11], 1: [7, 20, 41]}


def _table(module_rref):
    return module_rref.local_value().weight.detach().clone()


def _step(rank, world_size):
    if rank == 2:  # ps0 only serves
        return None
    torch.manual_seed(0)
    emb = RemoteModule("ps0/cpu", nn.EmbeddingBag, args=(ROWS, DIM), kwargs={"mode": "sum"})
    dense = DDP(nn.Linear(DIM, 1))
    before = rpc.rpc_sync("ps0", _table, args=(emb.module_rref,))
    ids = torch.tensor(IDS[rank])
    opt = DistributedOptimizer(
        torch.optim.SGD,
        [*emb.remote_parameters(), *[rpc.RRef(p) for p in dense.parameters()]],
        lr=0.5,
    )
    with dist_autograd.context() as ctx:
        out = dense(emb(ids.view(1, -1)))
        loss = out.pow(2).sum()
        dist_autograd.backward(ctx, [loss])
        opt.step(ctx)
    after = rpc.rpc_sync("ps0", _table, args=(emb.module_rref,))
    return before, after, [p.detach().clone() for p in dense.parameters()]


def test_remote_module_ddp_step_changes_exactly_the_looked_up_rows():
    # Each trainer owns one RemoteModule table on ps0 and looks up its own ids.
    out = run_distributed(_step, 3, setup="hybrid", num_servers=1, timeout=90)
    for rank in (0, 1):
        before, after, _ = out[rank]
        changed = (after != before).any(dim=1).nonzero().flatten().tolist()
        assert changed == sorted(set(IDS[rank]))
    # DDP averaged the dense gradients: both trainers hold the same dense layer afterwards.
    for p0, p1 in zip(out[0][2], out[1][2]):
        torch.testing.assert_close(p0, p1, rtol=0, atol=0)


def _plain_rpc(rank, world_size, *, tmp):
    import hybrid._C  # noqa: F401 - registers the hybrid_uv transport with TensorPipe

    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"file://{tmp}/rpc"))
    try:
        return rpc.rpc_sync(f"w{1 - rank}", torch.add, args=(torch.ones(2), rank)).tolist()
    finally:
        rpc.shutdown()


def test_plain_rpc_runs_in_a_process_that_loaded_hybrid(tmp_path):
    """A process that loaded hybrid's native library (it registers its own TensorPipe transport)
    can still start torch's RPC with the default transports, as the tutorial does."""
    out = run_distributed(_plain_rpc, 2, setup="none", timeout=60, tmp=str(tmp_path))
    assert out == [[1.0, 1.0], [2.0, 2.0]]
