"""One server's part of one remote collection: its table shards, their optimizer, and step state.

Step bookkeeping (sync, ``staleness`` 0): a step's gradients are applied once every trainer's
push of that step is in -- never one push on its own, since another trainer's lookup of the same
step may still be on its way and must read the tables as they were before the step -- and a
lookup of step ``t`` is answered once steps through ``t - 1`` are applied. Async
(``staleness`` k): each push is applied on arrival and a lookup of step ``t`` waits for steps
through ``t - 1 - k``. Waiting lookups are callbacks (:meth:`CollectionShard.when_ready`): no
thread ever blocks on a step.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybrid import ops
from hybrid.ops.reference import unpool_bags
from hybrid.ps.config import CollectionConfig
from hybrid.ps.init import initial_rows, table_key
from hybrid.ps.protocol import Bags, Rows
from hybrid.ps.server.dynamic import DynamicSlots, commit_updates, plan_updates, read_rows
from hybrid.ps.server.lazy import BLOCK_ROWS, LazyRows
from hybrid.ps.server.memory import table_tensor
from hybrid.ps.server.optim import RowSparseOptimizer, step_
from hybrid.ps.sharding import TableLayout


@dataclass
class ServerCounters:
    """What a server counts per collection; trainers read them with ``stats()``."""

    lookups: int = 0
    answered: int = 0
    """Lookups whose rows were gathered for the answer (``lookups - answered``: waiting for their
    step, or failed)."""
    gradients: int = 0
    """Gradient pushes received (one per trainer per step that looked up here)."""
    push_messages: int = 0
    """Gradient pushes that came in a message without a lookup of this collection."""
    channel_lookups: int = 0
    """Lookups that came through a same-host shared-memory transport rather than RPC."""
    rows_served: int = 0
    """Rows read for training lookups (evaluation reads are not counted, here or in ``bytes_out``)."""
    ids_requested: int = 0
    """Ids of training lookups before the trainers' deduplication; ``rows_served / ids_requested``
    is the unique ratio."""
    bytes_in: int = 0
    bytes_out: int = 0
    updates_applied: int = 0
    """Updates finished: sync, one per step (every trainer's gradients in); async, one per push."""
    updates_from_bags: int = 0
    """Of those, async plain-SGD updates of a lookup pooled here applied straight from its bags'
    gradients (:func:`hybrid.ops.sgd_bags_`)."""
    planned_ahead: int = 0
    """Sync dynamic tables: updates whose admissions were planned from the lookups, before the gradients."""
    plans_used: int = 0
    """Of those, the updates that used their plan (the rest planned again: their maps had changed)."""
    wait_s: float = 0.0
    """Time lookups spent waiting for the slowest trainer's update."""
    max_lag: int = 0
    """Largest number of earlier steps not yet fully applied when a lookup was answered."""
    lags: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "lags"}
        d["unique_ratio"] = self.rows_served / self.ids_requested if self.ids_requested else 1.0
        return d


