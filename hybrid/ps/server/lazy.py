"""A table shard's initial rows, made where they are first used and by a background fill.

Creating a table eagerly means writing every row before the first lookup, and the cost of that
is the first touch of gigabytes of memory (page faults; on a virtual machine, faults in the host
too), several seconds the trainers would wait for. So a server allocates a table without touching
it and answers the create call at once; each row's initial value is a pure function of (seed,
table, row id), so it can be made at any time before the row is first read or written:

- The rows are grouped in blocks of :data:`BLOCK_ROWS`, with one flag per block saying whether its
  rows (and their optimizer state) still wait for their initial values. Whatever reads or writes
  rows calls :meth:`LazyRows.ensure` (or :meth:`~LazyRows.ensure_range`) first, under the shard's
  lock; blocks are small (4 rows) so a step that reads a few thousand scattered rows per table
  makes only a few times as many rows, not the table.
- A background thread (:class:`hybrid.ps.server.service.ParameterServer`) makes the remaining
  blocks in order, :data:`FILL_BYTES` of rows at a time: it first asks the kernel for the pages
  (``hybrid.ops.populate_``, outside the lock and without the GIL: the slow part), then makes the
  rows under the lock (fast, the memory being there). Lookups wait for at most one such part.
  Once it is done the table is fully resident, as an eagerly made one, and the check costs
  nothing (:attr:`LazyRows.done`).
- Writes that replace whole rows (a checkpoint load, loading given weights) mark the blocks they
  cover as made instead of making them first (:meth:`~LazyRows.loaded`, :meth:`~LazyRows.overwrite`).

Huge pages: a lookup's first write into a table advised for transparent huge pages would fault a
whole 2 MiB page in. So lazily made tables are mapped without the advice
(``table_tensor(defer_huge_pages=True)``), and the fill advises each part as it populates it
(collapsing the small pages that lookups faulted in before).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from hybrid import ops
from hybrid.ps.server.memory import HUGE_PAGE

BLOCK_ROWS = 4
"""Rows per flag. Small, because a step's ids fall all over a table and the rows a step makes
are its distinct ids' blocks: with 64 (a 4 KiB page of 16-float rows) the first steps over 8
tables of 4M rows made 64x their rows and ran 14x slower than once filled; with 4 they run at
a fifth of that speed (``benchmarks.scale``, ``samples_per_s_filling``), the rest being the first
touch of the pages. The flags cost a byte per 4 rows."""
FILL_BYTES = HUGE_PAGE
"""Bytes of rows (of the weight) the background fill makes per hold of the shard's lock."""

Values = Callable[[torch.Tensor, torch.Tensor], None]
"""``values(rows, out)``: write the initial values of local rows ``rows`` (int64) into ``out``
(``[len(rows), dim]``, the table's dtype)."""


