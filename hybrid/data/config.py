"""What the data readers read: the model's :class:`Schema` and the ``data:`` section (:class:`DataConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

SOURCES = ("synthetic", "criteo", "csv", "parquet")
"""Values of ``data.source``: generated batches, Criteo TSV, CSV, Parquet."""
MALFORMED = ("error", "skip")
"""Values of ``data.malformed``: what a file reader does with a line it cannot parse."""
TASKS = ("ctr", "retrieval", "sequence")
"""Values of :attr:`Schema.task`."""
CATEGORICAL = ("id", "hash")
"""Values of ``data.categorical``: how a CSV/Parquet sparse cell's tokens become ids."""
DENSE_TRANSFORMS = ("none", "log1p", "standardize")
"""Values of ``data.dense_transform``."""



def _one_of(choices: tuple[str, ...]) -> str:
    return ", ".join(repr(c) for c in choices)


@dataclass
class Schema:
    """The inputs a model reads (a :class:`hybrid.train.ModelSpec` derives it from the model).

    Args:
        num_dense: width of ``Batch.dense``.
        features: sparse feature names, in the order of ``Batch.sparse``'s keys.
        num_embeddings: rows of each feature's table (same order); ids a reader makes from
            categorical values (Criteo hex, synthetic) lie in ``[0, rows)``.
        task: ``"ctr"`` (labels are clicks), ``"retrieval"`` (every sample is a positive
            (query, item) pair, label 1) or ``"sequence"`` (every sample is a user's item
            history: :mod:`hybrid.data.sequences`).
        query_features: retrieval only: the features of the query side; the others are the item's.
    """

    num_dense: int
    features: list[str]
    num_embeddings: list[int]
    task: str = "ctr"
    query_features: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.features = list(self.features)
        self.num_embeddings = [int(n) for n in self.num_embeddings]
        self.query_features = list(self.query_features)
        if len(self.features) != len(self.num_embeddings):
            raise ValueError(f"schema: {len(self.features)} features {self.features} but "
                             f"{len(self.num_embeddings)} table sizes {self.num_embeddings}")
        if len(set(self.features)) != len(self.features):
            raise ValueError(f"schema: feature names repeat: {self.features}")
        if any(n < 1 for n in self.num_embeddings):
            raise ValueError(f"schema: every table needs at least 1 row; got {self.num_embeddings}")
        if self.num_dense < 0:
            raise ValueError(f"schema: num_dense must be >= 0; got {self.num_dense}")
        if self.task not in TASKS:
            raise ValueError(f"schema: task {self.task!r}; expected one of {_one_of(TASKS)}")
        unknown = [f for f in self.query_features if f not in self.features]
        if unknown:
            raise ValueError(f"schema: query features {unknown} are not among the features {self.features}")

    @property
    def item_features(self) -> list[str]:
        """Retrieval: the features that are not the query's, in schema order."""
        return [f for f in self.features if f not in self.query_features]


@dataclass(kw_only=True)
class DataConfig:
    """The ``data`` section of a training config: where batches come from and how big they are.

    Plain types only (omegaconf structured config); :func:`check_data_config` checks values.
    """

    source: str = "synthetic"
    """``synthetic`` (generated, learnable; no files), ``criteo`` (Criteo TSV: label, I1..I13,
    C1..C26), ``csv`` or ``parquet`` (columns named below)."""
    train_paths: list[str] = field(default_factory=list)
    """Training files, read in order (``.gz`` is decompressed; glob patterns such as
    ``/data/day_*.gz`` are expanded, sorted). File sources only."""
    eval_paths: list[str] = field(default_factory=list)
    """Held-out files read at every evaluation. File sources only."""
    batch_size: int = 256
    """Samples per trainer per step; a step trains on ``trainers x batch_size`` samples."""
    read_ahead: int = 8
    """Training batches each trainer draws at a time, ahead of the steps that train on them. The
    trainers agree on each group (which batches hold NaN/inf, how many samples each step has)
    in one small all-reduce, instead of one collective every step; 1 draws each batch in its
    own step. The batches and the training are the same for every value. A group waits on the
    host (a GPU trainer copies each batch to its device when its step comes), and a read error
    in it (a malformed line) stops the run when the group is drawn, up to ``read_ahead - 1``
    steps before that batch's step."""
    eval_batches: int = 8
    """Synthetic source: held-out batches per trainer at every evaluation."""
    ids_per_feature: int = 1
    """Synthetic source: ids in every bag (every sample and feature)."""
    zipf_alpha: float = 1.05
    """Synthetic source: exponent of the power law of id popularity (0 = uniform; ~1 is
    typical of real click logs)."""
    seed: int = 0
    """Synthetic source: the seed of the batches and of the hidden "teacher" behind the labels."""
    malformed: str = "error"
    """File sources: a line that cannot be parsed stops the run with its file and line
    (``error``) or is skipped and counted (``skip``)."""
    check_lines: int = 10000
    """File sources: ``hybrid launch`` parses at least this many lines at the top of each file
    (whole chunks of a few thousand lines), with the run's own parser, before any process starts,
    so that a format mistake there ends the command at once; later lines are checked as the
    trainers read them. 0 checks the header only."""
    dense_columns: list[str] = field(default_factory=list)
    """CSV/Parquet: the dense feature columns, in the model's order. A model builder that takes
    ``num_dense`` gets ``len(dense_columns)`` (``model.num_dense`` may be left out)."""
    sparse_columns: list[str] = field(default_factory=list)
    """CSV/Parquet: the column of each sparse feature, in the model's feature order; empty =
    columns named like the features. A model builder that takes ``features`` gets these names
    (``model.features`` may be left out; given, it must be the same list)."""
    label_column: str = "label"
    """CSV/Parquet: the label column (0/1 clicks, or any value in [0, 1]). Retrieval data may
    leave it out: every row is then a positive pair (label 1)."""
    id_separator: str = "|"
    """CSV (and Parquet string columns): separates several ids in one cell (``"3|17|5"``); an
    empty cell is an empty bag."""
    max_len: int = 50
    """Sequence data: items a model reads per sequence; longer histories keep their newest
    ``max_len`` items (plus the one to predict)."""
    num_negatives: int = 4
    """Sequence data: uniformly sampled negative items per training sequence (shared by the
    trainer's batch, with its in-batch targets, as the sampled softmax's candidates)."""
    items_column: str = "items"
    """Sequence files: the column of each user's item ids (oldest first, or ordered by the
    timestamps), separated by ``id_separator`` (Parquet: also a list)."""
    timestamps_column: str = ""
    """Sequence files: optional column of one number per item; items are sorted by it."""
    actions_column: str = ""
    """Sequence files: the column of one action id per item (models that embed actions)."""
    drop_last: bool = True
    """File sources, training files: drop an incomplete last global batch. Otherwise it is split
    as evenly as possible over the trainers (dropped only when it has fewer samples than
    trainers), and the training loop weighs each trainer's loss by its share of that batch, so
    the step equals one process's mean over it. Evaluation always reads every held-out row (a trainer may get a short or empty
    last batch)."""
    categorical: str = "id"
    """CSV/Parquet sparse cells: ``id`` (each token is an id, a non-negative integer below
    ``2**63``) or ``hash`` (each token's UTF-8 text -- an integer's decimal digits -- becomes
    the id ``fnv1a64(text) & (2**63 - 1)``: the same on every machine and run;
    :func:`hybrid.data.tabular.hash_ids`). Strings and raw 64-bit ids need ``hash`` (or
    ``ids: dynamic`` tables for raw ids); ``hash`` ids are spread over ``[0, 2**63)``."""
    dense_transform: str = "none"
    """CSV/Parquet dense columns: ``none`` (as read), ``log1p`` (``log(1 + max(x, 0))``, as for
    Criteo counts) or ``standardize`` (``(x - mean) / std`` with each column's statistics over
    the training files, computed once and kept in ``data_stats.json`` in the run's output folder,
    reused on resume and at evaluation)."""
    label_threshold: Optional[float] = None
    """CSV/Parquet: label = 1 when the label column's number is above this, else 0 (ratings,
    watch time); unset: the label must already be in [0, 1]."""
    label_map: dict[str, float] = field(default_factory=dict)
    """CSV/Parquet: label of each text of the label column (``{">50K": 1, "<=50K": 0}``); a
    text not listed is a malformed line. Not together with ``label_threshold``."""


