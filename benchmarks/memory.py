"""``python -m benchmarks.memory``: what a dense-heavy model costs each trainer under DDP and FSDP.

The model is the benchmark DLRM with a wide top MLP (by default four 2048-wide layers, about
13M parameters) and small tables on one parameter server. For every strategy (``ddp``,
``fsdp``) and trainer count (``--trainers 2,4``) it is composed by hybrid (``over_arch`` and ``dense_arch`` under the strategy, tables on the server), and trained
for a few steps with Adam. Each trainer then counts, from the tensors it really holds (FSDP's
local shards, DDP's full replicas):

- ``param_bytes``: its parameters;
- ``grad_bytes``: its gradients after a backward (before the optimizer clears them);
- ``optim_bytes``: its optimizer state (Adam's two moments and step counts);

and reports its peak RSS (``ru_maxrss``; on CUDA also ``torch.cuda.max_memory_allocated``).
One JSON line per (strategy, trainers) goes to stdout, the table with FSDP/DDP ratios and the
issue's targets (<= 0.55 at 2 trainers, <= 0.3 at 4) to stderr.

``--model sequential`` measures the large preset of the sequential recommender instead
(``conf/train/sequential_large.yaml``: 8 transformer blocks of width 768, 57M dense parameters)
under its shipped plan (``conf/plans/sequential.yaml``: item table row-wise on one server, every
block its own FSDP unit with bf16 compute and fp32 reduction, activation checkpointing, heads
under DDP); its ``ddp`` run puts the encoder under DDP too. ``--batch`` sequences of the preset's
``max_len`` per trainer.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import sys
from pathlib import Path

import torch

from benchmarks.launch import BenchmarkError, spawn
from benchmarks.systems.hybrid_ps import plan_dict
from benchmarks.workload import Data, HelpFormatter, Workload, build_dlrm, loss_fn

REPO = Path(__file__).resolve().parents[1]
SEQUENTIAL_PLAN = REPO / "conf/plans/sequential.yaml"
SEQUENTIAL_LARGE = REPO / "conf/train/sequential_large.yaml"
TARGETS = {2: 0.55, 4: 0.3}
"""Trainers -> largest allowed FSDP/DDP ratio of per-trainer parameter+gradient+optimizer bytes."""


def _local_bytes(t: torch.Tensor | None) -> int:
    """Bytes this process holds for ``t`` (a DTensor's local shard, else the tensor)."""
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def sequential_plan(dense: str, world_size: int) -> dict:
    """The shipped sequential plan for ``world_size`` processes (one server); ``ddp``: the
    encoder under DDP as well."""
    import yaml

    plan = yaml.safe_load(SEQUENTIAL_PLAN.read_text())
    plan = copy.deepcopy(plan)
    plan["world_size"] = world_size
    plan["topology"]["parameter_servers"] = 1
    if dense == "ddp":
        plan["modules"]["encoder"] = {"strategy": "ddp"}
    return plan


def sequential_large():
    """``(model keyword arguments, data config)`` of the large preset."""
    from hybrid.train.config import load_config

    cfg = load_config(SEQUENTIAL_LARGE)
    return cfg.model_kwargs, cfg.data


def _rank(rank: int, world_size: int, store: str, *, w: Workload, dense: str, steps: int,
          model: str = "dlrm", limit_s: float = 300.0) -> dict:
    from hybrid.launch.init import RuntimeOptions, init_hybrid, shutdown
    from hybrid.launch.roles import role_of

    role = role_of(rank, world_size, w.servers)
    # The server goes straight to the shutdown barrier and waits there for the trainers' whole
    # run: its wait is the configuration's time limit, not the default minute.
    options = RuntimeOptions(shutdown_timeout_s=limit_s)
    init_hybrid(role, init_method=f"file://{store}/rpc", backend="gloo", options=options)
    report, ok = {"name": role.name}, False
    try:
        if role.is_trainer and model == "sequential":
            report.update(_sequential_trainer(role, w, dense=dense, steps=steps, options=options))
        elif role.is_trainer:
            report.update(_trainer(role, w, dense=dense, steps=steps, options=options))
        ok = True
    finally:
        shutdown(role, graceful=ok, timeout_s=options.shutdown_timeout_s)
    report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return report


def _trainer(role, w: Workload, *, dense: str, steps: int, options) -> dict:
    import hybrid
    from hybrid.plan import plan_from_dict
    from hybrid.ps.client import pipeline_of

    # Dense part built whole, then composed (DLRM's interaction indices cannot be built on meta):
    # peak RSS includes one full copy of the dense model at construction; the counted bytes do
    # not. The tables stay on meta: the servers fill them.
    model = build_dlrm(w, tables="meta")
    hybrid.compose(model, plan_from_dict(plan_dict(w, dense=dense, staleness=0)), role=role,
                   runtime_options=options, seed=w.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    out: dict = {}
    for b in Data(w).batches(trainer=role.index, steps=steps):
        with hybrid.step(model) as s:  # no optimizer here: the gradients are counted first
            s.backward(loss_fn(model(b.dense, b.kjt()), b.labels))
        out["grad_bytes"] = sum(_local_bytes(p.grad) for p in params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    pipeline_of(model).close()
    return _count(out, params, optimizer)


def _sequential_trainer(role, w: Workload, *, dense: str, steps: int, options) -> dict:
    import dataclasses

    import hybrid
    from hybrid.data.sequences import SyntheticSequences
    from hybrid.plan import plan_from_dict
    from hybrid.ps.client import pipeline_of
    from recsys_examples.sequential import SequentialTask, sequential

    kwargs, data_cfg = sequential_large()
    # Built on meta: FSDP materializes only each trainer's shard, the server fills the tables.
    model = sequential.make_model(kwargs, device=torch.device("meta"), seed=w.seed)
    schema = sequential.data_schema(model)
    hybrid.compose(model, plan_from_dict(sequential_plan(dense, role.world_size)), role=role,
                   runtime_options=options, seed=w.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    task = SequentialTask()
    data = SyntheticSequences(schema, dataclasses.replace(data_cfg, batch_size=w.batch), rank=role.index,
                              world_size=role.num_trainers)
    out: dict = {"losses": []}
    for _, b in zip(range(steps), data):
        with hybrid.step(model) as s:
            loss = task.loss(task.forward(model, b), b)
            s.backward(loss)
        out["losses"].append(float(loss))
        out["grad_bytes"] = sum(_local_bytes(p.grad) for p in params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    pipeline_of(model).close()
    return _count(out, params, optimizer)


def _count(out: dict, params: list, optimizer: torch.optim.Optimizer) -> dict:
    out["param_bytes"] = sum(_local_bytes(p) for p in params)
    out["optim_bytes"] = sum(_local_bytes(v) for st in optimizer.state.values() for v in st.values()
                             if isinstance(v, torch.Tensor))
    out["total_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optim_bytes"]
    out["dense_params"] = sum((p.full_tensor() if hasattr(p, "full_tensor") else p).numel() for p in params)
    if torch.cuda.is_available():
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    return out


def plan_estimate(w: Workload, dense: str, model_name: str = "dlrm") -> int:
    """What the plan report (``hybrid plan show``) predicts a trainer holds, for Adam."""
    from hybrid.plan import estimate_memory, plan_from_dict, resolve

    if model_name == "sequential":
        from recsys_examples.sequential import sequential

        model = sequential.make_model(sequential_large()[0], device=torch.device("meta"))
        plan = plan_from_dict(sequential_plan(dense, w.trainers + 1))
        resolved = resolve(plan, model, world_size=w.trainers + 1)
        return sum(m.trainer_bytes for m in estimate_memory(resolved, model, dense_optimizer="adam"))
    model = build_dlrm(w, tables="meta")
    resolved = resolve(plan_from_dict(plan_dict(w, dense=dense, staleness=0)), model,
                       world_size=w.trainers + w.servers)
    return sum(m.trainer_bytes for m in estimate_memory(resolved, model, dense_optimizer="adam"))


def measure(w: Workload, dense: str, trainers: int, *, steps: int, timeout_s: float,
            model: str = "dlrm") -> dict:
    """One (strategy, trainer count): the largest per-trainer numbers over its trainers."""
    w = w.with_(trainers=trainers)
    servers = 1 if model == "sequential" else w.servers
    reports = spawn(_rank, trainers + servers, timeout_s=timeout_s, threads=w.threads, w=w, dense=dense,
                    steps=steps, model=model, limit_s=timeout_s)
    ts = [r for r in reports if "total_bytes" in r]
    line = {"model": model, "strategy": dense, "trainers": trainers, "dense_params": ts[0]["dense_params"]}
    if "losses" in ts[0]:
        line["losses"] = [sum(r["losses"][i] for r in ts) / len(ts) for i in range(len(ts[0]["losses"]))]
    for k in ("param_bytes", "grad_bytes", "optim_bytes", "total_bytes", "peak_rss_mb", "cuda_peak_bytes"):
        if k in ts[0]:
            line[k] = max(r[k] for r in ts)
    line["server_peak_rss_mb"] = max(r["peak_rss_mb"] for r in reports if "total_bytes" not in r)
    line["plan_estimate_bytes"] = plan_estimate(w, dense, model)
    return line


def table(lines: list[dict]) -> str:
    by = {(l["strategy"], l["trainers"]): l for l in lines if "error" not in l}
    head = f"{'strategy':<9}{'trainers':>9}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}{'total MB':>10}" \
           f"{'peak RSS MB':>13}{'/ddp':>8}"
    rows = [head, "-" * len(head)]
    checks = []
    for l in lines:
        if "error" in l:
            rows.append(f"{l['strategy']:<9}{l['trainers']:>9}  FAILED (see the JSON line)")
            continue
        ddp = by.get(("ddp", l["trainers"]))
        ratio = l["total_bytes"] / ddp["total_bytes"] if ddp else float("nan")
        mb = 1 / 2**20
        rows.append(f"{l['strategy']:<9}{l['trainers']:>9}{l['param_bytes'] * mb:>11.1f}{l['grad_bytes'] * mb:>10.1f}"
                    f"{l['optim_bytes'] * mb:>10.1f}{l['total_bytes'] * mb:>10.1f}{l['peak_rss_mb']:>13.0f}{ratio:>8.3f}")
        if l["strategy"] == "fsdp" and ddp and l["trainers"] in TARGETS:
            checks.append((l["trainers"], ratio, TARGETS[l["trainers"]]))
    if checks:
        rows += ["", "targets (per-trainer parameter+gradient+optimizer bytes, FSDP / DDP):"]
        rows += [f"  {n} trainers: {got:.3f} <= {m:g}  {'met' if got <= m else 'MISSED'}" for n, got, m in checks]
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="dlrm", choices=["dlrm", "sequential"],
                   help="dlrm: the wide-MLP DLRM; sequential: the sequential recommender's large preset")
    p.add_argument("--trainers", default="2,4", help="comma-separated trainer counts")
    p.add_argument("--strategies", default="ddp,fsdp", help="comma-separated dense strategies")
    p.add_argument("--width", type=int, default=2048, help="width of every hidden layer of the top MLP")
    p.add_argument("--layers", type=int, default=4, help="hidden layers of the top MLP")
    p.add_argument("--batch", type=int, default=64, help="samples per trainer per step")
    p.add_argument("--steps", type=int, default=3, help="training steps before counting")
    p.add_argument("--rows", type=int, default=1000, help="rows of each of the (small) tables")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one configuration may take")
    args = p.parse_args(argv)
    try:
        args.trainer_counts = [int(x) for x in args.trainers.split(",") if x]
    except ValueError:
        p.error(f"--trainers: expected comma-separated integers such as 2,4; got {args.trainers!r}")
    args.strategy_list = [s for s in args.strategies.split(",") if s]
    bad = [s for s in args.strategy_list if s not in ("ddp", "fsdp")]
    if bad:
        p.error(f"--strategies: unknown {', '.join(bad)}; known: ddp, fsdp")
    if args.width < 1 or args.layers < 1 or args.steps < 1:
        p.error("--width, --layers and --steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    w = Workload(tables=2, rows=args.rows, batch=args.batch, top_mlp=[args.width] * args.layers + [1],
                 warmup=0, steps=args.steps)
    lines = []
    for n in args.trainer_counts:
        for dense in args.strategy_list:
            try:
                line = measure(w, dense, n, steps=args.steps, timeout_s=args.timeout, model=args.model)
            except BenchmarkError as e:
                line = {"strategy": dense, "trainers": n, "error": str(e)}
                print(f"{dense} x {n} failed:\n{e}", file=sys.stderr, flush=True)
            print(json.dumps(line), flush=True)
            lines.append(line)
    print(table(lines), file=sys.stderr, flush=True)
    return 1 if any("error" in l for l in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
