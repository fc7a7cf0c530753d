"""File readers: CSV and Parquet with named columns, and the sharding every file reader shares.

Sharding (:class:`FileReader`, also used by the Criteo reader): the good records of the files,
read in order, form global batches of ``world_size x batch_size``; trainer ``r`` yields records
``[r*B, (r+1)*B)`` of each. Every trainer reads every line, so all of them agree on which lines
are malformed and yield the same number of batches, and sync training equals single-process
training on the global batches. An incomplete last global batch of ``g`` records is dropped
(``data.drop_last``, the default) or split as evenly as possible: trainer ``r`` gets records
``[r*g//W, (r+1)*g//W)`` (dropped when ``g < W``, since every trainer must get a sample).

A malformed record is a ``ValueError`` naming the file, the line (or row) and the bad field when
``data.malformed == "error"``, or is skipped and counted when ``"skip"`` (the first one of each
pass is logged). ``counts`` holds, for the current or last pass: ``lines`` (records read),
``good``, ``malformed``, ``dropped`` (good records of a dropped last global batch) and
``batches`` (yielded by this trainer). Each ``iter()`` is a new pass over the files.

CSV and Parquet (:class:`CsvReader`, :class:`ParquetReader`):

- columns are named by ``data.dense_columns`` (one per dense feature, in order),
  ``data.sparse_columns`` (one per sparse feature, in the schema's order; empty = the feature
  names) and ``data.label_column``; a missing column is an error naming it and the header;
- a dense cell is a number, used as it is (normalize upstream); a blank/null one is 0;
- a sparse cell holds ids separated by ``data.id_separator`` (Parquet: also an integer or a list
  of integers); an empty/null cell is an empty bag. Ids must be non-negative integers below
  ``2**63``; ids beyond a table's rows are not checked here (the parameter server's id policy
  handles them);
- the label is a number in ``[0, 1]``; retrieval data may have no label column (every row is a
  positive pair, label 1);
- blank CSV lines are ignored; the CSV header is the first line.
"""

from __future__ import annotations

import csv
import glob
import gzip
import io
import logging
from collections.abc import Iterator, Sequence
from typing import IO, Any

import torch

from hybrid.data.batch import Batch, kjt_from_ids
from hybrid.data.config import DataConfig, Schema
from hybrid.errors import InputError

logger = logging.getLogger("hybrid.data")

_MAX_ID = (1 << 63) - 1
_CHUNK_ROWS = 8192


def expand_paths(paths: Sequence[str]) -> list[str]:
    """``paths`` in order, glob patterns (``*``, ``?``, ``[``) expanded and sorted; the rest kept."""
    out: list[str] = []
    for p in paths:
        out.extend(sorted(glob.glob(p)) if glob.has_magic(p) else [p])
    return out


def open_binary(path: str) -> IO[bytes]:
    """``path`` for reading bytes, decompressed when it is gzip (by its magic number, not its name)."""
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")  # type: ignore[return-value]


def show(value: Any, limit: int = 40) -> str:
    """``repr`` of a field for an error message: text (bytes decoded), cut to ``limit`` characters."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + "..."
    return repr(value)


class FileReader:
    """Sharded batches of the good records of files read in order (see the module docstring).

    A subclass sets ``source`` (named in messages as ``data.<source>``), yields lists of good
    records from :meth:`_chunks` (counting ``counts["lines"]``, reporting bad records with
    :meth:`_malformed`) and turns a list of records into a :class:`Batch` in :meth:`_batch`.
    """

    source = "files"

    def __init__(self, schema: Schema, cfg: DataConfig, paths: Sequence[str], *, rank: int = 0,
                 world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.schema, self.cfg = schema, cfg
        self.paths = expand_paths(paths)
        self.rank, self.world_size = rank, world_size
        self.batch_size = cfg.batch_size
        self.counts = self._zero_counts()

    @staticmethod
    def _zero_counts() -> dict[str, int]:
        return {"lines": 0, "good": 0, "malformed": 0, "dropped": 0, "batches": 0}

    def __iter__(self) -> Iterator[Batch]:
        self.counts = counts = self._zero_counts()
        w, b = self.world_size, self.batch_size
        size, lo, hi = w * b, self.rank * b, (self.rank + 1) * b
        buf: list[Any] = []
        for chunk in self._chunks():
            counts["good"] += len(chunk)
            buf += chunk
            while len(buf) >= size:
                counts["batches"] += 1
                yield self._batch(buf[lo:hi])
                del buf[:size]
        g = len(buf)
        if g and (self.cfg.drop_last or g < w):
            counts["dropped"] = g
        elif g:
            counts["batches"] += 1
            yield self._batch(buf[self.rank * g // w:(self.rank + 1) * g // w])

    def check_files(self) -> None:
        """Raise :class:`InputError` unless every file can be read and is not empty (CSV, Parquet:
        and has every named column) and its first ``data.check_lines`` lines parse, before a run
        starts; later lines are checked as they are read."""
        for path in self.paths:
            try:
                self._check_file(path)
                self._check_lines(path, self.cfg.check_lines)
            except OSError as e:
                raise InputError(f"data.{self.source}: {path}: cannot read it ({e.strerror or e})") from None

    def _check_lines(self, path: str, lines: int) -> None:
        """Parse the first ``lines`` lines of ``path`` as a run would (bad ones raise or are counted)."""
        if lines <= 0:
            return
        one = type(self)(self.schema, self.cfg, [path])
        chunks = one._chunks()
        try:
            for _ in chunks:
                if one.counts["lines"] >= lines:
                    break
        finally:
            chunks.close()

    def _check_file(self, path: str) -> None:
        """Raise unless ``path`` has a first line (``OSError`` when it cannot be read)."""
        with open_binary(path) as f:
            if not f.readline().strip():
                raise InputError(f"data.{self.source}: {path}: empty file (or an empty first line)")

    def _malformed(self, where: str, message: str) -> None:
        """Raise for a bad record at ``where`` (``file:line``), or count it when skipping."""
        text = f"data.{self.source}: {where}: {message}"
        if self.cfg.malformed == "error":
            raise InputError(f"{text} (data.malformed=skip skips such lines)")
        self.counts["malformed"] += 1
        if self.counts["malformed"] == 1:
            logger.warning("%s (skipped: data.malformed=skip; later ones are only counted)", text)

    def _chunks(self) -> Iterator[list[Any]]:
        """The good records, in order, a list at a time."""
        raise NotImplementedError

    def _batch(self, records: list[Any]) -> Batch:
        """One trainer's batch from its records."""
        raise NotImplementedError


