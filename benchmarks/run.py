"""``python -m benchmarks.run``: one synthetic DLRM, trained under several systems, side by side.

Every system trains the same model (same initial weights) on the same batches, in fresh
processes of its own, one system after the other. Each prints one JSON line on stdout::

    {"system": "hybrid_sync", "samples_per_s": ..., "median_step_s": ..., "first_loss": ...,
     "final_loss": ..., "processes": {"trainer0": {"cpu_util": ..., "peak_rss_mb": ...}, ...},
     "breakdown_s": {...}, "servers": {"ps0": {"rpcs_per_step": ..., ...}}}

and a table of throughput ratios (with the issue's targets) goes to stderr at the end. With
``--repeat N`` (default 3) every system runs N times, round-robin, and its line is its median
run's (``runs_samples_per_s`` lists them all): on a shared 2-core machine one run's samples/s
wanders by up to 1.5x. The table's ratios are medians of the ratios within each round (runs
seconds apart share the machine's speed of the moment), not ratios of the medians.
``samples_per_s`` counts every trainer's samples over the slowest trainer's timed window;
``first_loss``/``final_loss`` are the global batch's mean loss at the first and the last step.

``--network emulated[:rate=10gbit,delay=50us]`` runs every process as a host of its own on an
emulated network (:mod:`benchmarks.network`; root only); each process then also reports the bytes
its interface carried per step, and each hybrid server its bytes beside their minimum.

``--wire-dtype bfloat16`` runs every hybrid system with its tables' ``wire_dtype: bfloat16``:
rows and gradients cross between trainers and servers in 16 bits (the line's ``wire_dtype``).
``--pool-on server`` runs them with ``pool_on: server`` (tables table-wise), ``--pool-on
trainer`` with ``trainer``; the default, ``auto``, pools on the servers where the trainers reach
them over the network. Pooled on the servers, they send pooled bags and take the bags'
gradients (the line's ``pool_on``: where the pooling was); the bytes' minimum still counts rows.
"""

from __future__ import annotations

import argparse
import json
import contextlib
import math
import signal
import statistics
import sys
import time
from collections.abc import Iterator

from benchmarks.launch import BenchmarkError
from benchmarks.network import EmulatedNetwork, NetworkError, parse_network
from benchmarks.systems import DEFAULT_SYSTEMS, SYSTEMS
from benchmarks.systems.torchrec_dmp import SHARDINGS
from benchmarks.workload import HelpFormatter, Workload
from hybrid.ps.config import PS_TRANSPORTS, WIRE_BYTES, WIRE_DTYPES

TARGETS = {
    # (system, baseline, minimum ratio of samples/s), by the network the run used
    "loopback": [
        ("hybrid_sync", "torchrec_dmp", 1.4),
        ("hybrid_async", "torchrec_dmp", 1.7),
        ("hybrid_sync", "rpc_tutorial", 8.0),
        ("hybrid_sync", "local", 0.6),
        ("hybrid_sync_dynamic", "hybrid_sync", 0.8),
    ],
    "emulated": [
        ("hybrid_sync", "torchrec_dmp", 1.3),
        ("hybrid_async", "torchrec_dmp", 1.6),
    ],
}
"""The project's throughput targets, checked in the table: on one host (the same-host paths
included), and with every process a host of its own (``--network emulated``)."""

