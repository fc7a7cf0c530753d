"""One plain ``state_dict`` from a checkpoint: the keys of the unsharded model, whole tensors.

Runs in one process, without the job: the dense part is read from the DCP files (every shard
gathered into the whole tensor), each table from the parts of its server shards. The result
loads into the plain model with ``model.load_state_dict(torch.load(path, weights_only=True))``
for evaluation or serving; an export larger than :data:`EXPORT_PART_BYTES` is written in parts
named in an index, so no table is ever whole in memory (:func:`export`, :func:`load_export`).
Optimizer state is not exported (use :func:`load_tables` for it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

import torch

from hybrid.checkpoint import files as F
from hybrid.checkpoint.files import CheckpointError, FileEntry


def dense_state_dict(ckpt: str | Path, manifest: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The dense model's full state dict (no optimizer), read in this process. ``ckpt`` is a
    ``step_N`` directory or a root (its newest), as for :func:`export`."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    ckpt = Path(ckpt) if manifest is not None else F.resolve(ckpt)
    manifest = manifest or F.read_manifest(ckpt)
    for rel in sorted(manifest["files"]):
        if rel.startswith("dense/"):
            F.verify(ckpt, F.manifest_entry(manifest, rel))
    state: dict[str, Any] = {}
    F.load_dcp_metadata(ckpt / "dense" / ".metadata")  # refused here, by name, before DCP reads it
    try:
        _load_state_dict(state, storage_reader=F.safe_dcp_reader(ckpt / "dense"),
                         planner=F.safe_load_planner(keys={"model"}), no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP's exception is no Exception
        inner = F.unwrap_dcp_error(e)
        if isinstance(inner, CheckpointError):
            raise CheckpointError(f"{ckpt / 'dense'}: {inner}") from None
        raise
    return dict(state.get("model", {}))


def load_tables(ckpt: str | Path, manifest: dict[str, Any] | None = None
                ) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Every saved table, whole: ``{state-dict key: (weight, optimizer state by name)}``. ``ckpt``
    is a ``step_N`` directory or a root (its newest), as for :func:`export`."""
    ckpt = Path(ckpt) if manifest is not None else F.resolve(ckpt)
    manifest = manifest or F.read_manifest(ckpt)
    out = {}
    for coll in manifest.get("collections") or []:
        for t in coll["tables"]:
            if t.get("dynamic") is not None:
                raise CheckpointError(f"{ckpt}: table {t['key']} has ids: dynamic; "
                                      f"export_state_dict() gives its rows and their ids")
            weight = torch.empty(t["num_embeddings"], t["embedding_dim"])
            filled = torch.zeros(t["num_embeddings"], dtype=torch.bool)
            state: dict[str, torch.Tensor] = {}
            for k, f in enumerate(t["files"]):
                data = F.load_tensors(ckpt, FileEntry(f["path"], int(f["size"]), f["sha256"]))
                rows = F.saved_rows(ckpt, t, k, data["weight"].shape[0])
                weight[rows] = data["weight"]
                filled[rows] = True
                for name, v in data["state"].items():
                    if name not in state:
                        state[name] = torch.empty((t["num_embeddings"], *v.shape[1:]), dtype=v.dtype)
                    state[name][rows] = v
            F.uncovered(ckpt, t, filled)
            out[t["key"]] = (weight, state)
    return out


EXPORT_PART_BYTES = 1 << 30
"""An export larger than this is written as the dense part plus each table in files of at most
this many bytes, named in an index."""


def _ordered(manifest: dict[str, Any], keys) -> list[str]:
    """``keys`` in the plain model's order (the manifest's), any others after; every key of the
    model must be among them (else :class:`CheckpointError`: a table or tensor nothing holds)."""
    keys = list(keys)
    model_keys = manifest.get("keys") or []
    missing = [k for k in model_keys if k not in keys]
    if missing:
        raise CheckpointError(f"the checkpoint holds nothing for {missing[0]!r}"
                              f"{f' and {len(missing) - 1} more keys' if len(missing) > 1 else ''} of the model "
                              f"(the manifest was edited)")
    order = [k for k in model_keys if k in keys]
    return order + [k for k in keys if k not in order]


