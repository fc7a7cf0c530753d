"""Save and restore a composed model on the trainers (every trainer calls; trainer 0 leads).

Save, at a step boundary (every trainer's gradients of the last step delivered):

1. trainer 0 empties ``<root>/step_<N>/`` (a leftover of a crashed save of the same step);
2. trainer 0 asks every server to write its shards of every remote collection (in parallel,
   server-side, see :mod:`hybrid.checkpoint.server_io`) and, meanwhile,
3. the trainers write the dense model and its optimizer with ``torch.distributed.checkpoint``
   (FSDP parameters as their shards, replicated ones once), each trainer its RNG states and
   training position, and each hashes its share of the files;
4. trainer 0 writes ``manifest.json`` last, atomically, then keeps the newest ``keep``.

Restore: the dense state through DCP (which reshards to the current trainers), the tables by
the servers themselves (resharded row by row to the current layout), the step numbering of the
trainers' runtime and of the servers' step bookkeeping, and this trainer's RNG states. Every
file is checked against the manifest first. A failure on any trainer is raised on all of them.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import random
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybrid.checkpoint import files as F
from hybrid.checkpoint import server_io
from hybrid.checkpoint.files import CheckpointError, FileEntry
from hybrid.errors import first_line
from hybrid.launch.serve import PeerFailure, answers
from hybrid.log import logger
from hybrid.ps.client import RemoteCollection, RemoteTable, pipeline_of
from hybrid.ps.transport import call

DEFAULT_TIMEOUT_S = 1800.0


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(err: str | PeerFailure | None, what: str) -> None:
    """Every trainer learns whether any failed (a barrier too); all raise the first failure: a
    :class:`CheckpointError` (a mistake the user can fix: a path, a file), or a
    :class:`PeerFailure` where a server died or hung meanwhile (a failed process, not bad input)."""
    rank, world = _rank_world()
    errs: list[str | PeerFailure | None] = [err]
    if world > 1:
        errs = [None] * world
        dist.all_gather_object(errs, err)
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        r, e = bad[0]
        raise (PeerFailure if isinstance(e, PeerFailure) else CheckpointError)(f"{what} failed on trainer{r}: {e}")


def _wait_pinging(done, peer: str | None, stopped: str) -> None:  # noqa: ANN001 - a predicate
    """Wait until ``done()`` holds, pinging ``peer`` every second meanwhile (``None``: nobody to
    ping): one that does not answer within the RPC timeout (``runtime.rpc_timeout_s``) -- dead, or
    hung: stopped, or a host gone without closing its connections -- raises
    :class:`PeerFailure` (``stopped``: who stopped answering while doing what)."""
    import time

    import torch.distributed.rpc as rpc

    next_ping = time.monotonic() + 1.0
    while not done():
        time.sleep(0.05)
        if peer is not None and time.monotonic() >= next_ping and not done():
            timeout_s = rpc.get_rpc_timeout()
            if not answers(peer, timeout_s):
                raise PeerFailure(f"{stopped} (died or hung): no answer to a ping within {timeout_s:g}s "
                                  f"(runtime.rpc_timeout_s)")
            next_ping = time.monotonic() + 1.0


def _wait_answering(fut, server: str, doing: str):  # noqa: ANN001, ANN202 - a torch future and its value
    """The answer of ``fut``, a call to ``server`` that may run long (writing or loading large
    tables: its own timeout is :data:`DEFAULT_TIMEOUT_S`), the server pinged meanwhile
    (:func:`_wait_pinging`): one that hangs fails the wait after the RPC timeout rather than after
    the call's 30 minutes. A call that fails while the server no longer answers (its error is then
    only the connection's ``EOF`` or a timeout) raises :class:`PeerFailure` saying so; one the
    server answered raises its own error (a path, a file). A server this process holds itself
    (one-process mode) has nothing in between to lose."""
    from hybrid.ps import transport

    here = server in transport._HERE
    stopped = f"parameter server {server} stopped answering while {doing}"
    if not here:
        _wait_pinging(fut.done, server, stopped)
    try:
        return fut.wait()
    except Exception as e:
        if here or answers(server):
            raise
        raise PeerFailure(f"{stopped} (died or hung): {first_line(e)}") from None


def _remote_message(e: BaseException) -> str:
    """The message of an exception raised on an RPC peer. RPC re-raises it with the text
    ``On WorkerInfo(...):``, then the remote exception's ``repr`` (``Class('message')``), then the
    remote traceback."""
    lines = str(e).strip().splitlines()
    for k, line in enumerate(lines[:-1]):
        if "On WorkerInfo(" in line:
            m = re.fullmatch(r"\w+\((.*)\)", lines[k + 1].strip())
            if m:
                try:
                    return str(ast.literal_eval(m.group(1)))
                except (ValueError, SyntaxError):
                    return m.group(1)
    return lines[0] if lines else type(e).__name__


def _describe(e: BaseException) -> str:
    text = str(e).strip()
    return text if isinstance(e, CheckpointError) else f"{type(e).__name__}: {text}"


def remote_collections(model: nn.Module) -> list[tuple[str, RemoteCollection, dict[str, str]]]:
    """``(module path, collection, {table: state-dict key})`` of every remote module of ``model``."""
    out = []
    for fqn, m in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        if isinstance(m, RemoteCollection):
            out.append((fqn, m, m.state_keys(prefix)))
        elif isinstance(m, RemoteTable):
            out.append((fqn, m.collection, m.state_keys(prefix)))
    return out


def _no_load(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    return None


@contextmanager
def dense_only(model: nn.Module, *, placeholders: bool = False):
    """Within it, ``model.state_dict()`` and ``load_state_dict`` leave the remote tables out (the
    servers save and load those themselves; otherwise every trainer would fetch every table).
    With ``placeholders``, ``state_dict()`` holds an empty tensor at each table's key instead,
    so its keys are the plain model's, in order."""
    remotes = [m for m in model.modules() if isinstance(m, (RemoteCollection, RemoteTable))]
    for m in remotes:

        def save(destination, prefix, keep_vars, m=m):
            if placeholders:
                for key in m.state_keys(prefix).values():
                    destination[key] = torch.empty(0)

        m.__dict__["_save_to_state_dict"] = save
        m.__dict__["_load_from_state_dict"] = _no_load
    try:
        yield model
    finally:
        for m in remotes:
            m.__dict__.pop("_save_to_state_dict", None)
            m.__dict__.pop("_load_from_state_dict", None)


