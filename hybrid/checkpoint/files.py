"""Files of a checkpoint: the manifest, checksums, atomic writes, safe loading, finding and pruning.

A checkpoint is one directory ``<root>/step_<N>/``; it exists once its ``manifest.json`` does.
The manifest is written last, atomically (temp file, fsync, rename, fsync of the directory), and
names every other file with its size and SHA-256. Every reader checks a file against the
manifest before it opens it, and opens it without running pickled code: ``torch.load`` with
``weights_only=True`` for our files, and a restricted unpickler (DCP's own metadata classes,
``torch.Size``, dtypes, nothing else) for ``torch.distributed.checkpoint``'s ``.metadata``,
which DCP itself would read with plain ``pickle``, and a DCP load planner that reads DCP's byte
items with ``weights_only=True`` (DCP's own planner unpickles them with ``weights_only=False``).

With a key (:func:`checkpoint_key`) the manifest also carries an HMAC-SHA256 of its content: the
checksums then protect against a deliberate change too, since rewriting the manifest to match
changed files needs the key.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import pickle
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT = "hybrid-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
KEY_ENV = "HYBRID_CHECKPOINT_KEY"
STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read: missing, incomplete, tampered, incompatible."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as the manifest names it."""

    path: str
    """Relative to the checkpoint directory, ``/``-separated."""
    size: int
    sha256: str

    def as_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def entry_for(ckpt: str | Path, path: str | Path) -> FileEntry:
    """Size and checksum of ``path`` (a file inside checkpoint directory ``ckpt``)."""
    p = Path(path)
    return FileEntry(p.relative_to(ckpt).as_posix(), p.stat().st_size, sha256_of(p))


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_tensors(obj: Any, path: str | Path) -> None:
    """``torch.save`` then fsync: the file's bytes are on disk before the manifest names it."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``path`` so that it is either absent or complete: temp file, fsync, rename, fsync dir."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def checkpoint_key(key_file: str | Path = "") -> bytes | None:
    """The key that signs and verifies manifests: the bytes of ``key_file`` when given, else
    ``$HYBRID_CHECKPOINT_KEY``, else ``None`` (manifests are neither signed nor verified)."""
    if key_file:
        try:
            key = Path(key_file).expanduser().read_bytes().strip()
        except OSError as e:
            raise CheckpointError(f"checkpoint key file {key_file}: cannot read it ({e.strerror or e})") from None
        if not key:
            raise CheckpointError(f"checkpoint key file {key_file} is empty")
        return key
    env = os.environ.get(KEY_ENV, "")
    return env.encode() if env else None


def _signature(doc: dict[str, Any], key: bytes) -> str:
    body = {k: v for k, v in doc.items() if k != "signature"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def write_manifest(ckpt: str | Path, *, step: int, files: Iterable[FileEntry], key: bytes | None = None,
                   **sections: Any) -> None:
    """Write ``manifest.json`` (last, atomically). ``sections`` are further plain-JSON sections.

    Signed with ``key`` (default: :func:`checkpoint_key`) when there is one.
    """
    ckpt = Path(ckpt)
    for d in sorted({p for p in ckpt.rglob("*") if p.is_dir()} | {ckpt}, key=lambda p: -len(p.parts)):
        fsync_dir(d)  # every file's directory entry is durable before the manifest names it
    doc = {
        "format": FORMAT, "version": VERSION, "step": step, "created_unix": time.time(),
        **sections,
        "files": {e.path: e.as_json() for e in sorted(files, key=lambda e: e.path)},
    }
    key = key if key is not None else checkpoint_key()
    if key:
        doc["signature"] = {"alg": "hmac-sha256", "digest": _signature(doc, key)}
    atomic_write_text(ckpt / MANIFEST, json.dumps(doc, indent=1, sort_keys=False) + "\n")


def read_manifest(ckpt: str | Path, *, key: bytes | None = None) -> dict[str, Any]:
    """The manifest of checkpoint directory ``ckpt``; :class:`CheckpointError` when it has none.

    With ``key`` (default: :func:`checkpoint_key`) the manifest must carry a signature made with
    that key; one that is missing or does not verify is refused.
    """
    doc = _read_unverified(ckpt)
    key = key if key is not None else checkpoint_key()
    if key:
        path = Path(ckpt) / MANIFEST
        sig = doc.get("signature")
        if not isinstance(sig, dict) or sig.get("alg") != "hmac-sha256" or not isinstance(sig.get("digest"), str):
            raise CheckpointError(f"{path}: not signed, and a checkpoint key is set (checkpoint.key_file or "
                                  f"${KEY_ENV}); refusing an unsigned checkpoint")
        if not hmac.compare_digest(sig["digest"], _signature(doc, key)):
            raise CheckpointError(f"{path}: the signature does not verify with the checkpoint key: the manifest "
                                  f"was changed by someone without the key, or it was signed with another key; "
                                  f"refusing it")
    return doc


def _read_unverified(ckpt: str | Path) -> dict[str, Any]:
    path = Path(ckpt) / MANIFEST
    if path.exists() and not path.is_file():
        raise CheckpointError(f"{path}: not a file")
    if not path.is_file():
        why = "it does not exist" if not Path(ckpt).exists() else (
            f"it has no {MANIFEST}: the save did not finish (a crash mid-save), so it is not a checkpoint")
        raise CheckpointError(f"{ckpt} is not a complete checkpoint: {why}")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{path}: manifest version {doc.get('version')!r}; this hybrid reads version {VERSION}")
    _check_sections(doc, path)
    return doc


def _check_sections(doc: dict[str, Any], path: Path) -> None:
    """The manifest's sections have the types a save writes (what reading them relies on), else
    :class:`CheckpointError` naming the section: a manifest edited by hand or by a tool."""
    def bad(section: str, expected: str) -> CheckpointError:
        return CheckpointError(f"{path}: {section}: got {doc.get(section)!r:.80}; expected {expected} (the manifest "
                               f"was edited: hybrid writes none so)")

    def count(v: Any, least: int) -> bool:
        return type(v) is int and v >= least

    if not count(doc.get("step"), 0):
        raise bad("step", "a step number >= 0")
    files = doc.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and count(e.get("size"), 0) and isinstance(e.get("sha256"), str) for e in files.values()):
        raise bad("files", "a map of file paths to their size and sha256")
    world = doc.get("world", {"trainers": 1, "servers": 0})
    if not (isinstance(world, dict) and count(world.get("trainers"), 1) and count(world.get("servers"), 0)):
        raise bad("world", "the numbers of trainers (>= 1) and servers (>= 0)")
    for section, kind, expected in (("train", dict, "a map"), ("dense", dict, "a map"),
                                    ("collections", list, "a list"), ("keys", list, "a list")):
        if section in doc and not isinstance(doc[section], kind):
            raise bad(section, expected)
    if not all(isinstance(c, dict) for c in doc.get("collections", [])):
        raise bad("collections", "a list of collections")
    data = doc.get("train", {}).get("data", [0, 0])
    if not (isinstance(data, list) and len(data) == 2 and all(count(v, 0) for v in data)):
        raise CheckpointError(f"{path}: train.data: got {data!r:.80}; expected [epoch, batch] (the manifest was "
                              f"edited: hybrid writes none so)")
    records = doc.get("train", {}).get("records", 0)
    if not count(records, 0):
        raise CheckpointError(f"{path}: train.records: got {records!r:.80}; expected the data's records before the "
                              f"next batch, >= 0 (the manifest was edited: hybrid writes none so)")
    at = doc.get("train", {}).get("data_at", {"file": 0, "path": "", "size": 0, "records": 0})
    where = [k for k in ("offset", "line", "row") if k in at] if isinstance(at, dict) else []
    if not (isinstance(at, dict) and count(at.get("file"), 0) and isinstance(at.get("path"), str)
            and count(at.get("size"), 0) and count(at.get("records"), 0) and all(count(at[k], 0) for k in where)
            and set(at) <= {"file", "path", "size", "records", "offset", "line", "row"}):
        raise CheckpointError(f"{path}: train.data_at: got {at!r:.120}; expected where a data file's chunk starts "
                              f"(file, path, size, records, and offset and line or row; the manifest was edited: "
                              f"hybrid writes none so)")


def manifest_entry(manifest: dict[str, Any], rel: str) -> FileEntry:
    try:
        e = manifest["files"][rel]
    except KeyError:
        raise CheckpointError(f"the manifest names no file {rel!r}; the checkpoint is incomplete or was edited") from None
    return FileEntry(rel, int(e["size"]), str(e["sha256"]))


def verify(ckpt: str | Path, entry: FileEntry) -> Path:
    """Check one file against its manifest entry; returns its path. Raises on any difference."""
    path = Path(ckpt) / entry.path
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the manifest names it)")
    size = path.stat().st_size
    if size != entry.size:
        raise CheckpointError(f"{path}: {size} bytes, the manifest says {entry.size}: the file was changed "
                              f"after the checkpoint was written (truncated, corrupt or tampered); refusing it")
    digest = sha256_of(path)
    if digest != entry.sha256:
        raise CheckpointError(f"{path}: checksum mismatch (sha256 {digest[:16]}..., the manifest says "
                              f"{entry.sha256[:16]}...): the file was changed after the checkpoint was written "
                              f"(corrupt or tampered); refusing to load it")
    return path


def load_tensors(ckpt: str | Path, entry: FileEntry, *, mmap: bool = False) -> Any:
    """Verify, then ``torch.load(weights_only=True)``: tensors and plain data only, no pickled code."""
    path = verify(ckpt, entry)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).strip().split(". ")[0].splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: holds more than tensors and plain data (pickled objects); refusing to "
                              f"load it with weights_only=True ({first})") from None


# -- torch.distributed.checkpoint metadata, without plain pickle ----------------------------------

_DCP_METADATA_NAMES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
        "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex", "StorageMeta",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's ``Metadata`` and refuses any other global (a payload cannot run code)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_METADATA_NAMES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")


def load_dcp_metadata(path: str | Path) -> Any:
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: holds more than checkpoint metadata ({e}); refusing to load it") from None


def safe_dcp_reader(path: str | Path):
    """A ``FileSystemReader`` whose ``.metadata`` goes through :class:`_MetadataUnpickler`.

    Its tensor items are raw tensor bytes; its byte items are only read safely through the
    planner of :func:`safe_load_planner`.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata = load_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(str(path))


