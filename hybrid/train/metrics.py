"""Evaluation metrics over all trainers: loss, AUC, normalized entropy, accuracy, recall@k.

Each trainer keeps its evaluation outputs (:meth:`hybrid.train.tasks.Task.eval_outputs`:
per-sample predicted probability and label for CTR, the rank of each query's own item for
retrieval, or any per-sample values of a task of one's own); they are
gathered from every trainer and the metrics computed on the union, so every trainer reports the
same numbers and they do not depend on how samples were split.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

EPS = 1e-7


def auc(preds: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U, tied predictions get their average rank).

    NaN when the labels are all 0 or all 1 (the curve is undefined).
    """
    preds, labels = preds.double().reshape(-1), labels.double().reshape(-1)
    pos = float(labels.sum())
    neg = labels.numel() - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(preds)
    sorted_preds = preds[order]
    ranks = torch.empty_like(preds)
    ranks[order] = torch.arange(1, preds.numel() + 1, dtype=torch.float64)
    # Average the ranks within each group of equal predictions.
    _, inverse, counts = torch.unique_consecutive(sorted_preds, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    return float((ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def log_loss(preds: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of probabilities ``preds`` (clamped to [EPS, 1 - EPS])."""
    p = preds.double().clamp(EPS, 1 - EPS)
    y = labels.double()
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def normalized_entropy(preds: torch.Tensor, labels: torch.Tensor) -> float:
    """Log loss divided by the entropy of the base rate (1.0 = no better than predicting the CTR)."""
    ctr = float(labels.double().mean())
    if ctr <= 0 or ctr >= 1:
        return float("nan")
    base = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    return log_loss(preds, labels) / base


def accuracy(preds: torch.Tensor, labels: torch.Tensor, threshold: float = 0.5) -> float:
    return float(((preds >= threshold).double() == labels.double()).double().mean())


def recall_at_k(ranks: torch.Tensor, k: int) -> float:
    """Share of queries whose own item is among the ``k`` best-scored candidates (rank < k)."""
    return float((ranks < k).double().mean()) if ranks.numel() else float("nan")


def ctr_metrics(preds: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    return {
        "loss": log_loss(preds, labels),
        "auc": auc(preds, labels),
        "ne": normalized_entropy(preds, labels),
        "accuracy": accuracy(preds, labels),
        "ctr": float(labels.double().mean()) if labels.numel() else float("nan"),
    }


def retrieval_metrics(ranks: torch.Tensor, candidates: torch.Tensor, ks: list[int]) -> dict[str, float]:
    out = {f"recall@{k}": recall_at_k(ranks, k) for k in ks}
    out["mean_rank"] = float(ranks.double().mean()) if ranks.numel() else float("nan")
    out["candidates"] = float(candidates.double().mean()) if candidates.numel() else float("nan")
    return out


def gather(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The concatenation, in trainer order, of every trainer's 1-D ``t`` (lengths may differ)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    n = torch.tensor([t.numel()], dtype=torch.int64, device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    parts = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])


CTR_OUTPUTS = ("preds", "labels")
RETRIEVAL_OUTPUTS = ("ranks", "candidates")


def compute(outputs: dict[str, list[torch.Tensor]], *, ks: list[int]) -> dict[str, float]:
    """Metrics of the gathered evaluation ``outputs`` (lists of per-batch tensors by name).

    ``preds`` and ``labels`` give the CTR metrics, ``ranks`` and ``candidates`` recall@k for
    each of ``ks``; any other output is reported as its mean over all samples.
    """
    # Gathered where the outputs are (a GPU trainer's group may be NCCL), computed on the host.
    cat = {k: gather(torch.cat(v) if v else torch.zeros(0)).cpu() for k, v in outputs.items()}
    result: dict[str, float] = {}
    if all(k in cat for k in CTR_OUTPUTS):
        result.update(ctr_metrics(cat["preds"], cat["labels"]))
    if all(k in cat for k in RETRIEVAL_OUTPUTS):
        result.update(retrieval_metrics(cat["ranks"], cat["candidates"], ks))
    for k, v in cat.items():
        if k not in (*CTR_OUTPUTS, *RETRIEVAL_OUTPUTS):
            result[k] = float(v.double().mean()) if v.numel() else float("nan")
    return result


def headline(metrics: dict[str, float]) -> str | None:
    """The metric a run's curves and summary lead with: AUC, else the largest recall@k, else
    the first metric that is not the loss."""
    if "auc" in metrics:
        return "auc"
    recalls = [k for k in metrics if k.startswith("recall@")]
    if recalls:
        return max(recalls, key=lambda k: int(k.split("@", 1)[1]))
    return next((k for k in metrics if k != "loss"), None)
