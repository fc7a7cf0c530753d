"""``torchrec_dmp``: TorchRec ``DistributedModelParallel`` on the trainers (gloo on CPU), no servers.

The tables are sharded over the trainers (``table_wise`` by default: table ``i`` on trainer
``i % trainers``; every CPU sharding TorchRec 1.8 offers is selectable) with FBGEMM's fused
kernel and the sparse SGD applied inside backward (``apply_optimizer_in_backward``); the rest of
the DLRM is data parallel (DMP wraps it in DDP). Pooled embeddings travel between trainers by
all-to-all. The fused update sees the *sum* of the trainers' gradients (each of a local-batch
mean), so its learning rate is ``sparse_lr / trainers``: the same update as every other system.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from benchmarks.launch import batch_gloo_loops, spawn
from benchmarks.network import EmulatedNetwork
from benchmarks.systems.common import train
from benchmarks.workload import Data, Workload, build_dlrm, loss_fn, table_weights

DMPSharding = Literal["table_wise", "row_wise", "column_wise", "table_column_wise", "data_parallel"]
SHARDINGS = ("table_wise", "row_wise", "column_wise", "table_column_wise", "data_parallel")


def _generators(w: Workload, sharding: str) -> dict:
    from torchrec.distributed import sharding_plan as sp

    t = w.trainers
    if sharding == "table_wise":
        return {f"t{i}": sp.table_wise(rank=i % t) for i in range(w.tables)}
    if sharding == "row_wise":
        return {f"t{i}": sp.row_wise() for i in range(w.tables)}
    if sharding == "column_wise":
        return {f"t{i}": sp.column_wise(ranks=list(range(t))) for i in range(w.tables)}
    if sharding == "table_column_wise":
        # Each table split in two column halves, on two consecutive trainers.
        return {f"t{i}": sp.column_wise(ranks=[i % t, (i + 1) % t]) for i in range(w.tables)}
    if sharding == "data_parallel":
        return {f"t{i}": sp.data_parallel() for i in range(w.tables)}
    raise ValueError(f"torchrec_dmp sharding: got {sharding!r}; expected one of {', '.join(SHARDINGS)}")


def _load_tables(model, weights: list[torch.Tensor]) -> None:
    """Give the sharded tables the shared initial weights (sharding re-initializes them)."""
    state = model.state_dict()
    with torch.no_grad():
        for i, full in enumerate(weights):
            param = state[f"sparse_arch.embedding_bag_collection.embedding_bags.t{i}.weight"]
            if isinstance(param, torch.Tensor) and not hasattr(param, "local_shards"):
                param.copy_(full)
                continue
            for shard in param.local_shards():
                (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(full[r : r + nr, c : c + nc])


def _trainer(rank: int, world_size: int, store: str, *, w: Workload, sharding: str, gloo_loop_batch: bool) -> dict:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=rank, world_size=world_size)
    try:
        if gloo_loop_batch:
            batch_gloo_loops()
        dlrm = build_dlrm(w)
        initial = [t.clone() for t in table_weights(dlrm)]
        ebc = dlrm.sparse_arch.embedding_bag_collection
        sparse_lr = w.sparse_lr / w.trainers if sharding != "data_parallel" else w.sparse_lr
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": sparse_lr})
        module_plan = construct_module_sharding_plan(
            ebc, _generators(w, sharding), local_size=world_size, world_size=world_size, device_type="cpu"
        )
        model = DistributedModelParallel(
            dlrm, device=torch.device("cpu"), plan=ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan}),
            sharders=[EmbeddingBagCollectionSharder()],
        )
        _load_tables(model, initial)
        dense_opt = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(model.named_parameters())),
            lambda params: torch.optim.SGD(params, lr=w.lr),
        )
        batches = Data(w).batches(trainer=rank)
        for b in batches:
            b.kjt()  # built before the timed loop, as in every system

        def step(t: int, b) -> torch.Tensor:
            loss = loss_fn(model(b.dense, b.kjt()), b.labels)
            loss.backward()
            dense_opt.step()
            dense_opt.zero_grad(set_to_none=True)
            return loss

        report = train(w, batches, step, name=f"trainer{rank}", sync=dist.barrier)
        return {**report, "samples_per_step": w.batch, "sharding": sharding}
    finally:
        dist.destroy_process_group()


def run_torchrec_dmp(w: Workload, *, timeout_s: float, sharding: str = "table_wise",
                     hosts: EmulatedNetwork | None = None, gloo_loop_batch: bool = False) -> list[dict]:
    """Train ``w`` on ``trainers`` fresh processes under DMP (each on its emulated host with
    ``hosts``); returns every process's report. ``gloo_loop_batch``: gloo's event-loop thread
    under ``SCHED_BATCH``, as hybrid's trainers run it (``runtime.gloo_loop_batch``)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"torchrec_dmp sharding: got {sharding!r}; expected one of {', '.join(SHARDINGS)}")
    return spawn(_trainer, w.trainers, timeout_s=timeout_s, threads=w.threads, hosts=hosts, w=w,
                 sharding=sharding, gloo_loop_batch=gloo_loop_batch)


def run_torchrec_dmp_batch(w: Workload, **kwargs) -> list[dict]:
    """DMP with gloo's event-loop thread as hybrid's trainers run it: the baseline without that
    difference between the two (not in the default systems)."""
    return run_torchrec_dmp(w, gloo_loop_batch=True, **kwargs)
