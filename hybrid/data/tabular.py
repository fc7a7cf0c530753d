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

import collections
import contextlib
import csv
import dataclasses
import glob
import gzip
import io
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from hybrid import ops
from hybrid.data.batch import Batch, kjt_from_ids
from hybrid.data.config import DataConfig, Schema
from hybrid.errors import InputError

logger = logging.getLogger("hybrid.data")

_MAX_ID = (1 << 63) - 1
_CHUNK_ROWS = 8192
_CSV_BLOCK_BYTES = 1 << 20
_CSV_RECORD_BYTES = 64 << 20
"""A CSV record longer than this hands the rest of its file to pyarrow's streaming reader."""


def expand_paths(paths: Sequence[str]) -> list[str]:
    """``paths`` in order, glob patterns (``*``, ``?``, ``[``) expanded and sorted; the rest kept."""
    out: list[str] = []
    for p in paths:
        out.extend(sorted(glob.glob(p)) if glob.has_magic(p) else [p])
    return out


class _GzipFile(gzip.GzipFile):
    """A gzip file whose damaged or truncated data raises :class:`InputError` naming the file
    (``gzip`` raises ``zlib.error``, ``EOFError`` or ``BadGzipFile`` without it), wherever the
    reading stops: at the check before a run or in its middle."""

    def _named(self, fn, *args):  # noqa: ANN001, ANN202
        try:
            return fn(*args)
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise InputError(f"{self.name}: a damaged or truncated gzip file ({e})") from None

    def read(self, size=-1):  # noqa: ANN001, ANN201
        return self._named(super().read, size)

    def read1(self, size=-1):  # noqa: ANN001, ANN201
        return self._named(super().read1, size)

    def readline(self, size=-1):  # noqa: ANN001, ANN201
        return self._named(super().readline, size)

    def peek(self, n):  # noqa: ANN001, ANN201
        return self._named(super().peek, n)

    def seek(self, offset, whence=io.SEEK_SET):  # noqa: ANN001, ANN201 - forward: decompresses up to there
        return self._named(super().seek, offset, whence)


def open_binary(path: str) -> IO[bytes]:
    """``path`` for reading bytes, decompressed when it is gzip (by its magic number, not its name)."""
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return _GzipFile(path, "rb") if gzipped else open(path, "rb")  # type: ignore[return-value]


def csv_header(path: str, reader: Iterator[list[str]]) -> list[str]:
    """The first row of a ``csv.reader`` over ``path``: its header (an empty file is an error)."""
    header = next(reader, None)
    if header is None:
        raise InputError(f"data.csv: {path}: empty file (the first line must be the header)")
    return header


@contextlib.contextmanager
def csv_reader_at(path: str, start: tuple[int, int] | None) -> Iterator[tuple[Any, list[str], int]]:
    """A ``csv.reader`` over ``path`` after its header, or from ``start`` (the byte offset and the
    lines before it of a line that starts a record); with the header and the file's lines before
    the reader's first."""
    with io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.reader(f)
        header = csv_header(path, reader)
        base = 0
        if start is not None:
            f.seek(0)  # a text file seeks only to 0 or to tell()'s cookies: then the bytes beneath it
            f.buffer.seek(start[0])
            reader, base = csv.reader(f), start[1]
        yield reader, header, base


