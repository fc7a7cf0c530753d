"""The one synthetic DLRM workload every system trains: model, initial weights and batches.

Everything is a function of :class:`Workload` (and its seed), so every system, in every process,
builds the same model and sees the same batches: step ``t``'s *global* batch is generated from
``seed + t``, trainer ``r`` takes samples ``[r * batch, (r + 1) * batch)`` of it, and the
single-process ``local`` system trains on all of it.

Ids follow a power law over the rows (``P(rank k) ~ (k+1)**-zipf_alpha``, drawn by inverting the
continuous law, hot rows scattered by a fixed affine map ``(a*k + b) % rows`` per table), every
bag holds the same number of ids, and labels come from a fixed random "teacher" (a linear
function of the dense features plus a per-row score of the ids, a hash of the row), so the loss
has something to learn and ``final_loss`` means something. Nothing of the size of a table is
stored: a trainer's memory does not grow with ``rows``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.ps.config import POOL_ON


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends an option's default to its help, unless the help already says it or there is none
    to say (a default of ``None`` defers to something the help names)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


@dataclass(kw_only=True)
class Workload:
    """Every number of a benchmark run; each field is a ``--flag`` of ``benchmarks.run``."""

    tables: int = 8
    """Embedding tables, one sparse feature each."""
    rows: int = 100_000
    """Rows per table."""
    dim: int = 32
    """Embedding dimension (also the bottom MLP's output width, as DLRM's dot interaction needs)."""
    ids_per_bag: int = 8
    """Ids per sample and feature (every bag has exactly this many)."""
    zipf_alpha: float = 1.05
    """Exponent of the Zipf distribution of ids (0 = uniform)."""
    dense_features: int = 13
    """Dense input features."""
    bottom_mlp: list[int] = field(default_factory=lambda: [128, 32])
    """Bottom MLP layer widths after the dense input (the last equals ``dim``)."""
    top_mlp: list[int] = field(default_factory=lambda: [256, 128, 1])
    """Top MLP layer widths after the interaction (the last is 1: one logit)."""
    batch: int = 256
    """Samples per trainer per step (``local`` trains on ``trainers * batch``)."""
    trainers: int = 2
    """Trainer processes of the distributed systems."""
    servers: int = 1
    """Parameter-server processes (hybrid and rpc_tutorial)."""
    lr: float = 0.1
    """SGD learning rate of the dense part."""
    sparse_lr: float = 0.1
    """SGD learning rate of the embedding tables (of the mean gradient over the global batch)."""
    warmup: int = 10
    """Steps before the timed ones (not timed)."""
    steps: int = 50
    """Timed steps."""
    seed: int = 0
    """Seed of the initial weights and of the batches."""
    threads: int = 1
    """``OMP_NUM_THREADS`` / ``torch.set_num_threads`` of every process."""
    async_staleness: int = 1
    """``hybrid_async``'s ``sync.staleness``."""
    hot_rows: int = 0
    """``hybrid_async``'s ``hot_rows``: rows per table and server each trainer keeps (0: none;
    serves rows from ``async_staleness`` 2 on, the next batch being prefetched)."""
    pool_on: str = "auto"
    """Every hybrid system's ``pool_on``: ``auto`` (the plan's default: on the servers where a
    trainer reaches them over the network, as under ``--network emulated``, else on the
    trainers), ``trainer`` (servers send rows) or ``server`` (servers send pooled bags; tables
    table-wise)."""

    def __post_init__(self) -> None:
        checks = [
            ("tables", self.tables >= 1, "an integer >= 1"),
            ("rows", self.rows >= 1, "an integer >= 1"),
            ("dim", self.dim >= 1, "an integer >= 1"),
            ("ids_per_bag", self.ids_per_bag >= 1, "an integer >= 1"),
            ("zipf_alpha", self.zipf_alpha >= 0, "a value >= 0"),
            ("dense_features", self.dense_features >= 1, "an integer >= 1"),
            ("bottom_mlp", bool(self.bottom_mlp) and self.bottom_mlp[-1] == self.dim,
             f"widths ending in dim={self.dim} (DLRM's dot interaction needs it)"),
            ("top_mlp", bool(self.top_mlp) and self.top_mlp[-1] == 1, "widths ending in 1"),
            ("batch", self.batch >= 1, "an integer >= 1"),
            ("trainers", self.trainers >= 1, "an integer >= 1"),
            ("servers", self.servers >= 1, "an integer >= 1"),
            ("lr", self.lr > 0, "a value > 0"),
            ("sparse_lr", self.sparse_lr > 0, "a value > 0"),
            ("warmup", self.warmup >= 0, "an integer >= 0"),
            ("steps", self.steps >= 1, "an integer >= 1"),
            ("threads", self.threads >= 1, "an integer >= 1"),
            ("async_staleness", self.async_staleness >= 1, "an integer >= 1"),
            ("hot_rows", self.hot_rows >= 0, "an integer >= 0"),
            ("pool_on", self.pool_on in POOL_ON, " or ".join(map(repr, POOL_ON))),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"workload {name}: got {getattr(self, name)!r}; expected {expected}")

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def global_batch(self) -> int:
        return self.trainers * self.batch

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One ``--flag`` per field, defaults and help from the dataclass."""
        defaults = cls()
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = getattr(defaults, f.name)
            doc = _field_docs().get(f.name, "")
            if isinstance(default, list):
                parser.add_argument(flag, type=_int_list, default=default, metavar="W,W,...",
                                    help=f"{doc} (default: {','.join(map(str, default))})")
            else:
                parser.add_argument(flag, type=type(default), default=default, help=f"{doc} (default: {default})")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Workload:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def with_(self, **changes) -> Workload:
        return replace(self, **changes)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 128,32; got {text!r}") from None


def _field_docs() -> dict[str, str]:
    """The docstring under each field of :class:`Workload` (for ``--help``)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(Workload))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


