"""Row-sparse optimizers: the per-row state a server keeps and the update of the rows a step touched.

Semantics (``g`` is the step's summed, scaled gradient of one row):

- ``sgd``: ``w -= lr * (g + wd * w)``.
- ``adagrad`` (as ``torch.optim.Adagrad``): ``s += g*g``; ``w -= lr * g / (sqrt(s) + eps)``.
- ``rowwise_adagrad`` (as FBGEMM's): ``s_row += mean(g*g)``; ``w -= lr * g / (sqrt(s_row) + eps)``,
  the root correctly rounded (one pass over the rows takes it a row at a time).
- ``adam`` (lazy): only touched rows move, each with its own step count ``k`` for the bias
  corrections: ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g*g``;
  ``w -= lr / (1 - b1^k) * m / (sqrt(v) / sqrt(1 - b2^k) + eps)`` (torch.optim.Adam's formula).

Weight decay is lazy too (touched rows only). The arithmetic is :mod:`hybrid.ops`'
(``optimizer_step_``, ``optimizer_rows``, ``sgd_rows_``); this module owns the state. A step of
several tables (:func:`step_`) is all or nothing: a failure leaves weights and state as they were.
"""

from __future__ import annotations

import torch

from hybrid import ops
from hybrid.ps.config import OptimizerSpec
from hybrid.ps.server.memory import table_tensor


def step_(spec: OptimizerSpec, weights: list[torch.Tensor], optims: list[RowSparseOptimizer],
          rows: list[torch.Tensor], grads: list[torch.Tensor], grad_scales: list[float]) -> None:
    """One step of tables ``weights`` (each its optimizer in ``optims``): distinct ``rows[t]``,
    one gradient row each, times ``grad_scales[t]``; written in place, all or nothing. Raises
    :class:`hybrid.ops.NonFinite` when a new weight is not finite (``RowOutOfRange``: its
    ``table`` is the index in these lists)."""
    ops.optimizer_step_(spec.name, weights, [o.state for o in optims], rows, grads, grad_scales, lr=spec.lr,
                        eps=spec.eps, weight_decay=spec.weight_decay, beta1=spec.beta1, beta2=spec.beta2)


class RowSparseOptimizer:
    """Optimizer state for one table shard and the update of a set of its rows."""

    def __init__(self, spec: OptimizerSpec, rows: int, dim: int, *, huge_pages: bool = True,
                 fill: bool = True) -> None:
        """``fill``: give every row its initial state now; else the state is left unwritten for
        whoever makes rows lazily (:mod:`hybrid.ps.server.lazy`, with :meth:`initial_values`)."""
        self.spec = spec
        self.state: dict[str, torch.Tensor] = {}

        def tensor(*shape: int) -> torch.Tensor:
            return table_tensor(*shape, huge_pages=huge_pages, defer_huge_pages=not fill)

        if spec.name == "adagrad":
            self.state["sum"] = tensor(rows, dim)
        elif spec.name == "rowwise_adagrad":
            self.state["sum"] = tensor(rows)
        elif spec.name == "adam":
            self.state["exp_avg"] = tensor(rows, dim)
            self.state["exp_avg_sq"] = tensor(rows, dim)
            self.state["step"] = tensor(rows)
        if fill:
            for k, v in self.state.items():
                v.fill_(self.initial_values()[k])

    def initial_values(self) -> dict[str, float]:
        """Each state tensor's value for a fresh row."""
        return {k: self.spec.initial_accumulator_value if k == "sum" else 0.0 for k in self.state}

    def reset(self, rows: torch.Tensor) -> None:
        """Fresh state for ``rows`` (a dynamic table's new rows)."""
        init = self.initial_values()
        for k, v in self.state.items():
            v.index_fill_(0, rows, init[k])

    def compute(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, grad_scale: float = 1.0,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The new values of ``weight[rows]`` and of the state's rows (``rows`` distinct, one
        gradient row each, times ``grad_scale``); changes nothing. Raises :class:`hybrid.ops.NonFinite`
        when a new weight is not finite."""
        s = self.spec
        return ops.optimizer_rows(s.name, rows, grad, grad_scale=grad_scale, weight=weight, state=self.state,
                                  lr=s.lr, eps=s.eps, weight_decay=s.weight_decay, beta1=s.beta1, beta2=s.beta2)

    def commit(self, weight: torch.Tensor, rows: torch.Tensor, w: torch.Tensor,
               new_state: dict[str, torch.Tensor]) -> None:
        """Write what :meth:`compute` returned."""
        if rows.numel() == 0:
            return
        ops.scatter_rows_(weight, rows, w)
        for k, v in new_state.items():
            ops.scatter_rows_(self.state[k], rows, v)