class TableShard:
    """This server's rows of one table, with their optimizer state."""

    def __init__(self, layout: TableLayout, server: int, config: CollectionConfig, *, huge_pages: bool,
                 init: str | None = None) -> None:
        """``init``: ``None``, the caller writes the rows (:meth:`initialize`, tests) and the
        optimizer state is filled now; ``"seed"`` (initial values) or ``"zeros"``, rows and state
        made lazily (:attr:`lazy`). A dynamic table creates each row when its id is admitted."""
        self.layout = layout
        self.name = layout.table.name
        self.dim = layout.table.embedding_dim
        self.shard_pos = layout.servers.index(server)
        self.seed = config.init_seed
        self._init_key: tuple[int, float] | None = None
        self.dynamic: DynamicSlots | None = None
        if config.dynamic is not None:
            index = config.layouts.index(layout)
            self.dynamic = DynamicSlots(config.dynamic, config.parts_on(server, index), table=self.name,
                                        where=f"{config.cid} on ps{server}", huge_pages=huge_pages)
            self.rows = self.dynamic.capacity
        else:
            self.rows = layout.rows_on(server)
        dtype = getattr(torch, config.storage_dtype)
        lazy = init is not None and self.dynamic is None
        self.weight = table_tensor(self.rows, self.dim, dtype=dtype, huge_pages=huge_pages,  # see server.memory
                                   defer_huge_pages=lazy)
        self.optim = RowSparseOptimizer(config.optimizer, self.rows, self.dim, huge_pages=huge_pages, fill=not lazy)
        self.lazy: LazyRows | None = None
        """Which rows still wait for their initial values (:mod:`hybrid.ps.server.lazy`); every
        read or write of rows or optimizer state ensures its rows first. None: all are there."""
        if lazy:
            init_values = self.optim.initial_values()
            state = {k: (v, init_values[k]) for k, v in self.optim.state.items()}
            values = self._initial_values if init == "seed" else _zeros
            self.lazy = LazyRows(self.weight, state, values, huge_pages=huge_pages)

    def global_ids(self, local: torch.Tensor) -> torch.Tensor:
        return self.layout.global_ids(self.shard_pos, local)

    def _initial_values(self, local: torch.Tensor, out: torch.Tensor) -> None:
        t = self.layout.table
        initial_rows(t.name, t.num_embeddings, self.dim, self.global_ids(local), seed=self.seed, out=out)

    def ensure(self, local: torch.Tensor) -> None:
        """Make the initial values of local rows ``local`` that are still pending (caller holds
        the shard's lock)."""
        if self.lazy is not None and self.lazy.left:
            self.lazy.ensure(local)

    def ensure_range(self, start: int, stop: int) -> None:
        """:meth:`ensure` of local rows ``[start, stop)``."""
        if self.lazy is not None and self.lazy.left:
            self.lazy.ensure_range(start, stop)

    def initialize(self, seed: int) -> None:
        """Each row's layout-independent initial value (:mod:`hybrid.ps.init`); a dynamic table
        starts empty and creates each row when its id is admitted."""
        t = self.layout.table
        if self.dynamic is not None:
            return
        step = max(1, (64 << 20) // (4 * max(self.dim, 1)))
        for start in range(0, self.rows, step):
            local = torch.arange(start, min(start + step, self.rows), dtype=torch.int64)
            initial_rows(t.name, t.num_embeddings, self.dim, self.global_ids(local), seed=seed,
                         out=self.weight[start : start + local.numel()])


    # -- dynamic tables -------------------------------------------------------------------------
    def dynamic_rows(self) -> dict[str, torch.Tensor]:
        """A dynamic table's state as tensors, ascending by id: the map (:meth:`DynamicSlots.state`),
        each row (``rows``, float32) and its optimizer state (``state.<name>``)."""
        d = self.dynamic.state()
        d["rows"] = self.weight.index_select(0, d["slots"]).float()
        for k, v in self.optim.state.items():
            d[f"state.{k}"] = v.index_select(0, d["slots"])
        return d

    @property
    def init_key(self) -> tuple[int, float]:
        """The table's hash key and bound of its initial values (:mod:`hybrid.ps.init`), computed once."""
        if self._init_key is None:
            t = self.layout.table
            self._init_key = (table_key(self.seed, t.name), (1.0 / t.num_embeddings) ** 0.5)
        return self._init_key


def _zeros(local: torch.Tensor, out: torch.Tensor) -> None:
    out.zero_()


Contribution = tuple[Rows, torch.Tensor]
"""One trainer's gradient for the rows of one lookup: the rows and the flat gradient."""


@dataclass(eq=False)  # compared by identity: its tensors have no truth value
class LookedUp:
    """A lookup of dynamic tables, kept for the update of its step: its ids (a copy) and the
    slots and sightings the id maps held for them (:func:`hybrid.ps.server.dynamic.read_rows`)
    at the tables' ``versions``. The maps change only in updates, so while every table's
    version stays -- in sync mode always: the lookups of step t are answered after the update
    of t - 1 and before that of t -- the update of the same ids reuses them instead of probing
    the maps again."""

    rows: Rows
    found: torch.Tensor
    seen: torch.Tensor
    versions: list[int]

    def by_table(self, admit_after: int) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Table -> this lookup's ids of it, their slots and (``admit_after > 1``) sightings."""
        counts = self.rows.counts
        seen = self.seen.split(counts) if admit_after > 1 else [None] * len(counts)
        return {i: (ids, f, sn) for i, ids, f, sn in zip(self.rows.tables, self.rows.ids.split(counts),
                                                            self.found.split(counts), seen)}

    def matches(self, rows: Rows, shards: list[TableShard]) -> bool:
        return (self.rows.tables == list(rows.tables) and self.rows.counts == list(rows.counts)
                and self.versions == [t.dynamic.version for t in shards] and torch.equal(self.rows.ids, rows.ids))


@dataclass(eq=False)
class BagGradient:
    """A pooled lookup's gradient as it came, its bags' (float32), with what the server kept of
    the lookup: applied by plain SGD straight from the bags (:func:`hybrid.ops.sgd_bags_`),
    without the row gradients in memory; :meth:`unbagged` makes the row gradients where
    anything else takes it. Only an update applied while the message is handled takes one:
    the gradient may be the transport's memory."""

    rows: Rows
    grad: torch.Tensor
    groups: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor | None]]

    def unbagged(self) -> Contribution:
        """The rows and their gradients, computed as the trainer's pooling backward would."""
        return self.rows, unpool_bags(self.grad, self.groups)


@dataclass(eq=False)
class PooledLookup:
    """What a server keeps of a lookup it pooled (``pool_on: server``) until the trainer pushes
    the bags' gradients for it: the rows (a copy of the ids) and, per group of tables, its
    bags, dimension and the backward's index (:func:`hybrid.ops.bag_rows`)."""

    rows: Rows
    groups: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor | None]]
    """Per group: bags, dim, grad_bags, grad_offsets, grad_scale (:func:`hybrid.ops.bag_rows`)."""
    step: int
    """The training step of the lookup."""