# -- the model ------------------------------------------------------------------------------------


def table_configs(w: Workload):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=w.dim, num_embeddings=w.rows, feature_names=[f"f{i}"])
        for i in range(w.tables)
    ]


def build_dlrm(w: Workload, *, tables: Literal["meta", "cpu"] = "cpu") -> nn.Module:
    """TorchRec's ``DLRM`` over an ``EmbeddingBagCollection``, dense part on CPU initialized from
    ``w.seed``. ``tables="meta"``: the tables have shapes only (hybrid: the servers fill them);
    ``"cpu"``: filled by ``hybrid.init_tables`` with ``w.seed``, the same rows the servers start
    from, so every system starts from the same model."""
    import hybrid
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(w.seed)
    ebc = EmbeddingBagCollection(tables=table_configs(w), device=torch.device("meta"))
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=w.dense_features,
        dense_arch_layer_sizes=list(w.bottom_mlp),
        over_arch_layer_sizes=list(w.top_mlp),
    )
    if tables == "cpu":
        hybrid.init_tables(ebc, seed=w.seed)
    return dlrm


def table_weights(dlrm: nn.Module) -> list[torch.Tensor]:
    """The DLRM's table weights, in table order (``t0``, ``t1``, ...)."""
    ebc = dlrm.sparse_arch.embedding_bag_collection
    return [ebc.embedding_bags[c.name].weight.detach() for c in ebc.embedding_bag_configs()]


