"""Initial rows made lazily (``hybrid.ps.server.lazy``), on ``CollectionShard``s built in this
process (no RPC, no background thread): lookups, every optimizer's steps, a checkpoint saved while
most blocks wait and one loaded into a waiting table, given rows written, and the fill, each
against a shard whose rows were all made at creation."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from hybrid import ops
from hybrid.checkpoint import files as F
from hybrid.checkpoint.server_io import _fill, _write_shards
from hybrid.ps.config import CollectionConfig, OptimizerSpec
from hybrid.ps.protocol import Rows
from hybrid.ps.server.lazy import BLOCK_ROWS, LazyRows
from hybrid.ps.server.memory import table_tensor
from hybrid.ps.server.shard import CollectionShard
from hybrid.ps.sharding import TableSpec, shard_tables

# 5000 and 333 rows: many blocks, neither a multiple of the block nor of 2 or 3 servers.
TABLES = [TableSpec("a", 5000, 4, ("fa",)), TableSpec("b", 333, 3, ("fb",))]
SEED = 11
OPTIMIZERS = [OptimizerSpec(name="sgd", lr=0.1), OptimizerSpec(name="adagrad", lr=0.1, initial_accumulator_value=0.25),
              OptimizerSpec(name="rowwise_adagrad", lr=0.1), OptimizerSpec(name="adam", lr=0.01)]
LAYOUTS = [(s, n) for s in ("table_wise", "row_wise") for n in (1, 2, 3)]


def _servers(spec: OptimizerSpec, sharding: str, num_servers: int, *, lazy: bool, num_trainers: int = 1,
             storage_dtype: str = "float32") -> list[CollectionShard]:
    config = CollectionConfig(cid="ebc", tables=tuple(TABLES),
                              layouts=tuple(shard_tables(TABLES, num_servers, sharding)), optimizer=spec,
                              num_trainers=num_trainers, init_seed=SEED, storage_dtype=storage_dtype)
    shards = [CollectionShard(config, s, start_step=0, huge_pages=True, init="seed" if lazy else None)
              for s in range(num_servers)]
    if not lazy:
        for shard in shards:
            for t in shard.tables:
                t.initialize(SEED)  # every row now, as servers made them before
    return shards


def _ids(shard: CollectionShard, seed: int, n: int = 20) -> Rows:
    """Distinct, ascending local rows of every table this server holds."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randperm(t.rows, generator=g)[: min(n, t.rows)].sort().values for t in shard.tables]
    return Rows(list(shard.held), [i.numel() for i in ids], torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64))


def _state(shard: CollectionShard) -> list[torch.Tensor]:
    with shard.lock:
        for t in shard.tables:
            t.ensure_range(0, t.rows)
        return [x.clone() for t in shard.tables for x in (t.weight, *t.optim.state.values())]


@pytest.mark.parametrize("sharding,num_servers", LAYOUTS)
def test_lookups_of_never_touched_rows_equal_the_rows_made_at_creation(sharding, num_servers):
    lazy = _servers(OPTIMIZERS[0], sharding, num_servers, lazy=True)
    eager = _servers(OPTIMIZERS[0], sharding, num_servers, lazy=False)
    for a, b in zip(lazy, eager):
        rows = _ids(a, seed=a.server)
        assert torch.equal(a.gather(rows), b.gather(rows))
        # Only the blocks the ids fall in were made.
        for t, ids in zip(a.tables, rows.ids.split(rows.counts)):
            made = ~t.lazy.pending
            assert torch.equal(made.nonzero().flatten(), torch.unique(ids // BLOCK_ROWS))
            assert not t.lazy.done or t.lazy.blocks <= ids.numel()
    for a, b in zip(lazy, eager):
        assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))


def test_bfloat16_tables_make_the_same_rounded_rows():
    lazy = _servers(OPTIMIZERS[2], "row_wise", 2, lazy=True, storage_dtype="bfloat16")
    eager = _servers(OPTIMIZERS[2], "row_wise", 2, lazy=False, storage_dtype="bfloat16")
    for a, b in zip(lazy, eager):
        assert torch.equal(a.gather(_ids(a, 3)), b.gather(_ids(b, 3)))
        assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))


