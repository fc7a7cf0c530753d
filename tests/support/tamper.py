"""What an attacker who can write a checkpoint's files does: plant pickled code and fix the manifest.

Every payload pickles to ``os.system("touch MARKER")``; a test asserts the marker stays absent.
Each function rewrites the manifest's sizes and checksums to match the changed files, so only a
loader that refuses pickled code (or a manifest signature) stops the payload.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import torch

from hybrid.checkpoint import files as F


class Payload:
    """Pickles to a call of ``os.system`` that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def payload_bytes(marker: Path) -> bytes:
    """A ``torch.save`` file whose unpickling runs the payload (what DCP stores for a byte item)."""
    buf = io.BytesIO()
    torch.save({"lr": Payload(marker)}, buf)
    return buf.getvalue()


def refresh_manifest(ckpt: Path) -> None:
    """Rewrite every size and checksum in ``ckpt``'s manifest (and its table entries) to match the files."""
    path = ckpt / F.MANIFEST
    doc = json.loads(path.read_text())
    for rel in doc["files"]:
        doc["files"][rel] = F.entry_for(ckpt, ckpt / rel).as_json()
    for coll in doc.get("collections") or []:
        for t in coll["tables"]:
            for f in t["files"]:
                f.update(doc["files"][f["path"]])
    path.write_text(json.dumps(doc, indent=1))


def dcp_item(dense: Path, fqn: str, marker: Path) -> None:
    """Point DCP item ``fqn`` (a byte item, or a tensor re-declared as bytes) at a payload appended
    to a ``.distcp`` file of checkpoint directory ``dense``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta = F.load_dcp_metadata(dense / ".metadata")
    if fqn not in meta.state_dict_metadata:
        raise KeyError(f"{fqn} is not an item of {dense} (it has {sorted(meta.state_dict_metadata)})")
    target = sorted(dense.glob("*.distcp"))[0]
    data = payload_bytes(marker)
    offset = target.stat().st_size
    with open(target, "ab") as f:
        f.write(data)
    meta.state_dict_metadata[fqn] = BytesStorageMetadata()
    meta.storage_data = {k: v for k, v in meta.storage_data.items() if k.fqn != fqn}
    meta.storage_data[MetadataIndex(fqn)] = _StorageInfo(target.name, offset, len(data))
    (dense / ".metadata").write_bytes(pickle.dumps(meta))


def dcp_metadata(dense: Path, marker: Path) -> None:
    """Replace DCP's ``.metadata`` by a pickle that runs the payload."""
    (dense / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


def torch_file(path: Path, marker: Path) -> None:
    """Add a payload to a ``torch.save`` file of plain data (a table shard, a trainer's state)."""
    good = torch.load(path, weights_only=True)
    torch.save({**good, "extra": Payload(marker)}, path)
