"""``local``: one process, plain PyTorch, the whole global batch per step -- the ceiling.

The tables are ``nn.EmbeddingBag(sparse=True)`` (sparse gradients: only the touched rows), the
dense part is the DLRM's own bottom MLP, interaction and top MLP, and both go through
``torch.optim.SGD`` (which applies a sparse gradient row by row). No process group, no RPC.
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.launch import spawn
from benchmarks.network import EmulatedNetwork
from benchmarks.systems.common import train
from benchmarks.workload import Data, DenseDLRM, Workload, build_dlrm, loss_fn, table_weights


def _local(rank: int, world_size: int, store: str, *, w: Workload) -> dict:
    dlrm = build_dlrm(w)
    bags = nn.ModuleList(
        nn.EmbeddingBag.from_pretrained(t.clone(), freeze=False, mode="sum", sparse=True) for t in table_weights(dlrm)
    )
    dense = DenseDLRM(dlrm)
    sparse_opt = torch.optim.SGD(bags.parameters(), lr=w.sparse_lr)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=w.lr)
    batches = Data(w).batches()

    def step(t: int, b) -> torch.Tensor:
        pooled = torch.stack([bag(b.ids[i]) for i, bag in enumerate(bags)], dim=1)
        loss = loss_fn(dense(b.dense, pooled), b.labels)
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        sparse_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        return loss

    return {**train(w, batches, step, name="local"), "samples_per_step": w.global_batch}


def run_local(w: Workload, *, timeout_s: float, hosts: EmulatedNetwork | None = None) -> list[dict]:
    """Train ``w`` in one fresh process (on emulated host 0 with ``hosts``); returns its report."""
    return spawn(_local, 1, timeout_s=timeout_s, threads=w.threads, hosts=hosts, w=w)
