"""Example recommendation models, with no distribution code, registered as any user's are.

Each example is a :class:`hybrid.train.ModelSpec` named in this project's ``pyproject.toml``
under ``[project.entry-points."hybrid.models"]``: ``dlrm``, ``dcn`` (CTR) and ``two_tower``
(retrieval). Their builders take the ``model:`` section of ``conf/train/<name>.yaml``; the plan
for each lives in ``conf/plans/<name>.yaml``.
"""

from __future__ import annotations

from torch import nn

from hybrid.data import Schema
from hybrid.train import ModelSpec, model_schema
from recsys_examples.models import TwoTower, build_dcn, build_dlrm, build_two_tower


def _dense_width(model: nn.Module) -> Schema:
    """DLRM and DCN read as many dense features as their bottom MLP's first layer takes."""
    first = next(m for m in model.dense_arch.modules() if isinstance(m, nn.Linear))
    return model_schema(model, num_dense=first.in_features)


def _query_and_item(model: TwoTower) -> Schema:
    """The two-tower reads no dense features; its query tower's features are the query side."""
    query = [f for c in model.query_ebc.embedding_bag_configs() for f in c.feature_names]
    return model_schema(model, num_dense=0, task="retrieval", query_features=query)


dlrm = ModelSpec(build=build_dlrm, task="ctr", schema=_dense_width)
dcn = ModelSpec(build=build_dcn, task="ctr", schema=_dense_width)
two_tower = ModelSpec(build=build_two_tower, task="retrieval", schema=_query_and_item)

__all__ = ["TwoTower", "build_dcn", "build_dlrm", "build_two_tower", "dcn", "dlrm", "two_tower"]
