"""User-sequence data for next-item models (``schema.task == "sequence"``): a synthetic generator
and a reader for sequence files (CSV or Parquet).

A sample is one user's item history. Its :class:`~hybrid.data.Batch` holds, per sample:

- ``item``: the sequence itself, oldest first, at most ``data.max_len + 1`` items (longer ones
  keep their newest items): the model reads items ``0..L-2`` and predicts items ``1..L-1``;
- ``action`` (when the schema has it): one action type per item, aligned with ``item``;
- ``negative``: candidate items. Training: ``data.num_negatives`` uniform ids per sample, the
  uniformly sampled negatives of the batch. Evaluation: the whole catalog (``0..rows-1``) in the
  bag of the first sample of every trainer's batch, the others empty, so that the held-out item
  is ranked against every item.

``dense`` is ``[n, 0]`` and ``labels`` are ones. Evaluation scores the last item of each
sequence (the held-out item) from the items before it.

**Synthetic** (:class:`SyntheticSequences`): items have a power-law popularity (``zipf_alpha``,
ranks scattered over the ids as in :mod:`hybrid.data.synthetic`). A sequence starts at a
popularity draw and walks a fixed sparse item-to-item transition matrix: item ``i`` has
``SUCCESSORS`` successors (uniform over the catalog, a hash of ``(seed, i, j)``), the ``j``-th
taken with probability ``~ 1/(j+1)``; with probability ``NOISE`` the next item is a fresh
popularity draw instead. So the next item is mostly predictable from the current one (a model
can reach a recall@10 near ``1 - NOISE``), while a popularity ranking only catches the
popular starts and fresh draws. Lengths are uniform in ``[2, max_len + 1]``. Sample ``i`` of
step ``t`` is a pure function of ``(seed, split, t, i)`` (every draw a seeded hash of its place),
so trainer ``r`` draws only its samples ``[r*B, (r+1)*B)``, and sync training equals one process
on the global batch. Nothing of size ``rows x rows`` is stored: every successor is a hash.

**Files** (:class:`SequenceCsvReader`, :class:`SequenceParquetReader`): one row per user with the
columns ``data.user_column`` (any value; unused), ``data.items_column`` (ids separated by
``data.id_separator``, or a Parquet list), optionally ``data.timestamps_column`` (as many
numbers; items are ordered by them, stably) and ``data.actions_column`` (as many action ids).
The last item of every row is held out: ``split="train"`` reads every row without its last item,
``split="eval"`` reads the whole row and scores that last item (``data.eval_paths`` default to
the training files). Rows too short to give a target (fewer than 2 items once the held-out item
is removed for training) are skipped and counted (``counts["short"]``). A malformed row -- an id
that is not an integer in ``[0, rows)``, timestamps or actions of another length -- stops the
run naming ``file:line`` (``data.malformed=skip`` skips and counts it).
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybrid.data.batch import Batch
from hybrid.data.config import DataConfig, Schema
from hybrid.data.synthetic import _seed_of, _uniform, power_law_rank
from hybrid.data.tabular import (FileReader, _id, _is_number, _is_text, _number, _plain, _pyarrow_parquet,
                                 arrow_csv_batches, csv_header, csv_reader_at, open_binary, parquet_batches,
                                 show, split_text)
from hybrid.errors import InputError

ITEM, NEGATIVE, ACTION = "item", "negative", "action"
"""The features of a sequence batch (``action`` only when the model embeds actions)."""
SUCCESSORS = 4
"""Synthetic: successors of every item in the transition matrix."""
NOISE = 0.2
"""Synthetic: probability that the next item is a fresh popularity draw instead of a successor."""


def check_sequence_schema(schema: Schema) -> None:
    """A sequence schema has ``item`` and ``negative`` (same rows) and maybe ``action``."""
    if schema.features[:2] != [ITEM, NEGATIVE] or schema.features[2:] not in ([], [ACTION]):
        raise ValueError(f"schema: a sequence model reads features {[ITEM, NEGATIVE]} (+ {ACTION!r}); "
                         f"got {schema.features}")
    if schema.num_embeddings[0] != schema.num_embeddings[1]:
        raise ValueError(f"schema: {ITEM!r} and {NEGATIVE!r} are ids of one catalog; got rows "
                         f"{schema.num_embeddings[:2]}")


def sequence_batch(schema: Schema, items: Sequence[Sequence[int]], actions: Sequence[Sequence[int]] | None,
                   negatives: Sequence[Sequence[int]]) -> Batch:
    """The :class:`Batch` of ``len(items)`` sequences (see the module docstring)."""
    def jagged(bags: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([len(b) for b in bags], dtype=torch.int64),
                torch.tensor([i for b in bags for i in b], dtype=torch.int64))

    return _batch_of(schema, len(items), jagged(items), jagged(negatives),
                     jagged(actions) if ACTION in schema.features else None)


def _batch_of(schema: Schema, n: int, items: tuple[torch.Tensor, torch.Tensor],
              negatives: tuple[torch.Tensor, torch.Tensor],
              actions: tuple[torch.Tensor, torch.Tensor] | None) -> Batch:
    """The :class:`Batch` of ``n`` sequences from each feature's bag lengths and ids."""
    bags = [items, negatives] + ([actions] if actions is not None else [])
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=list(schema.features), values=torch.cat([v for _, v in bags]),
                                                 lengths=torch.cat([ln for ln, _ in bags]))
    return Batch(torch.zeros(n, 0), sparse, torch.ones(n))


