"""The example models: DLRM, DCN-v2 and a two-tower retrieval model.

Plain PyTorch/TorchRec modules with no distribution code: the plan in ``conf/plans/<name>.yaml``
says where each part runs. Every builder takes keyword arguments only (the ``model:`` section of
``conf/train/<name>.yaml``) and ``device`` (``"meta"`` builds shapes without storage, which is
what ``hybrid plan show`` and big models use). Every model's ``forward(dense, sparse)`` takes a
:class:`~hybrid.data.Batch`'s ``dense`` tensor and ``KeyedJaggedTensor``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

CRITEO_DENSE = 13
"""Integer (dense) features of a Criteo line."""
CRITEO_SPARSE = [f"C{i}" for i in range(1, 27)]
"""Categorical (sparse) features of a Criteo line, in file order."""


def _count(key: str, value: object) -> int:
    """``value`` as a size of at least 1, or a ``ValueError`` naming ``model.<key>``."""
    if type(value) is not int or value < 1:
        raise ValueError(f"model.{key}: got {value!r}; expected an integer >= 1")
    return value


def _widths(key: str, widths: Sequence[int], *, last: int | None = None) -> list[int]:
    """An MLP's layer widths (each >= 1; the last ``last`` where given), or a ``ValueError``."""
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or not widths:
        raise ValueError(f"model.{key}: got {widths!r}; expected a list of layer widths")
    out = [_count(key, w) for w in widths]
    if last is not None and out[-1] != last:
        raise ValueError(f"model.{key}: the last width is the model's output, {last}; got {out}")
    return out


def _rows(num_embeddings: int | Sequence[int], features: Sequence[str]) -> list[int]:
    if isinstance(num_embeddings, Sequence) and not isinstance(num_embeddings, (str, bytes)):
        rows = [_count("num_embeddings", n) for n in num_embeddings]
    else:
        rows = [_count("num_embeddings", num_embeddings)] * len(features)
    if len(rows) != len(features):
        raise ValueError(f"model.num_embeddings: {len(rows)} sizes for {len(features)} features {list(features)}")
    return rows


def embedding_tables(
    features: Sequence[str], num_embeddings: int | Sequence[int], embedding_dim: int, pooling: str = "sum",
) -> list[EmbeddingBagConfig]:
    """One table ``t_<feature>`` per feature."""
    if pooling not in ("sum", "mean"):
        raise ValueError(f"model.pooling: got {pooling!r}; expected 'sum' or 'mean'")
    return [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=embedding_dim, num_embeddings=n, feature_names=[f],
                           pooling=PoolingType.SUM if pooling == "sum" else PoolingType.MEAN)
        for f, n in zip(features, _rows(num_embeddings, features))
    ]


def build_dlrm(
    *,
    num_embeddings: int | Sequence[int] = 10_000,
    embedding_dim: int = 16,
    features: Sequence[str] = CRITEO_SPARSE,
    num_dense: int = CRITEO_DENSE,
    bottom_mlp: Sequence[int] = (64, 16),
    top_mlp: Sequence[int] = (64, 32, 1),
    pooling: str = "sum",
    seed: int | None = 0,
    device: torch.device | str | None = None,
) -> DLRM:
    """TorchRec's DLRM (bottom MLP, dot interaction, top MLP); ``forward`` returns ``[n, 1]`` logits."""
    if seed is not None:
        torch.manual_seed(seed)
    _count("embedding_dim", embedding_dim)
    bottom_mlp, top_mlp = _widths("bottom_mlp", bottom_mlp), _widths("top_mlp", top_mlp, last=1)
    if bottom_mlp[-1] != embedding_dim:
        raise ValueError(f"model.bottom_mlp: the last width must equal embedding_dim={embedding_dim} "
                         f"(DLRM's dot interaction); got {list(bottom_mlp)}")
    device = torch.device(device) if device is not None else None
    ebc = EmbeddingBagCollection(tables=embedding_tables(features, num_embeddings, embedding_dim, pooling), device=device)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=num_dense, dense_arch_layer_sizes=list(bottom_mlp),
                over_arch_layer_sizes=list(top_mlp), dense_device=device)


