"""CSV/Parquet readers taking data as it comes: hashed categoricals, label rules, dense
transforms, the bulk (pyarrow) CSV path against the line-by-line reference, every held-out row
read, and model inputs derived from the data config."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pytest
import torch

from hybrid.data import CsvReader, DataConfig, Schema, make_dataset
from hybrid.data.tabular import hash_id, hash_ids
from hybrid.plan import PlanError
from hybrid.train.config import load_config

SCHEMA = Schema(num_dense=2, features=["job", "ids"], num_embeddings=[10, 10])
TEXT = """income,job,hours,ids,age
>50K,Private,40,9223372036854775807|17,39
<=50K,Self-emp,,,50
<=50K,Private,13.5,5,-3
>50K,State gov,60,5|5|8,28
<=50K,?,20,12345678901234567,41
"""


def _reader(path, **kw):
    kw.setdefault("dense_columns", ["hours", "age"])
    kw.setdefault("label_column", "income")
    kw.setdefault("label_map", {">50K": 1, "<=50K": 0})
    kw.setdefault("sparse_columns", ["job", "ids"])
    stats_dir = kw.pop("stats_dir", None)
    cfg = DataConfig(source="csv", train_paths=[str(path)], **kw)
    return CsvReader(SCHEMA, cfg, [str(path)], stats_dir=stats_dir)


def _slow(reader):
    """The same reader's line-by-line reference path over its file."""
    blocks = list(reader._slow(reader.paths[0], skip=0))
    return reader._batch(blocks[0])


def test_fnv1a64_is_the_documented_hash_and_vectorized_equals_scalar():
    # FNV-1a 64 of "a" is 0xaf63dc4c8601ec8c; the top bit is cleared so ids are valid int64.
    assert hash_id("a") == 0xAF63DC4C8601EC8C & (2**63 - 1)
    assert hash_id("") == 0xCBF29CE484222325 & (2**63 - 1)
    tokens = ["Private", "a", "héllo", "9223372036854775807", "x" * 40, "?"]
    got = hash_ids(pa.array(tokens))
    assert got.tolist() == [hash_id(t) for t in tokens]
    assert hash_ids(pa.array(tokens).slice(2, 3)).tolist() == [hash_id(t) for t in tokens[2:5]]


