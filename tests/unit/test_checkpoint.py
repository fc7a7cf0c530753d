"""Checkpoint files without processes: reshard maths, manifest checks, refusing tampered or
pickled files, DCP metadata without plain pickle, finding and pruning, RNG states.

Shards are written and read by the server-side functions themselves, on ``CollectionShard``s
built in this process (no RPC).
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import random
import re
from pathlib import Path

import pytest
import torch

from hybrid.checkpoint import files as F
from hybrid.checkpoint.core import Checkpoint, capture_rng, restore_rng
from hybrid.checkpoint.export import load_tables
from hybrid.checkpoint.files import CheckpointError
from hybrid.checkpoint.server_io import _fill, _write_shards
from hybrid.ps.config import CollectionConfig
from hybrid.ps.config import OptimizerSpec as SparseOptimSpec
from hybrid.ps.server.shard import CollectionShard
from hybrid.ps.sharding import TableSpec, shard_tables
from tests.support import tamper

TABLES = [TableSpec("a", 23, 4, ("fa",)), TableSpec("b", 7, 3, ("fb",)), TableSpec("c", 2, 5, ("fc",))]
CID = "sparse_arch.ebc"


def _full(spec: SparseOptimSpec) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Distinct values for every row of every table and of its optimizer state."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for t in TABLES:
        state = {}
        if spec.name == "rowwise_adagrad":
            state["sum"] = torch.rand(t.num_embeddings, generator=g)
        elif spec.name == "adam":
            state = {"exp_avg": torch.randn(t.num_embeddings, t.embedding_dim, generator=g),
                     "exp_avg_sq": torch.rand(t.num_embeddings, t.embedding_dim, generator=g),
                     "step": torch.randint(1, 9, (t.num_embeddings,), generator=g).float()}
        out[t.name] = (torch.randn(t.num_embeddings, t.embedding_dim, generator=g), state)
    return out


def _servers(sharding: str, num_servers: int, spec: SparseOptimSpec) -> list[CollectionShard]:
    config = CollectionConfig(cid=CID, tables=tuple(TABLES), layouts=tuple(shard_tables(TABLES, num_servers, sharding)),
                              optimizer=spec, num_trainers=1)
    return [CollectionShard(config, s, start_step=0, huge_pages=False) for s in range(num_servers)]


def _held(t) -> torch.Tensor:
    return t.layout.global_ids(t.shard_pos, torch.arange(t.rows))


def _save(tmp: Path, sharding: str, num_servers: int, spec: SparseOptimSpec, full) -> Path:
    """Write ``full`` as the servers of a ``sharding`` x ``num_servers`` layout would, plus a manifest."""
    ckpt = F.step_dir(tmp, 5)
    F.prepare(ckpt)
    written = {}
    for shard in _servers(sharding, num_servers, spec):
        for t in shard.tables:
            w, st = full[t.name]
            t.weight.copy_(w[_held(t)])
            for k, v in st.items():
                t.optim.state[k].copy_(v[_held(t)])
        for f in _write_shards(shard, ckpt, 5):
            written.setdefault(f.pop("table"), []).append(f)
    tables = []
    for lay in shard_tables(TABLES, num_servers, sharding):
        t = lay.table
        tables.append({"name": t.name, "key": f"ebc.embedding_bags.{t.name}.weight", "num_embeddings": t.num_embeddings,
                       "embedding_dim": t.embedding_dim, "sharding": lay.sharding, "num_shards": lay.num_shards,
                       "servers": list(lay.servers), "optimizer": spec.name,
                       "files": sorted(written[t.name], key=lambda f: (f["shard"], f["rows"][0]))})
    files = [F.FileEntry(f["path"], f["size"], f["sha256"]) for parts in written.values() for f in parts]
    F.write_manifest(ckpt, step=5, files=files, collections=[{"cid": CID, "fqn": "ebc", "tables": tables}])
    return ckpt


def _load(ckpt: Path, sharding: str, num_servers: int, spec: SparseOptimSpec) -> list[CollectionShard]:
    saved = {t["name"]: t for t in F.read_manifest(ckpt)["collections"][0]["tables"]}
    servers = _servers(sharding, num_servers, spec)
    for shard in servers:
        for t in shard.tables:
            t.weight.fill_(float("nan"))
            _fill(t, ckpt, saved[t.name])
    return servers


@pytest.mark.parametrize("src,dst", [
    (("row_wise", 3), ("row_wise", 2)),
    (("row_wise", 2), ("table_wise", 2)),
    (("table_wise", 2), ("row_wise", 3)),
    (("row_wise", 2), ("row_wise", 1)),
    (("table_wise", 3), ("table_wise", 1)),
])
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("part_bytes", [None, 40], ids=["one part", "parts of 40 bytes"])
def test_tables_load_row_for_row_into_any_layout(tmp_path, monkeypatch, src, dst, optimizer, part_bytes):
    """Written in parts (of 1-2 rows with 40 bytes) and loaded one part at a time."""
    from hybrid.checkpoint import server_io

    if part_bytes is not None:
        monkeypatch.setattr(server_io, "PART_BYTES", part_bytes)
    spec = SparseOptimSpec(name=optimizer)
    full = _full(spec)
    ckpt = _save(tmp_path, *src, spec, full)
    parts = [f for t in F.read_manifest(ckpt)["collections"][0]["tables"] for f in t["files"]]
    assert len(parts) > (10 if part_bytes else 0) and all(f["rows"][1] - f["rows"][0] <= 2 or not part_bytes
                                                           for f in parts)
    for shard in _load(ckpt, *dst, spec):
        for t in shard.tables:
            w, st = full[t.name]
            assert torch.equal(t.weight, w[_held(t)]), (t.name, shard.server)
            for k, v in st.items():
                assert torch.equal(t.optim.state[k], v[_held(t)]), (t.name, k)
    for key, (w, st) in load_tables(ckpt).items():  # the export's reader agrees
        name = key.split(".")[-2]
        assert torch.equal(w, full[name][0])
        assert st.keys() == full[name][1].keys() and all(torch.equal(st[k], full[name][1][k]) for k in st)


def test_a_different_optimizer_is_refused(tmp_path):
    ckpt = _save(tmp_path, "row_wise", 2, SparseOptimSpec(name="rowwise_adagrad"), _full(SparseOptimSpec(name="rowwise_adagrad")))
    from hybrid.checkpoint.server_io import _check_fits

    t = _servers("row_wise", 1, SparseOptimSpec(name="adam"))[0].tables[0]
    saved = F.read_manifest(ckpt)["collections"][0]["tables"][0]
    with pytest.raises(ValueError, match="trained with the rowwise_adagrad optimizer but the plan says adam"):
        _check_fits(CID, t, saved)


def _one_shard(ckpt: Path) -> tuple[Path, dict]:
    table = F.read_manifest(ckpt)["collections"][0]["tables"][0]
    return ckpt / table["files"][0]["path"], table


def test_a_changed_byte_is_refused_as_a_checksum_mismatch(tmp_path):
    spec = SparseOptimSpec(name="rowwise_adagrad")
    ckpt = _save(tmp_path, "row_wise", 2, spec, _full(spec))
    path, table = _one_shard(ckpt)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch.*refusing to load it"):
        load_tables(ckpt)
    t = _servers("row_wise", 2, spec)[0].tables[0]
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        _fill(t, ckpt, table)


def test_a_truncated_file_is_refused(tmp_path):
    spec = SparseOptimSpec(name="sgd")
    ckpt = _save(tmp_path, "table_wise", 1, spec, _full(spec))
    path, _ = _one_shard(ckpt)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="100 bytes, the manifest says"):
        load_tables(ckpt)


def test_a_pickle_payload_in_a_shard_is_refused_even_with_a_matching_checksum(tmp_path):
    spec = SparseOptimSpec(name="rowwise_adagrad")
    ckpt = _save(tmp_path / "c", "row_wise", 2, spec, _full(spec))
    path, table = _one_shard(ckpt)
    marker = tmp_path / "pwned"
    good = torch.load(path, weights_only=True)
    torch.save({**good, "info": tamper.Payload(marker)}, path)
    manifest = json.loads((ckpt / F.MANIFEST).read_text())  # the attacker fixes the manifest too
    rel = table["files"][0]["path"]
    manifest["files"][rel] = F.entry_for(ckpt, path).as_json()
    manifest["collections"][0]["tables"][0]["files"][0].update(manifest["files"][rel])
    (ckpt / F.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="pickled objects.*weights_only=True"):
        load_tables(ckpt)
    t = _servers("row_wise", 2, spec)[0].tables[0]
    with pytest.raises(CheckpointError, match="weights_only=True"):
        _fill(t, ckpt, manifest["collections"][0]["tables"][0])
    assert not marker.exists()


def test_dcp_metadata_is_read_without_plain_pickle(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(3, 2), "b": torch.zeros(2, dtype=torch.float64)},
             "optim": {"param_groups": [{"lr": 0.1, "params": ["w"], "betas": (0.9, 0.99), "foreach": None}]}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dense"), no_dist=True)
    meta = F.load_dcp_metadata(tmp_path / "dense" / ".metadata")
    assert {"model.w", "model.b"} <= set(meta.state_dict_metadata)
    target = {"model": {"w": torch.empty(3, 2), "b": torch.empty(2, dtype=torch.float64)}}
    dcp.load(target, storage_reader=F.safe_dcp_reader(tmp_path / "dense"), no_dist=True)
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    marker = tmp_path / "pwned"
    (tmp_path / "dense" / ".metadata").write_bytes(pickle.dumps(tamper.Payload(marker)))
    with pytest.raises(CheckpointError, match="posix.system is not allowed|system is not allowed"):
        F.load_dcp_metadata(tmp_path / "dense" / ".metadata")
    assert not marker.exists()


def test_a_checkpoint_without_manifest_does_not_exist(tmp_path):
    spec = SparseOptimSpec(name="sgd")
    done = _save(tmp_path, "row_wise", 1, spec, _full(spec))
    partial = F.step_dir(tmp_path, 9)
    (partial / "tables").mkdir(parents=True)
    (partial / "tables" / "x.pt").write_bytes(b"half a file")
    assert F.latest(tmp_path) == done
    assert F.resolve(tmp_path) == done
    with pytest.raises(CheckpointError, match="not a complete checkpoint.*did not finish"):
        Checkpoint(partial)
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nowhere")


def test_prune_keeps_the_newest_and_removes_leftovers(tmp_path):
    for step in (2, 4, 6, 8):
        d = F.step_dir(tmp_path, step)
        F.prepare(d)
        F.write_manifest(d, step=step, files=[])
    F.prepare(F.step_dir(tmp_path, 3))  # a crashed save
    removed = F.prune(tmp_path, 2, current=F.step_dir(tmp_path, 8))
    assert sorted(p.name for p in removed) == ["step_00000002", "step_00000003", "step_00000004"]
    assert [s for s, _ in F.checkpoints(tmp_path)] == [6, 8]


def _steps(root: Path, *steps: int) -> None:
    for step in steps:
        d = F.step_dir(root, step)
        F.prepare(d)
        F.write_manifest(d, step=step, files=[])


@pytest.mark.parametrize("damage", ["not json", "another step", "a step that is text", "a directory", "version"])
def test_a_manifest_that_does_not_read_stops_resume_and_is_never_pruned(tmp_path, damage):
    """A step directory whose manifest is there but does not read as that step's is not a save
    that stopped midway: listing the checkpoints names it instead of passing over it (which
    resumed from an older step and let the next save prune the damaged one)."""
    _steps(tmp_path, 2, 4)
    manifest = F.step_dir(tmp_path, 4) / F.MANIFEST
    doc = json.loads(manifest.read_text())
    if damage == "not json":
        manifest.write_text(manifest.read_text() + "}")
    elif damage == "a directory":
        manifest.unlink()
        manifest.mkdir()
    else:
        doc.update({"another step": {"step": -5}, "a step that is text": {"step": "abc"},
                    "version": {"version": 99}}[damage])
        manifest.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"step_00000004/manifest\.json.*move step_00000004 out of"):
        F.latest(tmp_path)
    _steps(tmp_path, 6)
    removed = F.prune(tmp_path, 1, current=F.step_dir(tmp_path, 6))
    assert [p.name for p in removed] == ["step_00000002"]
    assert manifest.exists()


def test_a_run_refuses_a_checkpoint_dir_whose_checkpoints_it_would_overwrite(tmp_path):
    """A run that does not resume refuses a checkpoint.dir holding any checkpoint (its saves
    would replace or prune them); a resumed one refuses only those after its step. A save that
    stopped midway (no manifest) is not a checkpoint."""
    F.refuse_overwrite(tmp_path / "none", 0, resumed=False)
    F.prepare(F.step_dir(tmp_path, 3))  # a crashed save
    F.refuse_overwrite(tmp_path, 0, resumed=False)
    _steps(tmp_path, 2, 4)
    with pytest.raises(CheckpointError, match="holds step_00000002, step_00000004 of another run, which a run "
                                              "that does not resume would overwrite"):
        F.refuse_overwrite(tmp_path, 0, resumed=False)
    with pytest.raises(CheckpointError, match="holds step_00000004 of another run, which a run resumed at step 2"):
        F.refuse_overwrite(tmp_path, 2, resumed=True)
    F.refuse_overwrite(tmp_path, 4, resumed=True)


def test_export_refuses_an_output_inside_the_checkpoint_or_one_it_cannot_write(tmp_path, monkeypatch):
    from hybrid.checkpoint.export import export

    E = importlib.import_module("hybrid.checkpoint.export")
    monkeypatch.setattr(E, "dense_state_dict", lambda *a, **k: {"dense.w": torch.arange(4.0)})

    spec = SparseOptimSpec(name="sgd")
    ckpt = _save(tmp_path / "ck", "row_wise", 1, spec, _full(spec))
    before = (ckpt / F.MANIFEST).read_bytes()
    with pytest.raises(CheckpointError, match="is inside the checkpoint"):
        export(ckpt, ckpt / F.MANIFEST)
    assert (ckpt / F.MANIFEST).read_bytes() == before
    with pytest.raises(CheckpointError, match="is a directory"):
        export(ckpt, tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="cannot create the output's directory"):
        export(ckpt, tmp_path / "file" / "model.pt")
    long = tmp_path / "out" / ("m" * 250)  # its temporary file's name is too long for the file system
    with pytest.raises(CheckpointError, match=r"export: cannot write .*m{250} \(File name too long\)"):
        export(ckpt, long)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("edit,section", [
    ({"files": None}, "files"), ({"files": {"a": {"size": "1", "sha256": "0"}}}, "files"),
    ({"step": "abc"}, "step"), ({"world": {"trainers": 0, "servers": 1}}, "world"),
    ({"train": {"data": "x"}}, "train.data"), ({"collections": {}}, "collections"),
])
def test_a_manifest_with_a_section_of_another_type_is_refused_naming_it(tmp_path, edit, section):
    """Edited by hand or by a tool (no key), a manifest whose section has another type than a
    save writes is refused, naming the section, before anything reads it."""
    _steps(tmp_path, 4)
    d = F.step_dir(tmp_path, 4)
    doc = json.loads((d / F.MANIFEST).read_text())
    doc.update(edit)
    (d / F.MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=rf"manifest\.json: {re.escape(section)}: got .*the manifest was edited"):
        F.read_manifest(d, key=b"")


@pytest.mark.parametrize("edit,message", [
    ("fewer rows", "fall outside table"), ("more rows", "is in no saved file"), ("a part's rows", "holds"),
])
def test_a_manifest_whose_tables_disagree_with_their_files_is_refused(tmp_path, edit, message):
    """Edited without a key, so every file still matches its checksum: a table's row count or a
    part's rows that disagree with what the files hold are refused, never read past or left as
    uninitialized memory."""
    from hybrid.checkpoint.export import table_rows

    spec = SparseOptimSpec(name="sgd")
    ckpt = _save(tmp_path, "row_wise", 2, spec, _full(spec))
    doc = json.loads((ckpt / F.MANIFEST).read_text())
    t = doc["collections"][0]["tables"][0]
    if edit == "fewer rows":
        t["num_embeddings"] //= 2
    elif edit == "more rows":
        t["num_embeddings"] *= 2
    else:
        a, b = t["files"][0]["rows"]
        t["files"][0]["rows"] = [a, b - 1]
    (ckpt / F.MANIFEST).write_text(json.dumps(doc))
    # named by its path from here, not from inside the checkpoint
    where = re.escape(str(ckpt / (F.MANIFEST if edit == "more rows" else t["files"][0]["path"])))
    with pytest.raises(CheckpointError, match=f"^{where}: .*{message}.*the manifest was edited"):
        load_tables(ckpt, F.read_manifest(ckpt, key=b""))
    with pytest.raises(CheckpointError, match=f"^{where}: .*{message}.*the manifest was edited"):
        table_rows(ckpt, t, 0, t["num_embeddings"])


def test_manifest_is_replaced_atomically(tmp_path):
    F.write_manifest(tmp_path, step=1, files=[F.FileEntry("a", 1, "00")])
    F.write_manifest(tmp_path, step=2, files=[])
    assert F.read_manifest(tmp_path)["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == [F.MANIFEST]  # no temp file left


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    import numpy as np

    F.save_tensors(capture_rng(), tmp_path / "rng.pt")
    want = (torch.rand(3), random.random(), np.random.rand())
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]


def _dense_checkpoint(root: Path) -> dict:
    """A DCP ``dense`` directory like the trainers write: model tensors and optimizer byte items."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(3, 2)},
             "optim": {"param_groups": [{"lr": 0.1, "params": ["w"], "betas": (0.9, 0.99)}]}}
    dcp.save(state, checkpoint_id=str(root / "dense"), no_dist=True)
    return state


