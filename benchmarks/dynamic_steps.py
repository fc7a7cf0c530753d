"""``python -m benchmarks.dynamic_steps``: CPU per step of the sparse path, range against dynamic tables.

One process, no RPC: the default workload of :mod:`benchmarks.run` (8 tables x 100k rows x dim 32,
Zipf ids, 2 trainers x 256 samples, SGD, one server) with the tables of ``hybrid_sync`` and of
``hybrid_sync_dynamic`` (``ids: dynamic``, capacity = rows, ``evict: lru``, 64 parts). Each step
routes both trainers' batches (:class:`hybrid.ps.client.routing.Router`), answers both lookups and
applies both pushes on one :class:`hybrid.ps.server.shard.CollectionShard`, in the order a sync
server sees them; the gradients are random. Prints, per table kind, the thread CPU time per step
of each stage (median over ``--repeat`` runs): ``route`` (one trainer), ``lookups``, ``plan`` (a
sync server's planning of dynamic tables' admissions once both lookups are answered, while the
trainers compute) and ``update`` (the server, both trainers; what the last gradient waits for). Less sensitive to the machine's load than samples/s.

``--full CAPACITY [CAPACITY ...]``: instead, one ``evict: lru`` table (64 parts) per capacity,
filled to it, then 20 steps of 8,500 distinct ids of which half are new (each new id evicts a
row): the median milliseconds of the step's plan and of its commit (the id map's changes
included). A full table's step should cost the same at any capacity.

``--sightings WINDOW [WINDOW ...]``: instead, one ``admit_after: 2`` table (capacity 200,000, 64
parts) through 300 sync steps of 10,000 recurring ids (out of 50,000) and 10,000 fresh ones each
(a long tail seen once), once per ``admit_window`` given (0: none): the sightings kept at the end
and at most, the sightings map's largest size in MiB, the rows admitted and the milliseconds a
step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.systems.hybrid_ps import plan_dict
from benchmarks.workload import Data, Workload
from hybrid.ps.client.routing import Router
from hybrid.ps.config import CollectionConfig, DynamicIds, OptimizerSpec, TableSpec
from hybrid.ps.protocol import Rows
from hybrid.ps.server.dynamic import DynamicSlots, commit_updates, plan_updates
from hybrid.ps.server.shard import CollectionShard
from hybrid.ps.sharding import shard_tables


def config(w: Workload, *, dynamic: bool) -> CollectionConfig:
    """The benchmark's collection as its plan (:func:`plan_dict`) describes it, on one server."""
    opts = plan_dict(w, dense="ddp", staleness=0, dynamic=dynamic)["modules"]["sparse_arch.embedding_bag_collection"]
    specs = [TableSpec(f"t{i}", w.rows, w.dim, (f"f{i}",)) for i in range(w.tables)]
    ids = (DynamicIds(capacity=opts["capacity"], evict=opts["evict"], partitions=opts["partitions"])
           if dynamic else None)
    return CollectionConfig(cid="ebc", tables=tuple(specs), layouts=tuple(shard_tables(specs, 1, "row_wise")),
                            optimizer=OptimizerSpec(name="sgd", lr=w.sparse_lr), num_trainers=w.trainers,
                            dynamic=ids)


def run(w: Workload, *, dynamic: bool) -> dict[str, float]:
    """Milliseconds of thread CPU per timed step, by stage."""
    cfg = config(w, dynamic=dynamic)
    shard = CollectionShard(cfg, 0, start_step=0)
    for t in shard.tables:
        t.initialize(cfg.init_seed)
    router, data = Router(cfg), Data(w)
    ns = {"route": 0, "lookups": 0, "plan": 0, "update": 0}

    def timed(stage: str, fn, *args, **kwargs):
        t0 = time.thread_time_ns()
        out = fn(*args, **kwargs)
        if step >= w.warmup:
            ns[stage] += time.thread_time_ns() - t0
        return out

    for step in range(w.warmup + w.steps):
        batch = data.global_batch(step)
        kjts = [batch.slice(r * w.batch, (r + 1) * w.batch).kjt() for r in range(w.trainers)]
        reqs = [timed("route", router.route, k, where="bench").requests[0] for k in kjts]
        rows = [timed("lookups", shard.gather, req, step=step) for req in reqs]
        timed("plan", shard.plan_ahead, step)  # as the server does once both lookups are answered
        for r, (req, got) in enumerate(zip(reqs, rows)):
            timed("update", shard.push, r, step, [(req, torch.randn(got.numel()) * 1e-3)])
    ns["route"] /= w.trainers
    return {k: v / w.steps / 1e6 for k, v in ns.items()}


