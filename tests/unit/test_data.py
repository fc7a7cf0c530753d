"""The data readers (hybrid.data) without processes: synthetic determinism and sharding, Criteo TSV,
CSV and Parquet parsing, the malformed-line policy, and a seeded fuzz of the Criteo parser
against a straightforward reference parser."""

import gzip
import math
import random
import re
import sys

import pytest
import torch
from omegaconf import OmegaConf

from hybrid.data import (
    Batch,
    CriteoReader,
    CsvReader,
    DataConfig,
    Schema,
    SyntheticData,
    check_data_config,
    make_dataset,
)

CRITEO_FEATURES = [f"C{i}" for i in range(1, 27)]


def _criteo_schema(rows: int | list[int] = 1000) -> Schema:
    rows = [rows] * 26 if isinstance(rows, int) else rows
    return Schema(num_dense=13, features=CRITEO_FEATURES, num_embeddings=rows)


def _bags(batch: Batch) -> dict[str, list[list[int]]]:
    """Every feature's bags as lists of ids, sample by sample."""
    kjt = batch.sparse
    out = {}
    for key, jt in kjt.to_dict().items():
        out[key] = [v.tolist() for v in jt.to_dense()]
    return out


def _assert_same(a: Batch, b: Batch) -> None:
    torch.testing.assert_close(a.dense, b.dense, rtol=0, atol=0)
    torch.testing.assert_close(a.labels, b.labels, rtol=0, atol=0)
    assert a.sparse.keys() == b.sparse.keys()
    assert torch.equal(a.sparse.lengths(), b.sparse.lengths())
    assert torch.equal(a.sparse.values(), b.sparse.values())


def _auc(score: torch.Tensor, labels: torch.Tensor) -> float:
    ranks = torch.empty(len(score), dtype=torch.float64)
    ranks[score.argsort()] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    pos = labels.sum()
    neg = len(labels) - pos
    return float((ranks[labels > 0].sum() - pos * (pos + 1) / 2) / (pos * neg))


# -- config -----------------------------------------------------------------------------------

def test_config_defaults_are_valid_and_omegaconf_structured():
    cfg = DataConfig()
    check_data_config(cfg)
    node = OmegaConf.merge(OmegaConf.structured(DataConfig), {"source": "csv", "sparse_columns": ["a"]})
    assert OmegaConf.to_object(node) == DataConfig(source="csv", sparse_columns=["a"])


@pytest.mark.parametrize("kwargs,message", [
    ({"source": "foo"}, "data.source: got 'foo'; expected one of 'synthetic', 'criteo', 'csv', 'parquet'"),
    ({"malformed": "ignore"}, "data.malformed: got 'ignore'; expected one of 'error', 'skip'"),
    ({"check_lines": -1}, "data.check_lines: got -1; expected an integer >= 0"),
    ({"batch_size": 0}, "data.batch_size: got 0; expected an integer >= 1"),
    ({"ids_per_feature": 0}, "data.ids_per_feature: got 0"),
    ({"eval_batches": -1}, "data.eval_batches: got -1"),
    ({"zipf_alpha": -0.5}, "data.zipf_alpha: got -0.5"),
    ({"id_separator": ""}, "data.id_separator"),
    ({"dense_columns": ["a", "a"]}, "data.dense_columns: ['a'] listed more than once"),
    ({"dense_columns": ["label"]}, "data.label_column: 'label' is also a feature column"),
])
def test_config_errors_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_data_config(DataConfig(**kwargs))


def test_make_dataset_file_source_needs_paths(tmp_path):
    schema = _criteo_schema()
    with pytest.raises(ValueError, match=r"^data\.train_paths: .*criteo reads files"):
        make_dataset(schema, DataConfig(source="criteo"), split="train", rank=0, world_size=1)
    f = tmp_path / "a.tsv"
    f.write_text("")
    cfg = DataConfig(source="criteo", train_paths=[str(f)])
    assert isinstance(make_dataset(schema, cfg, split="train", rank=0, world_size=1), CriteoReader)
    with pytest.raises(ValueError, match=r"^data\.eval_paths: "):
        make_dataset(schema, cfg, split="eval", rank=0, world_size=1)
    cfg.eval_paths = [str(tmp_path / "missing.tsv")]
    with pytest.raises(ValueError, match=r"^data\.eval_paths: '.*missing\.tsv' is not a file"):
        make_dataset(schema, cfg, split="eval", rank=0, world_size=1)
    cfg.eval_paths = [str(tmp_path / "day_*.gz")]
    with pytest.raises(ValueError, match=r"matches no file"):
        make_dataset(schema, cfg, split="eval", rank=0, world_size=1)