def state_dict_keys(model: nn.Module) -> list[str]:
    """The composed model's state-dict keys, in order (the plain model's), without reading tables."""
    with dense_only(model, placeholders=True):
        return list(model.state_dict().keys())


def _dense_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    with dense_only(model):
        state = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


# -- RNG ------------------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA, Python's ``random``, NumPy's global) as plain data."""
    version, state, gauss = random.getstate()
    out: dict[str, Any] = {"torch": torch.get_rng_state(),
                           "python": {"version": version, "state": list(state), "gauss": gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        _, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return out


def restore_rng(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    py = st["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in st and np is not None:
        n = st["numpy"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))


# -- save -----------------------------------------------------------------------------------------


def save(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         keep: int = 3, train_state: dict[str, Any] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
         key: bytes | None = None) -> Path:
    """Write the checkpoint of ``step`` under ``root`` (every trainer calls); returns its directory.

    ``train_state`` is plain JSON data the training loop wants back on resume (data position,
    counters); it goes into the manifest (trainer 0's) and into each trainer's own file.
    ``key`` signs the manifest (default: :func:`hybrid.checkpoint.files.checkpoint_key`).
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    rank, world = _rank_world()
    pipeline = pipeline_of(model)
    after_step = pipeline.finished_step() if pipeline is not None else step - 1  # sends what is owed
    ckpt = F.step_dir(Path(root).resolve(), step)
    err = None
    if rank == 0:
        try:
            F.prepare(ckpt)
        except OSError as e:
            err = f"cannot create {ckpt}: {e}"
    _agree(err, f"saving step {step}")
    remotes = remote_collections(model)
    futures = []
    if rank == 0:  # the servers write while the trainers write the dense part
        for _fqn, coll, _ in remotes:
            for s in coll.servers:
                futures.append((coll, s, call(
                    coll.server_names[s], server_io.rpc_save_collection,
                    (coll.cid, str(ckpt), step, after_step), timeout_s=timeout_s)))
    mine: list[FileEntry] = []
    err = None
    try:
        state = _dense_state(model, optimizer)
        dcp_save(state, storage_writer=FileSystemWriter(str(ckpt / "dense")), no_dist=not dist.is_initialized())
        own = ckpt / "trainers" / f"trainer{rank}.pt"
        own.parent.mkdir(parents=True, exist_ok=True)
        F.save_tensors({"rng": capture_rng(), "train": train_state or {}}, own)
        mine.append(F.entry_for(ckpt, own))
    except BaseException as e:  # noqa: BLE001 - shared with every trainer below; DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        err = _describe(F.unwrap_dcp_error(e))
    _agree(err, f"saving step {step}")  # every dense file exists once all got here
    dense_files = sorted(p for p in (ckpt / "dense").rglob("*") if p.is_file())
    mine += [F.entry_for(ckpt, p) for i, p in enumerate(dense_files) if i % world == rank]
    keys = state_dict_keys(model)  # on every trainer: a model's state_dict() may be collective
    entries: list[list[FileEntry]] = [mine]
    if world > 1:
        entries = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(entries, mine)
    err = None
    if rank == 0:
        try:
            collections = _wait_servers(futures, remotes)
            table_files = [FileEntry(f["path"], f["size"], f["sha256"])
                           for c in collections for t in c["tables"] for f in t["files"]]
            F.write_manifest(
                ckpt, step=step, files=[e for part in entries for e in part] + table_files,
                world={"trainers": world, "servers": len(remotes[0][1].server_names) if remotes else 0},
                train=train_state or {}, dense={"dir": "dense", "optimizer": optimizer is not None,
                                                **({"optimizer_class": type(optimizer).__name__} if optimizer else {})},
                collections=collections, keys=keys, key=key,
            )
            removed = F.prune(ckpt.parent, keep, current=ckpt)
            newer = [p.name for s, p in F.scan(ckpt.parent)[0] if s > step]
            gone = f" (removed {', '.join(p.name for p in removed)})" if removed else ""
            logger.info("saved checkpoint %s%s", ckpt, gone)
            if newer:
                logger.warning("%s also holds newer checkpoints from an earlier run (%s); resume=latest picks "
                               "the newest", ckpt.parent, ", ".join(newer))
        except Exception as e:  # noqa: BLE001
            err = e if isinstance(e, PeerFailure) else _describe(e)
    _after_trainer0(rank, world, "the servers' checkpoint files")
    _agree(err, f"saving step {step}")
    return ckpt


_WAITS = [0]
"""Waits for trainer 0 this process has taken part in: every trainer counts the same, so the
count names one wait in the trainers' store."""


def _after_trainer0(rank: int, world: int, waiting_for: str) -> None:
    """Trainer 0 says it is done waiting for the servers (their files written, or their tables
    loaded); the others wait for it.

    The servers may write or load their tables for longer than a collective of the trainers may
    wait (``runtime.pg_timeout_s``: 5 minutes by default): the others must not wait in the
    agreement that follows. They poll the trainers' store instead, pinging trainer 0 every second
    meanwhile: one that does not answer within the RPC timeout (dead or hung) is named."""
    _WAITS[0] += 1
    if world == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"hybrid/checkpoint/wait{_WAITS[0]}/trainer0_done"
    if rank == 0:
        store.set(key, "1")
        return
    import torch.distributed.rpc as rpc

    pinged = rpc.api._is_current_rpc_agent_set()  # a job without RPC has no servers to wait for
    _wait_pinging(lambda: store.check([key]), "trainer0" if pinged else None,
                  f"trainer0 stopped answering while it waited for {waiting_for}")


def _wait_servers(futures, remotes) -> list[dict[str, Any]]:
    """Every server's file entries, grouped into the manifest's ``collections`` section: per
    table, its parts in shard order, each naming its shard and its rows there, which together must
    cover every shard's rows."""
    written: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for coll, s, fut in futures:
        try:
            answer = _wait_answering(fut, coll.server_names[s], f"writing its shards of {coll.cid}")
        except PeerFailure:
            raise
        except Exception as e:  # noqa: BLE001
            first = first_line(e)
            raise CheckpointError(f"parameter server {coll.server_names[s]} did not write its shards of "
                                  f"{coll.cid}: {first}") from None
        for f in answer:
            f = dict(f)
            written.setdefault((coll.cid, f.pop("table")), []).append(f)
    out = []
    for fqn, coll, keys in remotes:
        tables = []
        for t, lay in zip(coll.tables, coll.layouts, strict=True):
            files = sorted(written.get((coll.cid, t.name), []), key=lambda f: (f["shard"], f["rows"][0]))
            by_shard: dict[int, list[dict]] = {}
            for f in files:
                by_shard.setdefault(f["shard"], []).append(f)
            for k in range(lay.num_shards):
                shard_files = by_shard.get(k, [])
                ranges = [f["rows"] for f in shard_files]
                want, end = lay.shard_rows(k), 0
                if coll.config.dynamic is not None:  # a dynamic shard saves the rows it holds
                    want = max((f.get("dynamic_rows", -1) for f in shard_files), default=-1)
                for a, b in ranges:
                    end = b if a == end else -1
                if not ranges or end != want:
                    raise CheckpointError(f"{coll.cid}: the servers wrote rows {ranges} of shard {k} of table "
                                          f"{t.name}, not [0, {want})")
            tables.append({"name": t.name, "key": keys[t.name], "num_embeddings": t.num_embeddings,
                           "embedding_dim": t.embedding_dim, "sharding": lay.sharding, "num_shards": lay.num_shards,
                           "servers": list(lay.servers), "optimizer": coll.config.optimizer.name, "files": files,
                           **({"dynamic": dataclasses.asdict(coll.config.dynamic)} if coll.config.dynamic else {})})
        out.append({"cid": coll.cid, "fqn": fqn, "optimizer": dataclasses.asdict(coll.config.optimizer), "tables": tables})
    return out


# -- restore --------------------------------------------------------------------------------------


class Checkpoint:
    """A complete checkpoint, opened: its manifest read (cheap); :meth:`restore` loads it."""

    def __init__(self, path: str | Path, *, key: bytes | None = None) -> None:
        """``key``: the manifest's signing key (default: :func:`hybrid.checkpoint.files.checkpoint_key`)."""
        self.path = F.resolve(path).resolve()
        self.manifest = F.read_manifest(self.path, key=key)

    @property
    def step(self) -> int:
        """Training steps done when it was saved; a resumed run continues with this step number."""
        return int(self.manifest["step"])

    @property
    def train_state(self) -> dict[str, Any]:
        return dict(self.manifest.get("train") or {})

    @property
    def world(self) -> dict[str, int]:
        return dict(self.manifest.get("world") or {})

    def __repr__(self) -> str:
        w = self.world
        return (f"Checkpoint({str(self.path)!r}, step={self.step}, trainers={w.get('trainers')}, "
                f"servers={w.get('servers')})")

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, rng: bool = True,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Load everything into the composed ``model`` (every trainer calls, before training)."""
        rank, world = _rank_world()
        what = f"restoring {self.path}"
        err, rng_state = None, None
        try:
            dense = sorted(rel for rel in self.manifest["files"] if rel.startswith("dense/"))
            for i, rel in enumerate(dense):
                if i % world == rank:
                    F.verify(self.path, F.manifest_entry(self.manifest, rel))
            if rng:
                rng_state = self._read_rng(rank)
        except Exception as e:  # noqa: BLE001
            err = _describe(e)
        _agree(err, what)
        err = None
        try:
            self._load_dense(model, optimizer)
        except Exception as e:  # noqa: BLE001
            err = _describe(e)
        _agree(err, what)
        err = None
        if rank == 0:
            try:
                self._load_tables(model, timeout_s)
            except Exception as e:  # noqa: BLE001
                err = e if isinstance(e, PeerFailure) else _describe(e)
        _after_trainer0(rank, world, "the servers to load their tables")
        _agree(err, what)  # no trainer looks up before every table is loaded
        pipeline = pipeline_of(model)
        if pipeline is not None:
            if pipeline.current is not None:
                raise CheckpointError(f"restore during step {pipeline.current.step}: restore before training")
            pipeline.next_step = self.step
            pipeline.forget_rows()
        if rng_state is not None:
            restore_rng(rng_state)
        logger.info("restored %s", self)

    def _load_dense(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        dense = self.manifest.get("dense", {})
        with_optim = optimizer is not None and bool(dense.get("optimizer"))
        saved_class = dense.get("optimizer_class")
        if with_optim and saved_class is not None and saved_class != type(optimizer).__name__:
            raise CheckpointError(f"{self.path} holds the state of dense optimizer {saved_class}; this run's is "
                                  f"{type(optimizer).__name__} (train.optimizer): resume with the optimizer it was "
                                  f"saved with")
        if optimizer is not None and not with_optim:
            logger.warning("%s holds no dense optimizer state; the optimizer starts fresh", self.path)
        state = _dense_state(model, optimizer if with_optim else None)
        F.load_dcp_metadata(self.path / "dense" / ".metadata")  # refused here, by name, before DCP reads it
        try:
            dcp_load(state, storage_reader=F.safe_dcp_reader(self.path / "dense"),
                     planner=F.safe_load_planner(), no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as e:  # DCP's exception is no Exception
            inner = F.unwrap_dcp_error(e)
            if isinstance(inner, CheckpointError):
                raise CheckpointError(f"{self.path / 'dense'}: {inner}") from None
            raise CheckpointError(f"the dense state in {self.path / 'dense'} does not fit the model "
                                  f"({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})") from None
        with dense_only(model):
            set_model_state_dict(model, state["model"])
            if with_optim:
                set_optimizer_state_dict(model, optimizer, state["optim"])

    def _load_tables(self, model: nn.Module, timeout_s: float) -> None:
        saved = self.manifest.get("collections") or []
        futures = []
        for fqn, coll, _ in remote_collections(model):
            match = [c for c in saved if c["cid"] == coll.cid] or [c for c in saved if c["fqn"] == fqn]
            if not match:
                raise CheckpointError(f"{self.path} holds no tables for {fqn or coll.cid!r} (it has "
                                      f"{[c['fqn'] for c in saved]})")
            for s in coll.servers:
                futures.append((coll, s, call(
                    coll.server_names[s], server_io.rpc_load_collection,
                    (coll.cid, str(self.path), self.step, match[0]["tables"]), timeout_s=timeout_s)))
        for coll, s, fut in futures:
            try:
                answer = _wait_answering(fut, coll.server_names[s], f"loading {coll.cid}")
            except PeerFailure:
                raise
            except Exception as e:  # noqa: BLE001
                answer = _remote_message(e)
            if isinstance(answer, str):
                raise CheckpointError(f"parameter server {coll.server_names[s]} could not load {coll.cid}: {answer}")

    def _read_rng(self, rank: int) -> dict[str, Any] | None:
        rel = f"trainers/trainer{rank}.pt"
        if rel not in self.manifest["files"]:
            logger.info("%s was saved by %s trainers; trainer%d keeps its own RNG states", self.path,
                        self.world.get("trainers"), rank)
            return None
        return F.load_tensors(self.path, F.manifest_entry(self.manifest, rel))["rng"]


def find_resume(resume: str, root: str, *, key: bytes | None = None) -> Checkpoint | None:
    """The checkpoint named by a training config's ``checkpoint.resume`` (``latest`` or a path)."""
    if not resume:
        return None
    if resume == "latest":
        if not root:
            raise CheckpointError("checkpoint.resume=latest needs checkpoint.dir (where to look)")
        newest = F.latest(root)
        if newest is None:
            logger.info("checkpoint.resume=latest: no complete checkpoint under %s; starting at step 0", root)
            return None
        return Checkpoint(newest, key=key)
    return Checkpoint(os.path.expanduser(resume), key=key)