def summarize(system: str, w: Workload, reports: list[dict]) -> dict:
    """One system's JSON line from its processes' reports."""
    trainers = [r for r in reports if "losses" in r]
    window = max(r["window_s"] for r in trainers)
    samples = sum(r["samples_per_step"] for r in trainers) * w.steps
    per_step = [max(ts) for ts in zip(*(r["step_s"] for r in trainers))]
    line = {
        "system": system,
        "samples_per_s": samples / window,
        "median_step_s": statistics.median(per_step),
        # Every trainer's batch has the same size, so the global mean loss is the trainers' mean.
        "first_loss": sum(r["losses"][0] for r in trainers) / len(trainers),
        "final_loss": sum(r["losses"][-1] for r in trainers) / len(trainers),
        "steps": w.steps,
        "processes": {r["name"]: _process(r, w.steps) for r in reports},
    }
    if "sharding" in trainers[0]:
        line["sharding"] = trainers[0]["sharding"]
    if "breakdown_s" in trainers[0]:
        line["breakdown_s"] = trainers[0]["breakdown_s"]
        line["wire_dtype"] = trainers[0]["wire_dtype"]
        line["pool_on"] = trainers[0]["pool_on"]
        if "hot_rows" in trainers[0]:  # each trainer's cache, since it was made (warm-up included)
            line["hot_rows"] = {r["name"]: r["hot_rows"] for r in trainers}
        by_name = {r["name"]: r for r in reports}
        line["servers"] = {name: _per_step(c, w.steps, dim=w.dim, wire_bytes=WIRE_BYTES[line["wire_dtype"]],
                                           meter=by_name.get(name, {}))
                           for name, c in trainers[0]["server_stats"].items()}
    return line


def _process(r: dict, steps: int) -> dict:
    """One process's CPU and memory, and on an emulated host its interface's bytes per step."""
    out = {"cpu_util": r["cpu_util"], "cpu_ms_per_step": 1e3 * r["cpu_s"] / steps, "peak_rss_mb": r["peak_rss_mb"]}
    for way in ("recv", "sent"):
        if f"wire_bytes_{way}" in r:
            out[f"wire_bytes_{way}_per_step"] = r[f"wire_bytes_{way}"] / steps
    return out


def _per_step(c: dict, steps: int, *, dim: int, wire_bytes: int, meter: dict) -> dict:
    """A server's counters over the timed window, per step (all trainers together), and the
    memory its process holds in huge pages at the end.

    ``min_bytes_per_step`` is what rows and gradients need at least, each way: the unique rows
    served times ``dim`` times ``wire_bytes`` (the wire dtype's size). ``bytes_*_per_step`` are the
    payloads the server counts (rows out; lookup ids and gradients in); on an emulated host
    ``wire_bytes_*_per_step`` are what its interface carried (``meter``: the server's report),
    headers, ids and control messages included. Each has its ratio to the minimum."""
    least = c["rows_served"] * dim * wire_bytes / steps
    out = {
        "rpcs_per_step": (c["lookups"] - c.get("channel_lookups", 0) + c["push_messages"]) / steps,
        "channel_messages_per_step": c.get("channel_lookups", 0) / steps,
        "lookups_per_step": c["lookups"] / steps,
        "gradient_pushes_per_step": c["gradients"] / steps,
        "bytes_recv_per_step": c["bytes_in"] / steps,
        "bytes_sent_per_step": c["bytes_out"] / steps,
        "unique_id_ratio": c["rows_served"] / c["ids_requested"] if c["ids_requested"] else 1.0,
        "wait_s_per_step": c["wait_s"] / steps,
        "huge_page_mb": None if c.get("huge_page_bytes") is None else c["huge_page_bytes"] / 2**20,
        "unique_rows_per_step": c["rows_served"] / steps,
        "min_bytes_per_step": least,
    }
    for way in ("recv", "sent"):
        if f"wire_bytes_{way}" in meter:
            out[f"wire_bytes_{way}_per_step"] = meter[f"wire_bytes_{way}"] / steps
    for key in [k for k in out if k.startswith(("bytes_", "wire_bytes_"))]:
        out[key.replace("_per_step", "_over_min")] = out[key] / least if least else None
    return out