class DenseDLRM(nn.Module):
    """The DLRM without its embedding collection: bottom MLP, interaction, top MLP.

    ``forward(dense, pooled)`` takes the pooled embeddings as one ``[batch, tables, dim]`` tensor
    (what ``DLRM.sparse_arch`` returns), so systems that do their own lookups (``local``,
    ``rpc_tutorial``) compute exactly what ``DLRM.forward`` computes.
    """

    def __init__(self, dlrm: nn.Module) -> None:
        super().__init__()
        self.dense_arch = dlrm.dense_arch
        self.inter_arch = dlrm.inter_arch
        self.over_arch = dlrm.over_arch

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.over_arch(self.inter_arch(dense_features=self.dense_arch(dense), sparse_features=pooled))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy over the batch."""
    return F.binary_cross_entropy_with_logits(logits.squeeze(1), labels)


# -- the data -------------------------------------------------------------------------------------


@dataclass
class Batch:
    """One batch: dense features ``[n, dense_features]``, ids ``[tables, n, ids_per_bag]``, labels ``[n]``."""

    dense: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor
    _kjt: object = None

    def __len__(self) -> int:
        return self.labels.shape[0]

    def slice(self, lo: int, hi: int) -> Batch:
        return Batch(self.dense[lo:hi].contiguous(), self.ids[:, lo:hi].contiguous(), self.labels[lo:hi].contiguous())

    def kjt(self):
        """The sparse features as a ``KeyedJaggedTensor`` (keys ``f0``, ``f1``, ...), built once."""
        if self._kjt is None:
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

            t, n, L = self.ids.shape
            self._kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=[f"f{i}" for i in range(t)],
                values=self.ids.reshape(-1),
                lengths=torch.full((t * n,), L, dtype=torch.int64),
            )
        return self._kjt


class Data:
    """Deterministic batches of a workload: ``global_batch(t)`` is the same in every process."""

    def __init__(self, w: Workload) -> None:
        import random

        self.w = w
        g = torch.Generator().manual_seed(w.seed + 7_919)
        rng = random.Random(w.seed + 7_919)
        # Hot rows scattered over each table (not rows 0, 1, 2, ...), the same everywhere: rank k
        # is row (a*k + b) % rows, a coprime to rows.
        draws = ([rng.randrange(1, max(2, w.rows)) for _ in range(64)] for _ in range(w.tables))
        coprime = [next((a for a in tries if math.gcd(a, w.rows) == 1), 1) for tries in draws]
        self.a = torch.tensor(coprime, dtype=torch.int64).view(-1, 1)
        self.b = torch.tensor([rng.randrange(w.rows) for _ in range(w.tables)], dtype=torch.int64).view(-1, 1)
        self.score_key = torch.tensor([rng.getrandbits(32) for _ in range(w.tables)], dtype=torch.int64).view(-1, 1)
        self.teacher_dense = torch.randn(w.dense_features, generator=g) / w.dense_features**0.5

    def global_batch(self, step: int) -> Batch:
        from hybrid.data.synthetic import power_law_rank

        from hybrid.ps.init import fmix32

        w = self.w
        n = w.global_batch
        g = torch.Generator().manual_seed(w.seed * 1_000_003 + step)
        dense = torch.randn(n, w.dense_features, generator=g)
        u = torch.rand(w.tables, n * w.ids_per_bag, generator=g, dtype=torch.float64)
        rank = power_law_rank(u, w.rows, w.zipf_alpha)
        ids = (rank * self.a + self.b) % w.rows
        # The teacher's score of a row: uniform, mean 0, variance 1, a hash of (table, row).
        score = (fmix32(fmix32(ids ^ self.score_key)).double() + 0.5) / 2.0**32
        scores = ((score - 0.5) * 12**0.5).float().view(w.tables, n, -1)
        ids = ids.view(w.tables, n, w.ids_per_bag)
        logit = dense @ self.teacher_dense + scores.mean(dim=2).sum(dim=0) / w.tables**0.5
        labels = (logit > 0).float()
        return Batch(dense, ids, labels)

    def batches(self, trainer: int | None = None, steps: int | None = None) -> list[Batch]:
        """Every step's batch: the global one (``trainer=None``) or trainer ``trainer``'s slice."""
        out = []
        for t in range(self.w.total_steps if steps is None else steps):
            b = self.global_batch(t)
            if trainer is not None:
                b = b.slice(trainer * self.w.batch, (trainer + 1) * self.w.batch)
            out.append(b)
        return out