def test_schema_checks():
    with pytest.raises(ValueError, match="2 features"):
        Schema(num_dense=1, features=["a", "b"], num_embeddings=[3])
    with pytest.raises(ValueError, match="at least 1 row"):
        Schema(num_dense=1, features=["a"], num_embeddings=[0])
    with pytest.raises(ValueError, match=r"query features \['q'\]"):
        Schema(num_dense=0, features=["a"], num_embeddings=[3], task="retrieval", query_features=["q"])


# -- synthetic --------------------------------------------------------------------------------

def test_synthetic_is_deterministic_and_splits_differ():
    schema = _criteo_schema()
    cfg = DataConfig(batch_size=16, seed=3, eval_batches=3)
    a = list(SyntheticData(schema, cfg, steps=3))
    b = list(SyntheticData(schema, cfg, steps=3))
    for x, y in zip(a, b, strict=True):
        _assert_same(x, y)
    assert not torch.equal(a[0].dense, a[1].dense)
    ev = SyntheticData(schema, cfg, split="eval")
    first, second = list(ev), list(ev)
    assert len(first) == 3
    for x, y in zip(first, second, strict=True):  # the same held-out batches at every evaluation
        _assert_same(x, y)
    assert not torch.equal(first[0].dense, a[0].dense)
    other = next(iter(SyntheticData(schema, DataConfig(batch_size=16, seed=4))))
    assert not torch.equal(other.dense, a[0].dense)
    resumed = list(SyntheticData(schema, cfg, steps=2, start=1))
    _assert_same(resumed[0], a[1])
    _assert_same(resumed[1], a[2])


@pytest.mark.parametrize("task", ["ctr", "retrieval"])
def test_synthetic_trainer_slices_make_the_single_process_batch(task):
    if task == "ctr":
        schema = Schema(num_dense=3, features=["a", "b", "c"], num_embeddings=[5, 100, 10**12])
    else:
        schema = Schema(num_dense=0, features=["u", "h", "i", "cat"], num_embeddings=[50, 20, 40, 7],
                        task="retrieval", query_features=["u", "h"])
    W, B = 4, 6
    cfg = DataConfig(batch_size=B, ids_per_feature=2, seed=1)
    single = list(SyntheticData(schema, DataConfig(batch_size=W * B, ids_per_feature=2, seed=1), steps=3))
    trainers = [list(SyntheticData(schema, cfg, rank=r, world_size=W, steps=3)) for r in range(W)]
    for t in range(3):
        whole = SyntheticData(schema, cfg, rank=0, world_size=W).global_batch(t)
        assert len(whole) == W * B
        _assert_same(whole, single[t])
        for r in range(W):
            assert len(trainers[r][t]) == B
            _assert_same(trainers[r][t], whole.slice(r * B, (r + 1) * B))


def test_synthetic_trainer_draws_only_its_own_samples():
    # A trainer's data costs the same however many trainers there are: it draws its own slice of
    # the global batch and nothing else (here one of 1,000 trainers), and that slice is the one
    # the whole global batch would have there.
    schema = _criteo_schema()
    B, W, rank = 8, 1000, 3
    data = SyntheticData(schema, DataConfig(batch_size=B, seed=2), rank=rank, world_size=W, steps=2)
    drawn, draw = [], data.samples
    data.samples = lambda t, lo, hi: drawn.append((t, lo, hi)) or draw(t, lo, hi)
    batches = list(data)
    assert drawn == [(0, rank * B, (rank + 1) * B), (1, rank * B, (rank + 1) * B)]
    small = SyntheticData(schema, DataConfig(batch_size=W * B, seed=2))  # the same global batch
    for t, got in enumerate(batches):
        _assert_same(got, small.samples(t, rank * B, (rank + 1) * B))


