"""What a training step computes: the :class:`Task` protocol and the two built-in tasks.

A task turns a model and a :class:`~hybrid.data.Batch` into the outputs, the loss and the
per-sample evaluation outputs that the metrics read (:mod:`hybrid.train.metrics`):

- ``ctr`` (:class:`CTRTask`): ``model(dense, sparse)`` gives one logit per sample; binary
  cross-entropy with the click labels; evaluation keeps each sample's predicted probability and
  label (``preds``, ``labels``: AUC, normalized entropy, accuracy).
- ``retrieval`` (:class:`RetrievalTask`): ``model(dense, sparse)`` gives normalized query and item
  embeddings; softmax over the batch's items with the sample's own item as the positive
  (in-batch negatives), scaled by ``1 / temperature``; evaluation keeps the rank of each query's
  own item among the batch's items (``ranks``, ``candidates``: recall@k, mean rank).

The loss of a trainer is the mean over its own samples; data-parallel training averages the
trainers' gradients, so a distributed step optimizes the mean of the per-trainer losses (for CTR
that is the loss of the global batch; for retrieval each trainer's negatives are its own batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.data.batch import Batch


@runtime_checkable
class Task(Protocol):
    """What the training loop asks of a task; any object with these members is one.

    ``forward`` runs the model on a batch (inside the step, so remote lookups and the dense
    backward happen as for any model call); ``loss`` is the scalar the step minimizes;
    ``eval_outputs`` gives per-sample 1-D tensors by name, gathered from every trainer at an
    evaluation. Names the metrics know: ``preds`` + ``labels`` (CTR metrics), ``ranks`` +
    ``candidates`` (recall@k); any other name is reported as its mean over all samples.
    """

    name: str
    """Shown in the run's summary."""

    def forward(self, model: nn.Module, batch: Batch) -> Any: ...

    def loss(self, outputs: Any, batch: Batch) -> torch.Tensor: ...

    def eval_outputs(self, outputs: Any, batch: Batch) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class CTRTask:
    """Click-through rate: one logit per sample, binary cross-entropy with the labels."""

    name: str = "ctr"

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(batch.dense, batch.sparse).reshape(-1)

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs, batch.labels)

    def eval_outputs(self, outputs: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return {"preds": torch.sigmoid(outputs.detach().float()), "labels": batch.labels.detach().float()}


@dataclass(frozen=True)
class RetrievalTask:
    """Two-tower retrieval with in-batch negatives."""

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


TASKS = ("ctr", "retrieval")
"""Names of the built-in tasks (a :class:`hybrid.train.ModelSpec`'s ``task`` may be one)."""


def make_task(task: str | Task, *, temperature: float = 0.05) -> Task:
    """The task ``task`` names (``temperature``: the config's ``train.temperature``, for
    retrieval), or ``task`` itself when it is a task object."""
    if not isinstance(task, str):
        return task
    if task == "ctr":
        return CTRTask()
    if task == "retrieval":
        return RetrievalTask(temperature=temperature)
    raise ValueError(f"task: got {task!r}; expected one of {', '.join(map(repr, TASKS))} or a Task object")