def _catalog_bags(lo: int, hi: int, per: int, rows: int) -> list[list[int]]:
    """Evaluation negatives of samples ``[lo, hi)``: the whole catalog in the bag of every
    ``per``-th sample (the first of each trainer's batch), the others empty."""
    everything = list(range(rows))
    return [everything if i % per == 0 else [] for i in range(lo, hi)]


class SyntheticSequences:
    """Synthetic user sequences for trainer ``rank`` of ``world_size`` (see the module docstring).

    ``split="train"``: an endless stream from step ``start``; ``split="eval"``:
    ``cfg.eval_batches`` held-out batches, the same at every pass.
    """

    def __init__(self, schema: Schema, cfg: DataConfig, *, rank: int = 0, world_size: int = 1,
                 split: str = "train", start: int = 0) -> None:
        check_sequence_schema(schema)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.schema, self.cfg = schema, cfg
        self.rank, self.world_size, self.split = rank, world_size, split
        self.steps = cfg.eval_batches if split == "eval" else None
        self.start = 0 if split == "eval" else start
        self.rows = schema.num_embeddings[0]
        self.actions = schema.num_embeddings[2] if ACTION in schema.features else 0
        rng = random.Random(_seed_of(cfg.seed, "sequence-items"))
        n = self.rows
        a_max = max(1, min(n - 1, (1 << 62) // n))
        self._a = next((a for a in (rng.randint(1, a_max) for _ in range(64)) if math.gcd(a, n) == 1), 1)
        self._b = rng.randrange(n)
        self._key = rng.getrandbits(63)
        self._action_key = rng.getrandbits(63)
        w = torch.tensor([1.0 / (j + 1) for j in range(SUCCESSORS)], dtype=torch.float64)
        self._choice = torch.cumsum(w / w.sum(), 0)

    def _item_of_rank(self, rank: torch.Tensor) -> torch.Tensor:
        return (rank * self._a + self._b) % self.rows

    def successors(self, items: torch.Tensor) -> torch.Tensor:
        """``[n, SUCCESSORS]``: the successors of every item of ``items`` ``[n]`` (row of the
        transition matrix), most likely first."""
        j = torch.arange(SUCCESSORS, dtype=torch.int64)
        u = _uniform(items[:, None] * SUCCESSORS + j, self._key)
        return (u * self.rows).long().clamp_(max=self.rows - 1)

    def popularity_draw(self, u: torch.Tensor) -> torch.Tensor:
        """Items drawn by popularity, from uniforms ``u``."""
        return self._item_of_rank(power_law_rank(u, self.rows, self.cfg.zipf_alpha))

    def _width(self) -> int:
        """Uniforms a sample draws (:meth:`samples`): its length, its first item, three a later
        item (successor, fresh draw, which of the two), an action a position, its negatives."""
        T = self.cfg.max_len + 1
        negatives = self.cfg.num_negatives if self.split == "train" else 0
        return 3 * T - 1 + (T if self.actions else 0) + negatives

    def __iter__(self) -> Iterator[Batch]:
        b = self.cfg.batch_size
        lo = self.rank * b
        t = self.start
        while self.steps is None or t < self.start + self.steps:
            yield self.samples(t, lo, lo + b)
            t += 1

    def global_batch(self, t: int) -> Batch:
        """All ``world_size x batch_size`` sequences of step ``t``."""
        return self.samples(t, 0, self.world_size * self.cfg.batch_size)

    def samples(self, t: int, lo: int, hi: int) -> Batch:
        """Sequences ``[lo, hi)`` of step ``t``'s global batch, drawn alone (the others are not)."""
        n, T, width = hi - lo, self.cfg.max_len + 1, self._width()
        i = torch.arange(lo, hi, dtype=torch.int64)
        u = _uniform(i[:, None] * width + torch.arange(width, dtype=torch.int64),
                     _seed_of(self.cfg.seed, "sequences", self.split, t))  # every bit of the key counts
        lengths = 2 + (u[:, 0] * (T - 1)).long().clamp_(max=T - 2)
        seq = torch.empty(n, T, dtype=torch.int64)
        seq[:, 0] = self.popularity_draw(u[:, 1])
        for p in range(1, T):
            c = 3 * p - 1
            pick = torch.searchsorted(self._choice, u[:, c].contiguous()).clamp_(max=SUCCESSORS - 1)
            follow = self.successors(seq[:, p - 1]).gather(1, pick[:, None]).squeeze(1)
            seq[:, p] = torch.where(u[:, c + 2] < NOISE, self.popularity_draw(u[:, c + 1]), follow)
        items = [seq[k, : int(lengths[k])].tolist() for k in range(n)]
        c = 3 * T - 1
        actions = None
        if self.actions:
            act = (u[:, c : c + T] * self.actions).long().clamp_(max=self.actions - 1)
            actions = [act[k, : int(lengths[k])].tolist() for k in range(n)]
            c += T
        if self.split == "eval":
            negatives = _catalog_bags(lo, hi, self.cfg.batch_size, self.rows)
        else:
            k = self.cfg.num_negatives
            negatives = (u[:, c : c + k] * self.rows).long().clamp_(max=self.rows - 1).tolist()
        return sequence_batch(self.schema, items, actions, negatives)


_DECIMAL = r"^-?[0-9]+(\.[0-9]+)?$"
"""Timestamps as text taken in bulk: plain decimals, which ``float()`` and pyarrow read alike."""


class _Seqs(NamedTuple):
    """Parsed sequence rows, by column: each row's item count ``[n]``, the items of every row one
    after another, and their actions (``None`` without an action feature)."""

    lengths: torch.Tensor
    items: torch.Tensor
    actions: torch.Tensor | None

    def __len__(self) -> int:  # type: ignore[override]
        return self.lengths.shape[0]


class _SequenceFiles(FileReader):
    """What the CSV and Parquet sequence readers share: columns, the parse of a row, batches."""

    def __init__(self, schema: Schema, cfg: DataConfig, paths: Sequence[str], *, rank: int = 0,
                 world_size: int = 1, split: str = "train") -> None:
        check_sequence_schema(schema)
        super().__init__(schema, cfg, paths, rank=rank, world_size=world_size)
        self.split = split
        self.rows = schema.num_embeddings[0]
        self.num_actions = schema.num_embeddings[2] if ACTION in schema.features else 0
        self._step = 0

    @staticmethod
    def _zero_counts() -> dict[str, int]:
        return {**FileReader._zero_counts(), "short": 0}

    def __iter__(self) -> Iterator[Batch]:
        # The global batch the pass starts at: a run resumed where it stopped draws its negatives.
        self._step = self.start_record // (self.world_size * self.batch_size)
        return super().__iter__()

    def _columns(self) -> list[tuple[str, str]]:
        """``(key, column)`` of every column a row is read from (``items`` first)."""
        cols = [("data.items_column", self.cfg.items_column)]
        if self.cfg.timestamps_column:
            cols.append(("data.timestamps_column", self.cfg.timestamps_column))
        if self.num_actions:
            if not self.cfg.actions_column:
                raise InputError(f"data.actions_column: the model embeds actions (model.num_actions="
                                 f"{self.num_actions}); name the column of the action ids")
            cols.append(("data.actions_column", self.cfg.actions_column))
        return cols

    def _indices(self, path: str, header: Sequence[str]) -> list[int]:
        where = {name: i for i, name in enumerate(header)}
        out = []
        for key, name in self._columns():
            if name not in where:
                raise InputError(f"data.{self.source}: {path}: no column {name!r} ({key}); the header "
                                 f"has: {', '.join(map(str, header))}")
            out.append(where[name])
        return out

    def _tokens(self, value: Any) -> list[Any]:
        if value is None or value == "":
            return []
        if isinstance(value, str):
            return value.split(self.cfg.id_separator)
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def _parse(self, cells: Sequence[Any]) -> tuple | str | None:
        """``(items, actions)`` of one row, ``None`` for a row too short, or what is wrong."""
        cols = self._columns()
        tokens = [self._tokens(c) for c in cells]
        items = [_id(t) for t in tokens[0]]
        for t, i in zip(tokens[0], items):
            if i is None or i >= self.rows:
                return f"column {cols[0][1]!r}: {show(t)} is not an item id (an integer in [0, {self.rows}))"
        actions: list[int] | None = None
        for (key, name), toks in zip(cols[1:], tokens[1:]):
            if len(toks) != len(items):
                return f"column {name!r}: {len(toks)} values for {len(items)} items"
            if key == "data.timestamps_column":
                stamps = [_number(t) for t in toks]
                if None in stamps:
                    return f"column {name!r}: {show(toks[stamps.index(None)])} is not a number"
                order = sorted(range(len(items)), key=stamps.__getitem__)
                items = [items[k] for k in order]
                if actions is not None:
                    actions = [actions[k] for k in order]
                tokens = [tokens[0], *[[tk[k] for k in order] for tk in tokens[1:]]]
            else:
                acts = [_id(t) for t in tokens[-1]]
                for t, a in zip(tokens[-1], acts):
                    if a is None or a >= self.num_actions:
                        return f"column {name!r}: {show(t)} is not an action id (an integer in [0, {self.num_actions}))"
                actions = acts
        if self.split == "train":  # the last item is held out for evaluation
            items = items[:-1]
            actions = None if actions is None else actions[:-1]
        if len(items) < 2:
            self.counts["short"] += 1
            return None
        keep = self.cfg.max_len + 1
        return items[-keep:], (None if actions is None else actions[-keep:])

    def _keep(self, parsed: tuple | str | None, where: str, chunk: list) -> None:
        if isinstance(parsed, str):
            self._malformed(where, parsed)
        elif parsed is not None:
            chunk.append(parsed)

    # Records are buffered as a columnar block (_Seqs).
    def _empty(self) -> _Seqs:
        z = torch.zeros(0, dtype=torch.int64)
        return _Seqs(z, z, z if self.num_actions else None)

    def _cat(self, buf: _Seqs, chunk: _Seqs) -> _Seqs:
        if not len(buf):
            return chunk
        return _Seqs(torch.cat([buf.lengths, chunk.lengths]), torch.cat([buf.items, chunk.items]),
                     None if buf.actions is None else torch.cat([buf.actions, chunk.actions]))

    def _take(self, buf: _Seqs, lo: int, hi: int) -> _Seqs:
        a = int(buf.lengths[:lo].sum())
        b = a + int(buf.lengths[lo:hi].sum())
        return _Seqs(buf.lengths[lo:hi], buf.items[a:b], None if buf.actions is None else buf.actions[a:b])

    def _block(self, records: list[tuple]) -> _Seqs:
        """A block of records of the row parse (``(items, actions)`` lists)."""
        return _Seqs(torch.tensor([len(r[0]) for r in records], dtype=torch.int64),
                     torch.tensor([i for r in records for i in r[0]], dtype=torch.int64),
                     torch.tensor([a for r in records for a in r[1]], dtype=torch.int64)
                     if self.num_actions else None)

    def _batch(self, block: _Seqs) -> Batch:
        """The batch of a block: as :func:`sequence_batch` makes it from lists, from the block's
        tensors."""
        n = len(block)
        if self.split == "eval":  # the whole catalog in the first sample's bag (_catalog_bags)
            neg_lengths = torch.zeros(n, dtype=torch.int64)
            neg_values = torch.arange(self.rows if n else 0, dtype=torch.int64)
            if n:
                neg_lengths[0] = self.rows
        else:
            # Drawn for the whole global batch, this trainer's rows taken: a full global batch gets
            # the negatives one process reading it would.
            g = torch.Generator().manual_seed(_seed_of(self.cfg.seed, "negatives", self._step))
            size = self.world_size * self.batch_size
            drawn = torch.randint(0, self.rows, (size, self.cfg.num_negatives), generator=g)
            lo = min(self.rank * self.batch_size, size - n)
            neg_values = drawn[lo:lo + n].reshape(-1)
            neg_lengths = torch.full((n,), self.cfg.num_negatives, dtype=torch.int64)
        self._step += 1
        return _batch_of(self.schema, n, (block.lengths, block.items), (neg_lengths, neg_values),
                         (block.lengths, block.actions) if ACTION in self.schema.features else None)

    def _columnar(self, rb: Any, names: list[str]) -> _Seqs | None:
        """The records of a record batch as :meth:`_parse` makes them, as a block, converted a
        column at a time; ``None`` when a cell may not be what the row parse takes (it then decides and names
        it). Taken: item and action ids as lists of integers or as text (split on
        ``data.id_separator``), timestamps as lists of numbers or as text of plain decimals (no
        NaN), each row's lists of one length. Items are ordered by timestamp (stably,
        as ``sorted``), the last held out for training, rows left with fewer than 2 items
        counted as short, and each kept to its last ``data.max_len + 1``."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        n = rb.num_rows
        lens = None
        flat = []
        try:
            for (key, _), name in zip(self._columns(), names, strict=True):
                c = _plain(rb.column(name))
                t = c.type
                if _is_text(t):
                    c = split_text(c, self.cfg.id_separator)
                elif not ((pa.types.is_list(t) or pa.types.is_large_list(t))
                          and (_is_number(t.value_type) if key == "data.timestamps_column"
                               else pa.types.is_integer(t.value_type) or _is_text(t.value_type))):
                    return None
                n_of = pc.fill_null(pc.list_value_length(c), 0).to_numpy(zero_copy_only=False).astype(np.int64)
                if lens is None:
                    lens = n_of
                elif not np.array_equal(lens, n_of):
                    return None
                values = pc.list_flatten(c)
                if values.null_count:
                    return None
                if key == "data.timestamps_column":
                    if _is_text(values.type) and len(values) and not pc.all(
                            pc.match_substring_regex(values, _DECIMAL)).as_py():
                        return None  # text that float() and pyarrow might read differently
                    v = pc.cast(values, pa.float64(), safe=False).to_numpy(zero_copy_only=False)
                    if np.isnan(v).any():
                        return None
                else:
                    v = pc.cast(values, pa.int64()).to_numpy(zero_copy_only=False)
                    bound = self.rows if key == "data.items_column" else self.num_actions
                    if v.size and (v.min() < 0 or v.max() >= bound):
                        return None
                flat.append((key, v))
        except pa.ArrowException:
            return None
        assert lens is not None
        stamps = [v for key, v in flat if key == "data.timestamps_column"]
        items = flat[0][1]
        acts = next((v for key, v in flat if key == "data.actions_column"), None)
        if stamps:
            order = np.lexsort((stamps[0], np.repeat(np.arange(n), lens)))  # stable: ties keep their order
            items = items[order]
            acts = None if acts is None else acts[order]
        ends = np.cumsum(lens)
        kept = np.maximum(lens - 1, 0) if self.split == "train" else lens
        ends = ends - (lens - kept)
        starts = ends - np.minimum(kept, self.cfg.max_len + 1)
        good = kept >= 2
        self.counts["lines"] += n
        self.counts["short"] += int(n - good.sum())
        starts, ends = starts[good], ends[good]
        kept_lengths = ends - starts
        # Each kept row's range [start, end) of the flat lists, the ranges one after another.
        first = np.concatenate([[0], np.cumsum(kept_lengths)[:-1]]).astype(np.int64)
        index = np.arange(int(kept_lengths.sum()), dtype=np.int64) + np.repeat(starts - first, kept_lengths)
        return _Seqs(torch.from_numpy(kept_lengths.astype(np.int64)), torch.from_numpy(items[index]),
                     None if acts is None else torch.from_numpy(acts[index]))


class SequenceCsvReader(_SequenceFiles):
    """Sequence rows from CSV (first line the header; ``.gz`` decompressed): parsed by pyarrow and
    converted a column at a time, a block of the file at a time; from the first block that cannot
    be (a row pyarrow refuses, a cell the bulk conversion does not take), line by line with the
    stdlib ``csv`` module, which names a bad line."""

    source = "csv"

    def _check_file(self, path: str) -> None:
        with io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="replace", newline="") as f:
            self._indices(path, csv_header(path, csv.reader(f)))

    can_seek = True

    def _chunks(self) -> Iterator[_Seqs]:
        return self._bulk_then_lines(self._fast, self._slow)

    def _fast(self, path: str, start: tuple[int, int] | None
              ) -> Iterator[tuple[_Seqs, int, int | None, int | None] | None]:
        """The file's records (from ``start``: :func:`~hybrid.data.tabular.arrow_csv_batches`) and
        how many rows they came from, a block at a time, parsed by pyarrow and converted a column
        at a time (:meth:`_columnar`), with where the block starts; ``None`` (then nothing more)
        at the first block that needs the line-by-line path."""
        import pyarrow as pa

        with io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="replace", newline="") as f:
            header = csv_header(path, csv.reader(f))
        names = [header[i] for i in self._indices(path, header)]
        if len(set(header)) != len(header) or any(not h for h in header):
            yield None  # pyarrow needs unique, named columns
            return
        for item in arrow_csv_batches(path, {n: pa.string() for n in names}, start):
            block = None if item is None else self._columnar(item[0], names)
            if block is None:
                yield None
                return
            yield block, item[0].num_rows, item[1], item[2]

    def _slow(self, path: str, *, skip: int, start: tuple[int, int] | None = None) -> Iterator[_Seqs]:
        """The file line by line (the stdlib ``csv`` module) from the top or from ``start`` (where
        the pass started in it), after its first ``skip`` records there (read by the bulk path,
        and counted there)."""
        chunk: list[tuple] = []
        with csv_reader_at(path, start) as (reader, header, base):
            cols = self._indices(path, header)
            for row, where in self._csv_rows(path, reader, header, base):
                if skip:
                    skip -= 1
                    self.counts["lines"] -= 1  # counted when the bulk path read it
                    continue
                self._keep(self._parse([row[i] for i in cols]), where, chunk)
                if len(chunk) >= 8192:
                    yield self._block(chunk)
                    chunk = []
        yield self._block(chunk)


class SequenceParquetReader(_SequenceFiles):
    """Sequence rows from Parquet (list or string columns); rows are numbered from 1."""

    source = "parquet"

    def _check_file(self, path: str) -> None:
        pf = _pyarrow_parquet().ParquetFile(path)
        self._indices(path, pf.schema_arrow.names)
        if pf.metadata.num_rows == 0:
            raise InputError(f"data.parquet: {path}: empty file (no rows)")

    can_seek = True

    def _chunks(self) -> Iterator[_Seqs]:
        pq = _pyarrow_parquet()
        for path, where, at in self._files():
            pf = pq.ParquetFile(path)
            header = pf.schema_arrow.names
            names = [header[i] for i in self._indices(path, header)]
            for rb, row in parquet_batches(pf, names, at["row"] if at is not None else 0):
                self._at = {**where, "row": row}
                block = self._columnar(rb, names)
                if block is None:
                    cols = [rb.column(name).to_pylist() for name in names]
                    chunk: list[tuple] = []
                    for j in range(rb.num_rows):
                        self.counts["lines"] += 1
                        self._keep(self._parse([c[j] for c in cols]), f"{path}: row {row + j + 1}", chunk)
                    block = self._block(chunk)
                yield block


def make_sequence_dataset(schema: Schema, cfg: DataConfig, *, split: str, rank: int = 0, world_size: int = 1):
    """The sequence reader for ``cfg.source`` (``synthetic``, ``csv`` or ``parquet``)."""
    if cfg.source == "synthetic":
        return SyntheticSequences(schema, cfg, rank=rank, world_size=world_size, split=split)
    readers = {"csv": SequenceCsvReader, "parquet": SequenceParquetReader}
    if cfg.source not in readers:
        raise ValueError(f"data.source: got {cfg.source!r}; sequence data is 'synthetic', 'csv' or 'parquet'")
    paths = list(cfg.eval_paths if split == "eval" and cfg.eval_paths else cfg.train_paths)
    if not paths:
        raise ValueError(f"data.train_paths: data.source={cfg.source} reads files; list the sequence files")
    return readers[cfg.source](schema, cfg, paths, rank=rank, world_size=world_size, split=split)


__all__ = ["ACTION", "ITEM", "NEGATIVE", "SequenceCsvReader", "SequenceParquetReader", "SyntheticSequences",
           "make_sequence_dataset", "sequence_batch"]
