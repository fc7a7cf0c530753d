"""``python -m benchmarks.readers``: what a trainer's file reader costs per batch, by format and
number of trainers.

Every file reader shards by global batch: the good records of the files, in order, form global
batches of ``trainers x --batch`` and each trainer takes its slice, so every trainer parses every
record (all agree on the malformed ones) and a trainer's cost per batch grows with the trainers.
This measures trainer 0's CPU time per batch (``time.process_time`` over a whole pass, the
reader alone, in this process) for each ``--trainers`` count, on files written once into a
temporary folder from one seeded stream:

- ``criteo``: Criteo TSV (label, 13 integers, 26 hex categoricals; some blank cells);
- ``csv`` / ``parquet``: the same records with named columns (13 float, 26 integer-id columns);
- ``csv_quoted``: the CSV file with every value in quotes (pyarrow's ``quoting_style="all_valid"``);
- ``sequence_csv`` / ``sequence_parquet``: one row per user (3-60 item ids, timestamps with ties).

The CSV and Parquet readers convert a block of records a column at a time and fall back to
parsing rows one at a time; ``parquet_rows`` / ``sequence_parquet_rows`` are the Parquet readers
held to the row path, measured in the same run (the ratio line is row path / bulk). Each JSON line holds one
reader at one trainer count (median of ``--repeat`` passes); a table goes to stderr.

A resumed run starts Criteo, CSV (quoted or not) and Parquet files where the checkpoint says the block holding
its next record starts (``FileReader.seek_point``): the last lines give, for one trainer, the wall
time to the first batch at ``--resume-at`` of the file's records, reading from the top (every
record before it parsed) and from the seek point.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hybrid.data import DataConfig, Schema, make_dataset
from hybrid.data.sequences import ITEM, NEGATIVE, SequenceParquetReader
from hybrid.data.tabular import ParquetReader

DENSE, SPARSE = 13, 26


class _RowParquet(ParquetReader):
    """The Parquet reader held to its row-by-row path (the baseline of the bulk one)."""

    def _columnar(self, *args: Any) -> None:
        return None


class _RowSequenceParquet(SequenceParquetReader):
    def _columnar(self, *args: Any) -> None:
        return None


def write_files(folder: Path, records: int, seed: int) -> dict[str, str]:
    """The benchmark's files in ``folder``, by reader name."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    labels = [rng.randrange(2) for _ in range(records)]
    ints = [[rng.randrange(1000) if rng.random() > 0.2 else None for _ in range(DENSE)] for _ in range(records)]
    cats = [[rng.getrandbits(32) if rng.random() > 0.1 else None for _ in range(SPARSE)] for _ in range(records)]
    paths = {"criteo": str(folder / "day.tsv"), "csv": str(folder / "t.csv"),
             "csv_quoted": str(folder / "tq.csv"), "parquet": str(folder / "t.parquet"),
             "sequence_csv": str(folder / "s.csv"),
             "sequence_parquet": str(folder / "s.parquet")}
    with open(paths["criteo"], "w") as f:
        for y, xs, cs in zip(labels, ints, cats):
            f.write("\t".join([str(y), *("" if x is None else str(x) for x in xs),
                               *("" if c is None else "%08x" % c for c in cs)]) + "\n")
    cols: dict[str, Any] = {"label": pa.array(labels, pa.int64())}
    cols.update({f"I{j + 1}": pa.array([float(x[j] or 0) for x in ints]) for j in range(DENSE)})
    cols.update({f"C{j + 1}": pa.array([c[j] for c in cats], pa.int64()) for j in range(SPARSE)})
    table = pa.table(cols)
    pacsv.write_csv(table, paths["csv"])
    pacsv.write_csv(table, paths["csv_quoted"], write_options=pacsv.WriteOptions(quoting_style="all_valid"))
    pq.write_table(table, paths["parquet"])
    items = [[rng.randrange(100_000) for _ in range(rng.randrange(3, 61))] for _ in range(records)]
    stamps = [[float(rng.randrange(len(x))) for _ in x] for x in items]
    with open(paths["sequence_csv"], "w") as f:
        f.write("items,ts\n")
        for x, t in zip(items, stamps):
            f.write("|".join(map(str, x)) + "," + "|".join(map(str, t)) + "\n")
    pq.write_table(pa.table({"items": pa.array(items, pa.list_(pa.int64())), "ts": pa.array(stamps)}),
                   paths["sequence_parquet"])
    return paths