def dynamic_table(ckpt: Path, table: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A saved ``ids: dynamic`` table (its manifest entry): (ids ascending, their rows float32),
    every server's rows together (at most the table's capacity)."""
    return next(dynamic_chunks(ckpt, table, max(1, _dynamic_rows(table))))


def dynamic_chunks(ckpt: Path, table: dict[str, Any], chunk: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A saved ``ids: dynamic`` table (its manifest entry) as :func:`dynamic_table` gives it,
    ``chunk`` ids and rows at a time (the last chunk fewer; one empty chunk for a table with no
    rows), holding one saved file per server at most: each server's files are ascending by id,
    so the ids up to the smallest last id among the files held can all go out."""
    streams: dict[int, list[dict[str, Any]]] = {}
    for f in table["files"]:
        streams.setdefault(int(f["shard"]), []).append(f)
    queues = [sorted(fs, key=lambda f: f["rows"][0]) for fs in streams.values()]
    empty = (torch.empty(0, dtype=torch.int64), torch.empty(0, table["embedding_dim"]))
    held = [empty] * len(queues)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    pending = 0
    given = False
    while True:
        for k, queue in enumerate(queues):
            while held[k][0].numel() == 0 and queue:
                f = queue.pop(0)
                data = F.load_tensors(ckpt, FileEntry(f["path"], int(f["size"]), f["sha256"]))
                held[k] = (data["ids"], data["rows"].float())
        live = [k for k in range(len(queues)) if held[k][0].numel()]
        if not live:
            break
        bound = min(int(held[k][0][-1]) for k in live)
        ids, rows = [], []
        for k in live:
            n = int(torch.searchsorted(held[k][0], bound, right=True))
            ids.append(held[k][0][:n])
            rows.append(held[k][1][:n])
            held[k] = (held[k][0][n:], held[k][1][n:])
        ids_t, rows_t = torch.cat(ids), torch.cat(rows)
        order = torch.argsort(ids_t)
        out.append((ids_t[order], rows_t[order]))
        pending += ids_t.numel()
        while pending >= chunk:  # copies: torch.save of a view would write the whole tensor
            ids_t, rows_t = torch.cat([i for i, _ in out]), torch.cat([r for _, r in out])
            yield ids_t[:chunk].clone(), rows_t[:chunk].clone()
            given = True
            out, pending = [(ids_t[chunk:], rows_t[chunk:])], ids_t.numel() - chunk
    if pending or not given:
        yield (torch.cat([i for i, _ in out]), torch.cat([r for _, r in out])) if out else empty


def _dynamic_rows(table: dict[str, Any]) -> int:
    """Rows of a saved dynamic table (its manifest entry), from its files' entries."""
    return sum(f["rows"][1] - f["rows"][0] for f in table["files"])


def ids_key(key: str) -> str:
    """The export key of a dynamic table's ids: ``...weight`` -> ``...ids``."""
    return key[: -len("weight")] + "ids" if key.endswith("weight") else key + ".ids"


def _dynamic(path: Path, manifest: dict[str, Any], dense: dict[str, torch.Tensor]) -> None:
    """Add every dynamic table to ``dense`` as two tensors: its rows under the table's key and
    their ids under :func:`ids_key` (a dynamic table has no row numbers: ids name the rows)."""
    for coll in manifest.get("collections") or []:
        for t in coll["tables"]:
            if t.get("dynamic") is not None:
                dense[ids_key(t["key"])], dense[t["key"]] = dynamic_table(path, t)