@pytest.mark.parametrize("spec", OPTIMIZERS, ids=[s.name for s in OPTIMIZERS])
def test_steps_of_every_optimizer_equal_those_on_rows_made_at_creation(spec):
    # Two trainers: sync steps sum their pushes first (plain SGD adds each push); the pushes come
    # without lookups, so the update is the first to touch its rows.
    lazy = _servers(spec, "row_wise", 2, lazy=True, num_trainers=2)
    eager = _servers(spec, "row_wise", 2, lazy=False, num_trainers=2)
    for a, b in zip(lazy, eager):
        for step in range(3):
            for trainer in range(2):
                rows = _ids(a, seed=100 * step + 10 * trainer + a.server, n=5)
                grad = torch.randn(a.numel(rows), generator=torch.Generator().manual_seed(step + trainer))
                a.push(trainer, step, [(rows, grad)])
                b.push(trainer, step, [(rows, grad)])
        assert any(not t.lazy.done for t in a.tables)
        assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))


@pytest.mark.parametrize("spec", [OPTIMIZERS[1], OPTIMIZERS[3]], ids=["adagrad", "adam"])
def test_a_checkpoint_saved_while_most_blocks_wait_equals_the_eager_one(tmp_path: Path, spec):
    lazy = _servers(spec, "row_wise", 2, lazy=True)
    eager = _servers(spec, "row_wise", 2, lazy=False)
    for i, (a, b) in enumerate(zip(lazy, eager)):
        rows = _ids(a, seed=i)
        assert torch.equal(a.gather(rows), b.gather(rows))
        before = sum(t.lazy.left for t in a.tables)
        assert before > sum(t.lazy.blocks for t in a.tables) // 2
        saved_a = _write_shards(a, tmp_path / "lazy", step=1)
        saved_b = _write_shards(b, tmp_path / "eager", step=1)
        assert [f["rows"] for f in saved_a] == [f["rows"] for f in saved_b]
        for fa, fb in zip(saved_a, saved_b):
            da = F.load_tensors(tmp_path / "lazy", F.FileEntry(fa["path"], fa["size"], fa["sha256"]))
            db = F.load_tensors(tmp_path / "eager", F.FileEntry(fb["path"], fb["size"], fb["sha256"]))
            assert torch.equal(da["weight"], db["weight"])
            assert all(torch.equal(da["state"][k], db["state"][k]) for k in db["state"])


def _manifest_entry(shards: list[CollectionShard], saved: list[list[dict]], name: str, spec: OptimizerSpec) -> dict:
    t0 = next(t for t in shards[0].tables if t.name == name)
    lay = t0.layout
    files = [f for per in saved for f in per if f["table"] == name]
    return {"name": name, "num_embeddings": lay.table.num_embeddings, "embedding_dim": lay.table.embedding_dim,
            "sharding": lay.sharding, "num_shards": lay.num_shards, "optimizer": spec.name,
            "files": sorted(files, key=lambda f: (f["shard"], f["rows"][0]))}


def test_a_load_into_a_waiting_table_marks_its_blocks_made_and_reshards(tmp_path: Path):
    spec = OPTIMIZERS[1]
    src = _servers(spec, "row_wise", 2, lazy=False)
    for shard in src:  # values that are not the initial ones
        for t in shard.tables:
            t.weight.normal_()
            t.optim.state["sum"].uniform_()
    saved = [_write_shards(shard, tmp_path, step=4) for shard in src]
    want = {t.name: t for t in src[0].tables}
    dst = _servers(spec, "table_wise", 1, lazy=True)[0]
    with dst.lock:
        for t in dst.tables:
            _fill(t, tmp_path, _manifest_entry(src, saved, t.name, spec))
            assert t.lazy.done
    got = {t.name: t for t in dst.tables}
    # Global row r of a 2-server row-wise table is local row r // 2 of server r % 2.
    for name, t in got.items():
        for shard in src:
            s = next(x for x in shard.tables if x.name == name)
            glob = s.global_ids(torch.arange(s.rows))
            assert torch.equal(t.weight[glob], s.weight)
            assert torch.equal(t.optim.state["sum"][glob], s.optim.state["sum"])
    assert want