def safe_load_planner(*, keys: set[str] | None = None):
    """A DCP load planner that reads byte items (non-tensor values: an optimizer's ``lr``, a step
    counter) with ``torch.load(weights_only=True)``; a byte item holding anything else is refused.

    ``keys``: load every item under these top-level keys into an empty state dict (DCP's
    ``_EmptyStateDictLoadPlanner``); ``None``: load into the given state dict.
    """
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - pickled code, or bytes that are no torch file at all
            first = str(e).strip().split(". ")[0].splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint item {fqn!r} holds more than tensors and plain data; refusing to "
                                  f"load it with weights_only=True ({first})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    base = DefaultLoadPlanner if keys is None else _EmptyStateDictLoadPlanner
    planner = type("SafeLoadPlanner", (base,), {"load_bytes": load_bytes})
    return planner() if keys is None else planner(keys=keys)


def unwrap_dcp_error(e: BaseException) -> BaseException:
    """The :class:`CheckpointError` inside DCP's ``CheckpointException`` (which wraps what each rank
    raised), or ``e`` itself."""
    if isinstance(e, CheckpointError):
        return e
    for failure in (getattr(e, "failures", None) or {}).values():
        inner = unwrap_dcp_error(failure[0] if isinstance(failure, tuple) else failure)
        if isinstance(inner, CheckpointError):
            return inner
    return e