def _tables(path: Path, manifest: dict[str, Any], dense: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Every saved range table's manifest entry, by state-dict key."""
    tables = {t["key"]: t for coll in manifest.get("collections") or [] for t in coll["tables"]
              if t.get("dynamic") is None}
    clash = sorted(set(tables) & set(dense))
    if clash:
        raise CheckpointError(f"{path}: key {clash[0]!r} is both a dense and a table key")
    return tables


def table_rows(ckpt: Path, table: dict[str, Any], start: int, stop: int) -> torch.Tensor:
    """Global rows ``[start, stop)`` of a saved table (its manifest entry), read one saved part at
    a time: only the parts holding some of them are read."""
    out = torch.empty(stop - start, table["embedding_dim"])
    filled = torch.zeros(stop - start, dtype=torch.bool)
    for index, f in enumerate(table["files"]):
        rows = F.saved_rows(ckpt, table, index)
        if rows is not None and not bool(((rows >= start) & (rows < stop)).any()):
            continue
        weight = F.load_tensors(ckpt, FileEntry(f["path"], int(f["size"]), f["sha256"]))["weight"]
        rows = F.saved_rows(ckpt, table, index, weight.shape[0])
        keep = ((rows >= start) & (rows < stop)).nonzero().flatten()
        out[rows.index_select(0, keep) - start] = weight.index_select(0, keep).float()
        filled[rows.index_select(0, keep) - start] = True
    F.uncovered(ckpt, table, filled, start)
    return out


def export_state_dict(ckpt: str | Path, *, key: bytes | None = None) -> dict[str, torch.Tensor]:
    """The plain state dict of checkpoint ``ckpt`` (a ``step_N`` directory or a root: its newest),
    in memory: the dense part and every table whole, in the plain model's key order. ``key``
    verifies the manifest's signature (default: :func:`hybrid.checkpoint.files.checkpoint_key`)."""
    path = F.resolve(ckpt)
    manifest = F.read_manifest(path, key=key)
    state = dense_state_dict(path, manifest)
    _dynamic(path, manifest, state)
    for name, t in _tables(path, manifest, state).items():
        state[name] = table_rows(path, t, 0, t["num_embeddings"])
    return {k: state[k] for k in _ordered(manifest, state)}


def export(ckpt: str | Path, out: str | Path, *, key: bytes | None = None,
           part_bytes: int = EXPORT_PART_BYTES) -> dict[str, Any]:
    """Write checkpoint ``ckpt`` as the plain model's state dict, in bounded memory; returns what
    was written (``files``, ``keys``, ``values``).

    When everything fits in ``part_bytes``, ``out`` is one file holding the whole state dict
    (``model.load_state_dict(torch.load(out, weights_only=True))``). Otherwise ``out`` holds the
    dense part, each table goes into files of at most ``part_bytes`` (``<out>.<key>.part<i>.pt``,
    rows ``[a, b)`` each; a dynamic table's ids under its ids key in the same files, ``[a, b)``
    its places in ascending id order), and ``<out>.index.json`` names them all: :func:`load_export` reads it
    back, and no table is ever whole in this process while writing. Every file is written
    atomically; the index last."""
    path = F.resolve(ckpt)
    out = Path(out)
    if out.resolve().is_relative_to(path.resolve()):
        raise CheckpointError(f"export: the output {out} is inside the checkpoint {path}; write it elsewhere "
                                f"(an export there could replace the checkpoint's own files)")
    if out.is_dir():
        raise CheckpointError(f"export: the output {out} is a directory; name a file")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"export: cannot create the output's directory {out.parent} ({e.strerror or e})") from None
    manifest = F.read_manifest(path, key=key)
    dense = dense_state_dict(path, manifest)
    dynamic = {t["key"]: t for coll in manifest.get("collections") or [] for t in coll["tables"]
               if t.get("dynamic") is not None}
    tables = _tables(path, manifest, dense)
    clash = sorted(set(dense) & ({*dynamic} | {ids_key(k) for k in dynamic}))
    if clash:
        raise CheckpointError(f"{path}: key {clash[0]!r} is both a dense and a table key")
    index_path = out.with_name(f"{out.name}.index.json")
    # A dynamic table's bytes: its rows (float32) and their ids (int64).
    table_bytes = (sum(t["num_embeddings"] * t["embedding_dim"] * 4 for t in tables.values())
                   + sum(_dynamic_rows(t) * (4 * t["embedding_dim"] + 8) for t in dynamic.values()))
    values = (sum(v.numel() for v in dense.values()) + sum(t["num_embeddings"] * t["embedding_dim"]
                                                            for t in tables.values())
              + sum(_dynamic_rows(t) * (t["embedding_dim"] + 1) for t in dynamic.values()))
    keys = _ordered(manifest, [*dense, *tables, *(k for key in dynamic for k in (ids_key(key), key))])
    # Every file is written under a temporary name and renamed once all are written, so an
    # interrupted or failed export removes what it wrote and leaves an earlier export at ``out``
    # as it was.
    written: list[tuple[Path, Path]] = []
    try:
        if sum(v.numel() * v.element_size() for v in dense.values()) + table_bytes <= part_bytes:
            _dynamic(path, manifest, dense)
            state = {**dense, **{k: table_rows(path, t, 0, t["num_embeddings"]) for k, t in tables.items()}}
            _save_temp({k: state[k] for k in keys}, out, written)
            parts = None
        else:
            parts = _write_parts(path, out, keys, dense, dynamic, tables, part_bytes, written)
        try:
            index_path.unlink(missing_ok=True)  # an earlier export's, stale from here on
            for tmp, final in reversed(written):  # the parts first, ``out`` last
                os.replace(tmp, final)
            written.clear()
            if parts is not None:
                F.atomic_write_text(index_path, json.dumps({"dense": out.name, "keys": keys, "tables": parts},
                                                           indent=1))
        except OSError as e:
            raise CheckpointError(f"export: cannot write {out} ({e.strerror or e})") from None
    except BaseException:  # Ctrl-C included: a part may be as big as a table
        for tmp, _ in written:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # never made (a name too long, say): nothing to remove
                pass
        raise
    if parts is None:
        return {"files": [out.name], "keys": keys, "values": values}
    files = [out.name] + [p["file"] for ps in parts.values() for p in ps] + [index_path.name]
    return {"files": files, "keys": keys, "values": values}


