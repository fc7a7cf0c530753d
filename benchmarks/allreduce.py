"""``python -m benchmarks.allreduce``: how long one all-reduce of a DDP gradient bucket takes
between two trainer processes of this machine, through gloo and through hybrid's trainer ring.

Every DDP step of every system waits for one (TorchRec's DMP also for its all-to-alls, and the
training loop for its data agreement, ``data.read_ahead``). Two fresh processes
(:func:`benchmarks.launch.spawn`) all-reduce a float32 tensor of ``--floats`` elements (default:
the benchmark DLRM's dense parameters) ``--calls`` times back to back, after a warm-up, and one
JSON line reports the wall time of a call (percentiles and mean) and each process's CPU per call
(its threads' included: gloo's worker and event-loop threads do the work).

It runs the processes three times, in alternating rounds (``--rounds``): gloo's all-reduce with
its event-loop thread as gloo leaves it (``stock``) and under ``SCHED_BATCH`` (``batch``,
``runtime.gloo_loop_batch``, :func:`hybrid.launch.init.batch_gloo_loops`), and the trainers' own
ring (``ring``, ``runtime.trainer_ring``, :mod:`hybrid.dense.ring`: what hybrid's DDP uses on CPU);
one JSON line each, from all its rounds' calls, and the ratios against ``stock`` and ``batch``. On this project's 2-core virtual machine a stock call takes about
0.3 ms at the median, but one in ten or more takes 3.5-7 ms: about one tick of its kernel's
scheduler (250 Hz). The loop thread, woken by the peer's data, preempts the gloo worker holding
the connection's lock, finds it taken and polls again at once until the tick preempts it
(``perf stat -e syscalls:sys_enter_epoll_wait`` counts hundreds of ``epoll_wait`` calls per
all-reduce, against about 16 with ``--floats 1``). Under ``SCHED_BATCH`` its wake-up waits for the
worker instead. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

from benchmarks.launch import BenchmarkError, batch_gloo_loops, spawn
from benchmarks.workload import HelpFormatter

DLRM_DENSE = 56_609
"""Dense parameters of the benchmark's DLRM (bottom MLP 13-128-32, top MLP 256-128-1): DDP's one
bucket."""
PERCENTILES = (10, 50, 75, 90, 99)


LOOPS = ("stock", "batch", "ring")
"""How a run all-reduces: gloo with its event-loop thread as gloo starts it, or under
``SCHED_BATCH``; or the trainers' ring (gloo's loop under ``SCHED_BATCH``, as hybrid's trainers)."""


def _rank(rank: int, world_size: int, store: str, *, floats: int, calls: int, warmup: int, loop: str) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        if loop != "stock":
            batch_gloo_loops()
        if loop == "ring":
            from hybrid.dense import ring as ring_mod

            ring_mod.configure(dist.group.WORLD, address="127.0.0.1", timeout_s=60)
            ring = ring_mod.ring_of(dist.group.WORLD)
            if ring is None:
                raise BenchmarkError("the ring needs the native extension (hybrid._C); build it with make env")

            def all_reduce(t: torch.Tensor) -> None:
                ring.allreduce_(t).wait()
        else:
            all_reduce = dist.all_reduce
        x = torch.zeros(floats)  # a sum that stays put, call after call
        for _ in range(warmup):
            all_reduce(x)
        dist.barrier()
        walls = []
        cpu0 = time.process_time()
        for _ in range(calls):
            t0 = time.perf_counter()
            all_reduce(x)
            walls.append(time.perf_counter() - t0)
        cpu = (time.process_time() - cpu0) / calls
        check = torch.full((floats,), float(rank + 1))
        all_reduce(check)
        summed = bool((check == 3).all())
    finally:
        if loop == "ring":
            ring_mod.close_all()
        dist.destroy_process_group()
    return {"walls": walls, "cpu_s": cpu, "summed": summed}


def measure(floats: int = DLRM_DENSE, calls: int = 2000, warmup: int = 50, timeout_s: float = 300.0,
            rounds: int = 2) -> list[dict]:
    """Run the all-reduces, ``calls`` per round and way (:data:`LOOPS`), the ways alternating
    round by round; one report (milliseconds) per way, from all its rounds' calls."""
    if floats < 1 or calls < 1 or rounds < 1:
        raise BenchmarkError(f"--floats, --calls and --rounds: got {floats}, {calls} and {rounds}; "
                             f"expected integers >= 1")
    runs: dict[str, list[list[dict]]] = {loop: [] for loop in LOOPS}
    for _ in range(rounds):
        for loop in LOOPS:
            reports = spawn(_rank, 2, timeout_s=timeout_s, floats=floats, calls=calls, warmup=warmup, loop=loop)
            if not all(r["summed"] for r in reports):
                raise BenchmarkError("the all-reduce's check (1 + 2 in every element) came out wrong")
            runs[loop].append(reports)
    out = []
    for loop in LOOPS:
        walls = sorted(w for reports in runs[loop] for w in reports[0]["walls"])
        at = lambda q: 1e3 * walls[min(len(walls) - 1, int(q / 100 * len(walls)))]  # noqa: E731
        out.append({
            "loop": loop,
            "floats": floats,
            "calls": calls * rounds,
            "wall_ms": {f"p{q}": at(q) for q in PERCENTILES},
            "mean_wall_ms": 1e3 * sum(walls) / len(walls),
            "cpu_ms_per_call": [1e3 * sum(reports[r]["cpu_s"] for reports in runs[loop]) / rounds for r in range(2)],
        })
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.allreduce", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--floats", type=int, default=DLRM_DENSE, help="elements of the float32 tensor all-reduced")
    p.add_argument("--calls", type=int, default=2000, help="timed all-reduces")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each running every way (stock, batch, ring)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the processes are stopped")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        reports = measure(args.floats, args.calls, timeout_s=args.timeout, rounds=args.rounds)
    except BenchmarkError as e:
        print(f"benchmarks.allreduce: {e}", file=sys.stderr)
        return 2
    for report in reports:
        print(json.dumps(report))
        w = report["wall_ms"]
        print(f"{report['loop']:>5}: all-reduce of {args.floats} floats between 2 processes, {report['calls']} calls: "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in w.items())
              + f"; mean {report['mean_wall_ms']:.2f} ms; CPU a call "
              + " + ".join(f"{c:.2f}" for c in report["cpu_ms_per_call"]) + " ms", file=sys.stderr)
    stock, batch, ring = reports
    for a, b in ((batch, stock), (ring, stock), (ring, batch)):
        print(f"{a['loop']} / {b['loop']}: mean call {a['mean_wall_ms'] / b['mean_wall_ms']:.2f}x, CPU a call "
              f"{sum(a['cpu_ms_per_call']) / sum(b['cpu_ms_per_call']):.2f}x", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
