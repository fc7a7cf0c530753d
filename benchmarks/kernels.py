"""``python -m benchmarks.kernels``: a parameter server's row kernels, on one core, against this
machine's random-row gather ceiling and against FBGEMM's CPU table-batched embedding.

One table of ``--rows`` x ``--dim`` float32 (128 MB by default: far beyond the caches), and
batches of ``--ids`` distinct random ids, ascending as in a trainer's request (about the unique
rows a server reads per step in ``benchmarks.run``), cycling through one random permutation of the rows so that no batch finds
the previous ones' rows in cache. Every measurement runs one thread (``torch.set_num_threads(1)``)
for about ``--seconds`` of timed calls:

- ``gather_index_select``, ``gather_embedding``, ``gather_hybrid_op``: random rows copied out by
  ``torch.index_select``, ``torch.nn.functional.embedding`` and hybrid's ``gather_rows`` operator
  alone; the **ceiling** is the fastest of the three in each round;
- ``server_lookup``: what a server runs for a lookup, ``CollectionShard.gather`` (the operator,
  bounds checked, into a fresh tensor as for an RPC reply, and the server's bookkeeping);
- ``server_update``: what a server runs for one trainer's gradient push of those rows,
  ``CollectionShard.push`` (sync, one trainer): one optimizer step in place (``optimizer_step_``,
  all or nothing); plain SGD adds in place (``sgd_rows_``);
- ``server_message``: a whole step message as a transport hands it to the server, with an SGD
  push and a lookup of as many rows (``ParameterServer.handle_step`` from the decoded frame, rows
  gathered into a reply buffer); ``over_shard_calls`` is its time over ``server_lookup``'s plus
  ``server_update``'s (sgd): what decoding, ordering and answering the message add in Python;
- ``fbgemm_lookup`` / ``fbgemm_update``: ``SplitTableBatchedEmbeddingBagsCodegen`` on CPU (bags of
  one id, sum pooling: the forward reads the rows, the backward applies the fused optimizer to
  them), for the optimizers its CPU path has (``EXACT_SGD``, ``EXACT_ADAGRAD``,
  ``EXACT_ROWWISE_ADAGRAD``; not Adam). Only the backward of ``fbgemm_update`` is timed; between
  its forward and backward the caches are flushed (a 64 MB write), so its rows are as cold as a
  server's. ``fbgemm_update_warm`` times the backward right after the forward, as in training.

Tables and optimizer state live where ``--memory`` says, FBGEMM's too (through its
``preallocated_host_buffers``): ``huge_pages`` (the servers' default; ``huge_page_mb`` says what
the kernel granted) or ``plain``. Every kernel runs ``--repeat`` times, round-robin; each JSON
line holds its median rows/s, and its fraction of the ceiling and its ratio to FBGEMM's same
kernel as medians of each round's own ratio. A table goes to stderr. Before timing, one update of
each optimizer FBGEMM has is checked against FBGEMM's on the same rows, ids and gradients
(``max_abs_diff`` of rows and state).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from benchmarks.workload import HelpFormatter
from hybrid import ops
from hybrid.ps.server.memory import huge_page_bytes, table_tensor

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
FBGEMM_OPTIMIZERS = {"sgd": "EXACT_SGD", "adagrad": "EXACT_ADAGRAD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD"}
"""hybrid's optimizer -> FBGEMM's CPU optimizer with the same update."""
MEMORY = ("huge_pages", "plain")
EVICT_BYTES = 64 << 20
"""Written between an FBGEMM forward and its timed backward: twice a 32 MB last-level cache."""


@dataclass(kw_only=True)
class Setup:
    """What every kernel reads and updates."""

    rows: int = 1_000_000
    """Rows of the one table."""
    dim: int = 32
    """Floats per row (benchmarks.run's rows are 32 floats, 128 bytes)."""
    ids: int = 16_384
    """Distinct random ids per call."""
    seconds: float = 0.5
    """Timed seconds per measurement."""
    repeat: int = 3
    """Rounds over every kernel (round-robin, as ``benchmarks.run``); each line is the median."""
    memory: Literal["huge_pages", "plain"] = "huge_pages"
    """Where every table and its optimizer state live (FBGEMM's too)."""
    lr: float = 0.05
    """Learning rate of every optimizer."""
    seed: int = 0
    """Seed of the table, the ids and the gradients."""


class Data:
    """The initial table, the id batches and the gradient every kernel shares."""

    def __init__(self, s: Setup) -> None:
        g = torch.Generator().manual_seed(s.seed)
        self.weight = torch.randn(s.rows, s.dim, generator=g) * 0.1
        perm = torch.randperm(s.rows, generator=g)
        # ascending within a batch, as a trainer's request for a table's rows arrives
        self.batches = [c.sort().values for c in perm.split(s.ids) if c.numel() == s.ids]
        if not self.batches:
            raise ValueError(f"--ids {s.ids} is more than --rows {s.rows}")
        self.grad = torch.randn(s.ids, s.dim, generator=g) * 0.01


class Rate(NamedTuple):
    """One measurement."""

    rows_per_s: float
    calls: int
    """Calls timed."""
    huge_page_mb: float
    """This process's memory in transparent huge pages at the end of the timing (its tables alive)."""


def timed_rate(prepare: Callable[[torch.Tensor], Callable[[], object]], batches: list[torch.Tensor],
               seconds: float) -> Rate:
    """Rows per second of the calls ``prepare(ids)`` returns, cycling through ``batches`` (only
    the calls are timed, after one untimed)."""
    prepare(batches[0])()
    timed, rows, calls = 0.0, 0, 0
    while timed < seconds:
        ids = batches[(calls + 1) % len(batches)]
        call = prepare(ids)
        t0 = time.perf_counter()
        call()
        timed += time.perf_counter() - t0
        rows += ids.numel()
        calls += 1
    return Rate(rows / timed, calls, (huge_page_bytes() or 0) / 2**20)


def _table(s: Setup, data: Data) -> torch.Tensor:
    t = table_tensor(*data.weight.shape, huge_pages=s.memory == "huge_pages")
    t.copy_(data.weight)
    return t


# -- the kernels: each returns (rows per second, calls timed) -------------------------------------


GATHERS = {
    "index_select": lambda table, ids, out: torch.index_select(table, 0, ids, out=out),
    "embedding": lambda table, ids, out: torch.nn.functional.embedding(ids, table),
    "hybrid_op": lambda table, ids, out: ops.gather_rows([table], ids, [ids.numel()], out=out.view(-1)),
}
"""Random-row gathers the ceiling is the best of: torch's two, and hybrid's operator alone (it
prefetches rows ahead, which made it the fastest on this project's machine)."""


def gather(s: Setup, data: Data, how: str) -> Rate:
    table = _table(s, data)
    out = torch.empty(s.ids, s.dim)
    fn = GATHERS[how]
    return timed_rate(lambda ids: lambda: fn(table, ids, out), data.batches, s.seconds)


def server_shard(s: Setup, data: Data, optimizer: str):
    """A server's shard of a one-table collection (one trainer, sync), holding ``data.weight``."""
    from hybrid.ps.config import CollectionConfig, OptimizerSpec, TableSpec
    from hybrid.ps.server.shard import CollectionShard
    from hybrid.ps.sharding import TableLayout

    spec = TableSpec(name="t0", num_embeddings=s.rows, embedding_dim=s.dim, feature_names=("f0",))
    config = CollectionConfig(cid="kernels", tables=(spec,), layouts=(TableLayout(spec, "table_wise", (0,)),),
                              optimizer=OptimizerSpec(name=optimizer, lr=s.lr), num_trainers=1)
    shard = CollectionShard(config, 0, start_step=0, huge_pages=s.memory == "huge_pages")
    shard.tables[0].weight.copy_(data.weight)
    return shard


def _rows(ids: torch.Tensor):
    from hybrid.ps.protocol import Rows

    return Rows([0], [ids.numel()], ids)


def server_lookup(s: Setup, data: Data) -> Rate:
    shard = server_shard(s, data, "sgd")
    return timed_rate(lambda ids: lambda: shard.gather(_rows(ids)), data.batches, s.seconds)


def server_update(s: Setup, data: Data, optimizer: str) -> Rate:
    shard = server_shard(s, data, optimizer)
    grad = data.grad.reshape(-1)
    step = iter(range(1 << 62))
    return timed_rate(lambda ids: lambda: shard.push(0, next(step), [(_rows(ids), grad)]), data.batches, s.seconds)


def server_message(s: Setup, data: Data) -> Rate:
    """A whole step message as a server's transport hands it over: the frame decoded, then
    :meth:`ParameterServer.handle_step` applies its SGD push and gathers its lookup's rows into a
    reply buffer (as a channel's slot). The push is for rows of a batch half the cycle away, as
    cold as ``server_update``'s, so that the message's time compares with the shard's own lookup
    and update (``over_shard_calls``). Rows: the lookup's (the push has as many)."""
    from hybrid.ps import protocol
    from hybrid.ps.config import collection_handle
    from hybrid.ps.server.service import ParameterServer, ServerOptions

    shard = server_shard(s, data, "sgd")
    server = ParameterServer(0, ServerOptions(huge_pages=s.memory == "huge_pages"))
    handle = collection_handle(shard.cid)
    server.collections[handle] = shard
    grad = data.grad.reshape(-1)
    out = [torch.empty(s.ids * s.dim), torch.empty(1, dtype=torch.int64)]
    state = {"step": 0, "error": None}
    far = len(data.batches) // 2

    def reply(rows, err) -> None:  # noqa: ANN001
        state["error"], state["answered"] = err, rows is not None

    def prepare(ids: torch.Tensor) -> Callable[[], object]:
        step = state["step"]
        state["step"] = step + 1
        pushed = data.batches[(step + far) % len(data.batches)]
        msg = protocol.StepMessage(trainer=0, parts=[protocol.Part(
            collection=handle, step=step + 1, lookup=_rows(ids), num_raw=ids.numel(),
            pushes=[protocol.Push(step, _rows(pushed), grad)])])
        frame = protocol.encode(msg)

        def call() -> None:
            state["answered"] = False
            server.handle_step(protocol.decode(frame), reply, lambda sizes, dtypes: out)
            if state["error"] is not None:
                raise state["error"]
            if not state["answered"]:  # a lookup left waiting would time nothing
                raise RuntimeError(f"server_message: the lookup of step {step + 1} was not answered at once")

        return call

    return timed_rate(prepare, data.batches, s.seconds)


def fbgemm_tbe(s: Setup, data: Data, optimizer: str):
    """FBGEMM's CPU TBE of one table holding ``data.weight``, in the setup's kind of memory."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    kind = getattr(EmbOptimType, FBGEMM_OPTIMIZERS[optimizer])
    huge = s.memory == "huge_pages"
    given = {}  # plain memory is what FBGEMM allocates itself (and FBGEMM before 1.8 takes no buffers)
    if huge:
        buffers = {"weights": table_tensor(s.rows * s.dim, huge_pages=True)}
        if optimizer != "sgd":
            buffers["momentum1"] = table_tensor(s.rows * (s.dim if optimizer == "adagrad" else 1), huge_pages=True)
        given = {"preallocated_host_buffers": buffers}
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(s.rows, s.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=kind, learning_rate=s.lr,
        eps=1e-8, pooling_mode=PoolingMode.SUM, **given)
    assert not huge or tbe.weights_host.data_ptr() == given["preallocated_host_buffers"]["weights"].data_ptr(), \
        "FBGEMM did not take the buffer"
    tbe.split_embedding_weights()[0].copy_(data.weight)
    for state in _states(tbe):
        state.zero_()
    offsets = torch.arange(s.ids + 1, dtype=torch.int64)
    return tbe, offsets


def _states(tbe) -> list[torch.Tensor]:
    """The TBE's optimizer state of its one table (none for SGD)."""
    states = tbe.split_optimizer_states()
    return list(states[0]) if states else []


def fbgemm_lookup(s: Setup, data: Data) -> Rate:
    tbe, offsets = fbgemm_tbe(s, data, "rowwise_adagrad")
    with torch.no_grad():
        return timed_rate(lambda ids: lambda: tbe(ids, offsets), data.batches, s.seconds)


def fbgemm_update(s: Setup, data: Data, optimizer: str, *, warm: bool = False) -> Rate:
    tbe, offsets = fbgemm_tbe(s, data, optimizer)
    evict = torch.empty(EVICT_BYTES // 4)

    def prepare(ids: torch.Tensor) -> Callable[[], object]:
        out = tbe(ids, offsets)
        if not warm:
            evict.fill_(1.0)
        return lambda: out.backward(data.grad)

    return timed_rate(prepare, data.batches, s.seconds)


def agreement(s: Setup, data: Data, optimizer: str) -> float:
    """Largest difference of rows and state between one server update and FBGEMM's of the same
    rows, ids and gradients (float32 rounding apart, they compute the same update)."""
    shard = server_shard(s, data, optimizer)
    ids = data.batches[0]
    shard.push(0, 0, [(_rows(ids), data.grad.reshape(-1))])
    tbe, offsets = fbgemm_tbe(s, data, optimizer)
    tbe(ids, offsets).backward(data.grad)
    table = shard.tables[0]
    diff = (table.weight[ids] - tbe.split_embedding_weights()[0][ids]).abs().max().item()
    for ours, theirs in zip(table.optim.state.values(), _states(tbe), strict=True):
        diff = max(diff, (ours[ids].reshape(-1) - theirs.view(ours.shape)[ids].reshape(-1)).abs().max().item())
    return diff


# -- the run --------------------------------------------------------------------------------------


def kernels() -> list[tuple[str, str | None, Callable[[Setup, Data], Rate]]]:
    """(kernel, optimizer, measure) of every measurement, in the order of a round."""
    out: list = [(f"gather_{how}", None, lambda s, d, how=how: gather(s, d, how)) for how in GATHERS]
    out += [("server_lookup", None, server_lookup), ("fbgemm_lookup", None, fbgemm_lookup)]
    out += [("server_update", o, lambda s, d, o=o: server_update(s, d, o)) for o in OPTIMIZERS]
    out.append(("server_message", "sgd", server_message))
    out += [("fbgemm_update", o, lambda s, d, o=o: fbgemm_update(s, d, o)) for o in FBGEMM_OPTIMIZERS]
    out.append(("fbgemm_update_warm", "rowwise_adagrad", lambda s, d: fbgemm_update(s, d, "rowwise_adagrad", warm=True)))
    return out


def measurements(s: Setup, data: Data) -> list[dict]:
    """Every kernel ``s.repeat`` times, round-robin; one line each: its median rows/s, and its
    fraction of the ceiling and ratio to FBGEMM's same kernel, each the median over rounds of the
    round's own ratio (a slow spell of the shared machine slows a whole round alike)."""
    plan = kernels()
    runs: list[list[float]] = [[] for _ in plan]
    calls, held = [0 for _ in plan], [0.0 for _ in plan]
    for r in range(s.repeat):
        for k, (kernel, optimizer, measure) in enumerate(plan):
            got = measure(s, data)
            runs[k].append(got.rows_per_s)
            calls[k] += got.calls
            held[k] = max(held[k], got.huge_page_mb)
            print(f"  round {r + 1}/{s.repeat}: {kernel:<20}{optimizer or '':<17}{got.rows_per_s / 1e6:8.2f} M rows/s",
                  file=sys.stderr, flush=True)
    ceiling = [max(runs[k][r] for k, p in enumerate(plan) if p[0].startswith("gather_")) for r in range(s.repeat)]
    index = {(kernel, optimizer): k for k, (kernel, optimizer, _) in enumerate(plan)}
    lines = []
    for k, (kernel, optimizer, _) in enumerate(plan):
        rate = statistics.median(runs[k])
        line = {"kernel": kernel, "optimizer": optimizer, "rows_per_s": rate, "ns_per_row": 1e9 / rate,
                "runs_rows_per_s": runs[k], "calls": calls[k],
                "of_ceiling": statistics.median(x / c for x, c in zip(runs[k], ceiling))}
        theirs = index.get((kernel.replace("server_", "fbgemm_"), optimizer))
        if kernel.startswith("server_") and theirs is not None:
            line["vs_fbgemm"] = statistics.median(x / y for x, y in zip(runs[k], runs[theirs]))
        if kernel == "server_message":  # its time over the shard's own lookup and SGD update's
            parts = (runs[index[("server_lookup", None)]], runs[index[("server_update", "sgd")]])
            line["over_shard_calls"] = statistics.median(
                (1 / x) / (1 / a + 1 / b) for x, a, b in zip(runs[k], *parts))
        line.update(memory=s.memory, huge_page_mb=held[k], rows=s.rows, dim=s.dim, ids_per_call=s.ids)
        lines.append(line)
    return lines


def table(lines: list[dict]) -> str:
    head = f"{'kernel':<21}{'optimizer':<17}{'M rows/s':>9}{'ns/row':>8}{'of ceiling':>11}{'/ fbgemm':>9}"
    rows = [head, "-" * len(head)]
    for l in lines:
        vs = f"{l['vs_fbgemm']:.2f}x" if "vs_fbgemm" in l else ""
        rows.append(f"{l['kernel']:<21}{l['optimizer'] or '':<17}{l['rows_per_s'] / 1e6:>9.2f}"
                    f"{l['ns_per_row']:>8.1f}{l['of_ceiling']:>10.0%} {vs:>8}")
    rows += [f"server_message: {l['over_shard_calls']:.2f}x the time of server_lookup + server_update (sgd)"
             for l in lines if "over_shard_calls" in l]
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> Setup:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    defaults = Setup()
    p.add_argument("--rows", type=int, default=defaults.rows, help="rows of the table")
    p.add_argument("--dim", type=int, default=defaults.dim, help="floats per row")
    p.add_argument("--ids", type=int, default=defaults.ids, help="distinct random ids per call")
    p.add_argument("--seconds", type=float, default=defaults.seconds, help="timed seconds per measurement")
    p.add_argument("--repeat", type=int, default=defaults.repeat, help="rounds over every kernel")
    p.add_argument("--memory", choices=MEMORY, default=defaults.memory,
                   help="tables in transparent huge pages where the kernel grants them (the servers' default) or "
                        "in plain torch.empty memory; FBGEMM gets the same")
    args = p.parse_args(argv)
    for name, ok in (("rows", args.rows >= 1), ("dim", args.dim >= 1), ("ids", 1 <= args.ids <= args.rows),
                     ("seconds", args.seconds > 0), ("repeat", args.repeat >= 1)):
        if not ok:
            p.error(f"--{name}: got {getattr(args, name)}; expected a value >= 1 (ids at most rows, seconds > 0)")
    return Setup(rows=args.rows, dim=args.dim, ids=args.ids, seconds=args.seconds, repeat=args.repeat,
                 memory=args.memory)


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    torch.set_num_threads(1)
    data = Data(s)
    print(f"kernels: {s.rows} rows x {s.dim} floats in {s.memory} memory, {s.ids} distinct random ids per call, "
          f"one thread, {s.repeat} rounds", file=sys.stderr, flush=True)
    for optimizer in FBGEMM_OPTIMIZERS:
        diff = agreement(s, data, optimizer)
        print(json.dumps({"check": "server_update_equals_fbgemm", "optimizer": optimizer, "max_abs_diff": diff}),
              flush=True)
    lines = measurements(s, data)
    for line in lines:
        print(json.dumps(line), flush=True)
    print(table(lines), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
