"""Example recommendation models and their data, with no distribution code.

``MODELS`` maps an example's name to its builder (keyword arguments from the ``model:`` section
of ``conf/train/<name>.yaml``, plus ``device``); ``TASK_OF`` maps it to its task
(``recsys_examples.tasks``). The plan for each lives in ``conf/plans/<name>.yaml``.
"""

from __future__ import annotations

from torch import nn

from recsys_examples.models import build_dcn, build_dlrm, build_two_tower

MODELS = {"dlrm": build_dlrm, "dcn": build_dcn, "two_tower": build_two_tower}
TASK_OF = {"dlrm": "ctr", "dcn": "ctr", "two_tower": "retrieval"}


def schema_of(model: nn.Module, task: str):
    """The data schema a model reads: dense width and every sparse feature with its table's rows.

    Features are listed in the order of the model's embedding collections (``named_modules``)
    and their tables; works on meta-device models.
    """
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from recsys_examples.data import Schema
    from recsys_examples.models import TwoTower

    features: list[str] = []
    rows: list[int] = []
    for _, m in model.named_modules():
        if isinstance(m, EmbeddingBagCollection):
            for cfg in m.embedding_bag_configs():
                for f in cfg.feature_names:
                    if f not in features:
                        features.append(f)
                        rows.append(cfg.num_embeddings)
    if isinstance(model, TwoTower):
        num_dense = 0
        query = [f for c in model.query_ebc.embedding_bag_configs() for f in c.feature_names]
    else:
        num_dense = next(m for m in model.dense_arch.modules() if isinstance(m, nn.Linear)).in_features
        query = []
    return Schema(num_dense=num_dense, features=features, num_embeddings=rows, task=task, query_features=query)


__all__ = ["MODELS", "TASK_OF", "build_dcn", "build_dlrm", "build_two_tower", "schema_of"]
