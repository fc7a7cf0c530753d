"""The sequential example without processes: its data (synthetic sequences, sequence files with
truncation, held-out last items and file:line errors), its model and its task's metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hybrid
from hybrid.data import DataConfig, make_dataset
from hybrid.data.sequences import SUCCESSORS, SyntheticSequences
from hybrid.errors import InputError
from recsys_examples.sequential import SequentialTask, build_sequential, ndcg, ranks_of, sequential

SMALL = {"num_items": 50, "embedding_dim": 8, "max_len": 5, "num_blocks": 2, "num_heads": 2, "ffn_mult": 2}


def _schema(**kw):
    return sequential.data_schema(build_sequential(**{**SMALL, **kw}, device="meta"))


def _bags(batch, feature):
    jt = batch.sparse[feature]
    return [v.tolist() for v in torch.split(jt.values(), jt.lengths().tolist())]


def test_schema_reads_items_negatives_and_optional_actions():
    assert _schema().features == ["item", "negative"]
    s = _schema(num_actions=3)
    assert s.features == ["item", "negative", "action"] and s.num_embeddings == [50, 50, 3] and s.task == "sequence"


def test_synthetic_sequences_follow_the_transition_matrix():
    cfg = DataConfig(batch_size=256, max_len=10, num_negatives=2, zipf_alpha=1.0)
    data = SyntheticSequences(_schema(), cfg)
    batch = next(iter(data))
    seqs = _bags(batch, "item")
    assert all(2 <= len(s) <= 11 for s in seqs) and len(set(map(len, seqs))) > 3
    assert all(len(b) == 2 for b in _bags(batch, "negative"))
    pairs = [(a, b) for s in seqs for a, b in zip(s, s[1:])]
    succ = data.successors(torch.tensor([a for a, _ in pairs]))
    follows = sum(b in row for (_, b), row in zip(pairs, succ.tolist())) / len(pairs)
    assert follows > 0.75, follows  # 1 - NOISE, plus fresh draws that land on a successor
    assert succ.shape[1] == SUCCESSORS
    # A trainer draws only its own sequences: the slice the whole global batch has there.
    W, B = 16, 4
    small = DataConfig(batch_size=B, max_len=10, num_negatives=2, seed=5)
    for split in ("train", "eval"):
        mine = next(iter(SyntheticSequences(_schema(num_actions=3), small, rank=5, world_size=W, split=split)))
        whole = SyntheticSequences(_schema(num_actions=3), dataclasses.replace(small, batch_size=W * B),
                                   split=split).global_batch(0)
        ours = SyntheticSequences(_schema(num_actions=3), small, world_size=W, split=split).global_batch(0)
        for f in ("item", "negative", "action"):
            # Held-out negatives are the catalog in the first bag of each trainer's batch.
            want = (ours if split == "eval" and f == "negative" else whole)
            assert _bags(mine, f) == _bags(want, f)[5 * B : 6 * B], (split, f)
    # Evaluation: the whole catalog is the candidate pool of each trainer's batch.
    ev = next(iter(SyntheticSequences(_schema(), cfg, split="eval", rank=1, world_size=2)))
    negs = _bags(ev, "negative")
    assert negs[0] == list(range(50)) and not any(negs[1:])


def test_model_outputs_one_query_per_target_and_a_distinct_pool():
    model = hybrid.materialize(build_sequential(**SMALL, device="meta"), seed=0)
    schema = sequential.data_schema(model)
    cfg = DataConfig(batch_size=8, max_len=5, num_negatives=3)
    batch = next(iter(make_dataset(schema, cfg, split="train")))
    out = model(batch.dense, batch.sparse)
    lengths = batch.sparse["item"].lengths()
    assert out.queries.shape == (int((lengths - 1).sum()), 8)
    assert torch.equal(out.pool_ids, torch.unique(torch.cat([out.targets, batch.sparse["negative"].values()])))
    assert torch.equal(out.pool_ids[out.target_index], out.targets)
    assert torch.equal(out.targets[out.last], torch.tensor([s[-1] for s in _bags(batch, "item")]))
    task = SequentialTask()
    loss = task.loss(out, batch)
    loss.backward()
    assert loss.item() > 0 and model.encoder.blocks[0].qkv.weight.grad.abs().sum() > 0


def test_causal_a_position_sees_only_earlier_items():
    model = hybrid.materialize(build_sequential(**SMALL, device="meta"), seed=0).eval()
    schema = sequential.data_schema(model)
    from hybrid.data.sequences import sequence_batch

    a = sequence_batch(schema, [[1, 2, 3, 4]], None, [[]])
    b = sequence_batch(schema, [[1, 2, 9, 4]], None, [[]])
    qa, qb = model(a.dense, a.sparse).queries, model(b.dense, b.sparse).queries
    torch.testing.assert_close(qa[:2], qb[:2])  # positions 0, 1 read items 1, 2 only
    assert not torch.allclose(qa[2], qb[2])


def test_ranks_ties_and_ndcg():
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0]])
    assert ranks_of(scores, torch.tensor([2.0])).item() == 1.5  # one above, one tie
    assert ranks_of(torch.zeros(1, 10), torch.tensor([0.0])).item() == 4.5  # all tied: the middle
    torch.testing.assert_close(ndcg(torch.tensor([0.0, 1.0, 10.0]), 10),
                               torch.tensor([1.0, 1 / torch.log2(torch.tensor(3.0)).item(), 0.0]))


def test_popularity_baseline_ranks_by_training_counts():
    task = SequentialTask(k=2)
    model = hybrid.materialize(build_sequential(**SMALL, device="meta"), seed=0)
    schema = sequential.data_schema(model)
    from hybrid.data.sequences import sequence_batch

    train = sequence_batch(schema, [[7, 7, 7, 3], [7, 3]], None, [[1], [2]])
    task.loss(model(train.dense, train.sparse), train)  # counts: 7 x4, 3 x2
    ev = sequence_batch(schema, [[1, 7], [1, 3], [1, 5]], None, [list(range(50)), [], []])
    with torch.no_grad():
        out = task.eval_outputs(model(ev.dense, ev.sparse), ev)
    assert out["popularity_recall@2"].tolist() == [1.0, 1.0, 0.0]
    assert out["candidates"].tolist() == [50.0] * 3


def _write(tmp_path, text, name="seq.csv"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_csv_reader_truncates_holds_out_the_last_item_and_sorts_by_time(tmp_path):
    path = _write(tmp_path, "user,items,ts\nu1,1|2|3|4|5|6|7|8,1|2|3|4|5|6|7|8\nu2,9|8|7,30|10|20\nu3,4|5,1|2\n")
    cfg = DataConfig(source="csv", train_paths=[path], batch_size=3, max_len=3, timestamps_column="ts", drop_last=False)
    train = list(make_dataset(_schema(), cfg, split="train"))
    # u1: 7 items without the held-out 8, newest max_len + 1 kept; u2 ordered by time (8, 7, 9)
    # without 9; u3 has one item left: too short.
    assert _bags(train[0], "item") == [[4, 5, 6, 7], [8, 7]]
    ev = list(make_dataset(_schema(), cfg, split="eval"))
    assert _bags(ev[0], "item") == [[5, 6, 7, 8], [8, 7, 9], [4, 5]]
    assert _bags(ev[0], "negative")[0] == list(range(50))


@pytest.mark.parametrize("row, message", [
    ("u1,1|x|3,", "seq.csv:3: column 'items': 'x' is not an item id (an integer in [0, 50))"),
    ("u1,1|2|99,", "seq.csv:3: column 'items': '99' is not an item id"),
    ("u1,1|2|3,1|2", "seq.csv:3: column 'ts': 2 values for 3 items"),
])
def test_a_bad_row_names_file_and_line(tmp_path, row, message):
    path = _write(tmp_path, f"user,items,ts\nu0,1|2|3,1|2|3\n{row}\n")
    cfg = DataConfig(source="csv", train_paths=[path], batch_size=1, timestamps_column="ts")
    with pytest.raises(InputError, match=message.replace("|", r"\|").replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        list(make_dataset(_schema(), cfg, split="train"))
    skip = dataclasses.replace(cfg, malformed="skip")
    reader = make_dataset(_schema(), skip, split="eval")
    assert len(list(reader)) == 1 and reader.counts["malformed"] == 1


def test_a_missing_column_is_named(tmp_path):
    path = _write(tmp_path, "user,history\nu0,1|2|3\n")
    cfg = DataConfig(source="csv", train_paths=[path], batch_size=1)
    with pytest.raises(InputError, match=r"no column 'items' \(data.items_column\)"):
        make_dataset(_schema(), cfg, split="train").check_files()


def test_parquet_reader_reads_list_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "seq.parquet")
    pq.write_table(pa.table({"user": [1, 2], "items": [[1, 2, 3], [4, 5, 6, 7]], "act": [[0, 1, 2], [2, 2, 1, 0]]}), path)
    cfg = DataConfig(source="parquet", train_paths=[path], batch_size=2, actions_column="act")
    batch = next(iter(make_dataset(_schema(num_actions=3), cfg, split="train")))
    assert _bags(batch, "item") == [[1, 2], [4, 5, 6]] and _bags(batch, "action") == [[0, 1], [2, 2, 1]]


def test_file_negatives_do_not_depend_on_the_split(tmp_path):
    path = _write(tmp_path, "user,items\n" + "".join(f"u{i},{i}|{i + 1}|{i + 2}|{i + 3}\n" for i in range(8)))
    cfg = DataConfig(source="csv", train_paths=[path], batch_size=2, num_negatives=3)
    whole = next(iter(make_dataset(_schema(), dataclasses.replace(cfg, batch_size=4), split="train")))
    for r in range(2):
        part = next(iter(make_dataset(_schema(), cfg, split="train", rank=r, world_size=2)))
        assert _bags(part, "negative") == _bags(whole, "negative")[2 * r:2 * r + 2]
        assert _bags(part, "item") == _bags(whole, "item")[2 * r:2 * r + 2]


def test_seeded_fuzz_parquet_sequences_bulk_equals_row_parse(tmp_path):
    """SequenceParquetReader converts a record batch a column at a time when every cell is
    certainly good, else parses row by row (the reference, which names a bad row): on random
    tables (list or text columns, nulls, empty and short rows, timestamps with ties, ids out of
    range, lists of unequal lengths) the bulk records, wherever taken, equal the row parse's,
    short rows counted alike; clean tables always go in bulk."""
    import random

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from hybrid.data.sequences import SequenceParquetReader

    taken = 0
    for seed in range(150):
        rng = random.Random(seed)
        n, clean = rng.randrange(1, 30), seed % 3 == 0
        lens = [None if not clean and rng.random() < 0.1 else rng.randrange(0, 9) for _ in range(n)]

        def ids(bound, bad):
            return [None if k is None else [rng.randrange(bound + (1 if bad and rng.random() < 0.05 else 0))
                                            for _ in range(k)] for k in lens]

        items, acts = ids(20, not clean), ids(3, not clean)
        stamps = [None if k is None else [float(rng.randrange(4)) for _ in range(k)] for k in lens]
        if not clean and rng.random() < 0.3:
            j = rng.randrange(n)
            if acts[j]:
                acts[j] = acts[j][1:]  # one value short
        text = rng.random() < 0.3
        cols = {"items": pa.array(["|".join(map(str, x)) if x is not None else None for x in items]) if text
                else pa.array(items, pa.list_(pa.int64())),
                "act": pa.array(acts, pa.list_(pa.int32()))}
        ts_type = rng.choice([pa.float64(), pa.int64()] + ([] if clean else [pa.string()]))
        if ts_type == pa.string():
            cols["ts"] = pa.array([None if s is None else [str(int(v)) for v in s] for s in stamps], pa.list_(ts_type))
        else:
            cols["ts"] = pa.array([None if s is None else [ts_type.to_pandas_dtype()(v) for v in s] for s in stamps],
                                  pa.list_(ts_type))
        path = tmp_path / f"s{seed}.parquet"
        pq.write_table(pa.table(cols), path)
        with_ts, with_acts = rng.random() < 0.6, rng.random() < 0.5
        cfg = DataConfig(source="parquet", train_paths=[str(path)], batch_size=1, malformed="skip",
                         max_len=rng.choice([2, 3, 50]), timestamps_column="ts" if with_ts else "",
                         actions_column="act" if with_acts else "")
        split = rng.choice(["train", "eval"])
        schema = _schema(num_actions=3) if with_acts else _schema()
        bulk_reader = SequenceParquetReader(schema, cfg, [str(path)], split=split)
        row_reader = SequenceParquetReader(schema, cfg, [str(path)], split=split)
        names = [name for _, name in bulk_reader._columns()]
        (rb,) = pq.ParquetFile(path).iter_batches(batch_size=64, columns=list(dict.fromkeys(names)))
        bulk = bulk_reader._columnar(rb, names)
        if clean:
            assert bulk is not None, (seed, rb.schema)
        if bulk is None:
            continue
        taken += 1
        cells = [rb.column(name).to_pylist() for name in names]
        rows: list = []
        for j in range(n):
            parsed = row_reader._parse([c[j] for c in cells])
            assert not isinstance(parsed, str), (seed, parsed)
            if parsed is not None:
                rows.append(parsed)
        _assert_same_block(bulk, row_reader._block(rows))
        assert bulk_reader.counts["short"] == row_reader.counts["short"], seed
    assert taken >= 50


def _assert_same_block(a, b):
    assert torch.equal(a.lengths, b.lengths) and torch.equal(a.items, b.items)
    assert (a.actions is None) == (b.actions is None) and (a.actions is None or torch.equal(a.actions, b.actions))


def _joined(reader, blocks):
    out = reader._empty()
    for block in blocks:
        out = reader._cat(out, block)
    return out


@pytest.mark.parametrize("tail", ["", "u9,1|x|3,1|2|3\n"], ids=["all-bulk", "bad-row-at-the-end"])
def test_sequence_csv_bulk_equals_line_by_line(tmp_path, tail):
    """SequenceCsvReader reads blocks of about 1 MB through pyarrow, converted a column at a time,
    and from the first block it cannot convert goes line by line (the reference, which names a
    bad line) after the rows already read: over a 2.6 MB file (three blocks), with timestamps
    and actions, its records and counts equal the line-by-line path's alone."""
    import random

    from hybrid.data.sequences import SequenceCsvReader

    rng = random.Random(5)
    lines, size = ["user,items,ts,act\n"], 0
    while size < 2_600_000:
        k = rng.randrange(0, 12)
        items = "|".join(str(rng.randrange(20)) for _ in range(k))
        stamps = "|".join(rng.choice(["3", "1.5", "-2", "10"]) for _ in range(k))
        acts = "|".join(str(rng.randrange(3)) for _ in range(k))
        lines.append(f"u{len(lines)},{items},{stamps},{acts}\n")
        size += len(lines[-1])
    path = tmp_path / "seq.csv"
    path.write_text("".join(lines) + tail)
    cfg = DataConfig(source="csv", train_paths=[str(path)], batch_size=4, timestamps_column="ts",
                     actions_column="act", malformed="skip", max_len=5)
    schema = _schema(num_actions=3)
    bulk = SequenceCsvReader(schema, cfg, [str(path)])
    ref = SequenceCsvReader(schema, cfg, [str(path)])
    got, want = _joined(bulk, bulk._chunks()), _joined(ref, ref._slow(str(path), skip=0))
    _assert_same_block(got, want)
    assert len(got) > 20_000
    assert bulk.counts == ref.counts and bulk.counts["malformed"] == (1 if tail else 0), (bulk.counts, ref.counts)
    assert bulk.counts["lines"] == len(lines) - 1 + (1 if tail else 0)
    blocks = list(SequenceCsvReader(schema, cfg, [str(path)])._fast(str(path), None))
    # The bad row at the end sends its block, the third, line by line.
    assert [b is None for b in blocks] == ([False, False, True] if tail else [False, False, False])