def test_hashed_strings_and_raw_ids_with_a_label_map(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(TEXT)
    reader = _reader(path, categorical="hash", batch_size=5)
    (batch,) = list(reader)
    assert reader.slow_paths == []  # read in bulk
    assert batch.labels.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert batch.dense.tolist() == [[40.0, 39.0], [0.0, 50.0], [13.5, -3.0], [60.0, 28.0], [20.0, 41.0]]
    bags = batch.sparse.to_dict()
    assert bags["job"].values().tolist() == [hash_id(t) for t in ["Private", "Self-emp", "Private", "State gov", "?"]]
    assert bags["ids"].lengths().tolist() == [2, 0, 1, 3, 1]
    assert bags["ids"].values().tolist() == [hash_id(t) for t in
                                             ["9223372036854775807", "17", "5", "5", "5", "8", "12345678901234567"]]
    ref = _slow(reader)  # the bulk path equals the line-by-line reference
    assert torch.equal(ref.dense, batch.dense) and torch.equal(ref.labels, batch.labels)
    assert torch.equal(ref.sparse.values(), batch.sparse.values())
    assert torch.equal(ref.sparse.lengths(), batch.sparse.lengths())


def test_a_string_under_categorical_id_names_file_line_and_column(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(TEXT)
    with pytest.raises(ValueError, match=re.escape(f"data.csv: {path}:2: column 'job': 'Private' is not an id "
                                                   "(an integer in [0, 2**63)); data.categorical=hash takes any text")):
        list(_reader(path))
    path.write_text(TEXT + "maybe,a,1,2,3\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:7: column 'income': 'maybe' is not in data.label_map")):
        list(_reader(path, categorical="hash"))
    reader = _reader(path, categorical="hash", malformed="skip", batch_size=5)
    assert [len(b) for b in reader] == [5]
    assert reader.counts["malformed"] == 1 and reader.counts["lines"] == 6
    assert reader.slow_paths == [str(path)]


def test_label_threshold(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("rating,job,hours,ids,age\n4.5,1,1,1,1\n3,2,1,1,1\n3.5,3,1,1,1\n")
    (batch,) = list(_reader(path, label_column="rating", label_map={}, label_threshold=3.4, batch_size=3))
    assert batch.labels.tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match=r"data\.csv: .*r\.csv:2: column 'rating': '4\.5' is not a label in \[0, 1\]"):
        list(_reader(path, label_column="rating", label_map={}))


def test_dense_transforms_and_saved_statistics(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(TEXT)
    (batch,) = list(_reader(path, categorical="hash", dense_transform="log1p", batch_size=5))
    torch.testing.assert_close(batch.dense[:, 1], torch.log1p(torch.tensor([39.0, 50.0, 0.0, 28.0, 41.0])))
    run = tmp_path / "run"
    (batch,) = list(_reader(path, categorical="hash", dense_transform="standardize", batch_size=5, stats_dir=run))
    raw = torch.tensor([[40.0, 39.0], [0.0, 50.0], [13.5, -3.0], [60.0, 28.0], [20.0, 41.0]], dtype=torch.float64)
    want = (raw - raw.mean(0)) / raw.std(0, unbiased=False)
    torch.testing.assert_close(batch.dense, want.float())
    saved = json.loads((run / "data_stats.json").read_text())
    assert saved["rows"] == 5 and saved["dense_columns"] == ["hours", "age"]
    # Reused, not recomputed: a resumed run (or evaluation) reads the saved numbers.
    saved["mean"] = [0.0, 0.0]
    saved["std"] = [1.0, 1.0]
    (run / "data_stats.json").write_text(json.dumps(saved))
    (batch,) = list(_reader(path, categorical="hash", dense_transform="standardize", batch_size=5, stats_dir=run))
    torch.testing.assert_close(batch.dense, raw.float())


def test_evaluation_reads_every_held_out_row(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("label,user,x\n" + "".join(f"{i % 2},{i},{i}\n" for i in range(7)))
    schema = Schema(num_dense=1, features=["user"], num_embeddings=[10])
    cfg = DataConfig(source="csv", train_paths=[str(path)], eval_paths=[str(path)], dense_columns=["x"],
                     batch_size=2, drop_last=True)
    for split, rows in (("train", 4), ("eval", 7)):
        shards = [list(make_dataset(schema, cfg, split=split, rank=r, world_size=2)) for r in range(2)]
        assert len(shards[0]) == len(shards[1])  # every trainer runs as many (FSDP) steps
        users = sorted(u for s in shards for b in s for u in b.sparse.to_dict()["user"].values().tolist())
        assert users == list(range(rows)), (split, users)


def test_bulk_csv_path_equals_line_by_line_on_mixed_rows(tmp_path):
    path = tmp_path / "a.csv"
    rows = [f"{i % 2},{i}|{i + 3},{i * 0.25},{i % 5},{7 - i}" for i in range(300)]
    rows.insert(150, "")  # a blank line is ignored by both
    path.write_text("label,job,hours,ids,age\n" + "\n".join(rows) + "\n")
    reader = _reader(path, label_column="label", label_map={}, batch_size=300)
    (fast,) = list(reader)
    assert reader.slow_paths == []
    ref = _slow(reader)
    for a, b in ((fast.dense, ref.dense), (fast.labels, ref.labels), (fast.sparse.values(), ref.sparse.values()),
                 (fast.sparse.lengths(), ref.sparse.lengths())):
        assert torch.equal(a, b)


def test_model_features_and_dense_width_come_from_the_data_config(tmp_path):
    data = ["data.source=csv", "data.sparse_columns=[job,ids]", "data.dense_columns=[hours,age]"]
    cfg = load_config(None, ["model.name=dlrm", *data])
    assert cfg.model_kwargs["features"] == ["job", "ids"] and cfg.model_kwargs["num_dense"] == 2
    cfg = load_config(None, ["model.name=dlrm", "model.features=[job,ids]", "model.num_dense=2", *data])
    assert cfg.model_kwargs["features"] == ["job", "ids"]
    with pytest.raises(PlanError, match=r"model\.features: got \['job'\], but data\.sparse_columns gives "
                                        r"\['job', 'ids'\]; name the columns once"):
        load_config(None, ["model.name=dlrm", "model.features=[job]", *data])
    with pytest.raises(PlanError, match=r"model\.num_dense: got 13, but data\.dense_columns gives 2"):
        load_config(None, ["model.name=dlrm", "model.num_dense=13", *data])


def test_criteo_evaluation_reads_the_last_row_even_when_a_trainer_gets_none(tmp_path):
    from hybrid.data import CriteoReader

    line = "\t".join(["1", *["3"] * 13, *["0000000a"] * 26])
    path = tmp_path / "day.tsv"
    path.write_text(line + "\n")
    schema = Schema(num_dense=13, features=[f"C{i}" for i in range(26)], num_embeddings=[100] * 26)
    cfg = DataConfig(source="criteo", eval_paths=[str(path)], batch_size=2)
    shares = [list(make_dataset(schema, cfg, split="eval", rank=r, world_size=2)) for r in range(2)]
    assert [[len(b) for b in s] for s in shares] == [[0], [1]]
    assert isinstance(shares[0][0].sparse, type(shares[1][0].sparse)) and shares[0][0].dense.shape == (0, 13)
    assert not list(make_dataset(schema, DataConfig(source="criteo", train_paths=[str(path)], batch_size=2),
                                 split="train", rank=0, world_size=2))


def test_parquet_hashes_text_and_integers_by_their_text(tmp_path):
    import pyarrow.parquet as pq

    from hybrid.data import ParquetReader

    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"rating": [4.0, 2.0], "job": ["Private", None], "ids": [[2**62 + 5, 7], []],
                             "hours": [1.0, 2.0], "age": [3, 4]}), path)
    cfg = DataConfig(source="parquet", batch_size=2, dense_columns=["hours", "age"], label_column="rating",
                     label_threshold=3.0, categorical="hash", dense_transform="log1p")
    (batch,) = list(ParquetReader(SCHEMA, cfg, [str(path)]))
    assert batch.labels.tolist() == [1.0, 0.0]
    bags = batch.sparse.to_dict()
    assert bags["job"].values().tolist() == [hash_id("Private")] and bags["job"].lengths().tolist() == [1, 0]
    assert bags["ids"].values().tolist() == [hash_id(str(2**62 + 5)), hash_id("7")]
    torch.testing.assert_close(batch.dense, torch.log1p(torch.tensor([[1.0, 3.0], [2.0, 4.0]])))


