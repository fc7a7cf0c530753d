"""One plain ``state_dict`` from a checkpoint: the keys of the unsharded model, whole tensors.

Runs in one process, without the job: the dense part is read from the DCP files (every shard
gathered into the whole tensor), each table is assembled from its server shards. The result
loads into the plain model with ``model.load_state_dict(torch.load(path, weights_only=True))``
for evaluation or serving. Optimizer state is not exported (use :func:`load_tables` for it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hybrid.checkpoint import files as F
from hybrid.checkpoint.files import CheckpointError, FileEntry


def dense_state_dict(ckpt: str | Path, manifest: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The dense model's full state dict (no optimizer), read in this process."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    ckpt = Path(ckpt)
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
    """Every saved table, whole: ``{state-dict key: (weight, optimizer state by name)}``."""
    ckpt = Path(ckpt)
    manifest = manifest or F.read_manifest(ckpt)
    out = {}
    for coll in manifest.get("collections") or []:
        for t in coll["tables"]:
            weight = torch.empty(t["num_embeddings"], t["embedding_dim"])
            state: dict[str, torch.Tensor] = {}
            for k, f in enumerate(t["files"]):
                data = F.load_tensors(ckpt, FileEntry(f["path"], int(f["size"]), f["sha256"]))
                rows = slice(None) if t["sharding"] == "table_wise" else slice(k, None, t["num_shards"])
                weight[rows] = data["weight"]
                for name, v in data["state"].items():
                    if name not in state:
                        state[name] = torch.empty((t["num_embeddings"], *v.shape[1:]), dtype=v.dtype)
                    state[name][rows] = v
            out[t["key"]] = (weight, state)
    return out


def export(ckpt: str | Path, out: str | Path | None = None, *, key: bytes | None = None) -> dict[str, torch.Tensor]:
    """The plain state dict of checkpoint ``ckpt`` (a ``step_N`` directory or a root: its newest);
    written to ``out`` (atomically) when given. ``key`` verifies the manifest's signature
    (default: :func:`hybrid.checkpoint.files.checkpoint_key`)."""
    path = F.resolve(ckpt)
    manifest = F.read_manifest(path, key=key)
    state = dense_state_dict(path, manifest)
    for key, (weight, _) in load_tables(path, manifest).items():
        if key in state:
            raise CheckpointError(f"{path}: key {key!r} is both a dense and a table key")
        state[key] = weight
    order = [k for k in manifest.get("keys") or [] if k in state]  # the plain model's order
    state = {**{k: state[k] for k in order}, **state}
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
        F.save_tensors(state, tmp)
        os.replace(tmp, out)
    return state
