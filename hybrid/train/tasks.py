"""What a step computes for each kind of example: the loss and the outputs that metrics need.

- ``ctr`` (DLRM, DCN): ``model(dense, sparse)`` gives one logit per sample; binary cross-entropy
  with the click labels; evaluation keeps each sample's predicted probability and label.
- ``retrieval`` (two-tower): ``model(dense, sparse)`` gives normalized query and item embeddings;
  softmax over the batch's items with the sample's own item as the positive (in-batch
  negatives), scaled by ``1 / temperature``; evaluation keeps the rank of each query's own item
  among the batch's items (0 = first), from which recall@k follows.

The loss of a trainer is the mean over its own samples; data-parallel training averages the
trainers' gradients, so a distributed step optimizes the mean of the per-trainer losses (for CTR
that is the loss of the global batch; for retrieval each trainer's negatives are its own batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from recsys_examples.data.batch import Batch


@dataclass(frozen=True)
class CTRTask:
    name: str = "ctr"

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(batch.dense, batch.sparse).reshape(-1)

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs, batch.labels)

    def eval_outputs(self, outputs: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return {"preds": torch.sigmoid(outputs.detach().float()), "labels": batch.labels.detach().float()}


@dataclass(frozen=True)
class RetrievalTask:
    name: str = "retrieval"
    temperature: float = 0.05

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        query, item = model(batch.dense, batch.sparse)
        return query @ item.T / self.temperature

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(outputs, torch.arange(outputs.shape[0], device=outputs.device))

    def eval_outputs(self, outputs: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        scores = outputs.detach()
        own = scores.diagonal().unsqueeze(1)
        return {"ranks": (scores > own).sum(dim=1).float(), "candidates": torch.full_like(own.squeeze(1), scores.shape[1])}


TASKS = {"ctr": CTRTask, "retrieval": RetrievalTask}