def _load_dense(root: Path, planner) -> dict:
    import torch.distributed.checkpoint as dcp

    target = {"model": {"w": torch.empty(3, 2)}, "optim": {"param_groups": [{"lr": 0.0, "params": ["w"],
                                                                              "betas": (0.0, 0.0)}]}}
    dcp.load(target, storage_reader=F.safe_dcp_reader(root / "dense"), planner=planner, no_dist=True)
    return target


def test_dcp_byte_items_load_as_plain_data(tmp_path):
    state = _dense_checkpoint(tmp_path)
    got = _load_dense(tmp_path, F.safe_load_planner())
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    assert got["optim"]["param_groups"][0]["lr"] == 0.1 and got["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)


@pytest.mark.parametrize("fqn", ["optim.param_groups.0.lr", "model.w"])
def test_a_payload_in_a_dcp_item_runs_under_dcp_but_not_under_hybrid(tmp_path, fqn):
    """``model.w``: a tensor re-declared as a byte item. DCP's own planner runs the payload (the
    tampering works); hybrid's refuses the item and runs nothing."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    _dense_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    tamper.dcp_item(tmp_path / "dense", fqn, marker)
    with pytest.raises(BaseException) as caught:  # DCP wraps it in its CheckpointException (a BaseException)
        _load_dense(tmp_path, F.safe_load_planner())
    inner = F.unwrap_dcp_error(caught.value)
    assert isinstance(inner, CheckpointError) and fqn in str(inner) and "weights_only=True" in str(inner), caught.value
    assert not marker.exists()
    try:
        _load_dense(tmp_path, DefaultLoadPlanner())
    except BaseException:  # noqa: BLE001 - the payload's return value is no optimizer value
        pass
    assert marker.exists(), "the tampered item did not reach DCP's unpickler: this test would prove nothing"


def _signed(tmp_path: Path, key: bytes | None) -> Path:
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    F.save_tensors({"x": torch.ones(2)}, ckpt / "a.pt")
    F.write_manifest(ckpt, step=1, files=[F.entry_for(ckpt, ckpt / "a.pt")], key=key)
    return ckpt


def test_a_signed_manifest_verifies_with_its_key_only(tmp_path, monkeypatch):
    monkeypatch.delenv(F.KEY_ENV, raising=False)
    ckpt = _signed(tmp_path, b"secret")
    assert F.read_manifest(ckpt, key=b"secret")["step"] == 1
    assert F.read_manifest(ckpt)["step"] == 1  # no key: not verified (docs/security.md says so)
    with pytest.raises(CheckpointError, match="does not verify"):
        F.read_manifest(ckpt, key=b"other")
    monkeypatch.setenv(F.KEY_ENV, "other")
    with pytest.raises(CheckpointError, match="does not verify"):
        Checkpoint(ckpt)


def test_a_manifest_rewritten_without_the_key_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(F.KEY_ENV, raising=False)
    ckpt = _signed(tmp_path, b"secret")
    F.save_tensors({"x": torch.zeros(2)}, ckpt / "a.pt")  # the attacker changes a file ...
    tamper.refresh_manifest(ckpt)  # ... and fixes its size and checksum in the manifest
    F.read_manifest(ckpt)  # without a key, the manifest is only checked for accidents
    with pytest.raises(CheckpointError, match="does not verify"):
        F.read_manifest(ckpt, key=b"secret")
    doc = json.loads((ckpt / F.MANIFEST).read_text())
    del doc["signature"]  # removing the signature does not help either
    (ckpt / F.MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="not signed"):
        F.read_manifest(ckpt, key=b"secret")


def test_the_key_comes_from_the_key_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(F.KEY_ENV, "from-env")
    assert F.checkpoint_key() == b"from-env"
    (tmp_path / "key").write_text("from-file\n")
    assert F.checkpoint_key(tmp_path / "key") == b"from-file"
    with pytest.raises(CheckpointError, match="cannot read"):
        F.checkpoint_key(tmp_path / "missing")
    (tmp_path / "empty").write_text("")
    with pytest.raises(CheckpointError, match="is empty"):
        F.checkpoint_key(tmp_path / "empty")
    monkeypatch.delenv(F.KEY_ENV)
    assert F.checkpoint_key() is None


def test_a_dynamic_table_that_trained_on_loads_the_checkpoint_and_nothing_else(tmp_path):
    """A checkpoint loaded into a dynamic table that has trained since (one run evaluating or
    rolling back to several checkpoints) holds the saved rows, map and sightings only, and
    trains on exactly as a fresh table loaded from it."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from hybrid.checkpoint.server_io import _fill_dynamic, _write_dynamic
    from hybrid.ps.client.routing import Router
    from hybrid.ps.config import DynamicIds

    dynamic = DynamicIds(capacity=8, evict="lru", partitions=2, admit_after=2)
    config = CollectionConfig(cid=CID, tables=(TableSpec("a", 100, 4, ("fa",)),),
                              layouts=tuple(shard_tables([TableSpec("a", 100, 4, ("fa",))], 1, "row_wise")),
                              optimizer=SparseOptimSpec(name="adam", lr=0.1), num_trainers=1, dynamic=dynamic)
    router = Router(config)

    def train(shard: CollectionShard, step: int, ids: list[int]) -> None:
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["fa"], values=torch.tensor(ids), lengths=torch.tensor([len(ids)]))
        routed = router.route(kjt, where="test")
        rows = shard.gather(routed.requests[0], step=step).clone().requires_grad_(True)
        router.pool(routed, {0: rows}).sum().backward()
        shard.push(0, step, [(routed.requests[0], rows.grad)])

    def state(shard: CollectionShard) -> dict[str, torch.Tensor]:
        d = shard.tables[0].dynamic_rows()
        del d["slots"]
        return d

    live = CollectionShard(config, 0, start_step=0, huge_pages=False)
    for s in range(4):
        train(live, s, [1, 2, 3, 4, 5, 6, 100 + s])  # 100..103: seen once, without a row
    saved = state(live)
    src = {"dynamic": {"capacity": 8, "partitions": 2}, "files": _write_dynamic(live, live.tables[0], tmp_path, 4)}
    for s in range(4, 8):
        train(live, s, [10, 11, 12, 13, 14, 15, 16, 17, 100 + s])  # every row evicted, other sightings
    fresh = CollectionShard(config, 0, start_step=4, huge_pages=False)
    for shard in (live, fresh):
        _fill_dynamic(shard.tables[0], tmp_path, src)
        shard.complete_through = 3
        got = state(shard)
        assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved), shard
        assert shard.tables[0].dynamic.count.tolist() == torch.bincount(saved["part"], minlength=2).tolist()
    for s in range(4, 8):
        for shard in (live, fresh):
            train(shard, s, [1, 2, 7, 100, 101, 200 + s])
    a, b = state(live), state(fresh)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("part_bytes", [None, 200], ids=["one file", "parts"])
