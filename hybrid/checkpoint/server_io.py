"""Checkpoint code that runs on a parameter server (called by trainer 0 over RPC).

Each server writes its own shards straight into the checkpoint directory and reads them back
from there, all servers in parallel; no table crosses the wire. A table shard is written in
parts of at most :data:`PART_BYTES` (rows and their optimizer state), each its own file::

    tables/<collection>/<table>/shard<k>-of-<S>.part<i>.pt
        {"weight": [rows, dim], "state": {name: [rows, ...]}, "info": {...layout, rows [a, b), step...}}

and named in the manifest with its shard ``k`` and its shard-local rows ``[a, b)``. Shard ``k``
of a row-wise table holds global rows ``k, k+S, k+2S, ...`` (the cyclic layout of
:mod:`hybrid.ps.sharding`); a table-wise table has one shard holding every row. Loading reads one
part at a time and keeps the rows of it this server holds now, so a checkpoint written with S
servers, row-wise or table-wise, loads into any other layout (reshard), and neither saving nor
loading ever holds more than one part besides the tables themselves.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch
import torch.distributed.rpc as rpc

from hybrid.checkpoint.files import CheckpointError, FileEntry, entry_for, load_tensors, save_tensors, saved_rows
from hybrid.ps.server.service import server
from hybrid.ps.server.shard import TableShard

PART_BYTES = 64 << 20
"""Bytes of rows (with their optimizer state) in one file of a saved table shard."""

# Writes run here, not on an RPC thread nor on the thread that completed the step (which may be
# the distributed-autograd engine's or the one answering lookups).
_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid-ckpt-write")


def shard_file(cid: str, table: str, pos: int, num_shards: int, part: int) -> str:
    """Relative path of part ``part`` of one table shard's rows."""
    return f"tables/{quote(cid, safe='.-_')}/{quote(table, safe='.-_')}/shard{pos}-of-{num_shards}.part{part}.pt"


def _worker() -> str:
    from hybrid.ps.server import service

    return f"ps{service.server().index}"


