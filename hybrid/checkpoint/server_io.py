"""Checkpoint code that runs on a parameter server (called by trainer 0 over RPC).

Each server writes its own shards straight into the checkpoint directory and reads them back
from there, all servers in parallel; no table crosses the wire. One file per table shard::

    tables/<collection>/<table>/shard<k>-of-<S>.pt
        {"weight": [rows_k, dim], "state": {name: [rows_k, ...]}, "info": {...layout, step...}}

Shard ``k`` of a row-wise table holds global rows ``k, k+S, k+2S, ...`` (the cyclic layout of
:mod:`hybrid.ps.sharding`); a table-wise table has one shard holding every row. Loading maps
each row this server holds now to the saved shard and local row that has it, so a checkpoint
written with S servers, row-wise or table-wise, loads into any other layout (reshard).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch
import torch.distributed.rpc as rpc

from hybrid.checkpoint.files import CheckpointError, FileEntry, entry_for, load_tensors, save_tensors
from hybrid.ps.server.service import server
from hybrid.ps.server.shard import TableShard

LOAD_CHUNK_BYTES = 64 << 20
"""Rows of a saved shard copied into the table at once when loading."""

# Writes run here, not on an RPC thread nor on the thread that completed the step (which may be
# the distributed-autograd engine's or the one answering lookups).
_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid-ckpt-write")


def shard_file(cid: str, table: str, pos: int, num_shards: int) -> str:
    """Relative path of one table shard's file."""
    return f"tables/{quote(cid, safe='.-_')}/{quote(table, safe='.-_')}/shard{pos}-of-{num_shards}.pt"


def _worker() -> str:
    return rpc.get_worker_info().name


def _write_shards(shard, ckpt: Path, step: int) -> list[dict[str, Any]]:
    out = []
    with shard.lock:  # no update can interleave with the copy to disk
        for t in shard.tables:
            rel = shard_file(shard.cid, t.name, t.shard_pos, t.layout.num_shards)
            path = ckpt / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            payload = {"weight": t.weight, "state": dict(t.optim.state), "info": _info(shard.cid, t, step)}
            save_tensors(payload, path)
            e = entry_for(ckpt, path)
            out.append({"path": e.path, "size": e.size, "sha256": e.sha256})
    return out


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
            loaded += _fill(t, Path(ckpt), src)
        shard.complete_through = step - 1
        shard.arrived.clear()
        shard.pending.clear()
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
    """Load this server's rows of table ``t`` from the saved shards, a chunk of its rows at a time:
    each row is found in the saved shard (and the local row there) that holds its global id."""
    s, files = src["num_shards"], src["files"]
    opened: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def saved(k: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if k not in opened:  # verified once, then mapped: rows are read from the file as copied
            f = files[k]
            data = load_tensors(ckpt, FileEntry(f["path"], int(f["size"]), f["sha256"]), mmap=True)
            if set(data["state"]) != set(t.optim.state):
                raise ValueError(f"{f['path']}: optimizer state {sorted(data['state'])}; the table's optimizer "
                                 f"keeps {sorted(t.optim.state)}")
            opened[k] = data["weight"], data["state"]
        return opened[k]

    step = max(1, LOAD_CHUNK_BYTES // (4 * max(t.dim, 1)))
    for start in range(0, t.rows, step):
        mine = torch.arange(start, min(start + step, t.rows), dtype=torch.int64)
        rows = t.layout.global_ids(t.shard_pos, mine)  # global ids of this chunk
        for k in range(len(files)):
            if src["sharding"] == "table_wise":
                to, frm = mine, rows
            else:
                sel = (rows % s == k).nonzero().flatten()
                to, frm = mine[sel], rows[sel] // s
            if to.numel() == 0:
                continue
            weight, state = saved(k)
            if weight.shape[0] <= int(frm.max()):
                raise ValueError(f"{files[k]['path']}: holds {weight.shape[0]} rows; row {int(frm.max())} is needed")
            t.weight.index_copy_(0, to, weight.index_select(0, frm).to(t.weight.dtype))
            for key, v in state.items():
                t.optim.state[key].index_copy_(0, to, v.index_select(0, frm).to(t.optim.state[key].dtype))
    return t.rows
