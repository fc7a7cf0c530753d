"""Criteo TSV (the Kaggle / Terabyte click logs): ``label \\t I1..I13 \\t C1..C26`` per line.

What a line becomes (as TorchRec's and the DLRM reference's preprocessing do):

- ``label``: ``0`` or ``1``;
- ``I1..I13`` (dense): decimal integers; blank -> 0, negative -> 0, then ``log(1 + x)`` as
  float32 (values above ``2**62`` count as ``2**62``);
- ``C1..C26`` (sparse, the schema's 26 features in order): hexadecimal strings; blank -> 0 (the
  same id as the value ``0``); id = ``int(hex, 16) % num_embeddings[f]``, one id per bag.

Anything else is malformed: a number of fields other than 40, a label other than 0/1, a dense
field that is not an optional sign and digits, a categorical field with a non-hex character. An
error names the file, the line (from 1) and the field (from 1: field 1 is the label, field 5 is
I4, field 15 is C1), e.g. ``data.criteo: /x/day_0.tsv:17: field 5 (I4): 'abc' is not an
integer``. Files are read as bytes (``.gz`` decompressed); a line ends at ``\\n`` (a trailing
``\\r`` is ignored). Sharding, the malformed policy and ``counts`` are those of
:class:`~recsys_examples.data.tabular.FileReader`.

Speed: a line is checked by one regular expression; only the lines of this trainer's share are
converted, in bulk, per batch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from itertools import chain

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_examples.data.batch import Batch
from recsys_examples.data.config import DataConfig, Schema
from recsys_examples.data.tabular import FileReader, open_binary, show

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
_BIG = 1 << 62

# The common shape, whose fields convert without overflow: dense below 10**18, hex below 16**15.
_FAST = re.compile(rb"[01](?:\t(?:-?[0-9]{1,18})?){13}(?:\t[0-9a-fA-F]{0,15}){26}")
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

    def _records(self) -> Iterator[bytes]:
        fast = _FAST.fullmatch
        counts = self.counts
        for path in self.paths:
            with open_binary(path) as f:
                for lineno, line in enumerate(f, 1):
                    counts["lines"] += 1
                    line = line.rstrip(b"\n").removesuffix(b"\r")
                    if fast(line):
                        yield line
                        continue
                    checked = self._check(line)
                    if isinstance(checked, str):
                        self._malformed(f"{path}:{lineno}", checked)
                    else:
                        yield checked

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
                fields[j] = b"%x" % (int(v, 16) % self.rows[j - 1 - NUM_DENSE])
        return b"\t".join(fields)

    def _batch(self, lines: list[bytes]) -> Batch:
        n = len(lines)
        flat = b"\t".join(lines).split(b"\t")
        labels = torch.tensor([x == b"1" for x in flat[0::NUM_FIELDS]], dtype=torch.float32)
        dense = [int(x or b"0") for x in chain.from_iterable(flat[j::NUM_FIELDS] for j in range(1, 1 + NUM_DENSE))]
        cats = [int(x or b"0", 16)
                for x in chain.from_iterable(flat[j::NUM_FIELDS] for j in range(1 + NUM_DENSE, NUM_FIELDS))]
        dense_t = torch.tensor(dense, dtype=torch.int64).view(NUM_DENSE, n).t().clamp_min(0)
        ids = torch.tensor(cats, dtype=torch.int64).view(NUM_SPARSE, n) % self._rows
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=list(self.schema.features), values=ids.reshape(-1),
            lengths=torch.ones(NUM_SPARSE * n, dtype=torch.int64))
        return Batch(dense_t.double().log1p().float().contiguous(), sparse, labels)