def build_dcn(
    *,
    num_embeddings: int | Sequence[int] = 10_000,
    embedding_dim: int = 16,
    features: Sequence[str] = CRITEO_SPARSE,
    num_dense: int = CRITEO_DENSE,
    bottom_mlp: Sequence[int] = (64, 16),
    top_mlp: Sequence[int] = (64, 32, 1),
    dcn_num_layers: int = 3,
    dcn_low_rank_dim: int = 32,
    pooling: str = "sum",
    seed: int | None = 0,
    device: torch.device | str | None = None,
) -> DLRM_DCN:
    """DLRM with a DCN-v2 low-rank cross network as its interaction (TorchRec's ``DLRM_DCN``)."""
    if seed is not None:
        torch.manual_seed(seed)
    _count("embedding_dim", embedding_dim)
    bottom_mlp, top_mlp = _widths("bottom_mlp", bottom_mlp), _widths("top_mlp", top_mlp, last=1)
    _count("dcn_num_layers", dcn_num_layers)
    _count("dcn_low_rank_dim", dcn_low_rank_dim)
    device = torch.device(device) if device is not None else None
    ebc = EmbeddingBagCollection(tables=embedding_tables(features, num_embeddings, embedding_dim, pooling), device=device)
    return DLRM_DCN(embedding_bag_collection=ebc, dense_in_features=num_dense, dense_arch_layer_sizes=list(bottom_mlp),
                    over_arch_layer_sizes=list(top_mlp), dcn_num_layers=dcn_num_layers,
                    dcn_low_rank_dim=dcn_low_rank_dim, dense_device=device)


class TwoTower(nn.Module):
    """Query and item towers over their own embedding collections; dot-product scores.

    ``forward(dense, sparse)`` returns ``(query, item)``: L2-normalized ``[n, out_dim]`` embeddings
    of each sample's query and item. Trained with in-batch negatives (every other item of the
    batch is a negative for a query; see ``hybrid.train.tasks``). ``dense`` is unused.
    """

    def __init__(self, query_ebc: EmbeddingBagCollection, item_ebc: EmbeddingBagCollection,
                 tower: Sequence[int], device: torch.device | None = None) -> None:
        super().__init__()
        self.query_ebc = query_ebc
        self.item_ebc = item_ebc
        q_in = sum(c.embedding_dim * len(c.feature_names) for c in query_ebc.embedding_bag_configs())
        i_in = sum(c.embedding_dim * len(c.feature_names) for c in item_ebc.embedding_bag_configs())
        self.query_tower = MLP(q_in, list(tower), device=device)
        self.item_tower = MLP(i_in, list(tower), device=device)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.query_tower(self.query_ebc(sparse).values())
        i = self.item_tower(self.item_ebc(sparse).values())
        return F.normalize(q, dim=-1), F.normalize(i, dim=-1)


def build_two_tower(
    *,
    num_embeddings: int | Sequence[int] = 10_000,
    embedding_dim: int = 16,
    query_features: Sequence[str] = ("user_id", "user_history"),
    item_features: Sequence[str] = ("item_id", "item_category"),
    tower: Sequence[int] = (64, 32),
    pooling: str = "mean",
    seed: int | None = 0,
    device: torch.device | str | None = None,
) -> TwoTower:
    """A two-tower retrieval model: one collection and one MLP tower per side."""
    if seed is not None:
        torch.manual_seed(seed)
    _count("embedding_dim", embedding_dim)
    tower = _widths("tower", tower)
    device = torch.device(device) if device is not None else None
    features = [*query_features, *item_features]
    rows = _rows(num_embeddings, features)
    nq = len(query_features)
    query = EmbeddingBagCollection(
        tables=embedding_tables(query_features, rows[:nq], embedding_dim, pooling), device=device)
    item = EmbeddingBagCollection(
        tables=embedding_tables(item_features, rows[nq:], embedding_dim, pooling), device=device)
    return TwoTower(query, item, tower, device=device)