class LazyRows:
    """Which blocks of one table shard still wait for their initial values, and their making.

    ``weight`` is the shard's rows; ``state`` its optimizer state tensors (first dimension the
    rows) with each one's initial value; ``values`` makes initial rows (:data:`Values`). Every
    method but :meth:`fill_next` expects the caller to hold the shard's lock."""

    def __init__(self, weight: torch.Tensor, state: dict[str, tuple[torch.Tensor, float]], values: Values, *,
                 huge_pages: bool) -> None:
        self.weight = weight
        self.state = state
        self.values = values
        self.huge_pages = huge_pages
        self.rows = weight.shape[0]
        self.blocks = -(-self.rows // BLOCK_ROWS)
        self.pending = torch.ones(self.blocks, dtype=torch.bool)
        """Per block: its rows still wait for their initial values."""
        self.left = self.blocks
        """Blocks still pending."""
        row_bytes = max(1, weight[:1].numel() * weight.element_size())
        self.fill_blocks = max(1, FILL_BYTES // row_bytes // BLOCK_ROWS)
        """Blocks per part of the background fill."""
        self.cursor = 0
        """The first block the background fill has not passed yet."""

    @property
    def done(self) -> bool:
        """Every row has its value (or was written): nothing is left to check."""
        return self.left == 0

    def ensure(self, ids: torch.Tensor) -> None:
        """Make the pending blocks that local rows ``ids`` fall in. Ids outside the table make at
        most an edge block (whoever reads them raises its own error)."""
        if self.left == 0 or ids.numel() == 0:
            return
        blocks = torch.div(ids, BLOCK_ROWS, rounding_mode="floor").clamp_(0, self.blocks - 1)
        need = blocks[self.pending.index_select(0, blocks)]
        if need.numel():
            self._make(torch.unique(need))

    def ensure_range(self, start: int, stop: int) -> None:
        """Make the pending blocks that local rows ``[start, stop)`` fall in."""
        if self.left == 0 or stop <= start:
            return
        lo, hi = start // BLOCK_ROWS, -(-stop // BLOCK_ROWS)
        need = self.pending[lo:hi].nonzero().flatten()
        if need.numel():
            self._make(need + lo)

    def overwrite(self, start: int, stop: int) -> None:
        """Local rows ``[start, stop)`` of the weight are about to be written whole: the blocks
        they cover entirely only get their optimizer state's initial values (their rows come
        from the writer); the blocks at either edge, partly covered, are made first."""
        if self.left == 0 or stop <= start:
            return
        first, last = start // BLOCK_ROWS, (stop - 1) // BLOCK_ROWS
        for edge in {first, last}:
            lo, hi = edge * BLOCK_ROWS, min((edge + 1) * BLOCK_ROWS, self.rows)
            if bool(self.pending[edge]) and not (start <= lo and hi <= stop):
                self._make(torch.tensor([edge]))
        covered = self.pending[first : last + 1].nonzero().flatten() + first
        if covered.numel():
            self._make(covered, weight=False)

    def loaded(self, rows: torch.Tensor) -> None:
        """Local rows ``rows`` now hold loaded values, weight and optimizer state (a checkpoint):
        their blocks are made; a pending block only partly loaded gets its other rows' values.
        Works on the window of blocks ``rows`` spans, so loading a table part by part costs each
        part its own size."""
        if self.left == 0 or rows.numel() == 0:
            return
        lo, hi = int(rows.min()) // BLOCK_ROWS, int(rows.max()) // BLOCK_ROWS + 1
        first = lo * BLOCK_ROWS
        hit = torch.zeros((hi - lo) * BLOCK_ROWS, dtype=torch.bool)
        hit[rows - first] = True
        blocks = hit.view(hi - lo, BLOCK_ROWS)
        pending = self.pending[lo:hi]
        touched = pending & blocks.any(1)
        hit[self.rows - first :] = True  # past the last row: nothing to make
        partial = touched & ~blocks.all(1)
        if bool(partial.any()):
            missing = (~blocks[partial]).nonzero()
            local = (partial.nonzero().flatten()[missing[:, 0]] + lo) * BLOCK_ROWS + missing[:, 1]
            self._make_rows(local)
        self.left -= int(touched.sum())
        pending &= ~touched

    def fill_next(self, lock: AbstractContextManager) -> bool:
        """Make the next part of pending blocks (the background fill): populate its memory
        without ``lock``, then make its rows holding it. Returns whether any block is left."""
        while self.cursor < self.blocks and self.left:
            lo, hi = self.cursor, min(self.cursor + self.fill_blocks, self.blocks)
            self.cursor = hi
            part = self.pending[lo:hi]
            if not bool(part.any()):
                continue
            collapse = not bool(part.all())  # lookups made some rows here, in small pages
            start, stop = lo * BLOCK_ROWS, min(hi * BLOCK_ROWS, self.rows)
            for t in (self.weight, *(s for s, _ in self.state.values())):
                ops.populate_(t[start:stop], huge_pages=self.huge_pages and t.nbytes >= HUGE_PAGE,
                              collapse=collapse)
            with lock:
                self.ensure_range(start, stop)
            break
        return self.left > 0

    def _make(self, blocks: torch.Tensor, *, weight: bool = True) -> None:
        """Initial values of every row of ``blocks`` (distinct, ascending), then mark them made."""
        n = blocks.numel()
        first, last = int(blocks[0]), int(blocks[-1])
        if last - first + 1 == n:  # one run: slices, no index
            start, stop = first * BLOCK_ROWS, min((last + 1) * BLOCK_ROWS, self.rows)
            if weight:
                self.values(torch.arange(start, stop, dtype=torch.int64), self.weight[start:stop])
            for t, value in self.state.values():
                t[start:stop].fill_(value)
            self.pending[first : last + 1] = False
        else:
            rows = (blocks.unsqueeze(1) * BLOCK_ROWS + torch.arange(BLOCK_ROWS)).flatten()
            if last == self.blocks - 1:
                rows = rows[rows < self.rows]
            self._make_rows(rows, weight=weight)
            self.pending[blocks] = False
        self.left -= n

    def _make_rows(self, rows: torch.Tensor, *, weight: bool = True) -> None:
        """Initial values of local rows ``rows`` (their weight and optimizer state)."""
        if weight:
            out = torch.empty((rows.numel(), *self.weight.shape[1:]), dtype=self.weight.dtype)
            self.values(rows, out)
            self.weight.index_copy_(0, rows, out)
        for t, value in self.state.values():
            t.index_fill_(0, rows, value)
