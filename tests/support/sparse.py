"""Sparse test data and reference row-sparse optimizers shared by the PS and composer tests."""

from __future__ import annotations

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def sample_tables(mean: bool = True) -> list[EmbeddingBagConfig]:
    """Three tables: plain sum, a shared mean-pooled table with two features, and a tiny one
    (lots of duplicate ids). ``mean=False`` makes them all sum-pooled (weighted collections)."""
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=50, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=30, feature_names=["f1", "f2"],
                           pooling=PoolingType.MEAN if mean else PoolingType.SUM),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=7, feature_names=["f3"]),
    ]


def make_ebc(seed: int = 0, weighted: bool = False, tables=None) -> EmbeddingBagCollection:
    """A local collection holding the rows the servers start from with ``seed``."""
    from hybrid.ps.init import init_tables

    ebc = EmbeddingBagCollection(tables=tables or sample_tables(mean=not weighted), is_weighted=weighted,
                                 device=torch.device("meta"))
    return init_tables(ebc, seed=seed)


def global_batch(step: int, tables, batch: int, *, max_len: int = 4, weighted: bool = False,
                 seed: int = 1000) -> dict:
    """Per feature: lengths [batch] (empty bags included) and ids, deterministic in ``step``."""
    g = torch.Generator().manual_seed(seed + step)
    out = {}
    for t in tables:
        for f in t.feature_names:
            lengths = torch.randint(0, max_len + 1, (batch,), generator=g)
            ids = torch.randint(0, t.num_embeddings, (int(lengths.sum()),), generator=g)
            w = torch.rand(ids.shape, generator=g) if weighted else None
            out[f] = (lengths, ids, w)
    return out


def kjt_slice(data: dict, start: int, end: int, keys: list[str] | None = None) -> KeyedJaggedTensor:
    """The KJT of samples [start, end) of a ``global_batch``."""
    keys = keys or list(data)
    lengths, values, weights = [], [], []
    for k in keys:
        ln, ids, w = data[k]
        off = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(ln, 0)])
        lengths.append(ln[start:end])
        values.append(ids[off[start] : off[end]])
        if w is not None:
            weights.append(w[off[start] : off[end]])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths),
        weights=torch.cat(weights) if weights else None,
    )


def touched_rows(data: dict, tables) -> dict[str, torch.Tensor]:
    out = {}
    for t in tables:
        ids = torch.cat([data[f][1] for f in t.feature_names])
        mask = torch.zeros(t.num_embeddings, dtype=torch.bool)
        mask[ids] = True
        out[t.name] = mask
    return out


class ReferenceSparseOptimizer:
    """Dense formulation of the servers' row-sparse optimizers: only ``touched`` rows move."""

    def __init__(self, name: str, weight: torch.Tensor, *, lr: float, eps: float = 1e-8,
                 beta1: float = 0.9, beta2: float = 0.999, initial_accumulator_value: float = 0.0) -> None:
        self.name, self.w, self.lr, self.eps, self.b1, self.b2 = name, weight, lr, eps, beta1, beta2
        rows, dim = weight.shape
        init = initial_accumulator_value
        self.state = {
            "sgd": {},
            "adagrad": {"sum": torch.full((rows, dim), init)},
            "rowwise_adagrad": {"sum": torch.full((rows,), init)},
            "adam": {"exp_avg": torch.zeros(rows, dim), "exp_avg_sq": torch.zeros(rows, dim),
                     "step": torch.zeros(rows)},
        }[name]

    @torch.no_grad()
    def step(self, grad: torch.Tensor, touched: torch.Tensor) -> None:
        w, m = self.w, touched.unsqueeze(1)
        if self.name == "sgd":
            w.sub_(self.lr * grad * m)
        elif self.name == "adagrad":
            s = self.state["sum"]
            s.add_(grad * grad * m)
            w.sub_(torch.where(m, self.lr * grad / (s.sqrt() + self.eps), 0.0))
        elif self.name == "rowwise_adagrad":
            s = self.state["sum"]
            s.add_(torch.where(touched, (grad * grad).mean(1), 0.0))
            w.sub_(torch.where(m, self.lr * grad / (s.sqrt() + self.eps).unsqueeze(1), 0.0))
        elif self.name == "adam":
            st = self.state
            st["step"].add_(touched.float())
            k = st["step"].clamp(min=1).unsqueeze(1).double()
            st["exp_avg"].copy_(torch.where(m, st["exp_avg"] * self.b1 + (1 - self.b1) * grad, st["exp_avg"]))
            st["exp_avg_sq"].copy_(torch.where(m, st["exp_avg_sq"] * self.b2 + (1 - self.b2) * grad * grad, st["exp_avg_sq"]))
            step_size = (self.lr / (1 - self.b1 ** k)).float()
            bc2_sqrt = (1 - self.b2 ** k).sqrt().float()
            upd = step_size * (st["exp_avg"] / (st["exp_avg_sq"].sqrt() / bc2_sqrt + self.eps))
            w.sub_(torch.where(m, upd, 0.0))


def teacher_task(tables, *, trainer: int, num_trainers: int, batch: int, seed: int = 7):
    """A learnable task over ``tables``: the target of a sample is the sum, over its ids, of a
    fixed random score per row. Returns ``batch_of(step) -> (this trainer's KJT, targets)`` and
    a linear head over the pooled rows with its SGD optimizer (seeded alike on every trainer)."""
    from torch import nn

    torch.manual_seed(1)
    teacher = {t.name: torch.randn(t.num_embeddings) for t in tables}
    head = nn.Linear(sum(t.embedding_dim * len(t.feature_names) for t in tables), 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.05)

    def batch_of(step: int):
        data = global_batch(step, tables, num_trainers * batch, seed=seed)
        kjt = kjt_slice(data, trainer * batch, (trainer + 1) * batch)
        y = torch.zeros(batch)
        for t in tables:
            for f in t.feature_names:
                jt = kjt[f]
                bags = torch.repeat_interleave(torch.arange(batch), jt.lengths())
                y += torch.zeros(batch).index_add_(0, bags, teacher[t.name][jt.values()])
        return kjt, y

    return batch_of, head, opt