def _write_parts(path: Path, out: Path, keys: list[str], dense: dict[str, torch.Tensor],
                 dynamic: dict[str, dict[str, Any]], tables: dict[str, dict[str, Any]], part_bytes: int,
                 written: list[tuple[Path, Path]]) -> dict[str, list[dict[str, Any]]]:
    """The dense part for ``out`` and every table in part files of at most ``part_bytes``, each
    under a temporary name appended to ``written`` with its final one; returns the index's
    ``tables``."""
    _save_temp({k: dense[k] for k in keys if k in dense}, out, written)
    parts: dict[str, list[dict[str, Any]]] = {}
    for name, t in dynamic.items():  # ids and rows together, ascending by id, merged from the servers' files
        step = max(1, part_bytes // (4 * t["embedding_dim"] + 8))
        start = 0
        for i, (ids, rows) in enumerate(dynamic_chunks(path, t, step)):
            file = f"{out.name}.{quote(name, safe='.-_')}.part{i}.pt"
            _save_temp({ids_key(name): ids, name: rows}, out.with_name(file), written)
            for key in (ids_key(name), name):
                parts.setdefault(key, []).append({"file": file, "rows": [start, start + ids.numel()]})
            start += ids.numel()
    for name, t in tables.items():
        step = max(1, part_bytes // (4 * t["embedding_dim"]))
        for i, start in enumerate(range(0, t["num_embeddings"], step)):
            stop = min(start + step, t["num_embeddings"])
            file = f"{out.name}.{quote(name, safe='.-_')}.part{i}.pt"
            _save_temp({name: table_rows(path, t, start, stop)}, out.with_name(file), written)
            parts.setdefault(name, []).append({"file": file, "rows": [start, stop]})
    return parts


def _save_temp(state: dict[str, torch.Tensor], out: Path, written: list[tuple[Path, Path]]) -> None:
    """``state`` into a temporary file beside ``out``, recorded in ``written`` (before the write,
    so that a partial file is removed too)."""
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    written.append((tmp, out))
    try:
        F.save_tensors(state, tmp)
    except OSError as e:
        raise CheckpointError(f"export: cannot write {out} ({e.strerror or e})") from None


def load_export(out: str | Path) -> dict[str, torch.Tensor]:
    """The state dict :func:`export` wrote to ``out``, whole, in the plain model's order (tensors
    only: ``torch.load(weights_only=True)``)."""
    out = Path(out)
    index_path = out.with_name(f"{out.name}.index.json")
    state = torch.load(out, weights_only=True)
    if not index_path.exists():
        return state
    index = json.loads(index_path.read_text())
    for name, parts in index["tables"].items():
        pieces = [torch.load(out.with_name(p["file"]), weights_only=True)[name] for p in parts]
        state[name] = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return {k: state[k] for k in index["keys"]}