def full_table(capacity: int, steps: int = 20, seed: int = 0) -> dict[str, float]:
    """Milliseconds (median over ``steps``) of the plan and of the commit of a step of one full
    ``evict: lru`` table of ``capacity`` rows: 8,500 distinct ids, half of them new."""
    spec = DynamicIds(capacity=capacity, evict="lru", partitions=64)
    table = DynamicSlots(spec, list(range(spec.partitions)), table="t", where="bench", huge_pages=True)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(capacity, generator=g)
    step = 0
    for chunk in ids.split(max(1, capacity // 8)):  # filled in a few big steps
        commit_updates([table], plan_updates([table], [chunk.sort().values], step))
        step += 1
    plan_ms, commit_ms = [], []
    for r in range(steps):
        old = ids[torch.randint(0, capacity, (4250,), generator=g)].unique()
        new = torch.arange(4250) + capacity + 10_000_000 * (r + 1)
        t0 = time.perf_counter()
        admissions = plan_updates([table], [torch.cat([old, new]).sort().values], step)
        t1 = time.perf_counter()
        commit_updates([table], admissions)
        commit_ms.append((time.perf_counter() - t1) * 1e3)
        plan_ms.append((t1 - t0) * 1e3)
        step += 1
    assert table.rows == capacity and table.counters.evicted > 0
    return {"plan": statistics.median(plan_ms), "commit": statistics.median(commit_ms)}


def sightings(window: int, steps: int = 300, per_step: int = 10_000, seed: int = 0) -> dict[str, float]:
    """One ``admit_after: 2`` table with ``admit_window`` ``window`` through ``steps`` sync steps
    of ``per_step`` recurring ids (of 5 * ``per_step``) and ``per_step`` fresh ones each."""
    spec = DynamicIds(capacity=200_000, evict="lru", partitions=64, admit_after=2, admit_window=window)
    specs = [TableSpec("t", 1000, 16, ("f",))]
    cfg = CollectionConfig(cid="ebc", tables=tuple(specs), layouts=tuple(shard_tables(specs, 1, "table_wise")),
                           optimizer=OptimizerSpec(name="sgd", lr=0.1), num_trainers=1, dynamic=spec)
    shard = CollectionShard(cfg, 0, start_step=0, huge_pages=False)
    seen = shard.tables[0].dynamic.seen
    g = torch.Generator().manual_seed(seed)
    most, mib, t0 = 0, 0.0, time.perf_counter()
    for step in range(steps):
        ids = torch.cat([torch.randint(0, 5 * per_step, (per_step,), generator=g),
                         torch.randint(0, 2**62, (per_step,), generator=g)]).unique()
        shard.push(0, step, [(Rows([0], [ids.numel()], ids), torch.ones(ids.numel() * 16))])
        most, mib = max(most, len(seen)), max(mib, seen.keys.numel() * 16 / 2**20)
    ms = (time.perf_counter() - t0) / steps * 1e3
    return {"sightings": len(seen), "most": most, "map_mib": mib,
            "rows": shard.tables[0].dynamic.rows, "ms": ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="runs per table kind, alternating; medians reported")
    p.add_argument("--full", type=int, nargs="+", metavar="CAPACITY",
                   help="time a step of one full evict: lru table of each capacity instead")
    p.add_argument("--sightings", type=int, nargs="+", metavar="WINDOW",
                   help="a long tail of ids through an admit_after: 2 table, once per admit_window (0: none)")
    Workload.add_arguments(p)
    args = p.parse_args()
    w = Workload.from_args(args)
    torch.set_num_threads(w.threads)
    if args.sightings:
        print(f"{'window':>8s} {'sightings':>10s} {'at most':>10s} {'map MiB':>8s} {'rows':>8s} {'ms/step':>8s}")
        for window in args.sightings:
            got = sightings(window)
            print(f"{window:8d} {got['sightings']:10,d} {got['most']:10,d} {got['map_mib']:8.1f} {got['rows']:8,d} "
                  f"{got['ms']:8.2f}")
        return
    if args.full:
        print(f"{'capacity':>10s} {'plan':>8s} {'commit':>8s}  ms a step (one table, 8,500 ids, half new)")
        for capacity in args.full:
            got = full_table(capacity)
            print(f"{capacity:10d} {got['plan']:8.2f} {got['commit']:8.2f}")
        return
    got: dict[str, list[dict[str, float]]] = {"range": [], "dynamic": []}
    for _ in range(args.repeat):
        for kind in got:
            got[kind].append(run(w, dynamic=kind == "dynamic"))
    print(f"{'tables':8s} {'route (trainer)':>16s} {'lookups (server)':>17s} {'plan (server)':>14s} "
          f"{'update (server)':>16s}  ms CPU per step")
    for kind, runs in got.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{kind:8s} {med['route']:16.2f} {med['lookups']:17.2f} {med['plan']:14.2f} {med['update']:16.2f}")


if __name__ == "__main__":
    main()
