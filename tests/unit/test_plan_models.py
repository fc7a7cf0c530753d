"""Models and helpers shared by the plan tests (this file holds no tests itself).

The realistic model is torchrec's own DLRM with 4 small tables; its module paths are
``sparse_arch.embedding_bag_collection``, ``dense_arch``, ``inter_arch`` (no parameters) and
``over_arch``. The others are tiny modules made to hit one rule of the matcher.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

EBC = "sparse_arch.embedding_bag_collection"
PS_RULE = {"strategy": "parameter_server", "sharding": "row_wise", "optimizer": {"name": "rowwise_adagrad", "lr": 0.05}}


def tables(rows=(100, 100, 100, 100), dim: int = 8) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(rows)
    ]


def dlrm(rows=(100, 100, 100, 100), dim: int = 8) -> DLRM:
    """torchrec DLRM, tables on the meta device (shapes only, as ``hybrid plan show`` builds it)."""
    ebc = EmbeddingBagCollection(tables=tables(rows, dim), device=torch.device("meta"))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[16, dim], over_arch_layer_sizes=[16, 1])


def dcn() -> DLRM_DCN:
    ebc = EmbeddingBagCollection(tables=tables(), device=torch.device("meta"))
    return DLRM_DCN(
        embedding_bag_collection=ebc,
        dense_in_features=13,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
        dcn_num_layers=2,
        dcn_low_rank_dim=4,
    )


class OwnParams(nn.Module):
    """A parent with a parameter of its own beside two children."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


class PlainEmbeddings(nn.Module):
    """Plain torch embedding modules at the top level, plus a dense layer."""

    def __init__(self, mode: str = "sum") -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(1000, 16, mode=mode)
        self.emb = nn.Embedding(500, 4)
        self.head = nn.Linear(20, 1)


def write(tmp_path: Path, text: str, name: str = "plan.yaml") -> Path:
    """Write dedented YAML ``text`` to ``tmp_path/name``."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
