"""Evaluation metrics over all trainers: loss, AUC, normalized entropy, accuracy, recall@k.

Each trainer keeps its evaluation outputs (``recsys_examples.tasks``: per-sample predicted
probability and label for CTR, the rank of each query's own item for retrieval); they are
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


def compute(task: str, outputs: dict[str, list[torch.Tensor]], *, ks: list[int]) -> dict[str, float]:
    """Metrics of the gathered evaluation ``outputs`` (lists of per-batch tensors by name)."""
    cat = {k: gather(torch.cat(v) if v else torch.zeros(0)) for k, v in outputs.items()}
    if task == "ctr":
        return ctr_metrics(cat["preds"], cat["labels"])
    return retrieval_metrics(cat["ranks"], cat["candidates"], ks)