def arrow_csv_batches(path: str, types: dict[str, Any], start: tuple[int, int] | None = None
                      ) -> Iterator[tuple[Any, int | None, int | None] | None]:
    """The record batches of a CSV file (header first; ``.gz`` decompressed) read by pyarrow, about
    1 MB of the file at a time, with the columns of ``types`` as those types (a blank cell is
    null, except in text); ``None``, then nothing more, at the first row pyarrow refuses (another
    number of cells), text it cannot decode or a cell it cannot convert -- where a reader goes
    line by line instead.

    pyarrow parses the file's whole records a block at a time (:func:`_records_end` finds where
    the last record of a block ends, line breaks in quoted fields included), the header (one
    line, its names quoted or not) before them, and each batch comes with the byte offset (in the
    decompressed file) and the number of lines before its first row. A record longer than a
    block makes the block longer; from a record longer than ``_CSV_RECORD_BYTES`` on, pyarrow's
    streaming reader takes the rest of the file, and both are ``None``. ``start``: the
    ``(offset, lines)`` of a batch, to read from there."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    invalid: list[int] = []

    def on_invalid(row) -> str:  # noqa: ANN001 - pyarrow's InvalidRow
        invalid.append(row.number or 0)
        return "skip"

    def options(block_size: int, names: list[str] | None = None) -> dict[str, Any]:
        return {"read_options": pacsv.ReadOptions(use_threads=False, block_size=block_size, column_names=names),
                "parse_options": pacsv.ParseOptions(invalid_row_handler=on_invalid),
                "convert_options": pacsv.ConvertOptions(
                    column_types=types, include_columns=list(types), null_values=[""],
                    strings_can_be_null=False, quoted_strings_can_be_null=False)}

    with open_binary(path) as raw:
        try:
            header = raw.readline()
            offset, lines = len(header), 1
            if start is not None:
                raw.seek(start[0])
                offset, lines = start
            pending = bytearray()  # read, not yet parsed (a bytearray: the operator reads it in place)
            names = next(csv.reader([header.decode("utf-8", errors="replace")]), [])
            while header.count(b'"') % 2 == 0:  # the header is its first line (quoted names or not)
                chunk = raw.read(_CSV_BLOCK_BYTES)
                pending += chunk
                if not pending:
                    return
                end = _records_end(pending) if chunk else len(pending)  # at the end: whatever is left
                if end is None and len(pending) < _CSV_RECORD_BYTES:
                    continue  # a record longer than a block: read on
                if end is None:
                    break
                block, pending = pending[:end], pending[end:]
                table = pacsv.read_csv(pa.BufferReader(block), **options(len(block) + 1, names))
                if invalid:
                    yield None
                    return
                if table.num_rows:
                    yield table.combine_chunks().to_batches()[0], offset, lines
                offset, lines = offset + len(block), lines + block.count(b"\n")
            reader = pacsv.open_csv(_Joined(header + bytes(pending), raw), **options(_CSV_BLOCK_BYTES))
            for rb in reader:
                if invalid:
                    yield None
                    return
                yield rb, None, None
            if invalid:
                yield None
        except (pa.ArrowInvalid, UnicodeDecodeError):
            yield None


def _records_end(block: bytearray) -> int | None:
    """Where the last record that ends in ``block`` (which starts a record) ends, just past its
    line break, as pyarrow reads the quotes (:func:`hybrid.ops.csv_records_end`); ``None`` when
    no record ends in it."""
    at = block.rfind(b"\n")
    if at < 0 or b'"' not in block:  # without quotes every line break ends a record
        return at + 1 if at >= 0 else None
    end = ops.csv_records_end(torch.frombuffer(block, dtype=torch.uint8))
    return end if end > 0 else None


class _Joined(io.RawIOBase):
    """``head``, then the rest of ``tail``: one file to read from."""

    def __init__(self, head: bytes, tail: IO[bytes]) -> None:
        self.head, self.tail = memoryview(head), tail

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # noqa: ANN001 - a writable buffer
        if self.head.nbytes:
            n = min(len(b), self.head.nbytes)
            b[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        data = self.tail.read(len(b))
        b[:len(data)] = data
        return len(data)


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
        self._seen: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()
        self._seen_epoch = -1
        self._from: dict[str, Any] | None = None  # where this pass starts reading (_start)
        self._at: dict[str, Any] | None = None  # where the chunk being yielded starts

    @staticmethod
    def _zero_counts() -> dict[str, int]:
        return {"lines": 0, "good": 0, "malformed": 0, "dropped": 0, "batches": 0}

    start_record = 0
    """Good records each pass passes over before its first batch: a resumed run's data position,
    counted in the files' good records, so that it is the same place whatever the number of
    trainers and the batch size that saved it. The records passed over are parsed (every trainer
    must agree on which lines are good) but not batched."""

    keep_tail = False
    """Yield the incomplete last global batch whatever ``data.drop_last`` says, split as evenly as
    possible, even when some trainers get no sample (evaluation: every held-out row is read)."""

    resume_at: dict[str, Any] | None = None
    """Where a chunk of the pass holding record ``start_record`` starts, as :meth:`seek_point`
    gave it (a checkpoint's ``train.data_at``): the pass starts reading there, not at the top of
    the first file -- unless that file is no longer the one read then (its path or size
    differ; logged)."""

    epoch = 0
    """The training pass this is (set by the training loop; :meth:`seek_point` asks for one)."""

    def seek_point(self, epoch: int, records: int) -> dict[str, Any] | None:
        """Where reading must start to reach record ``records`` of pass ``epoch`` without parsing
        what comes before it: the start of a chunk at or before it that this pass read lately
        (``None`` if none is known), for :attr:`resume_at`."""
        if epoch != self._seen_epoch:
            return None
        point = None
        for good, at in self._seen:
            if good > records:
                break
            point = {**at, "records": good}
        return point

    def _start(self) -> dict[str, Any] | None:
        """:attr:`resume_at`, if it can be used for this pass's files."""
        at = self.resume_at
        if at is None or not self.can_seek or not 0 <= at.get("records", -1) <= self.start_record:
            return None
        i, path = at.get("file"), at.get("path")
        if not (isinstance(i, int) and 0 <= i < len(self.paths) and self.paths[i] == path):
            logger.warning("data.%s: the files are not those the checkpoint read (file %s: %s); reading them "
                           "from the top to find record %d", self.source, i, path, self.start_record)
            return None
        size = os.path.getsize(path)
        if size != at.get("size"):
            logger.warning("data.%s: %s has %d bytes, %s when the checkpoint was saved; reading the files from "
                           "the top to find record %d", self.source, path, size, at.get("size"), self.start_record)
            return None
        return at

    can_seek = False
    """Whether :meth:`_chunks` can start where :attr:`resume_at` says (:meth:`_files`): it then
    sets ``_at`` (``file``, ``path``, ``size`` and where in the file) before yielding each chunk."""

    slow_paths: list[str]
    """Files of the current pass read line by line (CSV; diagnostics)."""

    def _bulk_then_lines(self, bulk: Callable[..., Iterator[Any]], lines: Callable[..., Iterator[Any]]
                         ) -> Iterator[Any]:
        """The records of CSV files, a block at a time: from ``bulk(path, start)`` -- items
        ``(block, rows read, offset, lines before)``, ``None`` (then nothing more) where the file
        needs the line-by-line path -- and from there ``lines(path, skip=rows read in bulk,
        start=start)``, which reads the file again from where the pass started in it. Blocks with
        an offset get a seek point (:meth:`seek_point`)."""
        self.slow_paths = []
        for path, where, at in self._files():
            start = None if at is None else (at["offset"], at["line"])
            done, fast = 0, bulk(path, start)
            try:
                for item in fast:
                    if item is None:
                        break
                    block, rows, offset, before = item
                    if offset is not None:
                        self._at = {**where, "offset": offset, "line": before}
                    done += rows
                    yield block
                else:
                    continue
            finally:
                fast.close()
            self.slow_paths.append(path)
            yield from lines(path, skip=done, start=start)

    def _files(self) -> Iterator[tuple[str, dict[str, Any], dict[str, Any] | None]]:
        """The pass's files, each with what a seek point in it names of it (its index, path and
        size) and, for the one :attr:`resume_at` names (the first then), where to start in it;
        the files before that one are left out."""
        first = 0 if self._from is None else self._from["file"]
        for i, path in enumerate(self.paths[first:], start=first):
            where = {"file": i, "path": path, "size": os.path.getsize(path)}
            yield path, where, self._from if self._from is not None and i == first else None

    def __iter__(self) -> Iterator[Batch]:
        self.counts = counts = self._zero_counts()
        w, b = self.world_size, self.batch_size
        size, lo, hi = w * b, self.rank * b, (self.rank + 1) * b
        buf: Any = self._empty()
        self._from = at = self._start()
        first = at["records"] if at is not None else 0  # the good records of the pass before the first chunk
        skip = self.start_record - first
        # Where recent chunks start, for seek_point: as far back as the training loop's position
        # may lag the batches drawn (read ahead, prefetched).
        self._seen = collections.deque()
        self._seen_epoch = self.epoch
        keep = (self.cfg.read_ahead + 4) * size
        self._at = None
        for chunk in self._chunks():
            at_chunk, self._at = self._at, None
            if at_chunk is not None:
                self._seen.append((first + counts["good"], at_chunk))
                while len(self._seen) > 1 and self._seen[1][0] <= first + counts["good"] - keep:
                    self._seen.popleft()
            counts["good"] += len(chunk)
            if skip:
                passed = min(skip, len(chunk))
                chunk, skip = self._take(chunk, passed, len(chunk)), skip - passed
            buf = self._cat(buf, chunk)
            start = 0
            while len(buf) - start >= size:
                counts["batches"] += 1
                yield self._batch(self._take(buf, start + lo, start + hi))
                start += size
            buf = self._take(buf, start, len(buf)) if start else buf
        g = len(buf)
        if g and not self.keep_tail and (self.cfg.drop_last or g < w):
            counts["dropped"] = g
        elif g:
            counts["batches"] += 1
            yield self._batch(self._take(buf, self.rank * g // w, (self.rank + 1) * g // w))

    # Records are buffered as a list (Criteo) or a columnar block (CSV, Parquet).
    def _empty(self) -> Any:
        return []

    def _cat(self, buf: Any, chunk: Any) -> Any:
        return buf + chunk

    def _take(self, buf: Any, lo: int, hi: int) -> Any:
        return buf[lo:hi]

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

    def _csv_rows(self, path: str, reader: Any, header: list[str], base: int = 0) -> Iterator[tuple[list[str], str]]:
        """The rows of a ``csv.reader`` after its header that have one cell per column, each with
        where it is (:func:`_record_where`; ``base``: the file's lines before the reader's first);
        a line that is not CSV or has another number of cells is malformed, an empty line is
        skipped. Every line read is counted."""
        while True:
            start = base + reader.line_num + 1  # the line the next record starts on
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                self.counts["lines"] += 1
                self._malformed(_record_where(path, start, base + reader.line_num), f"not CSV: {e}")
                continue
            if not row:
                continue
            self.counts["lines"] += 1
            where = _record_where(path, start, base + reader.line_num)
            if len(row) != len(header):
                self._malformed(where, f"{len(row)} cells; the header has {len(header)}")
                continue
            yield row, where

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


_FNV_OFFSET, _FNV_PRIME, _MASK64 = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1


def hash_id(text: str) -> int:
    """The id ``data.categorical: hash`` gives a token: 64-bit FNV-1a of its UTF-8 bytes with the
    top bit cleared (``fnv1a64(text) & (2**63 - 1)``), the same on every machine and run.
    :func:`hash_ids` is the vectorized form."""
    h = _FNV_OFFSET
    for byte in text.encode("utf-8"):
        h = ((h ^ byte) * _FNV_PRIME) & _MASK64
    return h & _MAX_ID


def hash_ids(tokens: Any) -> torch.Tensor:
    """:func:`hash_id` of every string of a pyarrow string array (no nulls), as int64: one numpy
    pass per character position (categorical tokens are short), not a Python loop per token."""
    import numpy as np
    import pyarrow as pa

    tokens = tokens.cast(pa.large_string()) if tokens.type != pa.large_string() else tokens
    n = len(tokens)
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    _, off_buf, data_buf = tokens.buffers()
    offsets = np.frombuffer(off_buf, dtype=np.int64)[tokens.offset:tokens.offset + n + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    prime = np.uint64(_FNV_PRIME)
    active = np.arange(n)
    with np.errstate(over="ignore"):
        for j in range(int(lengths.max())):
            active = active[lengths[active] > j]
            h[active] = (h[active] ^ data[starts[active] + j].astype(np.uint64)) * prime
    return torch.from_numpy((h & np.uint64(_MAX_ID)).astype(np.int64))


def _plain(column: Any) -> Any:
    """A pyarrow array with its dictionary encoding, if any, undone."""
    import pyarrow as pa

    return column.dictionary_decode() if pa.types.is_dictionary(column.type) else column


def _is_text(t: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_number(t: Any) -> bool:
    """An integer, float or boolean pyarrow type (what :func:`_number` takes from a Parquet cell)."""
    import pyarrow as pa

    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def split_text(column: Any, sep: str) -> Any:
    """A pyarrow text array as lists of its ``sep``-separated tokens, an empty cell a null list (an
    empty bag, as :meth:`_Columns._parse` reads it)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.split_pattern(pc.if_else(pc.equal(column, ""), pa.scalar(None, column.type), column), sep)


def _float64(column: Any) -> Any:
    """A numeric pyarrow array as float64, each value rounded to the nearest double as
    ``float()`` rounds a Python int (an unchecked cast: a checked one refuses inexact integers)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.cast(column, pa.float64(), safe=False)


class _Block:
    """Parsed rows, by column: labels ``[n]``, dense ``[n, D]`` (as read, before
    ``data.dense_transform``), and per sparse feature the bag lengths ``[n]`` and ids."""

    __slots__ = ("labels", "dense", "lengths", "values", "starts")

    def __init__(self, labels: torch.Tensor, dense: torch.Tensor, lengths: list[torch.Tensor],
                 values: list[torch.Tensor]) -> None:
        self.labels, self.dense, self.lengths, self.values = labels, dense, lengths, values
        self.starts: list[Any] | None = None

    def __len__(self) -> int:
        return self.labels.shape[0]

    @staticmethod
    def empty(num_dense: int, num_sparse: int) -> _Block:
        z = torch.empty(0, dtype=torch.int64)
        return _Block(torch.empty(0), torch.empty(0, num_dense), [z] * num_sparse, [z] * num_sparse)

    @staticmethod
    def from_records(records: list[tuple], num_dense: int, num_sparse: int) -> _Block:
        n = len(records)
        labels = torch.tensor([r[0] for r in records], dtype=torch.float32)
        dense = torch.tensor([r[1] for r in records], dtype=torch.float32).reshape(n, num_dense)
        lengths = [torch.tensor([len(r[2][f]) for r in records], dtype=torch.int64) for f in range(num_sparse)]
        values = [torch.tensor([i for r in records for i in r[2][f]], dtype=torch.int64) for f in range(num_sparse)]
        return _Block(labels, dense, lengths, values)

    @staticmethod
    def cat(a: _Block, b: _Block) -> _Block:
        if not len(a):
            return b
        return _Block(torch.cat([a.labels, b.labels]), torch.cat([a.dense, b.dense]),
                      [torch.cat([x, y]) for x, y in zip(a.lengths, b.lengths)],
                      [torch.cat([x, y]) for x, y in zip(a.values, b.values)])

    def take(self, lo: int, hi: int) -> _Block:
        if self.starts is None:  # where each row's ids start, per feature; once per block
            import numpy as np

            self.starts = [np.concatenate([[0], np.cumsum(x.numpy())]) for x in self.lengths]
        values = [ids[int(st[lo]):int(st[hi])] for ids, st in zip(self.values, self.starts)]
        return _Block(self.labels[lo:hi], self.dense[lo:hi], [x[lo:hi] for x in self.lengths], values)


STATS_FILE = "data_stats.json"
"""The statistics of ``data.dense_transform: standardize``, in the run's output folder."""


class _Columns(FileReader):
    """What CSV and Parquet share: the column mapping, the parse of one row's cells (the
    reference for every check) and the columnar batches."""

    def __init__(self, schema: Schema, cfg: DataConfig, paths: Sequence[str], *, rank: int = 0,
                 world_size: int = 1, stats_dir: str | Path | None = None) -> None:
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
        self.hashing = cfg.categorical == "hash"
        self.label_map = {str(k): float(v) for k, v in dict(cfg.label_map).items()}
        self.stats_dir = stats_dir
        self._stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def _empty(self) -> _Block:
        return _Block.empty(self.schema.num_dense, len(self.schema.features))

    def _cat(self, buf: _Block, chunk: _Block) -> _Block:
        return _Block.cat(buf, chunk)

    def _take(self, buf: _Block, lo: int, hi: int) -> _Block:
        return buf.take(lo, hi)

    def _block(self, records: list[tuple]) -> _Block:
        return _Block.from_records(records, self.schema.num_dense, len(self.schema.features))

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

    def _label(self, value: Any) -> float | str:
        """The label of a label cell, or what is wrong with it."""
        column = f"column {self.cfg.label_column!r}"
        if self.label_map:
            text = value if isinstance(value, str) else "" if value is None else str(value)
            if text not in self.label_map:
                return f"{column}: {show(value)} is not in data.label_map ({', '.join(map(repr, self.label_map))})"
            return self.label_map[text]
        y = _number(value)
        if y is None:
            return f"{column}: {show(value)} is not a number"
        if self.cfg.label_threshold is not None:
            return float(y > self.cfg.label_threshold)
        if not 0.0 <= y <= 1.0:
            return f"{column}: {show(value)} is not a label in [0, 1] (data.label_threshold or data.label_map map other values)"
        return y

    def _parse(self, label: Any, dense: Sequence[Any], sparse: Sequence[Any]) -> tuple | str:
        """``(label, dense floats, id lists)`` from one row's cells, or what is wrong with them."""
        y = self._label(label)
        if isinstance(y, str):
            return y
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
            if self.hashing:
                texts = [t if isinstance(t, str) else str(t) if isinstance(t, int) and not isinstance(t, bool)
                         else "" for t in tokens]
                for t, text in zip(tokens, texts):
                    if not text:
                        return f"column {name!r}: {show(t)} is not a value to hash (text or an integer, not empty)"
                bags.append([hash_id(t) for t in texts])
                continue
            ids = [_id(t) for t in tokens]
            if None in ids:
                bad = tokens[ids.index(None)]
                return (f"column {name!r}: {show(bad)} is not an id (an integer in [0, 2**63)); "
                        f"data.categorical=hash takes any text")
            bags.append(ids)
        return y, xs, bags

    def _columnar(self, rb: Any, label: str | None, dense: list[str], sparse: list[str]) -> _Block | None:
        """One pyarrow record batch as a block, converted a column at a time; ``None`` when a
        cell may not be what :meth:`_parse` makes of it (the row-by-row path then decides and
        names it). Taken: numeric labels (text ones through ``data.label_map``), numeric dense
        cells (null: 0), and ids as integers, text (split on ``data.id_separator``) or lists of
        either (null: an empty bag), hashed by their text under ``data.categorical: hash``."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        n = rb.num_rows
        try:
            if label is None:
                labels = torch.ones(n)
            elif self.label_map:
                c = _plain(rb.column(label))
                if not _is_text(c.type):
                    return None
                pos = pc.index_in(c, value_set=pa.array(list(self.label_map), c.type))
                if pos.null_count:
                    return None
                table = torch.tensor(list(self.label_map.values()), dtype=torch.float32)
                labels = table[torch.from_numpy(pos.to_numpy(zero_copy_only=False, writable=True).astype("int64"))]
            else:
                c = _plain(rb.column(label))
                if not _is_number(c.type) or c.null_count:
                    return None
                y = torch.from_numpy(_float64(c).to_numpy(zero_copy_only=False, writable=True))
                if self.cfg.label_threshold is not None:
                    labels = (y > self.cfg.label_threshold).float()
                else:
                    if not bool(((y >= 0) & (y <= 1)).all()):
                        return None
                    labels = y.float()
            cols = []
            for name in dense:
                c = _plain(rb.column(name))
                if not _is_number(c.type):
                    return None
                cols.append(pc.fill_null(_float64(c), 0.0).to_numpy(zero_copy_only=False))
            dense_t = torch.from_numpy(np.stack(cols, 1).astype(np.float32)) if cols else torch.empty(n, 0)
            lengths, values = [], []
            for name in sparse:
                bag = self._bags(_plain(rb.column(name)))
                if bag is None:
                    return None
                lengths.append(bag[0])
                values.append(bag[1])
        except pa.ArrowException:
            return None
        return _Block(labels.float(), dense_t, lengths, values)

    def _bags(self, c: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Bag lengths and ids of one sparse column (see :meth:`_columnar`), or ``None``."""
        import pyarrow as pa
        import pyarrow.compute as pc

        t = c.type
        if _is_text(t):
            lists = split_text(c, self.sep)
        elif pa.types.is_integer(t):
            lists = None
        elif (pa.types.is_list(t) or pa.types.is_large_list(t)) and (
                _is_text(t.value_type) or pa.types.is_integer(t.value_type)):
            lists = c
        else:
            return None
        if lists is None:
            lens = pc.cast(pc.is_valid(c), pa.int64())
            tokens = c.drop_null()
        else:
            lens = pc.fill_null(pc.list_value_length(lists), 0)
            tokens = pc.list_flatten(lists)
            if tokens.null_count:
                return None
        if self.hashing:
            if pa.types.is_integer(tokens.type):
                tokens = pc.cast(tokens, pa.string())
            elif pc.any(pc.equal(tokens, "")).as_py():
                return None
            ids = hash_ids(tokens)
        else:
            ids = torch.from_numpy(pc.cast(tokens, pa.int64()).to_numpy(zero_copy_only=False, writable=True))
            if ids.numel() and int(ids.min()) < 0:
                return None
        return torch.from_numpy(lens.to_numpy(zero_copy_only=False, writable=True).astype("int64")), ids

    # -- dense transform ------------------------------------------------------------------------
    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        how = self.cfg.dense_transform
        if how == "log1p" and x.numel():
            return torch.log1p(x.clamp_min(0.0))
        if how == "standardize" and x.shape[1]:
            mean, std = self.standardize_stats()
            return (x - mean) / std
        return x

    def standardize_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each dense column's mean and standard deviation over the training files: read from
        ``data_stats.json`` in the run's folder when it is there for these columns and files,
        else computed (one pass over the files) and written there."""
        if self._stats is not None:
            return self._stats
        paths = expand_paths(self.cfg.train_paths)
        key = {"dense_columns": self.dense_columns, "train_paths": [os.path.abspath(p) for p in paths]}
        where = Path(self.stats_dir) / STATS_FILE if self.stats_dir is not None else None
        if where is not None and where.is_file():
            saved = json.loads(where.read_text())
            if {k: saved.get(k) for k in key} == key:
                self._stats = torch.tensor(saved["mean"]), torch.tensor(saved["std"])
                return self._stats
        cfg = dataclasses.replace(self.cfg, dense_transform="none", malformed="skip")
        reader = type(self)(self.schema, cfg, self.cfg.train_paths)
        n, total, squares = 0, torch.zeros(len(self.dense_columns), dtype=torch.float64), None
        squares = torch.zeros_like(total)
        for block in reader._chunks():
            d = block.dense.double()
            n += d.shape[0]
            total += d.sum(0)
            squares += (d * d).sum(0)
        mean = total / max(n, 1)
        std = (squares / max(n, 1) - mean * mean).clamp_min(0).sqrt()
        std = torch.where(std > 0, std, torch.ones_like(std))
        self._stats = mean.float(), std.float()
        if where is not None:
            where.parent.mkdir(parents=True, exist_ok=True)
            tmp = where.with_name(f"{where.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**key, "rows": n, "mean": mean.tolist(), "std": std.tolist()}, indent=1))
            os.replace(tmp, where)  # every trainer computes the same numbers; the last rename wins
        return self._stats

    def _batch(self, block: _Block) -> Batch:
        return Batch(self._dense(block.dense), kjt_from_ids(self.schema.features, block.values, block.lengths),
                     block.labels)


def _record_where(path: str, start: int, end: int) -> str:
    """Where a CSV record read from line ``start`` to line ``end`` is, for messages: ``file:line``.
    A record over several lines holds a quoted field with a line break -- in numbers and ids, a
    closing quote that is missing, and the csv module then reads on to the next quote or the end
    of the file. Every cell before the first such field lies on ``start``, so that field opens
    there: the message names that line, not the one where reading stopped."""
    if end <= start:
        return f"{path}:{start}"
    return f"{path}:{start}: a quoted field opens on this line and runs on to line {end} (a closing quote missing?)"


class CsvReader(_Columns):
    """CSV files, first line the header, ``.gz`` decompressed; see the module docstring.

    Each file is read by pyarrow's CSV reader in blocks and converted column by column (ids
    split, cast or hashed in bulk). The first block with anything the bulk path does not take
    as certainly good -- a bad cell, a row of the wrong width, text pyarrow cannot parse --
    sends the file to the line-by-line path (stdlib ``csv``, the reference for every check and
    message), which re-reads it from where the pass started in it and goes on after the rows
    already yielded. A resumed pass starts at the block a checkpoint names (:func:`arrow_csv_batches`).
    """

    source = "csv"

    def _check_file(self, path: str) -> None:
        with io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="replace", newline="") as f:
            self._indices(path, csv_header(path, csv.reader(f)))

    can_seek = True

    def _chunks(self) -> Iterator[_Block]:
        return self._bulk_then_lines(self._fast, self._slow)

    def _fast(self, path: str, start: tuple[int, int] | None
              ) -> Iterator[tuple[_Block, int, int | None, int | None] | None]:
        """The file's rows in blocks (from ``start``: :func:`arrow_csv_batches`), converted in bulk,
        each with its rows (counted as lines read) and where it starts; ``None`` (then nothing
        more) at the first block that needs the line-by-line path."""
        import pyarrow as pa

        with io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="replace", newline="") as f:
            header = csv_header(path, csv.reader(f))
        label, dense, sparse = self._indices(path, header)
        names = list(dict.fromkeys(header[i] for i in ([] if label is None else [label]) + dense + sparse))
        if len(set(header)) != len(header) or any(not h for h in header):
            yield None  # pyarrow needs unique, named columns
            return
        # Numbers parsed by pyarrow (a blank is null: 0 for a dense cell), ids and labels of a
        # label_map as text; a cell pyarrow cannot parse makes the block fail -> line by line.
        types = {n: pa.string() for n in names}
        types.update({header[i]: pa.float64() for i in dense})
        if label is not None and not self.label_map:
            types[header[label]] = pa.float64()
        for item in arrow_csv_batches(path, types, start):
            block = None if item is None else self._columnar(
                item[0], None if label is None else header[label], [header[i] for i in dense],
                [header[i] for i in sparse])
            if block is None:
                yield None
                return
            self.counts["lines"] += len(block)
            yield block, len(block), item[1], item[2]

    def _slow(self, path: str, *, skip: int, start: tuple[int, int] | None = None) -> Iterator[_Block]:
        """The line-by-line path from the top of ``path`` (or from ``start``, the byte offset and
        lines before it of a line that starts a record), yielding what follows its first ``skip``
        good rows there (read by the bulk path, and counted there)."""
        chunk: list[tuple] = []
        with csv_reader_at(path, start) as (reader, header, base):
            label, dense, sparse = self._indices(path, header)
            for row, where in self._csv_rows(path, reader, header, base):
                parsed = self._parse(1.0 if label is None else row[label], [row[i] for i in dense],
                                     [row[i] for i in sparse])
                if isinstance(parsed, str):
                    self._malformed(where, parsed)
                    continue
                if skip:
                    skip -= 1
                    self.counts["lines"] -= 1  # counted when the bulk path read it
                    continue
                chunk.append(parsed)
                if len(chunk) == _CHUNK_ROWS:
                    yield self._block(chunk)
                    chunk = []
        if chunk:
            yield self._block(chunk)


def parquet_batches(pf: Any, columns: list[str], start_row: int = 0) -> Iterator[tuple[Any, int]]:
    """The record batches of a ``pyarrow.parquet.ParquetFile`` from row ``start_row`` on, each
    with the number of its first row in the file (from 0): read from the row group that holds
    that row, the rows before it in the group decoded and passed over."""
    groups = range(pf.metadata.num_row_groups)
    row = cut = 0
    if start_row:
        starts = [0]
        for g in groups:
            starts.append(starts[-1] + pf.metadata.row_group(g).num_rows)
        first = max(g for g in groups if starts[g] <= start_row)
        groups, row, cut = range(first, len(groups)), start_row, start_row - starts[first]
    for rb in pf.iter_batches(batch_size=_CHUNK_ROWS, columns=list(dict.fromkeys(columns)), row_groups=groups):
        if cut:
            rb, cut = rb.slice(min(cut, rb.num_rows)), max(0, cut - rb.num_rows)
            if not rb.num_rows:
                continue
        yield rb, row
        row += rb.num_rows


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
                 world_size: int = 1, stats_dir: str | Path | None = None) -> None:
        super().__init__(schema, cfg, paths, rank=rank, world_size=world_size, stats_dir=stats_dir)
        self._pq = _pyarrow_parquet()

    def _check_file(self, path: str) -> None:
        try:
            pf = self._pq.ParquetFile(path)
        except ValueError as e:  # pyarrow's ArrowInvalid
            raise InputError(f"data.parquet: {path}: not a Parquet file ({e})") from None
        self._indices(path, pf.schema_arrow.names)
        if pf.metadata.num_rows == 0:
            raise InputError(f"data.parquet: {path}: empty file (no rows)")

    can_seek = True

    def _chunks(self) -> Iterator[_Block]:
        for path, where, at in self._files():
            pf = self._pq.ParquetFile(path)
            header = pf.schema_arrow.names
            label, dense, sparse = self._indices(path, header)
            label_name = None if label is None else header[label]
            dense_names, sparse_names = [header[i] for i in dense], [header[i] for i in sparse]
            names = list(dict.fromkeys(([] if label_name is None else [label_name]) + dense_names + sparse_names))
            for rb, row in parquet_batches(pf, names, at["row"] if at is not None else 0):
                self._at = {**where, "row": row}
                block = self._columnar(rb, label_name, dense_names, sparse_names)
                if block is None:
                    block = self._rows(rb, path, row, label_name, dense_names, sparse_names)
                else:
                    self.counts["lines"] += rb.num_rows
                yield block

    def _rows(self, rb: Any, path: str, row: int, label: str | None, dense: list[str],
              sparse: list[str]) -> _Block:
        """The good rows of a record batch (its first row is ``row + 1`` of ``path``), parsed
        one at a time by :meth:`_parse`; the others reported."""
        ys = rb.column(label).to_pylist() if label is not None else [1.0] * rb.num_rows
        xs = [rb.column(name).to_pylist() for name in dense]
        ss = [rb.column(name).to_pylist() for name in sparse]
        chunk = []
        for j in range(rb.num_rows):
            self.counts["lines"] += 1
            parsed = self._parse(ys[j], [c[j] for c in xs], [c[j] for c in ss])
            if isinstance(parsed, str):
                self._malformed(f"{path}: row {row + j + 1}", parsed)
            else:
                chunk.append(parsed)
        return self._block(chunk)

__all__ = ["CsvReader", "FileReader", "ParquetReader", "expand_paths", "hash_id", "hash_ids", "open_binary"]