def test_dynamic_tables_export_ascending_by_id_whole_or_in_parts(tmp_path, monkeypatch, part_bytes):
    """Two servers' dynamic shards, each saved in files of a few rows: the export holds every
    id and row once, ascending by id, in one file or -- over ``part_bytes`` -- in parts of at
    most that many bytes each, merged from the servers' files without reading a table whole."""
    import dataclasses
    import json as _json

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    import importlib

    from hybrid.checkpoint import server_io
    from hybrid.checkpoint.export import export, export_state_dict, load_export
    from hybrid.ps.client.routing import Router
    from hybrid.ps.config import DynamicIds

    monkeypatch.setattr(server_io, "PART_BYTES", 64)  # a few rows a saved file
    monkeypatch.setattr(importlib.import_module("hybrid.checkpoint.export"), "dense_state_dict", lambda *a, **k: {})
    spec = DynamicIds(capacity=64, evict="lru", partitions=8)
    table = TableSpec("a", 100, 3, ("fa",))
    config = CollectionConfig(cid=CID, tables=(table,), layouts=tuple(shard_tables([table], 2, "row_wise")),
                              optimizer=SparseOptimSpec(name="sgd", lr=0.5), num_trainers=1, dynamic=spec)
    router = Router(config)
    shards = [CollectionShard(config, s, start_step=0, huge_pages=False) for s in range(2)]
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        ids = torch.randint(-(1 << 62), 1 << 62, (20,), generator=g)
        routed = router.route(KeyedJaggedTensor.from_lengths_sync(keys=["fa"], values=ids, lengths=torch.tensor([20])),
                              where="test")
        for s, request in routed.requests.items():
            rows = shards[s].gather(request, step=step)
            shards[s].push(0, step, [(request, torch.ones_like(rows))])
    parts = [t.dynamic_rows() for shard in shards for t in shard.tables]
    ids = torch.cat([p["ids"] for p in parts])
    order = torch.argsort(ids)
    want_ids, want_rows = ids[order], torch.cat([p["rows"] for p in parts])[order]
    n = want_ids.numel()
    assert n > 40 and all(p["ids"].numel() for p in parts)
    ckpt = F.step_dir(tmp_path / "ck", 5)
    F.prepare(ckpt)
    written = [f for shard in shards for f in server_io._write_shards(shard, ckpt, 5)]
    assert len(written) > 4
    for f in written:
        f.pop("table")
    key = "ebc.embedding_bags.a.weight"
    F.write_manifest(ckpt, step=5, files=[F.FileEntry(f["path"], f["size"], f["sha256"]) for f in written],
                     collections=[{"cid": CID, "fqn": "ebc", "tables": [
                         {"name": "a", "key": key, "num_embeddings": 100, "embedding_dim": 3, "sharding": "row_wise",
                          "num_shards": 2, "servers": [0, 1], "optimizer": "sgd", "dynamic": dataclasses.asdict(spec),
                          "files": sorted(written, key=lambda f: (f["shard"], f["rows"][0]))}]}])
    state = export_state_dict(ckpt)
    assert torch.equal(state["ebc.embedding_bags.a.ids"], want_ids) and torch.equal(state[key], want_rows)
    out = tmp_path / "export" / "model.pt"
    done = export(ckpt, out, **({} if part_bytes is None else {"part_bytes": part_bytes}))
    assert done["values"] == n * 4
    got = load_export(out)
    assert list(got) == ["ebc.embedding_bags.a.ids", key]
    assert torch.equal(got["ebc.embedding_bags.a.ids"], want_ids) and torch.equal(got[key], want_rows)
    if part_bytes is None:
        assert done["files"] == ["model.pt"]
        return
    index = _json.loads((tmp_path / "export" / "model.pt.index.json").read_text())
    files = index["tables"][key]
    assert len(files) == -(-n // (200 // (4 * 3 + 8))) and index["tables"]["ebc.embedding_bags.a.ids"] == files
    for p in files:
        part = torch.load(tmp_path / "export" / p["file"], weights_only=True)
        assert part[key].shape[0] == p["rows"][1] - p["rows"][0] <= 200 // (4 * 3 + 8)


@pytest.mark.parametrize("part_bytes, writes_before", [(None, 0), (200, 0), (200, 3)],
                         ids=["one file", "parts: at the first", "parts: at the fourth"])
def test_an_interrupted_export_leaves_the_earlier_export_as_it_was(tmp_path, monkeypatch, part_bytes, writes_before):
    """Ctrl-C while an export writes (after ``writes_before`` whole files, halfway through the
    next) removes every file it wrote, the partial one included, and leaves the export an earlier
    run wrote to the same name as it was, whole in one file or in parts."""
    E = importlib.import_module("hybrid.checkpoint.export")  # the package's ``export`` is the function
    monkeypatch.setattr(E, "dense_state_dict", lambda *a, **k: {"dense.w": torch.arange(4.0)})
    spec = SparseOptimSpec(name="sgd")
    kw = {} if part_bytes is None else {"part_bytes": part_bytes}
    out = tmp_path / "export" / "model.pt"
    E.export(_save(tmp_path / "ck1", "row_wise", 1, spec, _full(spec)), out, **kw)
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    assert len(before) == (1 if part_bytes is None else 6)
    state = E.load_export(out)
    full = {name: (w + 1, st) for name, (w, st) in _full(spec).items()}  # another checkpoint
    ckpt = _save(tmp_path / "ck2", "row_wise", 1, spec, full)
    calls = []
    save = F.save_tensors

    def interrupted(tensors, path):
        calls.append(path)
        if len(calls) > writes_before:
            path.write_bytes(b"partial")
            raise KeyboardInterrupt
        save(tensors, path)

    monkeypatch.setattr(F, "save_tensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        E.export(ckpt, out, **kw)
    assert len(calls) == writes_before + 1
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before
    got = E.load_export(out)
    assert list(got) == list(state) and all(torch.equal(got[k], state[k]) for k in state)
    monkeypatch.setattr(F, "save_tensors", save)
    E.export(ckpt, out, **kw)  # the same export, not interrupted, replaces it
    got = E.load_export(out)
    assert all(torch.equal(got[f"ebc.embedding_bags.{t}.weight"], w) for t, (w, _) in full.items())


def test_ctrl_c_in_hybrid_export_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    """``hybrid export`` interrupted (Ctrl-C while its file is written) says so in one line, with no
    traceback, exits 130 as a shell would, and leaves no file of its own behind."""
    from hybrid.cli import main

    E = importlib.import_module("hybrid.checkpoint.export")
    monkeypatch.setattr(E, "dense_state_dict", lambda *a, **k: {"dense.w": torch.arange(4.0)})
    spec = SparseOptimSpec(name="sgd")
    ckpt = _save(tmp_path / "ck", "row_wise", 1, spec, _full(spec))
    calls = []
    save = F.save_tensors

    def interrupted(tensors, path):
        calls.append(path)
        path.write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(F, "save_tensors", interrupted)
    assert main(["export", str(ckpt), str(tmp_path / "out" / "model.pt")]) == 130
    err = capsys.readouterr().err
    assert err == "hybrid export: interrupted\n"
    assert len(calls) == 1 and list((tmp_path / "out").iterdir()) == []