def _reader(name: str, path: str, batch: int, rank: int, trainers: int) -> Any:
    if name.startswith("sequence"):
        schema = Schema(0, [ITEM, NEGATIVE], [100_000, 100_000], task="sequence")
        cfg = DataConfig(source=name.split("_")[1], train_paths=[path], batch_size=batch, timestamps_column="ts")
        if name.endswith("_rows"):
            return _RowSequenceParquet(schema, cfg, [path], rank=rank, world_size=trainers)
        return make_dataset(schema, cfg, split="train", rank=rank, world_size=trainers)
    schema = Schema(DENSE, [f"C{j + 1}" for j in range(SPARSE)], [100_000] * SPARSE)
    source = name.removesuffix("_rows").removesuffix("_quoted")
    cfg = DataConfig(source=source, train_paths=[path], batch_size=batch,
                     dense_columns=[] if source == "criteo" else [f"I{j + 1}" for j in range(DENSE)])
    if name.endswith("_rows"):
        return _RowParquet(schema, cfg, [path], rank=rank, world_size=trainers)
    return make_dataset(schema, cfg, split="train", rank=rank, world_size=trainers)


def measure(name: str, path: str, batch: int, trainers: int) -> tuple[float, int]:
    """Trainer 0's CPU milliseconds per batch over one pass, and its batches."""
    reader = _reader(name, path, batch, 0, trainers)
    t = time.process_time()
    n = sum(1 for _ in reader)
    return (time.process_time() - t) * 1e3 / max(n, 1), n


def measure_resume(name: str, path: str, batch: int, at: float, records: int) -> tuple[int, float, float]:
    """The record (about ``at`` of the file's ``records``) a resumed pass starts at, and the wall
    milliseconds to its first batch read from the top and from the seek point a pass gave there."""
    reader = _reader(name, path, batch, 0, 1)
    target, point = 0, None
    for j, _ in enumerate(reader, start=1):
        target = j * batch
        point = reader.seek_point(0, target)
        if target >= min(at * records, records - batch):  # a batch left after it
            break
    times = []
    for resume_at in (None, point):
        resumed = _reader(name, path, batch, 0, 1)
        resumed.start_record, resumed.resume_at = target, resume_at
        t = time.perf_counter()
        next(iter(resumed))
        times.append((time.perf_counter() - t) * 1e3)
    return target, times[0], times[1]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--records", type=int, default=40_000, help="records per file")
    p.add_argument("--batch", type=int, default=256, help="samples per trainer per batch")
    p.add_argument("--trainers", default="1,2,8,32", help="comma-separated trainer counts")
    p.add_argument("--readers", default="criteo,csv,csv_quoted,parquet,parquet_rows,sequence_csv,sequence_parquet,"
                                        "sequence_parquet_rows", help="comma-separated readers")
    p.add_argument("--repeat", type=int, default=3, help="passes per reader and trainer count (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume-at", type=float, default=0.975,
                   help="where a resumed pass starts, as a share of the file's records")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    import pyarrow.compute  # noqa: F401 - imported once here, not inside the first timed pass

    counts = [int(x) for x in args.trainers.split(",")]
    names = args.readers.split(",")
    rows: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="hybrid-readers-") as tmp:
        paths = write_files(Path(tmp), args.records, args.seed)
        for name in names:
            path = paths[name.removesuffix("_rows")]
            for w in counts:
                runs = [measure(name, path, args.batch, w) for _ in range(args.repeat)]
                ms, batches = statistics.median(r[0] for r in runs), runs[0][1]
                rows[name, w] = ms
                print(json.dumps({"reader": name, "trainers": w, "batch": args.batch, "batches": batches,
                                  "cpu_ms_per_batch": round(ms, 4), "records": args.records}), flush=True)
        resumes = []
        for name in [n for n in ("criteo", "csv", "csv_quoted", "parquet") if n in names]:
            record, top, seek = measure_resume(name, paths[name], args.batch, args.resume_at, args.records)
            print(json.dumps({"reader": name, "resume_record": record, "first_batch_ms_from_top": round(top, 2),
                              "first_batch_ms_from_seek_point": round(seek, 2)}), flush=True)
            resumes.append(f"{name}: resumed at record {record:,}, the first batch after {top:.1f} ms reading from "
                           f"the top, {seek:.1f} ms from the seek point")
    width = max(map(len, names))
    print(f"\ntrainer 0's CPU ms per batch of {args.batch} ({args.records} records a file)", file=sys.stderr)
    print(f"{'reader':<{width}}  " + "  ".join(f"{f'{w} trainers':>11}" for w in counts), file=sys.stderr)
    for name in names:
        print(f"{name:<{width}}  " + "  ".join(f"{rows[name, w]:>11.2f}" for w in counts), file=sys.stderr)
    for name in names:
        if name.endswith("_rows") and name.removesuffix("_rows") in names:
            bulk = name.removesuffix("_rows")
            ratios = ", ".join(f"{rows[name, w] / rows[bulk, w]:.1f}x" for w in counts)
            print(f"{bulk}: the row path costs {ratios} the bulk path's ({', '.join(map(str, counts))} trainers)",
                  file=sys.stderr)
    for line in resumes:
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