# -- finding and pruning ---------------------------------------------------------------------------


def scan(root: Path) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
    """The ``step_*`` directories under ``root`` that hold a manifest: those whose manifest
    reads as a checkpoint of that step (oldest first), and those whose manifest does not, with
    why. A directory without a manifest is a save that did not finish, in neither list."""
    complete, unreadable = [], []
    if not root.is_dir():
        return complete, unreadable
    for d in root.iterdir():
        m = STEP_DIR.match(d.name)
        if not (m and d.is_dir() and (d / MANIFEST).exists()):
            continue
        try:
            # listing only: the one picked is verified (signature included) when it is opened
            step = _read_unverified(d)["step"]  # an int >= 0 (_check_sections)
            if step != int(m.group(1)):
                raise CheckpointError(f"{d / MANIFEST}: its step is {step!r}, not the directory's {int(m.group(1))}")
        except CheckpointError as e:
            unreadable.append((d, str(e)))
            continue
        complete.append((step, d))
    return sorted(complete), sorted(unreadable)


def checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first. A ``step_*`` directory whose manifest
    is there but does not read as that step's raises :class:`CheckpointError` naming it: it is
    not a save that stopped midway (those have no manifest), and passing over it would resume
    from an older step and let the next save's pruning delete it."""
    complete, unreadable = scan(Path(root))
    if unreadable:
        d, why = unreadable[-1]
        raise CheckpointError(f"{why}; a save leaves no such manifest. Restore it, or move {d.name} out of "
                              f"{d.parent} to use the checkpoints before it")
    return complete


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or ``None``."""
    found = checkpoints(root)
    return found[-1][1] if found else None


def refuse_overwrite(root: str | Path, start_step: int, *, resumed: bool) -> None:
    """Raise :class:`CheckpointError` where a run saving under ``root`` from ``start_step`` on
    would overwrite or prune checkpoints of another run: any, for a run that does not resume;
    those after ``start_step``, for one that does (a save replaces its step's directory, and
    pruning keeps the newest). Leftovers of saves that did not finish are not checkpoints."""
    complete, unreadable = scan(Path(root))
    later = [d.name for s, d in complete if not resumed or s > start_step] + [d.name for d, _ in unreadable]
    if later:
        what = "a run that does not resume" if not resumed else f"a run resumed at step {start_step}"
        raise CheckpointError(
            f"checkpoint.dir {root} holds {', '.join(sorted(later))} of another run, which {what} would overwrite "
            f"or remove: resume the newest (checkpoint.resume=latest), move them away, or pick another checkpoint.dir")


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or a root holding ``step_*`` checkpoints (its newest)."""
    p = Path(path)
    if (p / MANIFEST).is_file() or STEP_DIR.match(p.name):
        return p
    if p.is_dir() and any(STEP_DIR.match(d.name) for d in p.iterdir()):
        newest = latest(p)
        if newest is None:
            raise CheckpointError(f"{p} holds no complete checkpoint (every step_* directory lacks {MANIFEST})")
        return newest
    return p


