"""Criteo TSV (the Kaggle / Terabyte click logs): ``label \\t I1..I13 \\t C1..C26`` per line.

What a line becomes (blanks are 0 as in TorchRec's preprocessing; negatives are 0 and dense
values ``log(1 + x)`` as in the DLRM reference's):

- ``label``: ``0`` or ``1``;
- ``I1..I13`` (dense): decimal integers; blank -> 0, negative -> 0, then ``log(1 + x)`` as
  float32 (values above ``2**62`` count as ``2**62``);
- ``C1..C26`` (sparse, the schema's 26 features in order): hexadecimal strings; blank -> 0 (the
  same id as the value ``0``); id = ``int(hex, 16) % num_embeddings[f]``, one id per bag.

Anything else is malformed: a number of fields other than 40, a label other than 0/1, a dense
field that is not an optional sign and digits, a categorical field with a non-hex character. An
error names the file, the line (from 1) and the field (from 1: field 1 is the label, field 5 is
I4, field 15 is C1), e.g. ``data.criteo: /x/day_0.tsv:17: field 5 (I4): 'abc' is not an
integer``. Files are read as bytes (``.gz`` decompressed); a line ends at ``\\n`` (trailing
``\\r`` are ignored). Sharding, the malformed policy and ``counts`` are those of
:class:`~hybrid.data.tabular.FileReader`.

Speed: every trainer parses every line, so that all trainers agree on the good lines: a chunk
of about 1 MB of whole lines at a time, by the native operator ``criteo_parse`` (one pass over
the bytes into tensors; :mod:`hybrid.ops`); a malformed line's message comes from a field-by-field
check in Python.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybrid import ops
from hybrid.data.batch import Batch
from hybrid.data.config import DataConfig, Schema
from hybrid.data.tabular import FileReader, open_binary, show

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
_CHUNK_BYTES = 1 << 20
_INT = re.compile(rb"[+-]?[0-9]+")
_HEX = re.compile(rb"[0-9a-fA-F]+")


class CriteoReader(FileReader):
    """Batches of Criteo TSV files for ``schema`` (13 dense, 26 sparse features, task ``ctr``)."""

    source = "criteo"

    def __init__(self, schema: Schema, cfg: DataConfig, paths: Sequence[str], *, rank: int = 0,
                 world_size: int = 1) -> None:
        if schema.num_dense != NUM_DENSE or len(schema.features) != NUM_SPARSE or schema.task != "ctr":
            raise ValueError(
                f"data.source: criteo gives {NUM_DENSE} dense and {NUM_SPARSE} sparse features with click "
                f"labels; the model reads num_dense={schema.num_dense}, {len(schema.features)} sparse "
                f"features, task {schema.task!r}")
        super().__init__(schema, cfg, paths, rank=rank, world_size=world_size)
        self.rows = list(schema.num_embeddings)
        self._names = ["label", *(f"I{j}" for j in range(1, NUM_DENSE + 1)), *schema.features]

    can_seek = True

    def _chunks(self) -> Iterator[_Lines]:
        for path, where, at in self._files():
            with open_binary(path) as f:
                offset = done = 0
                if at is not None:  # a resumed pass: from the chunk a checkpoint names
                    f.seek(at["offset"])
                    offset, done = at["offset"], at["line"]
                while text := f.read(_CHUNK_BYTES):
                    if not text.endswith(b"\n"):
                        text += f.readline()  # whole lines only
                    self._at = {**where, "offset": offset, "line": done}
                    offset += len(text)
                    status, labels, dense, ids = ops.criteo_parse(
                        torch.frombuffer(bytearray(text), dtype=torch.uint8), self.rows)
                    n = status.numel()
                    self.counts["lines"] += n
                    if bool(status.any()):
                        self._report(text, status, path, done)
                        good = status == 0
                        labels, dense, ids = labels[good], dense[good], ids[good]
                    yield _Lines(labels, dense, ids)
                    done += n

    def _report(self, text: bytes, status: torch.Tensor, path: str, done: int) -> None:
        """Report the malformed lines of a chunk (numbered from ``done + 1``), naming the field."""
        lines = text.split(b"\n")
        for i in status.nonzero().flatten().tolist():
            self._malformed(f"{path}:{done + i + 1}", self._check(lines[i].rstrip(b"\r")))

    def _check(self, line: bytes) -> str:
        """What is wrong with a malformed line (the first bad field)."""
        fields = line.split(b"\t")
        if len(fields) != NUM_FIELDS:
            return (f"{len(fields)} fields; a Criteo line has {NUM_FIELDS} "
                    f"(label, I1..I{NUM_DENSE}, {NUM_SPARSE} categorical)")
        if fields[0] not in (b"0", b"1"):
            return f"field 1 (label): {show(fields[0])} is not 0 or 1"
        for j in range(1, 1 + NUM_DENSE):
            if fields[j] and not _INT.fullmatch(fields[j]):
                return f"field {j + 1} ({self._names[j]}): {show(fields[j])} is not an integer"
        for j in range(1 + NUM_DENSE, NUM_FIELDS):
            if fields[j] and not _HEX.fullmatch(fields[j]):
                return f"field {j + 1} ({self._names[j]}): {show(fields[j])} is not hexadecimal"
        raise AssertionError(f"criteo_parse refused a good line: {line!r}")

    def _empty(self) -> _Lines:
        return _Lines(torch.zeros(0), torch.zeros(0, NUM_DENSE, dtype=torch.int64),
                      torch.zeros(0, NUM_SPARSE, dtype=torch.int64))

    def _cat(self, buf: _Lines, chunk: _Lines) -> _Lines:
        if not len(buf):
            return chunk
        return _Lines(torch.cat([buf.labels, chunk.labels]), torch.cat([buf.dense, chunk.dense]),
                      torch.cat([buf.ids, chunk.ids]))

    def _take(self, buf: _Lines, lo: int, hi: int) -> _Lines:
        return _Lines(buf.labels[lo:hi], buf.dense[lo:hi], buf.ids[lo:hi])

    def _batch(self, lines: _Lines) -> Batch:
        n = len(lines)
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=list(self.schema.features), values=lines.ids.t().reshape(-1),
            lengths=torch.ones(NUM_SPARSE * n, dtype=torch.int64))
        return Batch(lines.dense.double().log1p().float(), sparse, lines.labels.clone())


class _Lines(NamedTuple):
    """Good lines, parsed: labels ``[n]``, dense values ``[n, 13]`` (int64, before ``log(1 + x)``)
    and ids ``[n, 26]``."""

    labels: torch.Tensor
    dense: torch.Tensor
    ids: torch.Tensor

    def __len__(self) -> int:  # type: ignore[override]
        return self.labels.shape[0]