def _number(value: Any) -> float | None:
    """A float from a cell (text or a Parquet value); ``None`` when it is not a number."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _id(value: Any) -> int | None:
    """A valid id (integer in ``[0, 2**63)``) from a token or a Parquet value; ``None`` otherwise."""
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= _MAX_ID else None


class _Columns(FileReader):
    """What CSV and Parquet share: the column mapping and the parse of one row's cells."""

    def __init__(self, schema: Schema, cfg: DataConfig, paths: Sequence[str], *, rank: int = 0,
                 world_size: int = 1) -> None:
        super().__init__(schema, cfg, paths, rank=rank, world_size=world_size)
        self.dense_columns = list(cfg.dense_columns)
        self.sparse_columns = list(cfg.sparse_columns) or list(schema.features)
        if len(self.dense_columns) != schema.num_dense:
            raise ValueError(f"data.dense_columns: the model reads {schema.num_dense} dense features; "
                             f"got {len(self.dense_columns)} columns {self.dense_columns}")
        if len(self.sparse_columns) != len(schema.features):
            raise ValueError(f"data.sparse_columns: the model reads {len(schema.features)} sparse features "
                             f"{schema.features}; got {len(self.sparse_columns)} columns {self.sparse_columns}")
        self.sep = cfg.id_separator

    def _indices(self, path: str, header: Sequence[str]) -> tuple[int | None, list[int], list[int]]:
        """Positions in ``header`` of the label (``None``: none, retrieval only), dense and sparse columns."""
        where = {name: i for i, name in enumerate(header)}

        def find(name: str, key: str) -> int:
            if name not in where:
                raise InputError(f"data.{self.source}: {path}: no column {name!r} ({key}); the header "
                                 f"has: {', '.join(map(str, header))}")
            return where[name]

        label_name = self.cfg.label_column
        if self.schema.task == "retrieval" and (not label_name or label_name not in where):
            label = None
        else:
            label = find(label_name, "data.label_column")
        return (label, [find(n, "data.dense_columns") for n in self.dense_columns],
                [find(n, "data.sparse_columns") for n in self.sparse_columns])

    def _parse(self, label: Any, dense: Sequence[Any], sparse: Sequence[Any]) -> tuple | str:
        """``(label, dense floats, id lists)`` from one row's cells, or what is wrong with them."""
        y = _number(label)
        if y is None or not 0.0 <= y <= 1.0:
            what = "a number" if y is None else "a label in [0, 1]"
            return f"column {self.cfg.label_column!r}: {show(label)} is not {what}"
        xs = []
        for name, v in zip(self.dense_columns, dense, strict=True):
            x = 0.0 if v is None or v == "" else _number(v)
            if x is None:
                return f"column {name!r}: {show(v)} is not a number"
            xs.append(x)
        bags = []
        for name, v in zip(self.sparse_columns, sparse, strict=True):
            if v is None or v == "":
                bags.append([])
                continue
            tokens = v.split(self.sep) if isinstance(v, str) else v if isinstance(v, list) else [v]
            ids = [_id(t) for t in tokens]
            if None in ids:
                bad = tokens[ids.index(None)]
                return f"column {name!r}: {show(bad)} is not an id (an integer in [0, 2**63))"
            bags.append(ids)
        return y, xs, bags

    def _batch(self, records: list[tuple]) -> Batch:
        n = len(records)
        labels = torch.tensor([r[0] for r in records], dtype=torch.float32)
        dense = torch.tensor([r[1] for r in records], dtype=torch.float32).reshape(n, self.schema.num_dense)
        ids, lengths = [], []
        for f in range(len(self.schema.features)):
            lengths.append(torch.tensor([len(r[2][f]) for r in records], dtype=torch.int64))
            ids.append(torch.tensor([i for r in records for i in r[2][f]], dtype=torch.int64))
        return Batch(dense, kjt_from_ids(self.schema.features, ids, lengths), labels)