class CollectionShard:
    """The tables of one remote collection that live on this server, and their step state."""

    def __init__(self, config: CollectionConfig, server: int, *, start_step: int, huge_pages: bool = True,
                 init: str | None = None) -> None:
        """``init``: how the tables' rows start (:class:`TableShard`): ``None``, written by the
        caller; ``"seed"`` / ``"zeros"``, made lazily on first use and by a background fill."""
        self.config = config
        self.cid = config.cid
        self.server = server
        self.held = config.held(server)
        self.tables = [TableShard(config.layouts[i], server, config, huge_pages=huge_pages, init=init)
                       for i in self.held]
        self.by_index = dict(zip(self.held, self.tables))
        self.num_trainers = config.num_trainers
        self.staleness = config.staleness
        self.scale = config.scale
        self.wire_dtype = getattr(torch, config.wire_dtype)
        """What rows are sent and gradients arrive in (``wire_dtype``); the tables keep theirs."""
        # Plain SGD on float32 rows adds each contribution straight into the rows (dynamic tables:
        # into the admitted ids' slots), in trainer order; 16-bit rows sum a step's contributions
        # first, so each row is rounded once a step.
        self.accumulates = config.optimizer.accumulates and config.storage_dtype == "float32"
        self.looked_up: dict[int, list[LookedUp]] = defaultdict(list)
        """Step -> its lookups of dynamic tables not yet matched by an update (:class:`LookedUp`)."""
        self.planned: dict[int, _Planned] = {}
        """Step -> its update's admissions, planned from its lookups before its gradients came
        (:meth:`plan_ahead`)."""
        self.complete_through = start_step - 1
        self.arrived: dict[int, int] = defaultdict(int)
        self.pending: dict[int, list[tuple[int, Contribution]]] = defaultdict(list)
        """Step -> (trainer, contribution) of its pushes so far (sync); applied in trainer order,
        so a step's result never depends on the order its pushes arrived in."""
        self.pooled: dict[int, dict[int, PooledLookup]] = defaultdict(dict)
        """Trainer -> tag -> its pooled lookups not yet pushed for (:meth:`gather_pooled`)."""
        self.recorded: dict[tuple[int, int], list[Contribution | None]] = {}
        """(trainer, step) -> one slot per lookup of that step distributed autograd recorded here
        (:meth:`record`), filled by its backward (:meth:`recorded_part`)."""
        self.waiters: list[tuple[int, float, Callable[[BaseException | None], None]]] = []
        self.failed: BaseException | None = None
        self.lock = threading.RLock()
        self.counters = ServerCounters()

    # -- rows -----------------------------------------------------------------------------------
    def shards_of(self, rows: Rows) -> list[TableShard]:
        try:
            return [self.by_index[i] for i in rows.tables]
        except KeyError as e:
            raise IndexError(f"{self.cid} on ps{self.server}: table {e.args[0]} is not held here "
                             f"(this server holds {[t.name for t in self.tables]})") from None

    def numel(self, rows: Rows) -> int:
        """Elements of the rows ``rows`` asks for."""
        return sum(n * t.dim for n, t in zip(rows.counts, self.shards_of(rows)))

    def gather(self, rows: Rows, out: torch.Tensor | None = None, *, step: int | None = None,
               update: bool = True) -> torch.Tensor:
        """The rows asked for, flat, in :attr:`wire_dtype` (into ``out``, of that dtype, where
        given): each value is rounded to nearest, ties to even, as it is copied out of its table.
        ``step``: the training step of the lookup, whose update pushes gradients for these rows
        (dynamic tables keep what the maps said of them for it, :class:`LookedUp`). ``update``
        false: a read no update follows (evaluation), where a dynamic table's ids without a row
        read zeros (:func:`~hybrid.ps.server.dynamic.read_rows`)."""
        assert out is None or out.dtype == self.wire_dtype, (out.dtype, self.wire_dtype)
        got = self._read(rows, out, step, self.wire_dtype, update)
        if update:  # a training lookup (the counters describe training steps, not evaluation reads)
            self.counters.rows_served += int(rows.ids.numel())
            self.counters.bytes_out += got.numel() * got.element_size()
        return got

    def _read(self, rows: Rows, out: torch.Tensor | None, step: int | None, dtype: torch.dtype,
              update: bool = True) -> torch.Tensor:
        """:meth:`gather` without the counters, in ``dtype``."""
        shards = self.shards_of(rows)
        if self.config.dynamic is not None:
            return self._gather_dynamic(rows, shards, out, step, dtype, update)
        with self.lock:
            self._ensure(shards, rows)
            try:
                return ops.gather_rows([t.weight for t in shards], rows.ids, rows.counts, out=out, dtype=dtype)
            except ops.RowOutOfRange as e:
                raise self._outside(shards[e.table], e.row, "lookup") from None

    def gather_pooled(self, trainer: int, rows: Rows, bags: Bags, out: torch.Tensor, *, step: int) -> None:
        """``pool_on: server``: the rows asked for, pooled into the lookup's bags (float32, as the
        trainer would pool them), written into ``out`` in :attr:`wire_dtype`, group after group;
        the backward's index (:func:`hybrid.ops.bag_rows`) is kept for the trainer's push
        (:meth:`unpool`). Range tables pool straight from their rows (:func:`hybrid.ops.pool_rows`);
        dynamic ones, whose ids may have no row yet, from the rows :meth:`_read` makes."""
        spans = _group_spans(rows.counts, bags.groups)
        if spans is None or self.config.dynamic is not None:
            self._pool_read(rows, bags, out, step)
        else:
            shards = self.shards_of(rows)
            o = 0
            with self.lock:
                self._ensure(shards, rows)
                for g, (t0, t1, i0, i1) in zip(bags.groups, spans):
                    if t0 == t1 and g.idx.numel() == 0:  # no rows here: every bag is empty
                        out[o : o + g.bags * g.dim].zero_()
                        o += g.bags * g.dim
                        continue
                    try:
                        ops.pool_rows([t.weight for t in shards[t0:t1]], rows.ids[i0:i1], rows.counts[t0:t1], g.idx,
                                      g.offsets, weights=g.weights, mean=g.mean, out=out[o : o + g.bags * g.dim])
                    except ops.RowOutOfRange as e:
                        raise self._outside(shards[t0 + e.table], e.row, "lookup") from None
                    o += g.bags * g.dim
            if o != out.numel():
                raise ValueError(f"{self.cid} on ps{self.server}: the lookup's bag groups cover {o} of its "
                                 f"{out.numel()} pooled elements")
        kept = [(g.bags, g.dim, *ops.bag_rows(g.idx, g.offsets, rows=g.rows, features=g.features, weights=g.weights,
                                              mean=g.mean)) for g in bags.groups]
        with self.lock:
            self.pooled[trainer][bags.tag] = PooledLookup(rows.owned(), kept, step)
        self.counters.rows_served += int(rows.ids.numel())
        self.counters.bytes_out += out.numel() * out.element_size()

    def _pool_read(self, rows: Rows, bags: Bags, out: torch.Tensor, step: int) -> None:
        """:meth:`gather_pooled`'s pooling over the rows :meth:`_read` gathers (float32)."""
        flat = self._read(rows, _scratch(self.numel(rows)), step, torch.float32)
        pos = o = 0
        for g in bags.groups:
            table = flat[pos : pos + g.rows * g.dim].view(g.rows, g.dim)
            pos += g.rows * g.dim
            out[o : o + g.bags * g.dim].view(g.bags, g.dim).copy_(F.embedding_bag(
                g.idx, table, g.offsets, mode="mean" if g.mean else "sum", per_sample_weights=g.weights,
                include_last_offset=True))
            o += g.bags * g.dim
        if pos != flat.numel() or o != out.numel():
            raise ValueError(f"{self.cid} on ps{self.server}: the lookup's bag groups cover {pos} of its "
                             f"{flat.numel()} row elements and {o} of {out.numel()} pooled ones")

    def unpool(self, trainer: int, tag: int, grad: torch.Tensor, *, step: int) -> Contribution | BagGradient:
        """The row gradients of ``trainer``'s pooled lookup ``tag`` from its bags' gradients
        (``grad``, flat, in :attr:`wire_dtype`): float32, computed as the trainer's pooling
        backward would; ``step``: the push's step. Where :meth:`push` applies it at once by
        plain SGD (async mode), the bags' gradients as they are (:class:`BagGradient`). The
        trainer's lookups of an earlier step, or of this step with a smaller tag, were never used
        (their rows were discarded: a trainer pushes its steps in order, and a step's lookups in
        the order it made them) and are dropped; those of later steps stay (a prefetch may be
        made before the current step's own lookup, so tags do not follow steps). A failure fails
        the collection, as a failed push does (the step it belongs to can never complete)."""
        try:
            return self._unpool(trainer, tag, grad, step)
        except BaseException as e:
            with self.lock:
                self.failed = e
            raise

    def _unpool(self, trainer: int, tag: int, grad: torch.Tensor, step: int) -> Contribution | BagGradient:
        grad = self._widened(grad)
        with self.lock:
            mine = self.pooled[trainer]
            kept = mine.pop(tag, None)
            for old in [t for t, k in mine.items() if k.step < step or (k.step == step and t < tag)]:
                del mine[old]
        if kept is None:
            raise RuntimeError(f"{self.cid} on ps{self.server}: trainer {trainer} pushed the gradient of pooled "
                               f"lookup {tag}, which this server does not hold")
        expected = sum(b * d for b, d, *_ in kept.groups)
        if grad.numel() != expected:
            raise ValueError(f"{self.cid} on ps{self.server}: a pooled gradient of {grad.numel()} elements for "
                             f"{expected} pooled ones")
        bagged = BagGradient(kept.rows, grad, kept.groups)
        return bagged if self.staleness and self.accumulates and self.config.dynamic is None else bagged.unbagged()

    def _widened(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient as it arrived (counted), checked to be in :attr:`wire_dtype` and widened to
        float32 (the same tensor where that is float32)."""
        if grad.dtype != self.wire_dtype:
            raise TypeError(f"{self.cid} on ps{self.server}: a gradient of {grad.dtype}; this collection's "
                            f"wire_dtype is {self.config.wire_dtype} (trainers and servers disagree)")
        self.counters.bytes_in += grad.numel() * grad.element_size()
        return grad.float()

    def _gather_dynamic(self, rows: Rows, shards: list[TableShard], out: torch.Tensor | None,
                        step: int | None, dtype: torch.dtype, update: bool) -> torch.Tensor:
        numel = sum(n * t.dim for n, t in zip(rows.counts, shards))
        out = torch.empty(numel, dtype=dtype) if out is None else out[:numel]
        # Rows are read as float32 (initial values are computed so), then narrowed in one copy.
        full = out if out.dtype == torch.float32 else torch.empty(numel)
        with self.lock:
            found, seen = read_rows([t.dynamic for t in shards], [t.weight for t in shards], rows.ids,
                                    list(rows.counts), keys=[t.init_key[0] for t in shards],
                                    bounds=[t.init_key[1] for t in shards], out=full, update=update)
            if step is not None and step > self.complete_through:
                # The ids are copied: a transport may reuse the lookup's memory once answered.
                self.looked_up[step].append(LookedUp(rows.owned(),
                                                     found, seen, [t.dynamic.version for t in shards]))
        if full is not out:
            out.copy_(full)
        return out

    @staticmethod
    def _ensure(shards: list[TableShard], rows: Rows) -> None:
        """Make the pending initial values of ``rows`` (caller holds the lock)."""
        if all(t.lazy is None or t.lazy.done for t in shards):
            return
        for t, ids in zip(shards, rows.ids.split(list(rows.counts))):
            t.ensure(ids)

    def rows_to_fill(self) -> int:
        """Rows (in whole blocks) whose initial values are still to be made: the background
        fill's work left."""
        return sum(t.lazy.left * BLOCK_ROWS for t in self.tables if t.lazy is not None)

    def _outside(self, table: TableShard, row: int, what: str) -> IndexError:
        return IndexError(f"{what} of {self.cid} on ps{self.server}: row {row} is outside this server's "
                          f"{table.rows} rows of table {table.name!r}; nothing was changed")

    # -- steps ----------------------------------------------------------------------------------
    def when_ready(self, needed: int, fn: Callable[[BaseException | None], None]) -> bool:
        """Run ``fn(None)`` once steps through ``needed`` are applied (``fn(err)`` on failure).
        Returns whether it ran now; otherwise whoever completes the step runs it."""
        with self.lock:
            if self.failed is None and self.complete_through < needed:
                self.waiters.append((needed, time.monotonic(), fn))
                return False
            err = self.failed
        fn(err)
        return True

    def ready_waiters(self) -> list[tuple[Callable[[BaseException | None], None], BaseException | None]]:
        """Remove and return the waiters whose step is now complete (or all, after a failure)."""
        with self.lock:
            ready = [w for w in self.waiters if self.failed or w[0] <= self.complete_through]
            self.waiters = [w for w in self.waiters if w not in ready]
            err = self.failed
        now = time.monotonic()
        for _, since, _ in ready:
            self.counters.wait_s += now - since
        return [(fn, err) for _, _, fn in ready]

    def record(self, trainer: int, step: int) -> int:
        """``gradient_push: dist_autograd``: distributed autograd recorded a lookup of
        ``trainer``'s ``step`` here; its index among that step's recorded lookups. A step may
        look a collection up more than once, and each recorded lookup's backward brings its own
        gradient: :meth:`recorded_part` gathers them into the trainer's one push of the step."""
        with self.lock:
            slots = self.recorded.setdefault((trainer, step), [])
            slots.append(None)
            return len(slots) - 1

    def recorded_part(self, trainer: int, step: int, index: int, part: Contribution) -> list[Contribution] | None:
        """The gradient of recorded lookup ``index`` of ``trainer``'s ``step`` (:meth:`record`):
        once every recorded lookup of the step has its gradient, all of them, in the order they
        were recorded -- the trainer's push of the step -- else ``None``. A trainer's lookups of a step are all
        recorded before its backward starts (it waited for their rows), and a backward runs
        every lookup its context recorded."""
        with self.lock:
            slots = self.recorded[(trainer, step)]
            slots[index] = part
            if any(p is None for p in slots):
                return None
            del self.recorded[(trainer, step)]
            return slots

    def push(self, trainer: int, step: int, parts: list[Contribution], *, keeps_copy: bool = True,
             unpooled: bool = False) -> None:
        """One trainer's gradients for ``step``, one contribution per lookup it made of this
        collection in that step; applied when the step is due (sync: every trainer's arrived).
        ``keeps_copy``: the tensors may be reused by the transport after this call, so a push
        kept for later is copied (false: they stay valid until the step is applied, or until
        :meth:`own_pending`). Gradients arrive in :attr:`wire_dtype` and are widened to
        float32 here, before anything else reads them (``unpooled``: they are :meth:`unpool`'s,
        float32 already). Call :meth:`ready_waiters` afterwards."""
        self.counters.gradients += 1
        try:
            if not unpooled:
                parts = [(r, self._widened(g)) for r, g in parts]
            with self.lock:
                if self.failed is not None:
                    raise RuntimeError(f"{self.cid} on ps{self.server} failed earlier") from self.failed
                last = self.arrived.get(step, 0) + 1 == self.num_trainers
                if self.staleness == 0:
                    if keeps_copy and not last:
                        parts = [_copied(p) for p in parts]
                    self.pending[step].extend((trainer, p) for p in parts)
                    if last:
                        ordered = sorted(self.pending.pop(step), key=lambda e: e[0])  # stable: a trainer's own order
                        self.apply([p for _, p in ordered], step=step)
                else:
                    self.apply(parts, step=step)
                if self.staleness or last:
                    self.counters.updates_applied += 1
                self.arrived[step] += 1
                while self.arrived.get(self.complete_through + 1, 0) == self.num_trainers:
                    self.arrived.pop(self.complete_through + 1)
                    self.complete_through += 1
                    self._end_of_step(self.complete_through)
                    # A step that ended without its backward pushed by a message: its recorded lookups go.
                    for key in [key for key in self.recorded if key[1] <= self.complete_through]:
                        del self.recorded[key]
        except BaseException as e:
            with self.lock:
                self.failed = e
            raise

    def _end_of_step(self, step: int) -> None:
        """Every trainer's pushes through ``step`` are in (caller holds the lock): the last step
        of an ``admit_window`` forgets the sightings of ids still without a row. Keyed to the
        step, not to an update, so one process and any number of servers forget at the same
        point, and a checkpoint taken between steps holds the sightings of the current window."""
        dyn = self.config.dynamic
        if dyn is not None and dyn.admit_window and (step + 1) % dyn.admit_window == 0:
            for t in self.tables:
                t.dynamic.seen.clear()

    def own_pending(self, trainer: int, step: int) -> None:
        """Copy ``trainer``'s kept pushes of ``step`` (not yet applied) out of the memory they
        borrow (:meth:`push` with ``keeps_copy`` false)."""
        with self.lock:
            kept = self.pending.get(step)
            if kept:
                self.pending[step] = [(t, _copied(p) if t == trainer else p) for t, p in kept]

    def apply(self, contributions: list[Contribution], *, step: int = 0) -> None:
        """Apply the trainers' contributions of one step (or one async push): all or nothing
        (dynamic tables: a failed optimizer check after admission keeps the admitted rows)."""
        if self.config.dynamic is not None:
            self._apply_dynamic(contributions, step)
            return
        if self.accumulates:
            self._accumulate(contributions)
            return
        per_table: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for rows, grad in contributions:
            shards = self.shards_of(rows)
            sizes = [n * t.dim for n, t in zip(rows.counts, shards)]
            for index, t, ids, g, n in zip(rows.tables, shards, rows.ids.split(rows.counts), grad.split(sizes),
                                          rows.counts):
                entry = per_table.setdefault(index, ([], []))
                entry[0].append(ids)
                entry[1].append(g.view(n, t.dim))
        steps = []
        for index, (ids_l, grads_l) in per_table.items():
            table = self.by_index[index]
            try:
                if len(ids_l) == 1:
                    rows, summed, gscale = ids_l[0], grads_l[0], self.scale  # distinct: the trainer deduplicated
                else:
                    rows, summed = ops.sum_rows(torch.cat(ids_l), torch.cat(grads_l), scale=self.scale,
                                                num_rows=table.rows)
                    gscale = 1.0
            except ops.RowOutOfRange as e:
                raise self._outside(table, e.row, "gradient push") from None
            if rows.numel():
                steps.append((table, rows, summed, gscale))
        self._step(steps)

    def plan_ahead(self, step: int) -> None:
        """Sync dynamic tables, once every trainer's lookup of ``step`` is in (call after they are
        answered): merge their ids and plan the step's admissions now, while the trainers compute,
        so that the update, when the last gradient arrives, only carries the plan out. The maps
        change only in updates, so the plan holds while they are at the versions the lookups
        saw (which matching a push to its lookup checks); a plan that fails (a full table) is
        left to the update, which plans again and raises."""
        if self.config.dynamic is None or self.staleness or self.num_trainers < 2:
            return
        admit_after = self.config.dynamic.admit_after
        with self.lock:
            looked = self.looked_up.get(step, [])
            if step in self.planned or step <= self.complete_through or len(looked) != self.num_trainers:
                return
            order = sorted({i for e in looked for i in e.rows.tables})
            parts = [e.by_table(admit_after) for e in looked]
            runs = [[k for k, part in enumerate(parts) if i in part] for i in order]  # lookups in order
            try:
                merged = self._plan([self.by_index[i] for i in order], [len(ks) for ks in runs],
                                    [parts[k][i] for i, ks in zip(order, runs) for k in ks], step)
            except Exception:  # noqa: BLE001 - the update plans again and reports it
                return
            keys = [(k, i) for i, ks in zip(order, runs) for k in ks]
            self.planned[step] = _Planned(looked=list(looked), order=order, merged=merged, keys=keys,
                                          slots=self._lookup_slots(looked, merged, keys))
            self.counters.planned_ahead += 1

    def _lookup_slots(self, looked: list[LookedUp], merged: tuple, keys: list[tuple[int, int]]) -> list | None:
        """Plain SGD: each lookup's ids' slots after the planned update, in the lookup's own order
        (what :meth:`_in_slots` would make of its push), or ``None`` where an id would get no
        row (the general path then drops its gradient)."""
        if not self.accumulates:
            return None
        _, _, inverse, admissions = merged
        slots = admissions[0].plan.slots  # every table's distinct ids', in order
        if slots.numel() and int(slots.min()) < 0:
            return None
        run_slots = slots if inverse is None else slots.index_select(0, inverse)
        sizes = [looked[k].rows.counts[looked[k].rows.tables.index(i)] for k, i in keys]
        pieces = dict(zip(keys, run_slots.split(sizes)))
        return [_cat([pieces[(k, i)] for i in e.rows.tables]) for k, e in enumerate(looked)]

    def _plan(self, tables: list[TableShard], runs: list[int],
              segments: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]], step: int):
        """The distinct ids of an update's runs (per table, ``runs[t]`` of ``segments``: each
        run's ascending ids and, where its lookup found them, their slots and sightings), each
        run's ids' index among them, and the admissions :func:`plan_updates` decides.
        Returns ``(distinct, per, inverse, admissions)``; ``inverse`` is ``None`` for one run a table."""
        admit_after = self.config.dynamic.admit_after
        if max(runs) == 1:  # one trainer's ids: already distinct and ascending (the route)
            distinct, per, inverse = [seg[0] for seg in segments], None, None
        else:
            # Each run's ids of a table ascend: merged, every table at once.
            counts, at = [], 0
            for n in runs:
                counts += [seg[0].numel() for seg in segments[at:at + n]] + [0] * (max(runs) - n)
                at += n
            uniq, per_t, inverse = ops.merge_ids(_cat([seg[0] for seg in segments]), counts, runs=max(runs))
            per = per_t.tolist()
            distinct = list(uniq.split(per))
        found = None
        if all(seg[1] is not None for seg in segments):
            found = (_cat([seg[1] for seg in segments]),
                     _cat([seg[2] for seg in segments]) if admit_after > 1 else torch.empty(0, dtype=torch.int64))
            if inverse is not None:
                found = tuple(inverse.new_empty(sum(per)).scatter_(0, inverse, f) if f.numel()
                              else f for f in found)
        admissions = plan_updates([t.dynamic for t in tables], distinct, step, found)
        return distinct, per, inverse, admissions

    def _apply_dynamic(self, contributions: list[Contribution], step: int) -> None:
        """Dynamic tables: every table's distinct ids of the update are admitted (or not) in one
        plan, every table planned before any changes (a full table changes nothing), then the
        optimizer runs on the slots of the admitted ids, all tables in one call (all or nothing)."""
        looked = self.looked_up.get(step, [])
        planned = self.planned.pop(step, None)
        if planned is not None and planned.slots is not None and self._apply_planned(contributions, step, planned):
            return
        admit_after = self.config.dynamic.admit_after
        # Per table, one run per contribution: (ids, gradient rows, slots and sightings the
        # step's lookup found for them or None, the contribution's index), and which lookup it matched.
        Run = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]
        per_table: dict[int, list[Run]] = {}
        matched: dict[int, list[LookedUp | None]] = {}
        for k, (rows, grad) in enumerate(contributions):
            shards = self.shards_of(rows)
            match = next((e for e in looked if e.matches(rows, shards)), None)
            if match is not None:
                looked.remove(match)
            sizes = [n * t.dim for n, t in zip(rows.counts, shards)]
            found = match.found.split(rows.counts) if match is not None else [None] * len(rows.counts)
            seen = (match.seen.split(rows.counts) if match is not None and admit_after > 1
                    else [None] * len(rows.counts))
            for index, t, ids, g, n, f, sn in zip(rows.tables, shards, rows.ids.split(rows.counts), grad.split(sizes),
                                                  rows.counts, found, seen):
                per_table.setdefault(index, []).append((ids, g.view(n, t.dim), f, sn, k))
                matched.setdefault(index, []).append(match)
        # Lookups no update will match: of steps every trainer has pushed (sync: this one too).
        done = self.complete_through if self.staleness else step
        for s in [s for s in self.looked_up if s <= done]:
            del self.looked_up[s]
        for s in [s for s in self.planned if s <= done]:
            del self.planned[s]
        if not per_table:
            return
        order = sorted(per_table)
        tables = [self.by_index[i] for i in order]
        runs_of = [r for i in order for r in per_table[i]]
        if planned is not None and planned.serves(order, matched):
            distinct, per, _, admissions = planned.merged
            inverse = planned.inverse(order, matched)
            self.counters.plans_used += 1
        else:
            distinct, per, inverse, admissions = self._plan(
                tables, [len(per_table[i]) for i in order], [(r[0], r[2], r[3]) for r in runs_of], step)
        self._commit(tables, admissions)
        if self.accumulates:
            self._accumulate(self._in_slots(contributions, per_table, order, admissions, inverse))
            return
        if inverse is None:  # one run a table: its ids are distinct, its gradient rows summed
            summed = [r[1] for r in runs_of]
            gscale = self.scale
        else:
            _, summed = ops.sum_runs([r[1] for r in runs_of], inverse, per, [len(per_table[i]) for i in order],
                                     scale=self.scale)
            gscale = 1.0
        steps = []
        for table, a, grads in zip(tables, admissions, summed):
            slot = a.slots
            keep = slot >= 0  # ids not admitted (yet) get no update
            if int(keep.sum()) < slot.numel():
                slot, grads = slot[keep], grads[keep]
            slot, perm = slot.sort()  # ascending rows: optimizer_step_ updates them in place, in one pass
            grads = grads.index_select(0, perm)
            if slot.numel():
                steps.append((table, slot, grads, gscale))
        self._step(steps)

    @staticmethod
    def _commit(tables: list[TableShard], admissions: list) -> None:
        """Carry out a step's admissions: the slot state, the maps and the new rows' initial
        values and fresh optimizer state."""
        commit_updates([t.dynamic for t in tables], admissions, weights=[t.weight for t in tables],
                       keys=[t.init_key[0] for t in tables], bounds=[t.init_key[1] for t in tables])
        for table, a in zip(tables, admissions):
            if a.new_slots.numel():
                table.optim.reset(a.new_slots)

    def _apply_planned(self, contributions: list[Contribution], step: int, planned: _Planned) -> bool:
        """Plain SGD of a sync step whose pushes are exactly the planned lookups' (each matches one,
        at the maps' versions): the planned admissions committed, then each push added into its
        lookup's slots. ``False`` (nothing done) for any other update."""
        shards = [self.shards_of(rows) for rows, _ in contributions]
        looked = list(planned.looked)
        lookup_of = []
        for (rows, _), mine in zip(contributions, shards):
            k = next((k for k, e in enumerate(looked) if e is not None and e.matches(rows, mine)), None)
            if k is None:
                return False
            lookup_of.append(k)
            looked[k] = None
        if any(e is not None for e in looked):
            return False
        for s in [s for s in self.looked_up if s <= step]:  # this step's lookups are all matched
            del self.looked_up[s]
        for s in [s for s in self.planned if s <= step]:
            del self.planned[s]
        tables = [self.by_index[i] for i in planned.order]
        admissions = planned.merged[3]
        self._commit(tables, admissions)
        self.counters.plans_used += 1
        self._accumulate([(Rows(list(rows.tables), list(rows.counts), planned.slots[k]), grad)
                          for (rows, grad), k in zip(contributions, lookup_of)])
        return True

    def _in_slots(self, contributions: list[Contribution], per_table: dict[int, list], order: list[int],
                  admissions: list, inverse: torch.Tensor | None) -> list[Contribution]:
        """The contributions of a dynamic update with each id replaced by its slot and the rows of
        ids not admitted dropped, for :meth:`_accumulate`. ``per_table[i]``: table ``i``'s runs in
        contribution order (each run's last entry its contribution's index); ``inverse``: each run
        row's index among the distinct ids (table after table), ``None`` for one run a table."""
        distinct_slots = admissions[0].plan.slots  # every table's, in order (the admissions are views)
        run_slots = distinct_slots if inverse is None else distinct_slots.index_select(0, inverse)
        runs = [(i, r) for i in order for r in per_table[i]]
        # (table, contribution) -> that run's slots and gradient rows
        of = {(i, r[-1]): (piece, r[1])
              for (i, r), piece in zip(runs, run_slots.split([r[1].shape[0] for _, r in runs]))}
        out = []
        for k, (rows, grad) in enumerate(contributions):
            pieces = [of[(i, k)][0] for i in rows.tables]
            ids = _cat(pieces)
            if ids.numel() and int(ids.min()) < 0:  # ids not admitted (yet) get no update
                keeps = [p >= 0 for p in pieces]
                grads = [of[(i, k)][1] for i in rows.tables]
                pieces = [p[m] for p, m in zip(pieces, keeps)]
                ids, grad = _cat(pieces), _cat([g[m].reshape(-1) for g, m in zip(grads, keeps)])
            out.append((Rows(list(rows.tables), [p.numel() for p in pieces], ids), grad))
        return out

    def _step(self, steps: list[tuple[TableShard, torch.Tensor, torch.Tensor, float]]) -> None:
        """One optimizer step of every (table, distinct rows, their gradient rows, gradient scale)
        in ``steps``, all or nothing."""
        if not steps:
            return
        for t, rows, _, _ in steps:
            t.ensure(rows)
        try:
            step_(self.config.optimizer, [t.weight for t, *_ in steps], [t.optim for t, *_ in steps],
                  [r for _, r, _, _ in steps], [g for _, _, g, _ in steps], [s for *_, s in steps])
        except ops.RowOutOfRange as e:
            raise self._outside(steps[e.table][0], e.row, "gradient push") from None
        except ops.NonFinite as e:
            raise FloatingPointError(f"{self._what()}: {e}") from None

    def _what(self) -> str:
        return f"{self.config.optimizer.name} update of {self.cid} on ps{self.server}"

    def _accumulate(self, contributions: list[Contribution | BagGradient]) -> None:
        """Plain SGD: each contribution added straight into the weights, in order (rows may repeat
        across trainers), all in one ``sgd_rows_`` call, which checks every contribution before
        it adds the first; a lone :class:`BagGradient` straight from its bags (``sgd_bags_``)."""
        alpha = -self.config.optimizer.lr * self.scale
        bagged = contributions[0] if len(contributions) == 1 and isinstance(contributions[0], BagGradient) else None
        if bagged is not None:
            shards = self.shards_of(bagged.rows)
            self._ensure(shards, bagged.rows)

            def update() -> None:
                ops.sgd_bags_([t.weight for t in shards], bagged.rows.ids, bagged.rows.counts, bagged.grad,
                              bagged.groups, alpha=alpha)
        else:
            contributions = [c.unbagged() if isinstance(c, BagGradient) else c for c in contributions]
            shards = []
            for rows, _ in contributions:
                mine = self.shards_of(rows)
                self._ensure(mine, rows)
                shards += mine
            ids = _cat([rows.ids for rows, _ in contributions])
            counts = [n for rows, _ in contributions for n in rows.counts]

            def update() -> None:
                ops.sgd_rows_([t.weight for t in shards], ids, counts, [g for _, g in contributions], alpha=alpha)
        try:
            update()
        except ops.RowOutOfRange as e:
            raise self._outside(shards[e.table], e.row, "gradient push") from None
        except ops.NonFinite as e:
            raise FloatingPointError(f"{self._what()}: {e}") from None
        if bagged is not None:
            self.counters.updates_from_bags += 1

    # -- whole shards (creation, checkpoints) ---------------------------------------------------
    def table(self, name: str) -> TableShard:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"ps{self.server} holds no table {name!r} of {self.cid} (it holds "
                       f"{[t.name for t in self.tables]})")


