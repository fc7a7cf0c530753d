"""``python -m benchmarks.scale``: the benchmark DLRM with growing tables, one JSON line per size.

Sizes (``--sizes``, default ``100k,1M,4M``): ``100k``, ``1M``, ``4M``, ``16M`` are 8 tables of that
many rows x dim 32 on one parameter server; ``100M`` is one table of 100M rows x dim 16, row-wise
over 2 servers. Every size trains with 2 trainers (sync, SGD, the dense part under DDP; the
tables built on meta, so the trainers never hold one) in fresh processes, then saves a
checkpoint and loads it back. Each line holds:

- ``startup_s``: from starting the processes to the first training step (RPC up, the servers'
  tables allocated and initialized, the dense part composed, the batches made), and
  ``startup_phases_s`` (trainer 0): when the imports were done, RPC joined, compose returned;
- ``samples_per_s`` over the timed steps (every trainer's samples over the slowest's window),
  run once every initial row is made (the steady state), and ``samples_per_s_filling`` over the
  same steps run first, right after start-up, while the servers' background fill may still run;
- ``trainer_peak_rss_mb`` / ``server_peak_rss_mb``: the largest peak RSS (``VmHWM``) of any
  trainer / server over the training (``train_*``) and over the whole run, checkpoint included;
- ``server_bytes_per_row``: a server's resident memory grown by creating its shards, per row it
  holds, against ``expected_bytes_per_row`` (the row and its optimizer state), measured once the
  servers' background fill has made every initial row (``filled_s``: when that was, from the
  start; the servers make rows on first use before then, see ``hybrid.ps.server.lazy``);
- ``checkpoint_save_s`` / ``checkpoint_load_s``: ``hybrid.checkpoint.save`` and ``restore`` on
  the trainers (the servers write and read their own shards).

A size whose tables do not fit this machine (``runtime.server_memory_fraction`` of its available
memory) is refused by the servers before they allocate, and its line holds the error.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.launch import BenchmarkError, spawn
from benchmarks.systems.common import train
from benchmarks.systems.hybrid_ps import plan_dict, train_step, wait_filled
from benchmarks.workload import Data, HelpFormatter, Workload, build_dlrm

SIZES = {
    "100k": {"tables": 8, "rows": 100_000, "dim": 32, "servers": 1},
    "1M": {"tables": 8, "rows": 1_000_000, "dim": 32, "servers": 1},
    "4M": {"tables": 8, "rows": 4_000_000, "dim": 32, "servers": 1},
    "16M": {"tables": 8, "rows": 16_000_000, "dim": 32, "servers": 1},
    "100M": {"tables": 1, "rows": 100_000_000, "dim": 16, "servers": 2},
}
"""Size name (``--sizes``) -> tables, rows per table, dim and servers."""


def _rss_mb(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` (peak) of this process, MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rpc_rss(field: str) -> float:
    """:func:`_rss_mb` of the process this runs in (trainer 0 asks the servers)."""
    return _rss_mb(field)


def _servers(names: list[str], field: str) -> dict[str, float]:
    import torch.distributed.rpc as rpc

    return {n: rpc.rpc_sync(n, rpc_rss, args=(field,)) for n in names}


def _rank(rank: int, world_size: int, store: str, *, w: Workload, started: float, ckpt: str) -> dict:
    from hybrid.launch.init import RuntimeOptions, init_hybrid, shutdown
    from hybrid.launch.roles import role_of

    role = role_of(rank, world_size, w.servers)
    options = RuntimeOptions(rpc_timeout_s=600.0)  # creating and loading GBs of tables is one RPC
    imported = time.time() - started
    init_hybrid(role, init_method=f"file://{store}/rpc", backend="gloo", options=options)
    report, ok = {"name": role.name}, False
    try:
        if role.is_trainer:
            report = _trainer(role, w, options=options, started=started, ckpt=ckpt)
            report["startup_phases_s"] = {"imported": imported, **report["startup_phases_s"]}
        ok = True
    finally:
        shutdown(role, graceful=ok, timeout_s=options.shutdown_timeout_s)
    report["peak_rss_mb"] = _rss_mb("VmHWM")
    return report


def _trainer(role, w: Workload, *, options, started: float, ckpt: str) -> dict:
    import hybrid
    from hybrid.checkpoint import Checkpoint, save
    from hybrid.plan import plan_from_dict
    from hybrid.ps.client import pipeline_of

    joined = time.time() - started
    servers = [f"ps{s}" for s in range(w.servers)]
    before = _servers(servers, "VmRSS") if role.index == 0 else {}
    model = build_dlrm(w, tables="meta")
    hybrid.compose(model, plan_from_dict(plan_dict(w, dense="ddp", staleness=0)), role=role, runtime_options=options,
                   seed=w.seed)
    composed = time.time() - started
    pipeline = pipeline_of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=w.lr)
    batches = Data(w).batches(trainer=role.index)
    for b in batches:
        b.kjt()
    dist.barrier()
    startup_s = time.time() - started

    def sync() -> None:
        pipeline.flush()
        dist.barrier()

    def run() -> dict:
        return train(w, batches, lambda t, _b: train_step(model, optimizer, batches, t), name=role.name, sync=sync,
                     on_stop=sync)

    filling = run()  # right after start-up: the servers' background fill may still be running
    report = {"window_filling_s": filling["window_s"], "first_loss": filling["losses"][0], "startup_s": startup_s,
              "startup_phases_s": {"joined": joined, "composed": composed, "batches": startup_s}}
    if role.index == 0:
        wait_filled(model.sparse_arch.embedding_bag_collection)
        report["filled_s"] = time.time() - started
        after = _servers(servers, "VmRSS")
        report["server_grown_mb"] = {n: after[n] - before[n] for n in servers}
    dist.barrier()
    report = {**run(), **report}  # the same steps again, every initial row made: the steady state
    report.update(samples_per_step=w.batch, train_peak_rss_mb=_rss_mb("VmHWM"))
    if role.index == 0:
        report["server_train_peak_rss_mb"] = _servers(servers, "VmHWM")
    t0 = time.perf_counter()
    path = save(ckpt, w.total_steps, model, optimizer, keep=1)
    report["checkpoint_save_s"] = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    Checkpoint(path).restore(model, optimizer)
    dist.barrier()
    report["checkpoint_load_s"] = time.perf_counter() - t0
    pipeline.close()
    return report


def measure(name: str, *, trainers: int, warmup: int, steps: int, timeout_s: float, root: Path) -> dict:
    """One size's JSON line."""
    size = SIZES[name]
    w = Workload(tables=size["tables"], rows=size["rows"], dim=size["dim"], bottom_mlp=[128, size["dim"]],
                 trainers=trainers, servers=size["servers"], warmup=warmup, steps=steps)
    held = w.rows * w.tables // w.servers  # rows per server (row-wise: each holds 1/S of every table)
    line = {"size": name, "tables": w.tables, "rows": w.rows, "dim": w.dim, "trainers": w.trainers,
            "servers": w.servers, "table_bytes": w.tables * w.rows * w.dim * 4}
    ckpt = Path(tempfile.mkdtemp(prefix=f"scale-{name}-", dir=root))
    try:
        reports = spawn(_rank, w.trainers + w.servers, timeout_s=timeout_s, threads=w.threads, w=w,
                        started=time.time(), ckpt=str(ckpt))
    except BenchmarkError as e:
        return {**line, "error": str(e)}
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    ts = [r for r in reports if "losses" in r]
    first = next(r for r in ts if "server_grown_mb" in r)
    grown = max(first["server_grown_mb"].values()) * 2**20
    window = max(r["window_s"] for r in ts)
    line.update({
        "startup_s": max(r["startup_s"] for r in ts),
        "startup_phases_s": first["startup_phases_s"],
        "filled_s": first["filled_s"],
        "samples_per_s": sum(r["samples_per_step"] for r in ts) * w.steps / window,
        "samples_per_s_filling": sum(r["samples_per_step"] for r in ts) * w.steps
        / max(r["window_filling_s"] for r in ts),
        "train_trainer_peak_rss_mb": max(r["train_peak_rss_mb"] for r in ts),
        "train_server_peak_rss_mb": max(first["server_train_peak_rss_mb"].values()),
        "trainer_peak_rss_mb": max(r["peak_rss_mb"] for r in ts),
        "server_peak_rss_mb": max(r["peak_rss_mb"] for r in reports if "losses" not in r),
        "server_bytes_per_row": grown / held,
        "expected_bytes_per_row": w.dim * 4,  # sgd: no optimizer state
        "checkpoint_save_s": max(r["checkpoint_save_s"] for r in ts),
        "checkpoint_load_s": max(r["checkpoint_load_s"] for r in ts),
        "first_loss": sum(r["first_loss"] for r in ts) / len(ts),
        "final_loss": sum(r["losses"][-1] for r in ts) / len(ts),
    })
    line["bytes_per_row_ratio"] = line["server_bytes_per_row"] / line["expected_bytes_per_row"]
    return line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--sizes", default="100k,1M,4M", help=f"comma-separated sizes, in order; known: {', '.join(SIZES)}")
    p.add_argument("--trainers", type=int, default=2, help="trainer processes")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one size may take")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written (then removed)")
    args = p.parse_args(argv)
    args.size_list = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in args.size_list if s not in SIZES]
    if unknown:
        p.error(f"--sizes: unknown {', '.join(unknown)}; known: {', '.join(SIZES)}")
    if args.trainers < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--trainers and --steps must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    failed = False
    for name in args.size_list:
        line = measure(name, trainers=args.trainers, warmup=args.warmup, steps=args.steps, timeout_s=args.timeout,
                       root=Path(args.dir))
        failed |= "error" in line
        print(json.dumps(line), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
