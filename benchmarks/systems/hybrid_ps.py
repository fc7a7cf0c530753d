"""``hybrid_sync``, ``hybrid_async``, ``hybrid_sync_fsdp`` and ``hybrid_sync_dynamic``: the DLRM
composed by hybrid.

The tables go to the parameter servers (``sgd`` with ``sparse_lr``, trainers' gradients
averaged), the bottom and top MLPs under DDP (``hybrid_sync``, ``hybrid_async``) or FSDP2
(``hybrid_sync_fsdp``); ``hybrid_sync_dynamic`` is ``hybrid_sync`` with ``ids: dynamic`` tables
(capacity ``rows`` each, ``evict: lru``: the id map, routing by hash and row creation on first
touch, without evictions at steady state); ``hybrid_async`` runs with staleness 1 and prefetches
two batches ahead, the second one's lookup sent while DDP's all-reduce runs
(``s.prefetch_depth``). Every step is ``with hybrid.step(model, optimizer)``, as in the training
loop. ``wire_dtype`` (every system) is the tables' ``wire_dtype``: the dtype of
rows and gradients between trainers and servers. Besides the common report, trainer 0 returns the
per-step breakdown (:class:`hybrid.ps.client.StepTimes`), the servers' counters over the timed
window and the wire dtype it ran with.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from benchmarks.launch import METER, mark_servers, spawn
from benchmarks.network import ADDRESS_ENV, EmulatedNetwork
from benchmarks.systems.common import train
from benchmarks.workload import Data, Workload, build_dlrm, loss_fn


def plan_dict(w: Workload, *, dense: str, staleness: int, comm_hook: str | None = None,
              dynamic: bool = False, wire_dtype: str = "float32") -> dict:
    """The plan: tables row-wise on every server (table-wise with ``w.pool_on`` server, which
    needs every table whole on one server), rows and gradients in ``wire_dtype`` between
    them and the trainers, both MLPs under ``dense`` (a ddp ``comm_hook`` other than the plan's
    default when given; DDP with the options TorchRec's DMP gives its dense part, so the two
    systems' dense parts run alike); ``dynamic``: ``ids: dynamic`` tables of ``w.rows`` rows each."""
    dense_opts = {"strategy": dense, **({"comm_hook": comm_hook} if comm_hook else {})}
    if dense == "ddp":  # DDP as torchrec_dmp's dense part runs (TorchRec's DefaultDataParallelWrapper)
        dense_opts.update(gradient_as_bucket_view=True, static_graph=True, broadcast_buffers=False)
    # Parts of at least 1,024 rows (64 at the default 100k rows): a tiny table in 64 parts of 3
    # rows would be full as soon as one step brings 4 new ids of one part.
    parts = max(1, min(64, w.rows // 1024))
    ids = {"ids": "dynamic", "capacity": w.rows, "evict": "lru", "partitions": parts} if dynamic else {}
    return {
        "world_size": w.trainers + w.servers,
        "topology": {"parameter_servers": w.servers},
        "modules": {
            "sparse_arch.embedding_bag_collection": {
                "strategy": "parameter_server", "sharding": "table_wise" if w.pool_on == "server" else "row_wise",
                "pool_on": w.pool_on,
                "optimizer": {"name": "sgd", "lr": w.sparse_lr}, "wire_dtype": wire_dtype, **ids,
                **({"hot_rows": w.hot_rows} if staleness and w.hot_rows else {}),
            },
            "dense_arch": dict(dense_opts),
            "over_arch": dict(dense_opts),
        },
        "sync": {"staleness": staleness},
    }


def _rank(rank: int, world_size: int, store: str, *, w: Workload, dense: str, staleness: int,
          runtime: dict, comm_hook: str | None = None, dynamic: bool = False, wire_dtype: str = "float32") -> dict:
    from hybrid.launch.init import RuntimeOptions, init_hybrid, shutdown
    from hybrid.launch.roles import role_of
    from hybrid.launch.serve import release_servers, serve

    role = role_of(rank, world_size, w.servers)
    if ADDRESS_ENV in os.environ:  # an emulated host: every socket on its own address
        runtime = {**runtime, "address": os.environ[ADDRESS_ENV]}
    options = RuntimeOptions(**runtime)
    init_hybrid(role, init_method=f"file://{store}/rpc", backend="gloo", options=options)
    report, ok = None, False
    try:
        # As in `hybrid train`: a server serves until trainer 0 releases it, however long the
        # training takes (its RPC shutdown alone would wait runtime.shutdown_timeout_s).
        if role.is_trainer:
            report = _trainer(role, w, dense=dense, staleness=staleness, options=options, comm_hook=comm_hook,
                              dynamic=dynamic, wire_dtype=wire_dtype)
            dist.barrier()  # every trainer done before the servers go
            if role.index == 0:
                release_servers(role, options.rpc_timeout_s)
        else:
            serve(role, heartbeat_s=options.heartbeat_s, timeout_s=options.rpc_timeout_s)
        ok = True
    finally:
        shutdown(role, graceful=ok, timeout_s=options.shutdown_timeout_s)
    return report if role.is_trainer else METER.report(role.name)


def wait_filled(collection, timeout_s: float = 600.0) -> None:
    """Wait until the servers' background fill has made every initial row of ``collection``
    (``hybrid.ps.server.lazy``): the steady state other systems start in, their tables made
    eagerly before the first step."""
    deadline = time.monotonic() + timeout_s
    while any(d.get("rows_to_fill", 0) for d in collection.stats().values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the servers' background fill did not finish in {timeout_s:.0f} s")
        time.sleep(0.05)


def train_step(model, optimizer, batches: list, t: int) -> torch.Tensor:
    """Step ``t`` of a composed model over ``batches``, prefetching the coming batches' rows (as
    many as ``s.prefetch_depth``), as the training loop does; the loss."""
    import hybrid

    b = batches[t]
    with hybrid.step(model, optimizer) as s:
        logits = model(b.dense, b.kjt())
        s.prefetch(*(c.kjt() for c in batches[t + 1:t + 1 + s.prefetch_depth]))
        loss = loss_fn(logits, b.labels)
        s.backward(loss)
    return loss


def _trainer(role, w: Workload, *, dense: str, staleness: int, options, comm_hook: str | None = None,
             dynamic: bool = False, wire_dtype: str = "float32") -> dict:
    import hybrid
    from hybrid.plan import plan_from_dict
    from hybrid.ps.client import pipeline_of

    model = build_dlrm(w, tables="meta")  # the servers fill the tables: none on a trainer
    hybrid.compose(model, plan_from_dict(plan_dict(w, dense=dense, staleness=staleness, comm_hook=comm_hook,
                                                          dynamic=dynamic, wire_dtype=wire_dtype)), role=role,
                   runtime_options=options, seed=w.seed)
    ebc = model.sparse_arch.embedding_bag_collection
    pipeline = pipeline_of(model)
    optimizer = torch.optim.SGD([p for p in model.parameters()], lr=w.lr)
    batches = Data(w).batches(trainer=role.index)
    for b in batches:
        b.kjt()
    times, stats = [], {}

    def step(t: int, b) -> torch.Tensor:
        loss = train_step(model, optimizer, batches, t)
        if t >= w.warmup:
            times.append(pipeline.last_times)
        return loss

    # The servers' meters (CPU, bytes on their interface) open before the counters are read and
    # close after: every byte the counters count falls inside the meters' window. The trainers'
    # window ends once every push is in (the flush and the barrier), before the counters are read
    # (about 10 ms of RPC: the harness's, as DMP's window holds none).
    def stop() -> None:
        pipeline.flush()
        dist.barrier()

    def read_counters() -> None:
        if role.index == 0:
            stats["stop"] = ebc.stats()
            mark_servers(ebc.server_names, "stop")

    def sync() -> None:
        pipeline.flush()  # the window's counters start with nothing owed
        if role.index == 0:
            wait_filled(ebc)  # as every other system, the tables are whole before the window
            # The window opens before the barrier that lets every trainer into it: a trainer that
            # left the barrier first would otherwise send its first lookups before they are read.
            mark_servers(ebc.server_names, "start")
            stats["start"] = ebc.stats()
        dist.barrier()

    report = train(w, batches, step, name=role.name, sync=sync, on_stop=stop, after=read_counters)
    pipeline.close()
    report["samples_per_step"] = w.batch
    report["wire_dtype"] = ebc.config.wire_dtype
    report["pool_on"] = "server" if ebc.pools_on_server else "trainer"  # as pool_on resolved
    if ebc.hot_rows is not None:
        report["hot_rows"] = ebc.hot_rows.counters.as_dict()
    if role.index == 0:
        report["breakdown_s"] = {k: sum(getattr(x, k) for x in times) / len(times) for k in asdict(times[0])}
        report["server_stats"] = {n: _delta(stats["start"][n], stats["stop"][n]) for n in stats["stop"]}
        for n, st in stats["stop"].items():  # a level, not a counter
            report["server_stats"][n]["huge_page_bytes"] = st.get("huge_page_bytes")
    return report


def _delta(before: dict, after: dict) -> dict:
    """Counters accumulated over the timed window (numbers only)."""
    return {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float)) and k in before}


def _run(w: Workload, *, timeout_s: float, dense: str, staleness: int, runtime: dict | None,
         comm_hook: str | None = None, hosts: EmulatedNetwork | None = None, dynamic: bool = False,
         wire_dtype: str = "float32") -> list[dict]:
    return spawn(_rank, w.trainers + w.servers, timeout_s=timeout_s, threads=w.threads, hosts=hosts, w=w,
                 dense=dense, staleness=staleness, runtime=dict(runtime or {}), comm_hook=comm_hook, dynamic=dynamic,
                 wire_dtype=wire_dtype)


def run_hybrid_sync(w: Workload, *, timeout_s: float, runtime: dict | None = None,
                    comm_hook: str | None = None, hosts: EmulatedNetwork | None = None,
                    wire_dtype: str = "float32") -> list[dict]:
    """Sync (staleness 0), dense under DDP. ``runtime``: :class:`RuntimeOptions` overrides;
    ``comm_hook``: the plan's ddp ``comm_hook`` (default: the plan's default); ``hosts``: every
    process on its own emulated host, listening on its address; ``wire_dtype``: the tables'."""
    return _run(w, timeout_s=timeout_s, dense="ddp", staleness=0, runtime=runtime, comm_hook=comm_hook, hosts=hosts,
                wire_dtype=wire_dtype)


def run_hybrid_async(w: Workload, *, timeout_s: float, runtime: dict | None = None,
                     comm_hook: str | None = None, hosts: EmulatedNetwork | None = None,
                     wire_dtype: str = "float32") -> list[dict]:
    """Async (staleness ``w.async_staleness``, 1 by default, and ``w.hot_rows`` cached on each
    trainer; prefetch of the next batch), dense under DDP."""
    return _run(w, timeout_s=timeout_s, dense="ddp", staleness=w.async_staleness, runtime=runtime,
                comm_hook=comm_hook, hosts=hosts, wire_dtype=wire_dtype)


def run_hybrid_sync_fsdp(w: Workload, *, timeout_s: float, runtime: dict | None = None,
                         hosts: EmulatedNetwork | None = None, wire_dtype: str = "float32") -> list[dict]:
    """Sync (staleness 0), dense under FSDP2."""
    return _run(w, timeout_s=timeout_s, dense="fsdp", staleness=0, runtime=runtime, hosts=hosts,
                wire_dtype=wire_dtype)


def run_hybrid_sync_dynamic(w: Workload, *, timeout_s: float, runtime: dict | None = None,
                            comm_hook: str | None = None, hosts: EmulatedNetwork | None = None,
                            wire_dtype: str = "float32") -> list[dict]:
    """``hybrid_sync`` with ``ids: dynamic`` tables (capacity ``w.rows``, ``evict: lru``)."""
    return _run(w, timeout_s=timeout_s, dense="ddp", staleness=0, runtime=runtime, comm_hook=comm_hook, hosts=hosts,
                dynamic=True, wire_dtype=wire_dtype)
