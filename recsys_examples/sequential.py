"""A sequential recommender: causal transformer blocks over each user's item history, trained to
predict the next item with a sampled softmax (SASRec-style).

Model (:class:`SequentialRecommender`, no distribution code):

- ``embedding_collection``: a torchrec ``EmbeddingCollection`` (unpooled) with the table
  ``t_item`` (features ``item`` -- the history -- and ``negative`` -- sampled candidates) and,
  with ``num_actions > 0``, the table ``t_action`` (feature ``action``, one per item);
- ``input_head``: learned position embeddings (plus dropout); item and action embeddings are
  summed, positions added;
- ``encoder``: ``num_blocks`` pre-norm causal :class:`TransformerBlock` s (each its own module,
  so a plan can make each its own FSDP unit with ``wrap: [TransformerBlock]``) and a final norm;
- ``output_head``: a linear map of the encoder's states into the item-embedding space; the score
  of an item is the dot product with its (tied) input embedding.

``forward(dense, sparse)`` returns a :class:`SequenceOutputs`: for every sample and position
``p < L-1`` the query vector that predicts item ``p+1``, the target ids, and the candidate pool:
the batch's distinct items among every target and every ``negative`` id, with their embeddings.

Task (:class:`SequentialTask`): the loss is the softmax cross-entropy of each target against the
pool (the in-batch targets plus the uniform negatives; each distinct item once, so the target is
never also a negative), averaged over the batch's target positions. No logQ correction: the
in-batch part over-samples popular items, which a correction would offset, but a correction
from per-trainer item counts would make a step depend on how the global batch is split, and sync
training equals one process. Evaluation ranks the held-out last item of every sequence among the
whole catalog (the eval batches carry it as ``negative`` ids) and reports recall@k and NDCG@k
(``k=10``), and the same for a popularity baseline that ranks items by how often the trainers
have seen them in training batches (counts summed over the trainers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from hybrid.data import Batch, Schema
from hybrid.data.sequences import ACTION, ITEM, NEGATIVE
from hybrid.train import ModelSpec


class TransformerBlock(nn.Module):
    """Pre-norm causal self-attention and a feed-forward layer, each with a residual."""

    def __init__(self, dim: int, heads: int, ffn_mult: int = 4, dropout: float = 0.0,
                 device: torch.device | None = None) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"model.num_heads: {heads} does not divide embedding_dim={dim}")
        self.heads = heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(dim, device=device)
        # No bias: a key bias gets a zero gradient (softmax ignores a shift shared by all keys), and
        # Adam would turn the rounding noise of that zero into full-size steps.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, device=device)
        self.proj = nn.Linear(dim, dim, device=device)
        self.norm2 = nn.LayerNorm(dim, device=device)
        self.ffn_in = nn.Linear(dim, ffn_mult * dim, device=device)
        self.ffn_out = nn.Linear(ffn_mult * dim, dim, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # Right-padded sequences: a causal mask alone keeps every real position off the padding.
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(n, t, d)), self.dropout, self.training)
        h = self.ffn_out(F.gelu(self.ffn_in(self.norm2(x))))
        return x + F.dropout(h, self.dropout, self.training)


class Encoder(nn.Module):
    """``blocks`` in order, then a final layer norm."""

    def __init__(self, dim: int, num_blocks: int, heads: int, ffn_mult: int, dropout: float,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, ffn_mult, dropout, device=device)
                                    for _ in range(num_blocks))
        self.norm = nn.LayerNorm(dim, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class InputHead(nn.Module):
    """Adds learned position embeddings to the item (+ action) embeddings."""

    def __init__(self, max_len: int, dim: int, dropout: float, device: torch.device | None = None) -> None:
        super().__init__()
        self.position = nn.Embedding(max_len, dim, device=device)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.position.weight[: x.shape[1]]
        return F.dropout(x, self.dropout, self.training)


@dataclass
class SequenceOutputs:
    """What :meth:`SequentialRecommender.forward` gives the task (``P``: target positions)."""

    queries: torch.Tensor
    """``[P, d]``: the state that predicts each target."""
    targets: torch.Tensor
    """``[P]``: each target's item id."""
    last: torch.Tensor
    """``[n]``: index into ``P`` of each sample's last target (-1: a sample without one)."""
    pool_ids: torch.Tensor
    """``[M]``: the distinct candidate items, sorted."""
    pool: torch.Tensor
    """``[M, d]``: their embeddings."""
    target_index: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    """``[P]``: each target's place in the pool."""


