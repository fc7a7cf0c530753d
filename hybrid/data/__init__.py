"""Training data: one :class:`Batch` type, readers (synthetic, Criteo TSV, CSV/Parquet).

:func:`make_dataset` picks the reader named by ``data.source``. Every reader yields trainer
``rank``'s share ``[rank*B, (rank+1)*B)`` of each global batch of ``world_size x B`` samples, so
all trainers yield the same number of batches and sync training equals single-process training
on the global batches.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable

from hybrid.data.batch import Batch, kjt_from_ids
from hybrid.data.config import DataConfig, Schema, check_data_config
from hybrid.data.criteo import CriteoReader
from hybrid.data.sequences import make_sequence_dataset
from hybrid.data.synthetic import SyntheticData
from hybrid.data.tabular import CsvReader, FileReader, ParquetReader

READERS: dict[str, type[FileReader]] = {"criteo": CriteoReader, "csv": CsvReader, "parquet": ParquetReader}
"""The file readers by ``data.source`` (``synthetic`` needs no files)."""


def make_dataset(schema: Schema, cfg: DataConfig, *, split: str, rank: int = 0,
                 world_size: int = 1, stats_dir: str | os.PathLike | None = None) -> Iterable[Batch]:
    """The batches of trainer ``rank`` of ``world_size`` for ``split`` (``"train"`` or ``"eval"``).

    Sequence schemas (``schema.task == "sequence"``) read :mod:`hybrid.data.sequences`.
    Synthetic: an endless training stream and ``cfg.eval_batches`` held-out batches. Files:
    ``cfg.train_paths`` or ``cfg.eval_paths``, one pass per ``iter()``. A file source without
    files for the split, or a path that matches nothing, is a ``ValueError`` naming the key.
    Evaluation reads every held-out row (``data.drop_last`` applies to training files only).
    ``stats_dir``: where ``data.dense_transform: standardize`` keeps its statistics (the run's
    output folder).
    """
    check_data_config(cfg)
    if split not in ("train", "eval"):
        raise ValueError(f"split: got {split!r}; expected 'train' or 'eval'")
    if schema.task == "sequence":
        return make_sequence_dataset(schema, cfg, split=split, rank=rank, world_size=world_size)
    if cfg.source == "synthetic":
        return SyntheticData(schema, cfg, rank=rank, world_size=world_size, split=split)
    key = f"data.{split}_paths"
    paths = list(cfg.train_paths if split == "train" else cfg.eval_paths)
    if not paths:
        raise ValueError(f"{key}: data.source={cfg.source} reads files; list the {split} files "
                         f"(e.g. {key}=[/data/part_0.gz])")
    for p in paths:
        if not (glob.glob(p) if glob.has_magic(p) else os.path.isfile(p)):
            raise ValueError(f"{key}: {p!r} {'matches no file' if glob.has_magic(p) else 'is not a file'}")
    if cfg.source == "criteo":
        reader: FileReader = CriteoReader(schema, cfg, paths, rank=rank, world_size=world_size)
    else:
        reader = READERS[cfg.source](schema, cfg, paths, rank=rank, world_size=world_size,  # type: ignore[call-arg]
                                     stats_dir=stats_dir)
    reader.keep_tail = split == "eval"
    return reader


def check_files(schema: Schema, cfg: DataConfig) -> None:
    """Before a run starts: every file of a file source exists, can be read and is not empty, and
    (CSV, Parquet) its header has every named column. Raises ``ValueError`` naming the key or the
    file (:class:`hybrid.errors.InputError` for a file's content); lines are checked as they are read."""
    if cfg.source == "synthetic":
        return
    for split in ("train", "eval"):
        reader = make_dataset(schema, cfg, split=split)
        reader.check_files()  # type: ignore[union-attr] - a file source: a FileReader


__all__ = [
    "Batch", "CriteoReader", "CsvReader", "DataConfig", "ParquetReader", "Schema", "SyntheticData",
    "check_data_config", "check_files", "kjt_from_ids", "make_dataset",
]