def median_run(runs: list[dict]) -> dict:
    """One system's line from its repeated runs: the run with the median samples/s (the lower
    middle one of an even count), plus every run's samples/s in ``runs_samples_per_s``. A
    system with a failed run reports that run's error."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    sps = [r["samples_per_s"] for r in runs]
    mid = statistics.median_low(sps)
    return {**next(r for r in runs if r["samples_per_s"] == mid), "runs_samples_per_s": sps}


def run_rounds(w: Workload, systems: list[str], *, repeat: int, progress=None, **kwargs) -> list[dict]:
    """Run every system ``repeat`` times, round-robin (round 1 runs them all in order, then round
    2, ...), so that the machine's slow and fast moments fall on every system alike; returns one
    line per system (:func:`median_run`). ``progress(round, line)`` is called after each run."""
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for k in range(repeat):
        for name in systems:
            line = run_systems(w, [name], **kwargs)[0]
            runs[name].append(line)
            if progress is not None:
                progress(k + 1, line)
    return [median_run(runs[name]) for name in systems]


def run_systems(w: Workload, systems: list[str], *, timeout_s: float, dmp_sharding: str = "table_wise",
                runtime: dict | None = None, hosts: EmulatedNetwork | None = None,
                wire_dtype: str = "float32") -> list[dict]:
    """Run ``systems`` one after another (every process on its own emulated host with ``hosts``;
    hybrid's rows and gradients in ``wire_dtype``); returns their JSON lines (``{"system",
    "error"}`` for a system that failed)."""
    lines = []
    for name in systems:
        kwargs: dict = {"timeout_s": timeout_s, "hosts": hosts}
        if name.startswith("torchrec_dmp"):
            kwargs["sharding"] = dmp_sharding
        if name.startswith("hybrid"):
            kwargs["wire_dtype"] = wire_dtype
            if runtime:
                kwargs["runtime"] = runtime
        t0 = time.perf_counter()
        if hosts is not None:
            hosts.delay_line_snapshot()  # from here on, what this system sends
        try:
            line = summarize(name, w, SYSTEMS[name](w, **kwargs))
        except BenchmarkError as e:
            line = {"system": name, "error": str(e)}
        line["wall_s"] = time.perf_counter() - t0
        line["network"] = hosts.describe() if hosts is not None else {"kind": "loopback"}
        if hosts is not None and (held := hosts.delay_line_snapshot()) is not None:
            line["network"]["delay_line"] = held
        lines.append(line)
    return lines


def round_ratios(line: dict, base: dict) -> list[float]:
    """``line``'s samples/s over ``base``'s, round by round (the runs of one round are seconds to
    a minute apart, so they share the machine's speed of the moment, which wanders by a third
    on a shared 2-core machine)."""
    a = line.get("runs_samples_per_s", [line["samples_per_s"]])
    b = base.get("runs_samples_per_s", [base["samples_per_s"]])
    if len(a) != len(b):
        return [line["samples_per_s"] / base["samples_per_s"]]
    return [x / y for x, y in zip(a, b)]


def paired_ratio(line: dict, base: dict) -> float:
    """The median over rounds of :func:`round_ratios` (the lower middle for an even count): a
    slow spell of the machine slows both systems of a round, so it cancels here, where a ratio
    of the two medians would compare runs from different moments."""
    return statistics.median_low(round_ratios(line, base))


def ratio_table(lines: list[dict]) -> str:
    """Samples/s of every system (its median run), its ratio to each baseline present (the median
    of the rounds' ratios, :func:`paired_ratio`), and the targets."""
    ok = {l["system"]: l for l in lines if "error" not in l}
    bases = [b for b in ("local", "rpc_tutorial", "torchrec_dmp", "torchrec_dmp_batch") if b in ok]
    widths = [max(15, len(b) + 3) for b in bases]
    head = f"{'system':<18}{'samples/s':>11}{'step ms':>9}{'first loss':>12}{'final loss':>12}" + "".join(
        f"{'/' + b:>{n}}" for b, n in zip(bases, widths)
    )
    rows = [head, "-" * len(head)]
    for l in lines:
        if "error" in l:
            rows.append(f"{l['system']:<18}  FAILED (see the JSON line)")
            continue
        r = f"{l['system']:<18}{l['samples_per_s']:>11.0f}{l['median_step_s'] * 1e3:>9.1f}"
        r += f"{l['first_loss']:>12.6f}{l['final_loss']:>12.6f}"
        r += "".join(f"{paired_ratio(l, ok[b]):>{n - 1}.2f}x" for b, n in zip(bases, widths))
        rows.append(r)
    wire = [(l["system"], l["wire_dtype"], name, s) for l in lines if "error" not in l
            for name, s in l.get("servers", {}).items() if "wire_bytes_sent_over_min" in s]
    if wire:
        rows.append("")
        rows.append("bytes on the wire per step / minimum (unique rows x dim x the wire dtype's bytes), "
                    "server sent / received:")
        for system, dtype, name, s in wire:
            rows.append(f"  {system} {name} ({dtype}): {s['wire_bytes_sent_over_min']:.2f}x / {s['wire_bytes_recv_over_min']:.2f}x "
                        f"({s['wire_bytes_sent_per_step'] / 1e3:.0f} / {s['wire_bytes_recv_per_step'] / 1e3:.0f} kB; "
                        f"minimum {s['min_bytes_per_step'] / 1e3:.0f} kB)")
    held = [(l["system"], l["network"]["delay_line"]) for l in lines if "delay_line" in l.get("network", {})]
    if held:
        rows.append("")
        rows.append("delay line (the median run's): frames, how long they stayed, its CPU:")
        for system, d in held:
            h = d["held_us"]
            rows.append(f"  {system}: {d['frames']} frames, {d['dropped']} dropped; held p10 {h['p10']} / p50 {h['p50']} / "
                        f"p90 {h['p90']} / p99 {h['p99']} us; {d['cpu_s']:.2f} s CPU")
    kind = next((l.get("network", {}).get("kind") for l in lines), None) or "loopback"
    checks = [(s, b, m) for s, b, m in TARGETS[kind] if s in ok and b in ok]
    if checks:
        rows.append("")
        rows.append("targets:")
        for s, b, m in checks:
            got = paired_ratio(ok[s], ok[b])
            rounds = round_ratios(ok[s], ok[b])
            each = f"  (rounds: {', '.join(f'{x:.2f}' for x in rounds)})" if len(rounds) > 1 else ""
            rows.append(f"  {s} >= {m:g}x {b}: {got:.2f}x  {'met' if got >= m else 'MISSED'}{each}")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated systems to run, in order; known: {', '.join(SYSTEMS)} "
                        f"(torchrec_dmp_batch: DMP with gloo's event-loop thread as hybrid runs it)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one system may take before it is killed")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs per system, round-robin over the systems; each reports its median run "
                        "(the machine's speed wanders between runs)")
    p.add_argument("--dmp-sharding", default="table_wise", choices=SHARDINGS, help="torchrec_dmp's sharding type")
    p.add_argument("--transports", default=None,
                   help="hybrid's TensorPipe transports, e.g. uv or shm,uv (default: RuntimeOptions')")
    p.add_argument("--channels", default=None,
                   help="hybrid's TensorPipe channels, e.g. basic or cma,basic (default: RuntimeOptions')")
    p.add_argument("--rpc-threads", type=int, default=None,
                   help="hybrid's RPC worker threads per process (default: RuntimeOptions')")
    p.add_argument("--huge-pages", choices=("on", "off"), default=None,
                   help="hybrid's servers keep tables in transparent huge pages (default: RuntimeOptions', on)")
    p.add_argument("--gloo-loop", choices=("batch", "stock"), default=None,
                   help="hybrid's trainers run gloo's event-loop thread under SCHED_BATCH (batch) or as gloo "
                        "starts it (stock) (runtime.gloo_loop_batch; default: RuntimeOptions', batch)")
    p.add_argument("--allreduce", choices=("ring", "gloo"), default=None,
                   help="DDP's all-reduce on hybrid's trainers: over their own ring (ring) or gloo's "
                        "(runtime.trainer_ring; default: RuntimeOptions', ring)")
    p.add_argument("--server-policy", choices=("batch", "stock"), default=None,
                   help="hybrid's servers run under SCHED_BATCH (batch) or as started (stock) "
                        "(runtime.server_batch; default: RuntimeOptions', batch)")
    p.add_argument("--network", default="loopback", metavar="loopback|emulated[:rate=R,delay=D]",
                   help="loopback: every process on this host; emulated: every process a host of its own on an "
                        "emulated network, links shaped to rate R (default 10gbit) and one-way delay D (default "
                        "50us; 0 for none), see benchmarks/network.py (needs root)")
    p.add_argument("--ps-transport", choices=PS_TRANSPORTS, default=None,
                   help="hybrid's step messages: auto (shared memory on one host, a TCP step connection "
                        "across hosts), socket (that connection everywhere) or rpc (default: RuntimeOptions')")
    p.add_argument("--wire-dtype", choices=WIRE_DTYPES, default="float32",
                   help="dtype of the rows and gradients between hybrid's trainers and servers (the plan's "
                        "wire_dtype)")
    Workload.add_arguments(p)
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat: got {args.repeat}; expected 1 or more runs per system")
    unknown = [s for s in args.systems.split(",") if s and s not in SYSTEMS]
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    try:
        args.workload = Workload.from_args(args)
        args.network = parse_network(args.network)
    except ValueError as e:
        p.error(str(e))
    return args


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt (as SIGINT does), so that whatever a run has
    started -- processes, an emulated network -- is removed on the way out."""
    def interrupt(signum, frame):  # noqa: ANN001 - signal's handler signature
        raise KeyboardInterrupt(signal.Signals(signum).name)

    saved = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime = {}
    if args.transports:
        runtime["transports"] = args.transports.split(",")
    if args.channels:
        runtime["channels"] = args.channels.split(",")
    if args.huge_pages is not None:
        runtime["huge_pages"] = args.huge_pages == "on"
    if args.gloo_loop is not None:
        runtime["gloo_loop_batch"] = args.gloo_loop == "batch"
    if args.allreduce is not None:
        runtime["trainer_ring"] = args.allreduce == "ring"
    if args.server_policy is not None:
        runtime["server_batch"] = args.server_policy == "batch"
    if args.ps_transport is not None:
        runtime["ps_transport"] = args.ps_transport
    if args.rpc_threads:
        runtime["num_worker_threads"] = args.rpc_threads

    def progress(k: int, line: dict) -> None:
        if "error" in line:
            print(f"run {k}/{args.repeat}: {line['system']} failed:\n{line['error']}", file=sys.stderr, flush=True)
        else:
            print(f"run {k}/{args.repeat}: {line['system']:<18}{line['samples_per_s']:>9.0f} samples/s",
                  file=sys.stderr, flush=True)

    w = args.workload
    network = EmulatedNetwork(args.network, hosts=w.trainers + w.servers) if args.network else None
    where = json.dumps(network.describe()) if network else "loopback"
    print(f"workload: {json.dumps(vars(w))}, repeat: {args.repeat}, network: {where}", file=sys.stderr, flush=True)
    try:
        with _signals_interrupt():
            if network is not None:
                network.start()
            lines = run_rounds(w, [s for s in args.systems.split(",") if s], repeat=args.repeat, progress=progress,
                               timeout_s=args.timeout, dmp_sharding=args.dmp_sharding, runtime=runtime,
                               hosts=network, wire_dtype=args.wire_dtype)
    except NetworkError as e:
        print(f"benchmarks.run: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("benchmarks.run: interrupted; its processes were killed and its network removed", file=sys.stderr)
        return 130
    finally:
        if network is not None:
            network.close()
    for line in lines:
        print(json.dumps(line), flush=True)
    print(ratio_table(lines), file=sys.stderr, flush=True)
    bad = [l["system"] for l in lines if "error" in l or not all(
        math.isfinite(l[k]) for k in ("first_loss", "final_loss"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