def _padded(values: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Jagged rows ``values`` (``lengths`` per sample) as ``[n, width, ...]``, right-padded with 0."""
    n = lengths.numel()
    out = values.new_zeros((n, width, *values.shape[1:]))
    if values.shape[0]:
        offsets = torch.cumsum(lengths, 0) - lengths
        pos = torch.arange(values.shape[0], device=values.device) - torch.repeat_interleave(offsets, lengths)
        row = torch.repeat_interleave(torch.arange(n, device=values.device), lengths)
        out[row, pos] = values
    return out


class SequentialRecommender(nn.Module):
    """Next-item prediction over item histories (see the module docstring)."""

    def __init__(self, embedding_collection: EmbeddingCollection, *, max_len: int, num_blocks: int,
                 num_heads: int, ffn_mult: int = 4, dropout: float = 0.0, device: torch.device | None = None) -> None:
        super().__init__()
        dim = embedding_collection.embedding_dim()
        self.max_len = max_len
        self.embedding_collection = embedding_collection
        self.input_head = InputHead(max_len, dim, dropout, device=device)
        self.encoder = Encoder(dim, num_blocks, num_heads, ffn_mult, dropout, device=device)
        self.output_head = nn.Linear(dim, dim, device=device)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> SequenceOutputs:
        emb: dict[str, JaggedTensor] = self.embedding_collection(sparse)
        items = sparse[ITEM]
        lengths = items.lengths()
        inputs = (lengths - 1).clamp(min=0).clamp(max=self.max_len)
        width = max(1, min(self.max_len, int(lengths.max()) - 1 if lengths.numel() else 1))
        x = emb[ITEM].values()
        if ACTION in emb:
            x = x + emb[ACTION].values()
        seq = _padded(x, lengths, width + 1)  # the last column holds only the final targets
        ids = _padded(items.values(), lengths, width + 1)
        h = self.output_head(self.encoder(self.input_head(seq[:, :width])))
        valid = torch.arange(width, device=h.device)[None, :] < inputs[:, None]
        queries, targets = h[valid], ids[:, 1:][valid]
        counts = valid.sum(1)
        last = torch.where(counts > 0, torch.cumsum(counts, 0) - 1, torch.full_like(counts, -1))
        # The pool: every distinct target and negative id, each with one embedding.
        target_emb = _padded(emb[ITEM].values(), lengths, width + 1)[:, 1:][valid]
        all_ids = torch.cat([targets, sparse[NEGATIVE].values()])
        all_emb = torch.cat([target_emb, emb[NEGATIVE].values()])
        pool_ids, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
        first = torch.full((pool_ids.numel(),), all_ids.numel(), dtype=torch.int64, device=all_ids.device)
        first.scatter_reduce_(0, inverse, torch.arange(all_ids.numel(), device=all_ids.device), reduce="amin")
        return SequenceOutputs(queries=queries, targets=targets, last=last, pool_ids=pool_ids,
                               pool=all_emb[first], target_index=inverse[: targets.numel()])


def build_sequential(
    *,
    num_items: int = 2000,
    num_actions: int = 0,
    embedding_dim: int = 64,
    max_len: int = 50,
    num_blocks: int = 2,
    num_heads: int = 2,
    ffn_mult: int = 4,
    dropout: float = 0.0,
    seed: int | None = 0,
    device: torch.device | str | None = None,
) -> SequentialRecommender:
    """The sequential recommender: tables ``t_item`` (features item, negative) and, with
    ``num_actions > 0``, ``t_action``; ``num_blocks`` transformer blocks of width ``embedding_dim``."""
    if seed is not None:
        torch.manual_seed(seed)
    if num_items < 1 or max_len < 1 or num_blocks < 0 or num_actions < 0:
        raise ValueError(f"model: num_items={num_items}, max_len={max_len} must be >= 1 and num_blocks="
                         f"{num_blocks}, num_actions={num_actions} >= 0")
    device = torch.device(device) if device is not None else None
    tables = [EmbeddingConfig(name="t_item", embedding_dim=embedding_dim, num_embeddings=num_items,
                              feature_names=[ITEM, NEGATIVE])]
    if num_actions:
        tables.append(EmbeddingConfig(name="t_action", embedding_dim=embedding_dim, num_embeddings=num_actions,
                                      feature_names=[ACTION]))
    ec = EmbeddingCollection(tables=tables, device=device)
    return SequentialRecommender(ec, max_len=max_len, num_blocks=num_blocks, num_heads=num_heads,
                                 ffn_mult=ffn_mult, dropout=dropout, device=device)


def _all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t


def ranks_of(scores: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Rank (0 = best) of ``own`` ``[n]`` among the rows of ``scores`` ``[n, M]``; ties share the
    mean place (a popularity tie among unseen items is a random order, not a win)."""
    above = (scores > own[:, None]).sum(1).double()
    ties = (scores == own[:, None]).sum(1).double() - 1
    return above + ties / 2


def ndcg(ranks: torch.Tensor, k: int) -> torch.Tensor:
    """Per-sample NDCG@k of one relevant item at ``ranks`` (1 / log2(rank + 2) when rank < k)."""
    return torch.where(ranks < k, 1.0 / torch.log2(ranks + 2.0), torch.zeros_like(ranks))


class SequentialTask:
    """Next-item sampled softmax; recall@k / NDCG@k and a popularity baseline (module docstring)."""

    name = "sequential"

    def __init__(self, k: int = 10) -> None:
        self.k = k
        self.counts = torch.zeros(0, dtype=torch.float64)

    def forward(self, model: nn.Module, batch: Batch) -> SequenceOutputs:
        return model(batch.dense, batch.sparse)

    def loss(self, outputs: SequenceOutputs, batch: Batch) -> torch.Tensor:
        if outputs.queries.requires_grad:  # a training step: the baseline counts what training sees
            self._count(batch.sparse[ITEM].values())
        if outputs.targets.numel() == 0:
            return outputs.queries.sum() * 0.0 + outputs.pool.sum() * 0.0
        logits = outputs.queries @ outputs.pool.T
        return F.cross_entropy(logits.float(), outputs.target_index)

    def _count(self, ids: torch.Tensor) -> None:
        ids = ids.detach().cpu()
        if ids.numel():
            size = max(self.counts.numel(), int(ids.max()) + 1)
            self.counts = F.pad(self.counts, (0, size - self.counts.numel())) + torch.bincount(ids, minlength=size).double()

    def popularity(self, catalog: int) -> torch.Tensor:
        """Every trainer's training counts of items ``0..catalog-1``, summed (a collective)."""
        size = torch.tensor([max(catalog, self.counts.numel())], dtype=torch.int64)
        size = int(_all_reduce(size, dist.ReduceOp.MAX))
        local = F.pad(self.counts, (0, size - self.counts.numel()))
        return _all_reduce(local.clone())[:catalog]

    def eval_outputs(self, outputs: SequenceOutputs, batch: Batch) -> dict[str, torch.Tensor]:
        has = outputs.last >= 0
        last = outputs.last[has]
        q = outputs.queries[last].detach().float()
        own_ids = outputs.targets[last]
        scores = q @ outputs.pool.detach().float().T
        place = torch.searchsorted(outputs.pool_ids, own_ids)
        ranks = ranks_of(scores, scores.gather(1, place[:, None]).squeeze(1))
        catalog = int(outputs.pool_ids.max()) + 1 if outputs.pool_ids.numel() else 0
        pop = self.popularity(catalog).to(scores.device)[outputs.pool_ids]
        pop_ranks = ranks_of(pop[None, :].expand(own_ids.numel(), -1), pop[place])
        k = self.k
        return {
            "ranks": ranks, "candidates": torch.full_like(ranks, float(outputs.pool_ids.numel())),
            f"ndcg@{k}": ndcg(ranks, k),
            f"popularity_recall@{k}": (pop_ranks < k).double(), f"popularity_ndcg@{k}": ndcg(pop_ranks, k),
        }


def _sequence_schema(model: SequentialRecommender) -> Schema:
    cfgs = {c.name: c for c in model.embedding_collection.embedding_configs()}
    features, rows = [ITEM, NEGATIVE], [cfgs["t_item"].num_embeddings] * 2
    if "t_action" in cfgs:
        features.append(ACTION)
        rows.append(cfgs["t_action"].num_embeddings)
    return Schema(num_dense=0, features=features, num_embeddings=rows, task="sequence")


sequential = ModelSpec(build=build_sequential, task=SequentialTask(), schema=_sequence_schema)

__all__ = ["Encoder", "SequenceOutputs", "SequentialRecommender", "SequentialTask", "TransformerBlock",
           "build_sequential", "sequential"]