def _random_column(rng, n, kind):
    """``n`` cells of one Parquet column of ``kind``, some of them null or not what the reader takes."""
    def maybe(v):
        return None if rng.random() < 0.1 else v

    ints = lambda: rng.choice([0, 1, 7, 2**31, 2**62 + 5, -1]) if rng.random() < 0.1 else rng.randrange(1000)  # noqa: E731
    tokens = ["5", "007", " 5", "+5", "1_0", "-0", "-3", "", "a", "9223372036854775807", "9223372036854775808"]
    token = lambda: rng.choice(tokens) if rng.random() < 0.05 else str(rng.randrange(1000))  # noqa: E731
    if kind in ("int64", "int8", "uint64"):
        lo = 0 if kind == "uint64" else -1
        cells = [maybe(ints()) for _ in range(n)]
        cells = [None if c is None or (kind == "int8" and not -128 <= c < 128) else max(c, lo) if kind == "uint64" else c
                 for c in cells]
        if kind == "uint64" and rng.random() < 0.3:
            cells[rng.randrange(n)] = 2**63 + 1
        return pa.array(cells, getattr(pa, kind)())
    if kind in ("float32", "float64"):
        return pa.array([maybe(rng.choice([0.5, 1.0, 0.0, 2**60 + 1.0, float("nan")]) if rng.random() < 0.05
                               else rng.random()) for _ in range(n)], getattr(pa, kind)())
    if kind == "bool":
        return pa.array([maybe(rng.random() < 0.5) for _ in range(n)], pa.bool_())
    if kind in ("string", "large_string", "dictionary"):
        cells = [maybe("" if rng.random() < 0.05 else "|".join(token() for _ in range(rng.randrange(1, 4))))
                 for _ in range(n)]
        arr = pa.array(cells, pa.large_string() if kind == "large_string" else pa.string())
        return arr.dictionary_encode() if kind == "dictionary" else arr
    if kind in ("list_int", "large_list_int"):
        cells = [maybe([ints() if rng.random() < 0.97 else None for _ in range(rng.randrange(0, 4))])
                 for _ in range(n)]
        return pa.array(cells, (pa.large_list if kind == "large_list_int" else pa.list_)(pa.int64()))
    if kind == "list_string":
        return pa.array([maybe([token() for _ in range(rng.randrange(0, 3))]) for _ in range(n)], pa.list_(pa.string()))
    raise AssertionError(kind)