class CsvReader(_Columns):
    """CSV files (stdlib ``csv``, first line the header, ``.gz`` decompressed); see the module docstring."""

    source = "csv"

    def _check_file(self, path: str) -> None:
        with io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="replace", newline="") as f:
            self._indices(path, self._header(path, csv.reader(f)))

    @staticmethod
    def _header(path: str, reader: Iterator[list[str]]) -> list[str]:
        header = next(reader, None)
        if header is None:
            raise InputError(f"data.csv: {path}: empty file (the first line must be the header)")
        return header

    def _chunks(self) -> Iterator[list[tuple]]:
        chunk: list[tuple] = []
        for path in self.paths:
            with io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="replace", newline="") as f:
                reader = csv.reader(f)
                header = self._header(path, reader)
                label, dense, sparse = self._indices(path, header)
                while True:
                    try:
                        row = next(reader)
                    except StopIteration:
                        break
                    except csv.Error as e:
                        self.counts["lines"] += 1
                        self._malformed(f"{path}:{reader.line_num}", f"not CSV: {e}")
                        continue
                    if not row:
                        continue
                    self.counts["lines"] += 1
                    if len(row) != len(header):
                        self._malformed(f"{path}:{reader.line_num}", f"{len(row)} cells; the header has {len(header)}")
                        continue
                    parsed = self._parse(1.0 if label is None else row[label], [row[i] for i in dense],
                                         [row[i] for i in sparse])
                    if isinstance(parsed, str):
                        self._malformed(f"{path}:{reader.line_num}", parsed)
                        continue
                    chunk.append(parsed)
                    if len(chunk) == _CHUNK_ROWS:
                        yield chunk
                        chunk = []
        yield chunk


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("parquet needs pyarrow: pip install pyarrow") from None
    return pq


class ParquetReader(_Columns):
    """Parquet files (pyarrow, read in record batches); see the module docstring. Rows are numbered from 1."""

    source = "parquet"

    def __init__(self, schema: Schema, cfg: DataConfig, paths: Sequence[str], *, rank: int = 0,
                 world_size: int = 1) -> None:
        super().__init__(schema, cfg, paths, rank=rank, world_size=world_size)
        self._pq = _pyarrow_parquet()

    def _check_file(self, path: str) -> None:
        try:
            pf = self._pq.ParquetFile(path)
        except ValueError as e:  # pyarrow's ArrowInvalid
            raise InputError(f"data.parquet: {path}: not a Parquet file ({e})") from None
        self._indices(path, pf.schema_arrow.names)
        if pf.metadata.num_rows == 0:
            raise InputError(f"data.parquet: {path}: empty file (no rows)")

    def _chunks(self) -> Iterator[list[tuple]]:
        for path in self.paths:
            pf = self._pq.ParquetFile(path)
            header = pf.schema_arrow.names
            label, dense, sparse = self._indices(path, header)
            names = list(dict.fromkeys(header[i] for i in ([] if label is None else [label]) + dense + sparse))
            row = 0
            for rb in pf.iter_batches(batch_size=_CHUNK_ROWS, columns=names):
                cols = {name: rb.column(name).to_pylist() for name in names}
                ys = cols[header[label]] if label is not None else [1.0] * rb.num_rows
                xs = [cols[header[i]] for i in dense]
                ss = [cols[header[i]] for i in sparse]
                chunk = []
                for j in range(rb.num_rows):
                    self.counts["lines"] += 1
                    parsed = self._parse(ys[j], [c[j] for c in xs], [c[j] for c in ss])
                    if isinstance(parsed, str):
                        self._malformed(f"{path}: row {row + j + 1}", parsed)
                    else:
                        chunk.append(parsed)
                row += rb.num_rows
                yield chunk


__all__ = ["CsvReader", "FileReader", "ParquetReader", "expand_paths", "open_binary"]
