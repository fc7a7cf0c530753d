"""``rpc_tutorial``: PyTorch's "Combining Distributed DataParallel with Distributed RPC Framework".

Written as a user would from that tutorial: one ``RemoteModule(nn.EmbeddingBag)`` per table on
the parameter server(s) (table ``i`` on ``ps{i % servers}``), shared by every trainer; the dense
part under ``DistributedDataParallel``; each step inside ``dist_autograd.context()``, with
``dist_autograd.backward(ctx, [loss])`` and ``DistributedOptimizer.step(ctx)``; TensorPipe with
its default options. Two deliberate departures, both in the baseline's favour or neutral: the
per-table lookups go out together (``forward_async``) rather than one after another, and the
tables get their own ``DistributedOptimizer`` with ``sparse_lr / trainers`` (every trainer applies
its own gradient, so this makes the update the mean over the global batch, as in every other
system).

The tables are plain ``nn.EmbeddingBag`` (dense gradients, as in the tutorial): every step each
trainer's gradient of every table is table-sized, and the trainers' updates interleave on the
server without any step synchronization.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.launch import METER, mark_servers, spawn
from benchmarks.network import EmulatedNetwork
from benchmarks.systems.common import train
from benchmarks.workload import Data, DenseDLRM, Workload, build_dlrm, loss_fn, table_weights

_TABLES: dict[int, rpc.RRef] = {}
_LOCK = threading.Lock()


def _server_tables(w: Workload, server: int) -> dict[int, rpc.RRef]:
    """On a server: its tables (created once, from the shared initial weights), by table index."""
    with _LOCK:
        if not _TABLES:
            weights = table_weights(build_dlrm(w))
            for i in range(server, w.tables, w.servers):
                bag = nn.EmbeddingBag(w.rows, w.dim, mode="sum")
                with torch.no_grad():
                    bag.weight.copy_(weights[i])
                _TABLES[i] = rpc.RRef(bag)
        return dict(_TABLES)


def _rank(rank: int, world_size: int, store: str, *, w: Workload) -> dict:
    trainers = w.trainers
    name = f"trainer{rank}" if rank < trainers else f"ps{rank - trainers}"
    if rank < trainers:
        dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=rank, world_size=trainers)
    rpc.init_rpc(name, rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}/rpc"))
    report = None
    try:
        if rank < trainers:
            report = _trainer(rank, w)
        # A server just serves until every trainer has called shutdown.
    finally:
        rpc.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    return report if rank < trainers else METER.report(name)


def _trainer(rank: int, w: Workload) -> dict:
    servers = [f"ps{s}" for s in range(w.servers)]
    embs: dict[int, RemoteModule] = {}
    for s, ps in enumerate(servers):
        for i, rref in rpc.rpc_sync(ps, _server_tables, args=(w, s)).items():
            embs[i] = RemoteModule.init_from_module_rref(f"{ps}/cpu", rref)
    embs = [embs[i] for i in range(w.tables)]
    dense = DDP(DenseDLRM(build_dlrm(w, tables="meta")))
    sparse_opt = DistributedOptimizer(torch.optim.SGD, [p for e in embs for p in e.remote_parameters()],
                                      lr=w.sparse_lr / w.trainers)
    dense_opt = DistributedOptimizer(torch.optim.SGD, [rpc.RRef(p) for p in dense.parameters()], lr=w.lr)
    batches = Data(w).batches(trainer=rank)

    def step(t: int, b) -> torch.Tensor:
        with dist_autograd.context() as ctx:
            futs = [emb.forward_async(b.ids[i]) for i, emb in enumerate(embs)]
            pooled = torch.stack([f.wait() for f in futs], dim=1)
            loss = loss_fn(dense(b.dense, pooled), b.labels)
            dist_autograd.backward(ctx, [loss])
            sparse_opt.step(ctx)
            dense_opt.step(ctx)
        return loss

    def start() -> None:
        if rank == 0:
            mark_servers(servers, "start")

    def stop() -> None:
        if rank == 0:  # after the barrier (on_stop): the servers' window closes after the last update
            mark_servers(servers, "stop")

    report = train(w, batches, step, name=f"trainer{rank}", sync=dist.barrier, on_start=start, on_stop=dist.barrier,
                   after=stop)
    return {**report, "samples_per_step": w.batch}


def run_rpc_tutorial(w: Workload, *, timeout_s: float, hosts: EmulatedNetwork | None = None) -> list[dict]:
    """Train ``w`` on ``trainers + servers`` fresh processes (each on its emulated host with
    ``hosts``); returns every process's report."""
    return spawn(_rank, w.trainers + w.servers, timeout_s=timeout_s, threads=w.threads, hosts=hosts, w=w)