@dataclass
class _Planned:
    """A sync step's update planned from its lookups (:meth:`CollectionShard.plan_ahead`): the
    lookups it covers, its tables and :meth:`CollectionShard._plan`'s result for their runs (table
    after table, each in lookup order)."""

    looked: list[LookedUp]
    order: list[int]
    merged: tuple
    keys: list[tuple[int, int]]
    """(lookup, table) of each run, in the order the runs were merged."""
    slots: list[torch.Tensor] | None = None
    """Plain SGD: each lookup's ids' slots after the update (:meth:`CollectionShard._lookup_slots`)."""

    def serves(self, order: list[int], matched: dict[int, list[LookedUp | None]]) -> bool:
        """Whether the update whose runs matched these lookups (``matched[table]``, in
        contribution order; a match holds only while the maps are at the lookup's versions) is
        the one planned: the same lookups and tables."""
        mine = {id(e) for e in self.looked}
        got = {id(e) for runs in matched.values() for e in runs if e is not None}
        return (order == self.order and got == mine and all(e is not None for r in matched.values() for e in r)
                and sum(len(r) for r in matched.values()) == len(self.keys))

    def inverse(self, order: list[int], matched: dict[int, list[LookedUp]]) -> torch.Tensor | None:
        """The merged ids' inverse for the runs in the update's order (its contributions')."""
        inverse = self.merged[2]
        if inverse is None:
            return None
        sizes = [self.looked[k].rows.counts[self.looked[k].rows.tables.index(i)] for k, i in self.keys]
        pieces = dict(zip(self.keys, inverse.split(sizes)))
        index = {id(e): k for k, e in enumerate(self.looked)}
        return _cat([pieces[(index[id(e)], i)] for i in order for e in matched[i]])