def test_synthetic_ids_in_range_and_bag_sizes():
    rows = [1, 2, 7, 1000, 2**40]
    schema = Schema(num_dense=2, features=list("abcde"), num_embeddings=rows)
    batch = SyntheticData(schema, DataConfig(batch_size=512, ids_per_feature=3)).global_batch(0)
    assert batch.dense.dtype == torch.float32 and batch.dense.shape == (512, 2)
    assert batch.labels.dtype == torch.float32 and set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    assert batch.sparse.keys() == list("abcde")
    assert torch.equal(batch.sparse.lengths(), torch.full((5 * 512,), 3))
    for f, n in zip("abcde", rows, strict=True):
        ids = batch.sparse[f].values()
        assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < n
    assert int(batch.sparse["e"].values().max()) > 2**32  # large tables are covered, not only low rows


def test_synthetic_ids_follow_a_power_law_with_scattered_hot_rows():
    rows = 10_000
    schema = Schema(num_dense=0, features=["a"], num_embeddings=[rows])

    def top_share(alpha):
        ids = SyntheticData(schema, DataConfig(batch_size=8192, zipf_alpha=alpha)).global_batch(0).sparse.values()
        counts = torch.bincount(ids, minlength=rows).sort(descending=True)
        return float(counts.values[: rows // 100].sum()) / len(ids), counts.indices[:10]

    skewed, hot = top_share(1.05)
    uniform, _ = top_share(0.0)
    assert skewed > 0.4  # the top 1% of rows get a large share of the ids
    assert uniform < 0.1  # (sampling noise alone gives the top 1% about 5%)
    assert int(hot.max() - hot.min()) > rows // 10  # hot rows are spread over the table


def test_synthetic_ctr_labels_are_learnable():
    """A logistic model (dense weights + one bias per row) beats chance by far on held-out batches."""
    torch.manual_seed(0)
    rows = 200
    schema = Schema(num_dense=4, features=[f"f{i}" for i in range(6)], num_embeddings=[rows] * 6)
    cfg = DataConfig(batch_size=512, eval_batches=4)
    w = torch.zeros(4, requires_grad=True)
    bias = torch.zeros(6, rows, requires_grad=True)
    opt = torch.optim.Adagrad([w, bias], lr=0.3)

    def logits(b):
        ids = b.sparse.values().view(6, len(b))
        return b.dense @ w + bias.gather(1, ids).sum(0)

    for b in SyntheticData(schema, cfg, steps=60):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(b), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    held_out = list(SyntheticData(schema, cfg, split="eval"))
    with torch.no_grad():
        score = torch.cat([logits(b) for b in held_out])
    labels = torch.cat([b.labels for b in held_out])
    assert 0.2 < float(labels.mean()) < 0.6
    assert _auc(score, labels) > 0.75


def test_synthetic_retrieval_items_follow_their_user():
    schema = Schema(num_dense=0, features=["user", "hist", "item", "cat"], num_embeddings=[300, 50, 1000, 20],
                    task="retrieval", query_features=["user", "hist"])
    batch = SyntheticData(schema, DataConfig(batch_size=8192)).global_batch(0)
    assert torch.equal(batch.labels, torch.ones(8192))
    bags = {k: v.values() for k, v in batch.sparse.to_dict().items()}
    by_user: dict[int, list[int]] = {}
    for u, i in zip(bags["user"].tolist(), bags["item"].tolist(), strict=True):
        by_user.setdefault(u, []).append(i)
    frequent = [items for items in by_user.values() if len(items) >= 10]
    modal = sum(max(items.count(i) for i in set(items)) for items in frequent) / sum(map(len, frequent))
    assert modal > 0.8  # ~90% of a user's pairs hold its preferred item
    for key, base in (("hist", "user"), ("cat", "item")):  # attributes are functions of their id
        pairs = set(zip(bags[base].tolist(), bags[key].tolist(), strict=True))
        assert len(pairs) == len(set(bags[base].tolist()))


def test_synthetic_retrieval_needs_both_sides():
    schema = Schema(num_dense=0, features=["u"], num_embeddings=[3], task="retrieval", query_features=["u"])
    with pytest.raises(ValueError, match="retrieval needs query and item features"):
        SyntheticData(schema, DataConfig())


# -- Criteo -----------------------------------------------------------------------------------

def _criteo_line(rng: random.Random) -> str:
    dense = [rng.choice(["", str(rng.randint(-3, 5000)), str(rng.randint(0, 9))]) for _ in range(13)]
    cats = [rng.choice(["", f"{rng.getrandbits(32):08x}", f"{rng.getrandbits(32):08X}"]) for _ in range(26)]
    return "\t".join([str(rng.randint(0, 1)), *dense, *cats])


def _ref_criteo(line: bytes, rows: list[int]):
    """The documented meaning of one line (without its newline): (label, dense, ids) or None."""
    fields = line.split(b"\t")
    if len(fields) != 40 or fields[0] not in (b"0", b"1"):
        return None
    dense = []
    for v in fields[1:14]:
        if v and not re.fullmatch(rb"[+-]?[0-9]+", v):
            return None
        dense.append(math.log1p(min(max(int(v), 0), 2**62)) if v else 0.0)
    ids = []
    for v, n in zip(fields[14:], rows, strict=True):
        if v and not re.fullmatch(rb"[0-9a-fA-F]+", v):
            return None
        ids.append(int(v, 16) % n if v else 0)
    return float(fields[0] == b"1"), dense, ids


def _rows_of(batches: list[Batch]):
    """(label, dense, ids) of every sample of ``batches`` (one id per bag), in order."""
    out = []
    for b in batches:
        ids = b.sparse.values().view(26, len(b))
        for i in range(len(b)):
            out.append((float(b.labels[i]), b.dense[i].tolist(), ids[:, i].tolist()))
    return out


def _assert_rows_close(got, want):
    assert len(got) == len(want)
    for (gl, gd, gi), (wl, wd, wi) in zip(got, want, strict=True):
        assert gl == wl and gi == wi
        torch.testing.assert_close(torch.tensor(gd), torch.tensor(wd, dtype=torch.float32))


def _criteo(path, rows=1000, *, batch_size=4, rank=0, world_size=1, **kw):
    cfg = DataConfig(source="criteo", batch_size=batch_size, **kw)
    return CriteoReader(_criteo_schema(rows), cfg, [str(path)] if not isinstance(path, list) else path,
                        rank=rank, world_size=world_size)


def test_criteo_values_blanks_negatives_and_hex(tmp_path):
    rows = [7] * 13 + [1000] * 13
    lines = [
        "1\t" + "\t".join(["", "-4", "0", "3", "+5", "99999999999999999999999"] + ["1"] * 7) + "\t"
        + "\t".join(["", "ff", "FFFFFFFF", "0123456789abcdef0", "7fffffff"] + ["a"] * 21),
        "0\t" + "\t".join(["2"] * 13) + "\t" + "\t".join(["00000010"] * 26),
    ]
    path = tmp_path / "day.tsv"
    path.write_bytes(("\r\n".join(lines) + "\n").encode())  # \r\n line ends as well
    reader = _criteo(path, rows, batch_size=2)
    (batch,) = list(reader)
    assert reader.counts == {"lines": 2, "good": 2, "malformed": 0, "dropped": 0, "batches": 1}
    want = [_ref_criteo(line.encode(), rows) for line in lines]
    _assert_rows_close(_rows_of([batch]), want)
    assert batch.dense[0, :6].tolist() == pytest.approx([0.0, 0.0, 0.0, math.log(4), math.log(6), math.log1p(2**62)])
    assert batch.sparse.values().view(26, 2)[:5, 0].tolist() == [0, 255 % 7, 0xFFFFFFFF % 7, 0x0123456789ABCDEF0 % 7, 0x7FFFFFFF % 7]
    assert batch.dense.dtype == torch.float32 and batch.labels.tolist() == [1.0, 0.0]


def _bad_lines():
    good = "\t".join(["1"] + ["1"] * 13 + ["abcdef01"] * 26)
    fields = good.split("\t")

    def with_field(i, value):
        f = list(fields)
        f[i] = value
        return "\t".join(f)

    return good, [
        (with_field(4, "abc"), "field 5 (I4): 'abc' is not an integer"),
        (with_field(0, "2"), "field 1 (label): '2' is not 0 or 1"),
        (with_field(14, "xyz1"), "field 15 (C1): 'xyz1' is not hexadecimal"),
        (with_field(39, "0x12"), "field 40 (C26): '0x12' is not hexadecimal"),
        (with_field(1, "1.5"), "field 2 (I1): '1.5' is not an integer"),
        (with_field(2, "-"), "field 3 (I2): '-' is not an integer"),
        (good + "\t", "41 fields; a Criteo line has 40"),
        ("", "1 fields; a Criteo line has 40"),
    ]


def test_criteo_malformed_skip_counts_and_error_messages(tmp_path):
    good, bad = _bad_lines()
    lines = [good] * 3 + [b for b, _ in bad] + [good] * 4  # 7 good, 8 bad
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join(lines) + "\n")
    reader = _criteo(path, batch_size=3, malformed="skip")
    batches = list(reader)
    assert [len(b) for b in batches] == [3, 3]
    assert reader.counts == {"lines": 15, "good": 7, "malformed": 8, "dropped": 1, "batches": 2}
    for i, (line, message) in enumerate(bad):
        path.write_text("\n".join([good] * 2 + [line, good]) + "\n")
        with pytest.raises(ValueError) as e:
            list(_criteo(path, batch_size=1))
        assert str(e.value).startswith(f"data.criteo: {path}:3: {message}"), (i, str(e.value))
    # The error comes on every trainer, also when the line is not in its share.
    path.write_text("\n".join([good, good, bad[0][0]]) + "\n")
    for rank in (0, 1):
        with pytest.raises(ValueError, match=re.escape(f"{path}:3: field 5 (I4)")):
            list(_criteo(path, batch_size=1, rank=rank, world_size=2))


def test_criteo_sharding_over_two_trainers(tmp_path):
    rng = random.Random(0)
    lines = [_criteo_line(rng) for _ in range(23)]
    lines[5] = "garbage"
    path = tmp_path / "day.tsv"
    path.write_text("\n".join(lines) + "\n")
    good = [_ref_criteo(line.encode(), [1000] * 26) for line in lines]
    good = [g for g in good if g is not None]
    assert len(good) == 22
    B = 3
    shards = [list(_criteo(path, batch_size=B, rank=r, world_size=2, malformed="skip")) for r in range(2)]
    assert [len(s) for s in shards] == [3, 3]  # 22 good lines: 3 global batches of 6, 4 dropped
    interleaved = [b for pair in zip(*shards, strict=True) for b in pair]
    assert all(len(b) == B for b in interleaved)
    _assert_rows_close(_rows_of(interleaved), good[:18])
    # drop_last=False: the last 4 lines are split evenly (2 each).
    shards = [list(_criteo(path, batch_size=B, rank=r, world_size=2, malformed="skip", drop_last=False))
              for r in range(2)]
    assert [len(b) for b in shards[0]] == [3, 3, 3, 2] and [len(b) for b in shards[1]] == [3, 3, 3, 2]
    _assert_rows_close(_rows_of([b for pair in zip(*shards, strict=True) for b in pair]), good)


def test_criteo_gzip_and_several_files_in_order(tmp_path):
    rng = random.Random(1)
    lines = [_criteo_line(rng) for _ in range(10)]
    plain = tmp_path / "day_0.tsv"
    plain.write_text("\n".join(lines[:7]) + "\n")
    packed = tmp_path / "day_1.gz"
    with gzip.open(packed, "wt") as f:
        f.write("\n".join(lines[7:]))  # no newline at the end
    reader = _criteo([str(plain), str(packed)], batch_size=4)
    batches = list(reader)
    assert [len(b) for b in batches] == [4, 4]  # a global batch spans both files
    assert reader.counts["lines"] == 10 and reader.counts["dropped"] == 2
    _assert_rows_close(_rows_of(batches), [_ref_criteo(line.encode(), [1000] * 26) for line in lines[:8]])
    glob_reader = _criteo([str(tmp_path / "day_*")], batch_size=4)
    for a, b in zip(batches, glob_reader, strict=True):
        _assert_same(a, b)


def test_criteo_schema_must_fit():
    with pytest.raises(ValueError, match="criteo gives 13 dense and 26 sparse"):
        CriteoReader(Schema(num_dense=2, features=["a"], num_embeddings=[3]), DataConfig(), [])


def _mutate(line: bytes, rng: random.Random) -> bytes:
    alphabet = b"\t\n\r -+0189afAFxg._\x00\xff\xc3"
    data = bytearray(line)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:
            del data[min(pos, len(data) - 1)]
        elif op == 1:
            data.insert(pos, rng.choice(alphabet))
        elif op == 2 and data:
            data[min(pos, len(data) - 1)] = rng.randrange(256)
        elif op == 3:  # a field emptied or replaced
            fields = bytes(data).split(b"\t")
            i = rng.randrange(len(fields))
            fields[i] = rng.choice([b"", b"-7", b"1" * 25, b"f" * 20, b"+3", b"--1", b"1e3"])
            data = bytearray(b"\t".join(fields))
        else:  # a field dropped or duplicated
            fields = bytes(data).split(b"\t")
            i = rng.randrange(len(fields))
            fields.insert(i, fields[i]) if rng.random() < 0.5 else fields.pop(i)
            data = bytearray(b"\t".join(fields))
    return bytes(data)


def test_criteo_fuzz_only_documented_errors(tmp_path):
    rng = random.Random(1234)
    rows = [rng.randint(1, 10**6) for _ in range(26)]
    path = tmp_path / "fuzz.tsv"
    for _ in range(40):
        lines = [_criteo_line(rng).encode() for _ in range(10)]
        lines = [_mutate(line, rng) if rng.random() < 0.6 else line for line in lines]
        content = b"\n".join(lines) + b"\n"
        path.write_bytes(content)
        want = [_ref_criteo(line.rstrip(b"\r"), rows) for line in content.split(b"\n")[:-1]]
        try:
            got = list(_criteo(path, rows, batch_size=len(want) or 1, drop_last=False))
            assert all(w is not None for w in want)
        except ValueError as e:
            assert re.match(rf"data\.criteo: {re.escape(str(path))}:\d+: ", str(e)), str(e)
            bad = int(str(e).split(":")[2])
            assert want[bad - 1] is None and all(w is not None for w in want[: bad - 1])
        reader = _criteo(path, rows, batch_size=len(want) or 1, drop_last=False, malformed="skip")
        got = list(reader)
        good = [w for w in want if w is not None]
        assert reader.counts["lines"] == len(want) and reader.counts["malformed"] == len(want) - len(good)
        _assert_rows_close(_rows_of(got), good)


# -- CSV and Parquet --------------------------------------------------------------------------

def _tab_schema(task="ctr"):
    if task == "retrieval":
        return Schema(num_dense=0, features=["user", "items"], num_embeddings=[10, 10], task="retrieval",
                      query_features=["user"])
    return Schema(num_dense=2, features=["user", "items"], num_embeddings=[10, 10])


def _csv(paths, *, task="ctr", batch_size=2, rank=0, world_size=1, **kw):
    kw.setdefault("dense_columns", [] if task == "retrieval" else ["price", "age"])
    cfg = DataConfig(source="csv", batch_size=batch_size, **kw)
    return CsvReader(_tab_schema(task), cfg, [str(p) for p in paths], rank=rank, world_size=world_size)


CSV = """label,user,price,items,age
1,3,0.5,1|2|3,10
0,4,,,11
1,12,1.5,7,-2
"""


def test_csv_values_multi_id_and_empty_cells(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(CSV)
    reader = _csv([path], batch_size=3)
    (batch,) = list(reader)
    assert reader.counts == {"lines": 3, "good": 3, "malformed": 0, "dropped": 0, "batches": 1}
    assert batch.labels.tolist() == [1.0, 0.0, 1.0]
    assert batch.dense.tolist() == [[0.5, 10.0], [0.0, 11.0], [1.5, -2.0]]
    bags = batch.sparse.to_dict()
    assert bags["user"].lengths().tolist() == [1, 1, 1] and bags["user"].values().tolist() == [3, 4, 12]
    assert bags["items"].lengths().tolist() == [3, 0, 1] and bags["items"].values().tolist() == [1, 2, 3, 7]
    # 12 >= rows (10) is left to the parameter server's id policy.


def test_csv_malformed_skip_and_error(tmp_path):
    bad = [
        ("1,3,0.5,1|2", "4 cells; the header has 5"),
        ("1,3,abc,1,1", "column 'price': 'abc' is not a number"),
        ("1,-3,0.5,1,1", "column 'user': '-3' is not an id (an integer in [0, 2**63))"),
        ("1,3,0.5,1|1.5,1", "column 'items': '1.5' is not an id"),
        ("1,3,0.5,1||2,1", "column 'items': '' is not an id"),
        ("2,3,0.5,1,1", "column 'label': '2' is not a label in [0, 1]"),
        ("x,3,0.5,1,1", "column 'label': 'x' is not a number"),
        (",3,0.5,1,1", "column 'label': '' is not a number"),
    ]
    path = tmp_path / "a.csv"
    path.write_text(CSV + "\n".join(b for b, _ in bad) + "\n\n1,5,1,5,1\n")  # a blank line is ignored
    reader = _csv([path], batch_size=2, malformed="skip")
    assert [len(b) for b in reader] == [2, 2]
    assert reader.counts == {"lines": 12, "good": 4, "malformed": 8, "dropped": 0, "batches": 2}
    for line, message in bad:
        path.write_text(CSV + line + "\n")
        with pytest.raises(ValueError) as e:
            list(_csv([path]))
        assert str(e.value).startswith(f"data.csv: {path}:5: {message}")


def test_csv_an_unclosed_quote_is_named_at_the_line_it_opens_on(tmp_path):
    """The csv module reads a quoted field on to the next quote or the end of the file (or until
    the field is too long), so the record ends far below; the message names the line the quote
    opens on, where the record starts."""
    good = "".join(f"1,{i % 10},0.5,{i % 10},3\n" for i in range(20))
    path = tmp_path / "a.csv"
    opened = "data.csv: {}:5: a quoted field opens on this line and runs on to line {} (a closing quote missing?): "
    for text, end, message in [
        (CSV + '1,3,0.5,"1|2,1\n' + good, 25, "4 cells; the header has 5"),  # never closed
        (CSV + '1,3,0.5,"1|2,1\n' + good + '1,3,0.5,1",1\n' + good, 26, "column 'items': '2,1\\n1,0,"),
        (CSV + '1,3,0.5,"1|2,1\n' + good * 600, 10928, "not CSV: field larger than field limit"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError) as e:
            list(_csv([path]))
        assert str(e.value).startswith(opened.format(path, end) + message), str(e.value)
    path.write_text(CSV + '1,3,0.5,"1|2,1\n' + good)
    reader = _csv([path], batch_size=3, malformed="skip")  # skipped: the records of lines 2-4 stay
    assert [len(b) for b in reader] == [3] and reader.counts["malformed"] == 1


def test_csv_columns_and_sharding(tmp_path):
    path = tmp_path / "a.csv.gz"
    rows = [f"{i % 2},{i},{i / 2},{i}|{i + 1},{i}" for i in range(9)]
    with gzip.open(path, "wt") as f:
        f.write("label,user,price,items,age\n" + "\n".join(rows) + "\n")
    shards = [list(_csv([path], batch_size=2, rank=r, world_size=2)) for r in range(2)]
    assert [len(s) for s in shards] == [2, 2]  # 9 rows: 2 global batches of 4, 1 dropped
    users = [b.sparse.to_dict()["user"].values().tolist() for pair in zip(*shards, strict=True) for b in pair]
    assert users == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match=re.escape(f"data.csv: {path}: no column 'weight' (data.dense_columns); "
                                                   "the header has: label, user, price, items, age")):
        list(_csv([path], dense_columns=["price", "weight"]))
    with pytest.raises(ValueError, match=r"data\.dense_columns: the model reads 2 dense features; got 1"):
        _csv([path], dense_columns=["price"])
    with pytest.raises(ValueError, match=r"data\.sparse_columns: the model reads 2 sparse features"):
        _csv([path], sparse_columns=["user"])


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_a_damaged_gzip_file_is_an_input_error_naming_it(tmp_path, damage):
    """Cut short or with changed bytes, a gzip file raises one InputError naming it, from the
    check before a run and from reading it in a run."""
    from hybrid.errors import InputError

    path = tmp_path / "a.csv.gz"
    rows = [f"{i % 2},{i % 10},{i / 2},{i % 10},{i}" for i in range(20000)]
    packed = gzip.compress(("label,user,price,items,age\n" + "\n".join(rows) + "\n").encode(), mtime=0)
    if damage == "truncated":
        packed = packed[: len(packed) * 2 // 3]
    else:
        mid = len(packed) * 2 // 3
        packed = packed[:mid] + bytes([packed[mid] ^ 0xFF]) * 64 + packed[mid + 64 :]
    path.write_bytes(packed)
    with pytest.raises(InputError, match=re.escape(f"{path}: a damaged or truncated gzip file (")):
        _csv([path], batch_size=2, check_lines=10).check_files()  # the check reads a block past the damage
    with pytest.raises(InputError, match=re.escape(f"{path}: a damaged or truncated gzip file (")):
        list(_csv([path], batch_size=2))


def test_csv_retrieval_without_labels(tmp_path):
    path = tmp_path / "pairs.csv"
    path.write_text("u,i\n1,2\n3,4\n")
    (batch,) = list(_csv([path], task="retrieval", sparse_columns=["u", "i"]))
    assert batch.labels.tolist() == [1.0, 1.0] and batch.dense.shape == (2, 0)
    assert batch.sparse.to_dict()["items"].values().tolist() == [2, 4]


def test_parquet_without_pyarrow_says_how_to_install(monkeypatch):
    from hybrid.data import ParquetReader

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=re.escape("parquet needs pyarrow: pip install pyarrow")):
        ParquetReader(_tab_schema(), DataConfig(source="parquet", dense_columns=["price", "age"]), [])


def test_parquet_reader(tmp_path):
    import pyarrow as pa  # pinned in requirements.txt: this test always runs
    import pyarrow.parquet as pq
    from hybrid.data import ParquetReader

    table = pa.table({
        "label": [1, 0, 1, 1, 0],
        "user": [3, 4, None, 5, -1],
        "price": [0.5, None, 1.5, 2.0, 1.0],
        "items": [[1, 2], [], None, [9], [1]],
        "age": [10, 11, 12, 13, 14],
    })
    path = tmp_path / "a.parquet"
    pq.write_table(table, path)
    cfg = DataConfig(source="parquet", batch_size=4, dense_columns=["price", "age"], malformed="skip")
    reader = ParquetReader(_tab_schema(), cfg, [str(path)])
    (batch,) = list(reader)
    assert reader.counts == {"lines": 5, "good": 4, "malformed": 1, "dropped": 0, "batches": 1}
    assert batch.labels.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert batch.dense.tolist() == [[0.5, 10.0], [0.0, 11.0], [1.5, 12.0], [2.0, 13.0]]
    bags = batch.sparse.to_dict()
    assert bags["user"].lengths().tolist() == [1, 1, 0, 1] and bags["user"].values().tolist() == [3, 4, 5]
    assert bags["items"].lengths().tolist() == [2, 0, 0, 1] and bags["items"].values().tolist() == [1, 2, 9]
    cfg.malformed = "error"
    with pytest.raises(ValueError, match=re.escape(f"data.parquet: {path}: row 5: column 'user': -1 is not an id")):
        list(ParquetReader(_tab_schema(), cfg, [str(path)]))


def test_seeded_fuzz_batch_slice_equals_slicing_each_feature():
    """Batch.slice (a trainer's share of a global batch) on random KJTs -- empty bags, empty
    features, weights, any [lo, hi) including empty ranges -- equals slicing every feature's
    bags one by one."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(99)
    for case in range(100):
        n, keys = int(torch.randint(1, 9, (1,), generator=g)), ["a", "b", "c"][: 1 + case % 3]
        lengths = torch.randint(0, 4, (len(keys) * n,), generator=g) * (torch.rand(len(keys) * n, generator=g) > 0.3)
        values = torch.randint(0, 1000, (int(lengths.sum()),), generator=g)
        weighted = case % 2 == 0
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths,
                                                  weights=torch.rand(values.numel(), generator=g) if weighted else None)
        batch = Batch(torch.randn(n, 2, generator=g), kjt, torch.rand(n, generator=g))
        lo = int(torch.randint(0, n + 1, (1,), generator=g))
        hi = int(torch.randint(lo, n + 1, (1,), generator=g))
        part = batch.slice(lo, hi)
        assert len(part) == hi - lo and part.sparse.keys() == keys
        torch.testing.assert_close(part.dense, batch.dense[lo:hi])
        for k in keys:
            jt = kjt[k]
            bags = [jt.values()[int(jt.offsets()[i]):int(jt.offsets()[i + 1])] for i in range(lo, hi)]
            assert part.sparse[k].lengths().tolist() == [b.numel() for b in bags], (case, k)
            assert part.sparse[k].values().tolist() == (torch.cat(bags).tolist() if bags else []), (case, k)
            if weighted:
                wb = [jt.weights()[int(jt.offsets()[i]):int(jt.offsets()[i + 1])] for i in range(lo, hi)]
                want = torch.cat(wb) if wb else torch.empty(0)
                torch.testing.assert_close(part.sparse[k].weights(), want)