def prepare(ckpt: Path) -> None:
    """Make an empty directory for a new save; a leftover of a crashed save is removed first."""
    if ckpt.exists():
        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True)


def prune(root: str | Path, keep: int, *, current: Path) -> list[Path]:
    """Keep the newest ``keep`` complete checkpoints (always ``current``); remove the rest and
    every incomplete ``step_*`` directory (leftovers of crashed saves, without a manifest); a
    directory whose manifest does not read is kept. Returns what was removed."""
    root = Path(root)
    complete, unreadable = scan(root)
    keep_paths = {p for _, p in complete[-keep:]} | {current} | {d for d, _ in unreadable}  # never what it cannot read
    removed = []
    for d in sorted(root.iterdir()):
        if not (STEP_DIR.match(d.name) and d.is_dir()) or d in keep_paths:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def dumps_plain(obj: Any) -> bytes:
    """``torch.save`` into bytes (for the test hook that writes part of a file)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def saved_rows(ckpt: Path, table: dict[str, Any], index: int, count: int | None = None) -> torch.Tensor | None:
    """Global row ids held by file ``index`` of saved table ``table`` (its entry in checkpoint
    ``ckpt``'s manifest): the
    rows ``[a, b)`` of shard ``k`` it names. A file of a manifest without parts holds all of shard
    ``index``: its ``count`` rows (``None`` while the count is unknown)."""
    f = table["files"][index]
    shard = int(f.get("shard", index))
    a, b = f["rows"] if "rows" in f else (0, count)
    if b is None:
        return None
    if count is not None and int(b) - int(a) != count:
        raise CheckpointError(f"{Path(ckpt) / f['path']}: holds {count} rows; the manifest says rows [{a}, {b}) of shard {shard} "
                              f"(the manifest was edited)")
    local = torch.arange(int(a), int(b), dtype=torch.int64)
    rows = local if table["sharding"] == "table_wise" else local * int(table["num_shards"]) + shard
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= int(table["num_embeddings"])):
        raise CheckpointError(f"{Path(ckpt) / f['path']}: rows [{a}, {b}) of shard {shard} fall outside table {table['key']}'s "
                              f"{table['num_embeddings']} rows (the manifest was edited)")
    return rows


def uncovered(ckpt: Path, table: dict[str, Any], filled: torch.Tensor, start: int = 0) -> None:
    """Raise unless every row of ``filled`` (rows ``start`` on of ``table``, an entry of checkpoint
    ``ckpt``'s manifest, set where a saved file held them) is set: a row no file holds would be
    left as uninitialized memory."""
    if not bool(filled.all()):
        first = int((~filled).nonzero()[0]) + start
        raise CheckpointError(f"{Path(ckpt) / MANIFEST}: table {table['key']}: row {first} (and {int((~filled).sum()) - 1} more) is in no "
                              f"saved file (the manifest was edited)")
