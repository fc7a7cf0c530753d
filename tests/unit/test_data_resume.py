"""A file reader started at a record (``FileReader.start_record``, a resumed run's data position).

With the trainers and batch size that saved the position, a reader started at global batch
``j``'s first record yields exactly the batches a fresh pass yields from batch ``j`` on (the
sequence readers' drawn negatives included), so a resumed run is the run that did not stop.
With others, the trainers' batches together hold the good records from that record on, in
order: the run continues where the saving run stopped instead of at the same batch number.
Malformed lines among the records passed over are still counted.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybrid.data import CriteoReader, CsvReader, DataConfig, ParquetReader, Schema
from hybrid.data.criteo import NUM_SPARSE
from hybrid.data.sequences import SequenceCsvReader, SequenceParquetReader
from tests.support.criteo_data import write_criteo

FEATURES = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]
RECORDS = 47  # good ones; the files also have a malformed line among the first records


def _criteo(tmp_path):
    path = write_criteo(tmp_path / "day.tsv", RECORDS, bad_at=4)
    schema = Schema(num_dense=13, features=FEATURES, num_embeddings=[1000] * NUM_SPARSE)
    return _maker(lambda cfg, shard: CriteoReader(schema, DataConfig(source="criteo", malformed="skip", **cfg),
                                                  [str(path)], **shard))


def _tabular_rows():
    rows = [f"{i % 2},{i},{i / 4},{i}|{i + 1},{i % 7}" for i in range(RECORDS)]
    rows.insert(40, "1,-5,0,1,1")  # a negative id: malformed
    return rows


def _csv(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("label,user,price,items,age\n" + "\n".join(_tabular_rows()) + "\n")
    return _maker(lambda cfg, shard: CsvReader(_tab_schema(), DataConfig(
        source="csv", malformed="skip", dense_columns=["price", "age"], **cfg), [str(path)], **shard))


def _parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cells = [r.split(",") for r in _tabular_rows()]
    table = pa.table({"label": [int(c[0]) for c in cells], "user": [int(c[1]) for c in cells],
                      "price": [float(c[2]) for c in cells], "items": [c[3] for c in cells],
                      "age": [int(c[4]) for c in cells]})
    path = tmp_path / "a.parquet"
    pq.write_table(table, path, row_group_size=10)  # several record batches
    return _maker(lambda cfg, shard: ParquetReader(_tab_schema(), DataConfig(
        source="parquet", malformed="skip", dense_columns=["price", "age"], **cfg), [str(path)], **shard))


def _sequence_csv(tmp_path):
    from recsys_examples.sequential import build_sequential, sequential

    rng = random.Random(1)
    lines = [f"u{i},{'|'.join(str(rng.randrange(20)) for _ in range(rng.randrange(2, 8)))}" for i in range(RECORDS)]
    lines.insert(40, "u,1|x|3")  # not an id: malformed
    path = tmp_path / "seq.csv"
    path.write_text("user,items\n" + "\n".join(lines) + "\n")
    schema = sequential.data_schema(build_sequential(num_items=20, max_len=8, embedding_dim=8, num_blocks=1,
                                                     num_heads=1, device="meta"))
    return _maker(lambda cfg, shard: SequenceCsvReader(schema, DataConfig(
        source="csv", malformed="skip", max_len=8, num_negatives=3, **cfg), [str(path)], **shard))


def _sequence_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from recsys_examples.sequential import build_sequential, sequential

    rng = random.Random(2)
    items = [[rng.randrange(20) for _ in range(rng.randrange(2, 8))] for _ in range(RECORDS)]
    items.insert(4, [1])  # one item, none left to learn from: left out (short)
    path = tmp_path / "seq.parquet"
    pq.write_table(pa.table({"items": pa.array(items, pa.list_(pa.int64()))}), path, row_group_size=11)
    schema = sequential.data_schema(build_sequential(num_items=20, max_len=8, embedding_dim=8, num_blocks=1,
                                                     num_heads=1, device="meta"))
    return _maker(lambda cfg, shard: SequenceParquetReader(schema, DataConfig(
        source="parquet", max_len=8, num_negatives=3, **cfg), [str(path)], **shard))


def _tab_schema():
    return Schema(num_dense=2, features=["user", "items"], num_embeddings=[10, 10])


def _maker(make):
    """``make(config keys, shard)`` called as ``reader(rank=, world_size=, **config keys)``."""
    def reader(rank=0, world_size=1, **cfg):
        return make(cfg, {"rank": rank, "world_size": world_size})
    return reader


READERS = {"criteo": _criteo, "csv": _csv, "parquet": _parquet, "sequence_csv": _sequence_csv,
           "sequence_parquet": _sequence_parquet}


def _assert_same(a, b):
    torch.testing.assert_close(a.dense, b.dense, rtol=0, atol=0)
    torch.testing.assert_close(a.labels, b.labels, rtol=0, atol=0)
    assert a.sparse.keys() == b.sparse.keys()
    assert torch.equal(a.sparse.lengths(), b.sparse.lengths()) and torch.equal(a.sparse.values(), b.sparse.values())


def _pass(make, *, start=0, **kw):
    reader = make(**kw)
    reader.start_record = start
    return list(reader), reader.counts


@pytest.mark.parametrize("kind", READERS)
def test_a_reader_started_at_a_global_batch_yields_the_fresh_pass_from_there(tmp_path, kind):
    make = READERS[kind](tmp_path)
    W, B = 2, 3
    fresh, fresh_counts = zip(*(_pass(make, rank=r, world_size=W, batch_size=B) for r in range(W)), strict=True)
    assert len(fresh[0]) == fresh_counts[0]["good"] // (W * B) >= 6
    for j in (1, 5):
        for r in range(W):
            got, counts = _pass(make, start=j * W * B, rank=r, world_size=W, batch_size=B)
            assert len(got) == len(fresh[r]) - j, (j, r)
            for a, b in zip(got, fresh[r][j:], strict=True):
                _assert_same(a, b)
            assert counts["malformed"] == (kind != "sequence_parquet")  # the bad line among them (parquet: short)
            assert counts == {**fresh_counts[r], "batches": len(got)}


@pytest.mark.parametrize("kind", ["criteo", "csv", "parquet"])
def test_a_reader_started_at_any_record_continues_there_with_other_trainers(tmp_path, kind):
    make = READERS[kind](tmp_path)
    records = [b for b in _pass(make, batch_size=1)[0]]  # every good record, in order
    assert len(records) == RECORDS
    start, W, B = 2 * 2 * 3 + 1, 3, 2  # saved by 2 trainers of 3 after 2 steps (and one more record)
    shards = [_pass(make, start=start, rank=r, world_size=W, batch_size=B)[0] for r in range(W)]
    steps = (RECORDS - start) // (W * B)
    assert [len(s) for s in shards] == [steps] * W
    got = [b.slice(i, i + 1) for step in zip(*shards, strict=True) for b in step for i in range(len(b))]
    assert len(got) == steps * W * B
    for a, b in zip(got, records[start:], strict=False):
        _assert_same(a, b)


def test_a_start_past_the_last_record_yields_nothing_and_counts_every_record(tmp_path):
    make = READERS["csv"](tmp_path)
    got, counts = _pass(make, start=RECORDS + 5, batch_size=2, drop_last=False)
    assert got == [] and counts["good"] == RECORDS and counts["malformed"] == 1


@pytest.mark.parametrize("kind", ["criteo", "criteo_gz", "csv", "parquet", "sequence_csv", "sequence_parquet"])
def test_a_reader_resumed_at_a_seek_point_reads_from_there_and_yields_the_same(tmp_path, monkeypatch, kind):
    """``seek_point`` (saved in a checkpoint) names where the chunk holding a record starts: a
    reader given it as ``resume_at`` starts reading there -- it reads fewer lines than the pass
    before it -- and yields the batches of a fresh pass from that record on. A file that changed
    since (another size) is read from the top instead, the batches the same."""
    import gzip
    import hybrid.data.criteo as criteo
    import hybrid.data.tabular as tabular

    monkeypatch.setattr(criteo, "_CHUNK_BYTES", 600)  # chunks of a few lines
    monkeypatch.setattr(tabular, "_CHUNK_ROWS", 5)
    monkeypatch.setattr(tabular, "_CSV_BLOCK_BYTES", 60)
    make = READERS[kind.removesuffix("_gz")](tmp_path)
    if kind == "criteo_gz":
        path = tmp_path / "day.tsv"
        with gzip.open(tmp_path / "day.gz", "wb") as f:
            f.write(path.read_bytes())
        path.write_bytes((tmp_path / "day.gz").read_bytes())  # the same name, gzip content
    W, B = 2, 3
    size = W * B
    fresh = [_pass(make, rank=r, world_size=W, batch_size=B)[0] for r in range(W)]
    reader = make(rank=0, world_size=W, batch_size=B)
    points = {}
    for j, _ in enumerate(reader, start=1):
        points[j] = reader.seek_point(0, j * size)
    assert reader.seek_point(1, 2 * size) is None  # another pass
    total_lines = reader.counts["lines"]
    assert len(points) == len(fresh[0]) >= 6 and all(points.values()), points
    assert len({(p.get("offset"), p.get("row")) for p in points.values()}) >= 3  # several chunks apart
    for j in (2, 5):
        for r in range(W):
            resumed = make(rank=r, world_size=W, batch_size=B)
            resumed.start_record, resumed.resume_at = j * size, points[j]
            got = list(resumed)
            assert len(got) == len(fresh[r]) - j and resumed.counts["lines"] < total_lines, (j, r, resumed.counts)
            for a, b in zip(got, fresh[r][j:], strict=True):
                _assert_same(a, b)
    moved = make(rank=0, world_size=W, batch_size=B)
    moved.start_record, moved.resume_at = 5 * size, {**points[5], "size": points[5]["size"] + 1}
    got = list(moved)
    assert moved.counts["lines"] == total_lines  # read from the top
    for a, b in zip(got, fresh[0][5:], strict=True):
        _assert_same(a, b)


@pytest.mark.parametrize("case", ["clean", "gzip", "quoted fields further down", "stray quotes further down",
                                  "a record longer than a block further down", "a record too long further down",
                                  "a bad row further down"])
def test_a_csv_reader_resumes_from_a_block(tmp_path, monkeypatch, case):
    """Every CSV block ends where a record ends, as pyarrow reads the quotes, so each has a seek
    point. A reader resumed at one yields the fresh pass's batches, having read fewer lines;
    from a block in which no record ends pyarrow's streaming reader goes on (no seek points
    beyond it); a row that sends the file line by line is named at its own line, as a fresh pass
    names it."""
    import gzip
    import hybrid.data.tabular as tabular

    monkeypatch.setattr(tabular, "_CSV_BLOCK_BYTES", 60)  # blocks of a few rows
    rows = [f"{i % 2},{i % 10},{i / 4},{i % 10}|{(i + 1) % 10},{i % 7},n{i}" for i in range(60)]
    if case == "quoted fields further down":  # a comma, a doubled quote and a line break in quotes
        rows[40] = '1,3,0.5,"4|5",2,"a, ""b"""'
        rows[44] = '0,"1",1.5,2|3,"4","two\nlines"'
    if case == "stray quotes further down":  # a quote inside an unquoted field, text after a closing one
        rows[40] = '1,3,0.5,4|5,2,a"b'
        rows[43] = '1,3,0.5,4|5,2,"a"b'
    if case == "a record longer than a block further down":
        rows[40] = '1,3,0.5,4|5,2,"' + "x" * 200 + '\n"'
    if case == "a record too long further down":  # longer than _CSV_RECORD_BYTES
        monkeypatch.setattr(tabular, "_CSV_RECORD_BYTES", 1000)
        rows[40] = '1,3,0.5,4|5,2,"' + "x" * 1000 + '\n"'
    if case == "a bad row further down":
        rows[50] = "1,x,0.5,4,2,n"
    path = tmp_path / "a.csv"
    text = "label,user,price,items,age,note\n" + "\n".join(rows) + "\n"
    if case == "gzip":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    malformed = "error" if case == "a bad row further down" else "skip"

    def make(**kw):
        cfg = DataConfig(source="csv", dense_columns=["price", "age"], malformed=malformed, batch_size=3)
        return CsvReader(_tab_schema(), cfg, [str(path)], **kw)

    def drain(reader):
        got = []
        try:
            for b in reader:
                got.append(b)
        except ValueError as e:
            return got, str(e)
        return got, None

    W, size = 2, 6
    fresh = [drain(make(rank=r, world_size=W)) for r in range(W)]
    reader = make(rank=0, world_size=W)
    points = {}
    for j, _ in enumerate(reader, start=1):
        points[j] = reader.seek_point(0, j * size)
        if len(points) == 6:
            break
    assert all(points.values()) and points[6]["offset"] > points[2]["offset"] > 0, points
    for r in range(W):
        resumed = make(rank=r, world_size=W)
        resumed.start_record, resumed.resume_at = 6 * size, points[6]
        got, error = drain(resumed)
        assert error == fresh[r][1], (error, fresh[r][1])
        if error is not None:
            assert "a.csv:52: column 'user': 'x' is not an id" in error, error
        assert len(got) == len(fresh[r][0]) - 6
        for a, b in zip(got, fresh[r][0][6:], strict=True):
            _assert_same(a, b)
        assert resumed.counts["lines"] < 60 - 30, resumed.counts  # read from record 36 on
    if case == "a bad row further down":
        return
    whole = make(rank=0, world_size=W)
    last = None
    for j, _ in enumerate(whole, start=1):
        last = whole.seek_point(0, j * size) or last
    if case == "a record too long further down":  # none after the block before it
        assert last["line"] <= 41, last
    else:  # to the file's last blocks
        assert last["line"] >= 50, last