def test_seeded_fuzz_parquet_bulk_path_equals_row_by_row(tmp_path):
    """ParquetReader converts a record batch column by column when every cell is certainly good
    and otherwise parses its rows one at a time (the reference, which names a bad row): on random
    tables of every column type, wherever the bulk conversion takes a batch it gives what the rows
    give, with no row malformed; clean tables of the common types always go in bulk."""
    import random

    import pyarrow.parquet as pq

    from hybrid.data import ParquetReader

    schema = Schema(num_dense=2, features=["f0", "f1"], num_embeddings=[10, 10])
    sparse_kinds = ["int64", "int8", "uint64", "string", "large_string", "dictionary", "list_int",
                    "large_list_int", "list_string", "float64", "bool"]
    dense_kinds = ["float64", "float32", "int64", "int8", "bool", "string"]
    taken = 0
    for seed in range(120):
        rng = random.Random(seed)
        n = rng.randrange(1, 40)
        clean = seed % 4 == 0
        label_kind = rng.choice(["float64", "int64", "bool", "string"])
        labels = {"float64": [rng.random() for _ in range(n)], "int64": [rng.randrange(2) for _ in range(n)],
                  "bool": [rng.random() < 0.5 for _ in range(n)],
                  "string": [rng.choice(["yes", "no"]) for _ in range(n)]}[label_kind]
        if not clean and rng.random() < 0.3:
            labels[rng.randrange(n)] = None if rng.random() < 0.5 else (2.0 if label_kind == "float64" else labels[0])
        cols = {"y": pa.array(labels)}
        for j in range(2):
            kind = rng.choice(["float64", "float32", "int64"] if clean else dense_kinds)
            cols[f"d{j}"] = _random_column(rng, n, kind)
            kind = rng.choice(["int64", "string", "list_int"] if clean else sparse_kinds)
            cols[f"s{j}"] = _random_column(rng, n, kind)
        if clean:
            cols = {k: (pa.array([abs(x) % 1000 if x is not None else 3 for x in v.to_pylist()], v.type)
                        if pa.types.is_integer(v.type) else v) for k, v in cols.items()}
            cols = {k: (pa.array([[abs(x or 0) for x in c] if c is not None else None for c in v.to_pylist()], v.type)
                        if pa.types.is_list(v.type) else v) for k, v in cols.items()}
            cols = {k: (pa.array(["|".join(str(rng.randrange(1000)) for _ in range(2)) for _ in range(n)])
                        if pa.types.is_string(v.type) and k != "y" else v) for k, v in cols.items()}
        path = tmp_path / f"t{seed}.parquet"
        pq.write_table(pa.table(cols), path)
        kw = {"label_map": {"yes": 1, "no": 0}} if label_kind == "string" else (
            {"label_threshold": 0.5} if rng.random() < 0.3 else {})
        cfg = DataConfig(source="parquet", batch_size=1, dense_columns=["d0", "d1"], sparse_columns=["s0", "s1"],
                         label_column="y", malformed="skip", categorical=rng.choice(["id", "hash"]), **kw)
        reader = ParquetReader(schema, cfg, [str(path)])
        (rb,) = pq.ParquetFile(path).iter_batches(batch_size=64)
        bulk = reader._columnar(rb, "y", ["d0", "d1"], ["s0", "s1"])
        rows = reader._rows(rb, str(path), 0, "y", ["d0", "d1"], ["s0", "s1"])
        if clean:
            assert bulk is not None, (seed, rb.schema)
        if bulk is None:
            continue
        taken += 1
        assert reader.counts["malformed"] == 0, (seed, rb.schema)
        torch.testing.assert_close(bulk.labels, rows.labels, rtol=0, atol=0)
        torch.testing.assert_close(bulk.dense, rows.dense, rtol=0, atol=0, equal_nan=True)
        for a, b in zip(bulk.lengths + bulk.values, rows.lengths + rows.values):
            assert a.tolist() == b.tolist(), (seed, rb.schema)
    assert taken >= 40  # the bulk path was compared often, not only refused