_SCRATCH = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """``numel`` float32 of this thread's scratch memory, grown as needed: a pooled lookup's rows
    live there between the gather and the pooling (a fresh megabyte each time costs its page
    faults)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH.buf = torch.empty(max(numel, 1 << 16))
    return buf[:numel]


def _group_spans(counts: list[int], groups: list) -> list[tuple[int, int, int, int]] | None:
    """Per bag group, its tables ``[t0, t1)`` in the lookup and their ids ``[i0, i1)``: the
    groups' rows, in order, are whole tables' rows. ``None`` where a group's rows end inside a
    table, or the groups do not cover the lookup's rows."""
    spans, t, i = [], 0, 0
    for g in groups:
        t0, i0, left = t, i, g.rows
        while left > 0 and t < len(counts):
            if counts[t] > left:
                return None
            left -= counts[t]
            i += counts[t]
            t += 1
        if left:
            return None
        spans.append((t0, t, i0, i))
    if i != sum(counts):
        return None
    return spans


def _copied(part: Contribution) -> Contribution:
    """A push's ids and gradient in memory of their own (not the transport's)."""
    rows, grad = part
    return rows.owned(), grad.clone()


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` without the copy of a single tensor; no tensors are no ids (int64): the
    lookup or push of a trainer whose batch has no id on this server's tables."""
    if not tensors:
        return torch.empty(0, dtype=torch.int64)
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
