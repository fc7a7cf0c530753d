"""The one batch type every reader yields and the training loop consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class Batch:
    """``n`` samples: dense features, sparse features and labels.

    - ``dense``: ``[n, num_dense]`` float32;
    - ``sparse``: a ``KeyedJaggedTensor`` with stride ``n`` (one bag per sample and feature,
      keys in the schema's feature order, int64 ids);
    - ``labels``: ``[n]`` float32 (click / no click for CTR; 1 for the positive pairs of a
      retrieval batch, whose negatives are the other samples' items).
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch on ``device`` (``non_blocking`` copies from pinned memory overlap with
        the work already queued on the device)."""
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(torch.device(device), non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory, from where a copy to a GPU need not block."""
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory())

    def slice(self, lo: int, hi: int) -> Batch:
        """Samples ``[lo, hi)`` (a trainer's share of a global batch)."""
        kjt = self.sparse
        n = len(self)
        lengths = kjt.lengths().view(len(kjt.keys()), n)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
        starts = offsets[:-1].view_as(lengths)
        keep = lengths[:, lo:hi].reshape(-1)
        first = starts[:, lo:hi].reshape(-1)
        # Position of every kept id: its bag's start plus its place inside the bag.
        bag_start_in_out = torch.cumsum(keep, 0) - keep
        total = int(keep.sum())
        index = torch.repeat_interleave(first - bag_start_in_out, keep, output_size=total) + torch.arange(total)
        weights = kjt.weights_or_none()
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=kjt.keys(),
            values=kjt.values()[index],
            lengths=keep.contiguous(),
            weights=None if weights is None else weights[index],
        )
        return Batch(self.dense[lo:hi].contiguous(), sparse, self.labels[lo:hi].contiguous())


def kjt_from_ids(keys: list[str], ids: list[torch.Tensor], lengths: list[torch.Tensor]) -> KeyedJaggedTensor:
    """A KJT from per-feature flat ids and per-sample lengths (both in feature order)."""
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys),
        values=torch.cat(ids).to(torch.int64) if ids else torch.zeros(0, dtype=torch.int64),
        lengths=torch.cat(lengths).to(torch.int64) if lengths else torch.zeros(0, dtype=torch.int64),
    )