@pytest.mark.parametrize("split", ["train", "eval"])
@pytest.mark.parametrize("with_actions", [False, True], ids=["items", "items+actions"])
def test_a_file_block_batch_equals_sequence_batch_of_its_records(split, with_actions):
    """A file reader's batch, made from a columnar block, is the batch sequence_batch makes from
    the same records as lists (the synthetic stream's form): items, the negatives (drawn for the
    global batch, this trainer's rows; in evaluation the whole catalog in the first bag) and
    actions, bag by bag."""
    from hybrid.data.sequences import SequenceCsvReader, _catalog_bags, _seed_of, sequence_batch

    schema = _schema(num_actions=3) if with_actions else _schema()
    cfg = DataConfig(source="csv", train_paths=["unused.csv"], batch_size=4, num_negatives=3)
    reader = SequenceCsvReader(schema, cfg, ["unused.csv"], rank=1, world_size=2, split=split)
    records = [([1, 2, 3], [0, 1, 2]), ([4, 5], [1, 1]), ([6, 7, 8, 9], [2, 0, 1, 0])]
    if not with_actions:
        records = [(items, None) for items, _ in records]
    got = reader._batch(reader._block(records))
    n, rows = len(records), schema.num_embeddings[0]
    if split == "eval":
        negatives = _catalog_bags(0, n, n, rows)
    else:
        g = torch.Generator().manual_seed(_seed_of(cfg.seed, "negatives", 0))
        negatives = torch.randint(0, rows, (8, 3), generator=g)[4:4 + n].tolist()
    want = sequence_batch(schema, [r[0] for r in records], [r[1] for r in records] if with_actions else None,
                          negatives)
    assert got.sparse.keys() == want.sparse.keys()
    assert torch.equal(got.sparse.lengths(), want.sparse.lengths()) and torch.equal(got.sparse.values(), want.sparse.values())
    assert torch.equal(got.labels, want.labels) and got.dense.shape == want.dense.shape