def _part_rows(t: TableShard) -> int:
    """Rows of ``t`` per part: :data:`PART_BYTES` of rows and optimizer state."""
    row = t.weight.element_size() * t.dim + sum(v[:1].numel() * v.element_size() for v in t.optim.state.values())
    return max(1, PART_BYTES // max(row, 1))


def _write_shards(shard, ckpt: Path, step: int) -> list[dict[str, Any]]:
    """Write every table shard of ``shard`` in parts; their manifest entries (path, size, sha256,
    table, shard, rows)."""
    out = []
    with shard.lock:  # no update can interleave with the copy to disk
        for t in shard.tables:
            if t.dynamic is not None:
                out += _write_dynamic(shard, t, ckpt, step)
                continue
            step_rows = _part_rows(t)
            bounds = list(range(0, t.rows, step_rows)) or [0]  # an empty shard: one empty part
            for part, a in enumerate(bounds):
                b = min(a + step_rows, t.rows)
                path = ckpt / shard_file(shard.cid, t.name, t.shard_pos, t.layout.num_shards, part)
                path.parent.mkdir(parents=True, exist_ok=True)
                t.ensure_range(a, b)  # rows never used yet: their initial values, made now
                # Copies of the part's rows: torch.save of a view would write the whole table.
                payload = {"weight": t.weight[a:b].clone(), "state": {k: v[a:b].clone() for k, v in t.optim.state.items()},
                           "info": {**_info(shard.cid, t, step), "rows": [a, b]}}
                save_tensors(payload, path)
                e = entry_for(ckpt, path)
                out.append({"path": e.path, "size": e.size, "sha256": e.sha256, "table": t.name,
                            "shard": t.shard_pos, "rows": [a, b]})
    return out


def _write_dynamic(shard, t: TableShard, ckpt: Path, step: int) -> list[dict[str, Any]]:
    """A dynamic table shard: its occupied rows ascending by id, in parts, each holding per row its
    id, part, place in the part, last step, row and optimizer state; the first part also the
    sightings and counters (``TableShard.dynamic_rows``)."""
    d = t.dynamic_rows()
    n = d["ids"].numel()
    step_rows = _part_rows(t)
    per_row = [k for k in d if k not in ("seen_ids", "seen_counts", "counters", "slots")]
    out = []
    for part, a in enumerate(list(range(0, n, step_rows)) or [0]):
        b = min(a + step_rows, n)
        payload = {k: d[k][a:b].clone() for k in per_row}
        if part == 0:
            payload.update(seen_ids=d["seen_ids"], seen_counts=d["seen_counts"], counters=d["counters"])
        payload["info"] = {**_info(shard.cid, t, step), "rows": [a, b], "dynamic_rows": n}
        path = ckpt / shard_file(shard.cid, t.name, t.shard_pos, t.layout.num_shards, part)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_tensors(payload, path)
        e = entry_for(ckpt, path)
        out.append({"path": e.path, "size": e.size, "sha256": e.sha256, "table": t.name, "shard": t.shard_pos,
                    "rows": [a, b], "dynamic_rows": n})
    return out


def _fill_dynamic(t: TableShard, ckpt: Path, src: dict[str, Any]) -> int:
    """Load a dynamic table shard: of every saved row, those whose part this server holds now
    (any server count: parts move whole), at the same place in their part, and nothing else (a
    table that trained before the load, as when one run evaluates several checkpoints, keeps
    none of its rows or sightings)."""
    dyn = t.dynamic
    saved = src.get("dynamic")
    if saved is None:
        raise ValueError(f"table {t.name} was saved with ids: range; the plan says ids: dynamic")
    if (saved["capacity"], saved["partitions"]) != (dyn.spec.capacity, dyn.spec.partitions):
        raise ValueError(f"table {t.name} was saved with capacity {saved['capacity']} in {saved['partitions']} "
                         f"partitions; the plan says capacity {dyn.spec.capacity} in {dyn.spec.partitions}: "
                         f"use the saved capacity and partitions to resume")
    held = torch.zeros(dyn.spec.partitions, dtype=torch.bool)
    held[dyn.parts] = True
    from hybrid.ps.config import part_of

    dyn.empty()
    counters = torch.zeros(4, dtype=torch.int64)
    n_shards_now = t.layout.num_shards
    for f in src["files"]:
        data = load_tensors(ckpt, FileEntry(f["path"], int(f["size"]), f["sha256"]))
        if set(k[6:] for k in data if k.startswith("state.")) != set(t.optim.state):
            raise ValueError(f"{ckpt / f['path']}: optimizer state {sorted(k for k in data if k.startswith('state.'))}; "
                             f"the table's optimizer keeps {sorted(t.optim.state)}")
        mine = held[data["part"]]
        slots = dyn.part_base[data["part"][mine]] + data["index"][mine]
        ids = data["ids"][mine]
        dyn.restore(ids, slots, data["last"][mine])
        t.weight.index_copy_(0, slots, data["rows"][mine].to(t.weight.dtype))
        for key, v in t.optim.state.items():
            v.index_copy_(0, slots, data[f"state.{key}"][mine].to(v.dtype))
        if "seen_ids" in data:
            keep = held[part_of(data["seen_ids"], dyn.spec.partitions)]
            if bool(keep.any()):
                dyn.seen.insert(data["seen_ids"][keep], data["seen_counts"][keep])
            if int(f["shard"]) % n_shards_now == t.shard_pos:  # the counters stay summed over servers
                counters += data["counters"]
    c = dyn.counters
    c.admitted, c.evicted, c.hits, c.looked_up = (int(x) for x in counters)
    return dyn.rows


def _info(cid: str, t: TableShard, step: int) -> dict[str, Any]:
    lay = t.layout
    return {"cid": cid, "table": t.name, "shard": t.shard_pos, "num_shards": lay.num_shards,
            "sharding": lay.sharding, "num_embeddings": lay.table.num_embeddings,
            "embedding_dim": lay.table.embedding_dim, "optimizer": t.optim.spec.name, "step": step}


@rpc.functions.async_execution
def rpc_save_collection(cid: str, ckpt: str, step: int, after_step: int):
    """Write this server's shards of ``cid`` into ``ckpt`` (the checkpoint of training step
    ``step``) once every trainer's updates through ``after_step`` are applied; answers the
    manifest entries (path, size, sha256) of the files it wrote."""
    shard = server().shard(cid)
    fut: torch.futures.Future = torch.futures.Future()

    def write() -> None:
        try:
            fut.set_result(_write_shards(shard, Path(ckpt), step))
        except BaseException as e:  # noqa: BLE001 - handed to the trainer
            fut.set_exception(RuntimeError(f"{_worker()}: saving {cid} into {ckpt} failed: {e!r}"))

    def ready(err: BaseException | None) -> None:
        if err is not None:
            fut.set_exception(RuntimeError(f"{_worker()}: collection {cid} failed before the save: {err!r}"))
        else:
            _WRITER.submit(write)

    shard.when_ready(after_step, ready)
    return fut


def rpc_load_collection(cid: str, ckpt: str, step: int, saved: list[dict[str, Any]]) -> int | str:
    """Fill this server's shards of ``cid`` from the saved tables ``saved`` (the manifest's
    entries of this collection, with their file entries), then continue step bookkeeping from
    ``step``: lookups of step ``step`` are answered at once. Returns the rows loaded, or the
    message of a checkpoint that cannot be loaded (a user's mistake or a bad file: an answer, not
    a server failure)."""
    try:
        return _load_collection(cid, ckpt, step, saved)
    except (CheckpointError, KeyError, ValueError) as e:
        return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def _load_collection(cid: str, ckpt: str, step: int, saved: list[dict[str, Any]]) -> int:
    shard = server().shard(cid)
    by_name = {s["name"]: s for s in saved}
    loaded = 0
    with shard.lock:
        for t in shard.tables:
            src = by_name.get(t.name)
            if src is None:
                raise KeyError(f"{_worker()}: the checkpoint has no table {t.name!r} in {cid} "
                               f"(it has {sorted(by_name)})")
            _check_fits(cid, t, src)
            if t.dynamic is not None:
                loaded += _fill_dynamic(t, Path(ckpt), src)
                continue
            if src.get("dynamic") is not None:
                raise ValueError(f"table {t.name} was saved with ids: dynamic; the plan says ids: range")
            loaded += _fill(t, Path(ckpt), src)
        shard.complete_through = step - 1
        shard.arrived.clear()
        shard.pending.clear()
        shard.recorded.clear()
    return loaded


def _check_fits(cid: str, t: TableShard, src: dict[str, Any]) -> None:
    have = (src["num_embeddings"], src["embedding_dim"])
    want = (t.layout.table.num_embeddings, t.layout.table.embedding_dim)
    if have != want:
        raise ValueError(f"{cid}: table {t.name} is {have[0]} x {have[1]} in the checkpoint but {want[0]} x "
                         f"{want[1]} in the model")
    if src["optimizer"] != t.optim.spec.name:
        raise ValueError(f"{cid}: table {t.name} was trained with the {src['optimizer']} optimizer but the plan "
                         f"says {t.optim.spec.name}: its optimizer state cannot be carried over (use the same "
                         f"optimizer to resume)")


def _fill(t: TableShard, ckpt: Path, src: dict[str, Any]) -> int:
    """Load this server's rows of table ``t`` from the saved table ``src`` (its manifest entry),
    one part file at a time: of each part, the rows whose global ids this server holds now.
    Rows not made yet are not made first: once loaded, their blocks count as made."""
    for index, f in enumerate(src["files"]):
        glob = saved_rows(ckpt, src, index)
        if glob is not None and _rows_held(t, glob)[1].numel() == 0:
            continue  # nothing of it is this server's: not even read
        data = load_tensors(ckpt, FileEntry(f["path"], int(f["size"]), f["sha256"]))
        weight, state = data["weight"], data["state"]
        glob = saved_rows(ckpt, src, index, weight.shape[0])  # checks the count against the manifest
        if set(state) != set(t.optim.state):
            raise ValueError(f"{ckpt / f['path']}: optimizer state {sorted(state)}; the table's optimizer keeps "
                             f"{sorted(t.optim.state)}")
        held, to = _rows_held(t, glob)
        t.weight.index_copy_(0, to, weight.index_select(0, held).to(t.weight.dtype))
        for key, v in state.items():
            t.optim.state[key].index_copy_(0, to, v.index_select(0, held).to(t.optim.state[key].dtype))
        if t.lazy is not None:
            t.lazy.loaded(to)
    return t.rows


def _rows_held(t: TableShard, glob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of global ids ``glob``: the positions of those this server holds of ``t`` now, and their
    local rows here."""
    lay = t.layout
    if lay.sharding == "table_wise":
        return torch.arange(glob.numel(), dtype=torch.int64), glob
    held = (glob % lay.num_shards == t.shard_pos).nonzero().flatten()
    return held, glob.index_select(0, held) // lay.num_shards