def check_data_config(cfg: DataConfig) -> None:
    """Raise ``ValueError`` for a bad value, naming the key (``data.source: got 'foo'; ...``)."""
    if cfg.source not in SOURCES:
        raise ValueError(f"data.source: got {cfg.source!r}; expected one of {_one_of(SOURCES)}")
    if not isinstance(cfg.check_lines, int) or cfg.check_lines < 0:
        raise ValueError(f"data.check_lines: got {cfg.check_lines!r}; expected an integer >= 0")
    if cfg.malformed not in MALFORMED:
        raise ValueError(f"data.malformed: got {cfg.malformed!r}; expected one of {_one_of(MALFORMED)}")
    for key in ("batch_size", "ids_per_feature", "max_len", "read_ahead"):
        value = getattr(cfg, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"data.{key}: got {value!r}; expected an integer >= 1")
    if not isinstance(cfg.eval_batches, int) or isinstance(cfg.eval_batches, bool) or cfg.eval_batches < 0:
        raise ValueError(f"data.eval_batches: got {cfg.eval_batches!r}; expected an integer >= 0")
    if not isinstance(cfg.num_negatives, int) or isinstance(cfg.num_negatives, bool) or cfg.num_negatives < 0:
        raise ValueError(f"data.num_negatives: got {cfg.num_negatives!r}; expected an integer >= 0")
    if not cfg.zipf_alpha >= 0:  # also refuses NaN
        raise ValueError(f"data.zipf_alpha: got {cfg.zipf_alpha!r}; expected a number >= 0 (0 = uniform)")
    if not cfg.id_separator:
        raise ValueError("data.id_separator: got ''; expected a non-empty string such as '|'")
    for key in ("train_paths", "eval_paths", "dense_columns", "sparse_columns"):
        value = getattr(cfg, key)
        if not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"data.{key}: got {list(value)!r}; expected a list of non-empty strings")
    for key in ("dense_columns", "sparse_columns"):
        names = list(getattr(cfg, key))
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"data.{key}: {twice} listed more than once")
    if cfg.categorical not in CATEGORICAL:
        raise ValueError(f"data.categorical: got {cfg.categorical!r}; expected one of {_one_of(CATEGORICAL)}")
    if cfg.dense_transform not in DENSE_TRANSFORMS:
        raise ValueError(f"data.dense_transform: got {cfg.dense_transform!r}; expected one of "
                         f"{_one_of(DENSE_TRANSFORMS)}")
    if cfg.label_map and cfg.label_threshold is not None:
        raise ValueError("data.label_map: set either it or data.label_threshold, not both")
    bad = {k: v for k, v in dict(cfg.label_map).items() if not 0.0 <= float(v) <= 1.0}
    if bad:
        raise ValueError(f"data.label_map: labels must lie in [0, 1]; got {bad}")
    if cfg.label_column and cfg.label_column in [*cfg.dense_columns, *cfg.sparse_columns]:
        raise ValueError(f"data.label_column: {cfg.label_column!r} is also a feature column")