def test_loaded_rows_of_part_of_a_block_leave_its_other_rows_their_initial_values():
    b = BLOCK_ROWS
    n = 3 * b + 2
    weight = torch.full((n, 2), float("nan"))
    state = torch.full((n,), float("nan"))
    lazy = LazyRows(weight, {"sum": (state, 0.5)}, lambda rows, out: out.copy_(rows.float().unsqueeze(1).expand_as(out)),
                    huge_pages=False)
    lo, hi = b // 2, b + b // 2  # all of no block: part of block 0 and part of block 1
    rows = torch.arange(lo, hi)
    weight[rows] = -1.0
    state[rows] = -2.0
    lazy.loaded(rows)
    assert lazy.pending.tolist() == [False, False, True, True]
    assert torch.equal(weight[:lo, 0], torch.arange(float(lo)))
    assert torch.equal(weight[hi : 2 * b, 0], torch.arange(float(hi), 2 * b))
    assert bool((weight[lo:hi] == -1).all()) and bool((state[lo:hi] == -2).all())
    assert bool((state[:lo] == 0.5).all()) and bool((state[hi : 2 * b] == 0.5).all())
    assert bool(weight[2 * b :].isnan().all())  # still waiting: untouched


def test_rows_overwritten_whole_are_not_made_first_and_edges_are():
    made = []

    def values(rows, out):
        made.append(rows.clone())
        out.copy_(rows.float().unsqueeze(1).expand_as(out))

    b = BLOCK_ROWS
    n = 4 * b + b // 2
    weight = torch.full((n, 2), float("nan"))
    state = torch.full((n,), float("nan"))
    lazy = LazyRows(weight, {"sum": (state, 0.0)}, values, huge_pages=False)
    start, stop = b // 2, 3 * b + b // 2
    lazy.overwrite(start, stop)  # block 0 and block 3 partly, blocks 1 and 2 whole
    weight[start:stop] = -1.0
    assert torch.equal(torch.cat(made).sort().values, torch.cat([torch.arange(0, b), torch.arange(3 * b, 4 * b)]))
    assert lazy.pending.tolist() == [False, False, False, False, True]
    assert torch.equal(weight[:start, 0], torch.arange(float(start)))
    assert torch.equal(weight[stop : 4 * b, 0], torch.arange(float(stop), 4 * b))
    assert bool((state[: 4 * b] == 0).all()) and bool(state[4 * b :].isnan().all())


def test_the_background_fill_makes_every_row_and_skips_made_ones():
    spec = OPTIMIZERS[1]
    lazy = _servers(spec, "table_wise", 1, lazy=True)[0]
    eager = _servers(spec, "table_wise", 1, lazy=False)[0]
    rows = _ids(lazy, seed=5)
    grad = torch.randn(lazy.numel(rows))
    for s in (lazy, eager):
        s.push(0, 0, [(rows, grad)])  # rows that changed: the fill must not make them again
    lock = threading.RLock()
    for t in lazy.tables:
        t.lazy.fill_blocks = 2  # several parts per table
        parts = 0
        while t.lazy.fill_next(lock):
            parts += 1
        assert t.lazy.done and (parts >= 2 or t.name != "a")
    assert all(torch.equal(x, y) for x, y in zip([x.clone() for t in lazy.tables for x in (t.weight, *t.optim.state.values())],
                                                  _state(eager)))


def test_populate_keeps_what_memory_holds():
    t = table_tensor(1 << 20, 4, huge_pages=True, defer_huge_pages=True)  # 16 MiB, mapped, not advised
    t[:100] = 3.0
    t[-100:] = 5.0
    for huge in (False, True):
        ops.populate_(t[1000:300_000], huge_pages=huge, collapse=huge)
        ops.populate_(t, huge_pages=huge)
    assert bool((t[:100] == 3).all()) and bool((t[-100:] == 5).all()) and bool((t[100:-100] == 0).all())
