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

Speed: every trainer checks every line (one regular expression; the few lines it refuses get a
field-by-field check), so that all trainers agree on the good lines; only this trainer's share
of each global batch is converted, in bulk (8-digit hex fields by one ``bytes.fromhex``).
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Iterator, Sequence
from itertools import chain

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybrid.data.batch import Batch
from hybrid.data.config import DataConfig, Schema
from hybrid.data.tabular import FileReader, open_binary, show

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
_BIG = 1 << 62
_CHUNK_BYTES = 1 << 20

# The common shape: dense fields below 10**18 (no overflow), hex fields 8 digits (as in the real
# logs) or blank. _check rewrites other good lines into it (hex values of more digits stay wider).
_FAST = re.compile(rb"[01](?:\t(?:-?[0-9]{1,18})?){13}(?:\t(?:[0-9a-fA-F]{8})?){26}")
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
        self._rows = torch.tensor(self.rows, dtype=torch.int64).unsqueeze(1)
        self._names = ["label", *(f"I{j}" for j in range(1, NUM_DENSE + 1)), *schema.features]

    def _chunks(self) -> Iterator[list[bytes]]:
        fast = _FAST.fullmatch
        for path in self.paths:
            with open_binary(path) as f:
                done = 0
                while raw := f.readlines(_CHUNK_BYTES):
                    self.counts["lines"] += len(raw)
                    lines = [line.rstrip(b"\r\n") for line in raw]
                    yield lines if all(map(fast, lines)) else self._sift(lines, path, done)
                    done += len(raw)

    def _sift(self, lines: list[bytes], path: str, done: int) -> list[bytes]:
        """The good lines of a chunk (in the fast shape); the others reported, numbered from ``done + 1``."""
        good = []
        for i, line in enumerate(lines):
            checked = line if _FAST.fullmatch(line) else self._check(line)
            if isinstance(checked, str):
                self._malformed(f"{path}:{done + i + 1}", checked)
            else:
                good.append(checked)
        return good

    def _check(self, line: bytes) -> bytes | str:
        """A line the fast pattern refused: the same line in the fast shape, or what is wrong."""
        fields = line.split(b"\t")
        if len(fields) != NUM_FIELDS:
            return (f"{len(fields)} fields; a Criteo line has {NUM_FIELDS} "
                    f"(label, I1..I{NUM_DENSE}, {NUM_SPARSE} categorical)")
        if fields[0] not in (b"0", b"1"):
            return f"field 1 (label): {show(fields[0])} is not 0 or 1"
        for j in range(1, 1 + NUM_DENSE):
            v = fields[j]
            if v:
                if not _INT.fullmatch(v):
                    return f"field {j + 1} ({self._names[j]}): {show(v)} is not an integer"
                fields[j] = b"%d" % min(max(int(v), 0), _BIG)
        for j in range(1 + NUM_DENSE, NUM_FIELDS):
            v = fields[j]
            if v:
                if not _HEX.fullmatch(v):
                    return f"field {j + 1} ({self._names[j]}): {show(v)} is not hexadecimal"
                fields[j] = b"%08x" % (int(v, 16) % self.rows[j - 1 - NUM_DENSE])
        return b"\t".join(fields)

    def _batch(self, lines: list[bytes]) -> Batch:
        n = len(lines)
        if n == 0:  # an evaluation trainer's empty share of the last global batch
            return Batch(torch.zeros(0, NUM_DENSE), KeyedJaggedTensor.from_lengths_sync(
                keys=list(self.schema.features), values=torch.zeros(0, dtype=torch.int64),
                lengths=torch.zeros(0, dtype=torch.int64)), torch.zeros(0))
        flat = b"\t".join(lines).split(b"\t")
        labels = torch.tensor([x == b"1" for x in flat[0::NUM_FIELDS]], dtype=torch.float32)
        dense = array("q", [int(x or b"0") for x in _columns(flat, 1, 1 + NUM_DENSE)])
        dense_t = torch.frombuffer(dense, dtype=torch.int64).view(NUM_DENSE, n).t().clamp_min(0)
        ids = _hex_ids(list(_columns(flat, 1 + NUM_DENSE, NUM_FIELDS))).view(NUM_SPARSE, n) % self._rows
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=list(self.schema.features), values=ids.reshape(-1),
            lengths=torch.ones(NUM_SPARSE * n, dtype=torch.int64))
        return Batch(dense_t.double().log1p().float().contiguous(), sparse, labels)


def _columns(flat: list[bytes], first: int, stop: int) -> Iterator[bytes]:
    """Fields ``first..stop-1`` of every line of ``flat`` (all lines' fields in a row), column by column."""
    return chain.from_iterable(flat[j::NUM_FIELDS] for j in range(first, stop))


def _hex_ids(fields: list[bytes]) -> torch.Tensor:
    """``int(field or "0", 16)`` of every field, as int64.

    Fields are blank, 8 hex digits, or (rewritten by ``_check``) more digits for a value that
    needs them, below ``2**63``. Without the latter (always, for real Criteo data) the whole
    list decodes with one ``bytes.fromhex`` instead of one ``int()`` per field.
    """
    if not fields:
        return torch.zeros(0, dtype=torch.int64)
    blank8 = b"\t00000000\t"
    packed = (b"\t" + b"\t".join(fields) + b"\t").replace(b"\t\t", blank8).replace(b"\t\t", blank8)
    packed = packed.replace(b"\t", b"")
    if len(packed) == 8 * len(fields):
        u = torch.frombuffer(bytearray(bytes.fromhex(packed.decode("ascii"))), dtype=torch.uint8)
        u = u.view(-1, 4).long()
        return (u[:, 0] << 24) | (u[:, 1] << 16) | (u[:, 2] << 8) | u[:, 3]
    return torch.frombuffer(array("q", [int(x or b"0", 16) for x in fields]), dtype=torch.int64)
