"""The parameter-server side: table shards, step bookkeeping, and the RPC entry points.

A server process holds one :class:`CollectionShard` per remote collection that has tables on it.
Trainers reach it through the module-level ``rpc_*`` functions below (RPC runs them in the
server process). The protocol of one step ``t`` of one trainer:

1. ``rpc_lookup(..., step=t, ids)`` -- deduplicated local row ids of every table held here, in
   one request. It is answered (``async_execution``: no RPC thread waits) once the updates of
   every trainer through step ``t - 1 - staleness`` are applied. The rows come back through
   :class:`_Lookup`, an autograd function whose input is a per-shard anchor leaf, so
   distributed autograd records the exchange without the table being a graph leaf: nothing
   table-sized is ever built for the gradient.
2. The trainer's ``dist_autograd.backward`` sends the gradient of those rows back; the
   server's engine runs ``_Lookup.backward``, which hands it to :meth:`CollectionShard.push`.
   Sync mode (staleness 0) sums the gradients of all trainers for step ``t`` and applies the
   optimizer once, when the last one arrives; async mode applies each on arrival.

Waiting lookups are completed by whoever completes the step they wait for, on that thread.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed.rpc as rpc

from hybrid.ps import channel, native
from hybrid.ps.memory import huge_page_bytes, table_tensor
from hybrid.ps.optim import RowSparseOptimizer, SparseOptimSpec, ascending_per_table, check_finite
from hybrid.ps.sharding import TableLayout


@dataclass
class ServerCounters:
    """What a server counts per collection; trainers read them with :func:`rpc_stats`."""

    lookups: int = 0
    gradients: int = 0
    """Gradient pushes received (one per trainer per step that looked up here)."""
    push_messages: int = 0
    """Gradient pushes that came in a message of their own (the rest rode on a lookup)."""
    channel_lookups: int = 0
    """Lookups that came through a shared-memory channel rather than RPC (:mod:`hybrid.ps.channel`)."""
    rows_served: int = 0
    ids_requested: int = 0
    """Ids before the trainers' deduplication; ``rows_served / ids_requested`` is the unique ratio."""
    bytes_in: int = 0
    bytes_out: int = 0
    updates_applied: int = 0
    """Updates finished: sync, one per step (every trainer's gradients in); async, one per push."""
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

    def __init__(self, layout: TableLayout, server: int, spec: SparseOptimSpec) -> None:
        self.layout = layout
        self.name = layout.table.name
        self.dim = layout.table.embedding_dim
        self.shard_pos = layout.servers.index(server)
        self.rows = layout.rows_on(server)
        self.weight = table_tensor(self.rows, self.dim)  # huge pages: see hybrid.ps.memory
        self.optim = RowSparseOptimizer(spec, self.rows, self.dim)

    def init_uniform(self, seed: int) -> None:
        """TorchRec's default init (uniform in +-sqrt(1/num_embeddings)), seeded per table+shard."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + hash(self.name) % 1_000_003 + self.shard_pos)
        bound = (1.0 / self.layout.table.num_embeddings) ** 0.5
        self.weight.uniform_(-bound, bound, generator=g)


class _Lookup(torch.autograd.Function):
    """Rows out in forward; their gradient goes to the shard's step bookkeeping in backward."""

    @staticmethod
    def forward(ctx, anchor, shard, trainer, step, ids, counts):  # noqa: D401
        ctx.shard, ctx.trainer, ctx.step, ctx.ids, ctx.counts = shard, trainer, step, ids, counts
        return shard.gather(ids, counts)

    @staticmethod
    def backward(ctx, grad):
        ctx.shard.push(ctx.trainer, ctx.step, ctx.ids, ctx.counts, grad)
        return None, None, None, None, None, None


class CollectionShard:
    """The tables of one remote collection that live on this server, and their step state."""

    def __init__(
        self,
        *,
        cid: str,
        server: int,
        layouts: list[TableLayout],
        optimizer: SparseOptimSpec,
        num_trainers: int,
        staleness: int,
        gradient_scaling: str,
        start_step: int,
    ) -> None:
        self.cid = cid
        self.server = server
        self.tables = [TableShard(lay, server, optimizer) for lay in layouts if server in lay.servers]
        self.num_trainers = num_trainers
        self.staleness = staleness
        self.scale = 1.0 / num_trainers if gradient_scaling == "mean" else 1.0
        self.complete_through = start_step - 1
        self.arrived: dict[int, int] = defaultdict(int)
        self.pending: dict[int, list[tuple[torch.Tensor, list[int], torch.Tensor]]] = defaultdict(list)
        self.waiters: list[tuple[int, float, Callable[[BaseException | None], None]]] = []
        self.failed: BaseException | None = None
        self.fault: str | None = None
        self.lock = threading.RLock()
        self.anchor = torch.zeros((), requires_grad=True)
        # Plain SGD on every table: each contribution is added straight in, duplicates and all
        # (:meth:`_apply`). In sync mode still only once every trainer's push of the step is in:
        # a push applied on arrival would be read by another trainer's lookup of the same step
        # that reaches the server after it (at the first step, whose lookups carry no push, or
        # behind a slow trainer), which single-process training never reads.
        self.accumulates = all(t.optim.accumulates for t in self.tables)
        self.counters = ServerCounters()
        self.channels: dict[int, channel.ServerEnd] = {}
        # For the native kernels (hybrid.ps.native): every table's address, width and rows. The
        # weight tensors are written in place for the shard's whole life, never replaced.
        self._native_ok = all(t.weight.dtype == torch.float32 and t.weight.is_contiguous()
                              and t.weight.device.type == "cpu" for t in self.tables)
        self._addr = torch.tensor([t.weight.data_ptr() for t in self.tables], dtype=torch.int64)
        self._dims = torch.tensor([t.dim for t in self.tables], dtype=torch.int64)
        self._nrows = torch.tensor([t.rows for t in self.tables], dtype=torch.int64)

    # -- reading rows -------------------------------------------------------------------------
    def _split(self, flat: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        sizes = [n * t.dim for n, t in zip(counts, self.tables)]
        return [c.view(n, t.dim) for c, n, t in zip(flat.split(sizes), counts, self.tables)]

    def gather(self, ids: torch.Tensor, counts: list[int], out: Callable[[int], torch.Tensor] | None = None,
               ) -> torch.Tensor:
        """Rows of ``ids`` (one chunk per table held here, ``counts`` long), flat; into ``out(n)``
        (``n`` floats) where given, else a fresh tensor."""
        numel = sum(n * t.dim for n, t in zip(counts, self.tables))
        out = torch.empty(numel) if out is None else out(numel)
        kernels = self._kernels(ids)
        with self.lock:
            if kernels is not None:
                cnt, bad = torch.tensor(counts, dtype=torch.int64), torch.empty(1, dtype=torch.int64)
                code = kernels.hy_gather(out.data_ptr(), len(self.tables), self._addr.data_ptr(), self._dims.data_ptr(),
                                         self._nrows.data_ptr(), cnt.data_ptr(), ids.data_ptr(), bad.data_ptr())
                if code:
                    raise self._bad_id(ids, counts, int(bad), "lookup")
            else:
                # Straight into the reply: no per-table temporaries and no concatenation copy.
                for t, i, o in zip(self.tables, ids.split(counts), self._split(out, counts)):
                    torch.index_select(t.weight, 0, i, out=o)
        self.counters.rows_served += int(ids.numel())
        self.counters.bytes_out += out.numel() * out.element_size()
        return out

    def _kernels(self, ids: torch.Tensor):
        """The native kernels where they apply to this shard and these ids, else ``None``."""
        if not self._native_ok or ids.dtype != torch.int64 or not ids.is_contiguous():
            return None
        return native.lib()

    def _bad_id(self, ids: torch.Tensor, counts: list[int], pos: int, what: str) -> IndexError:
        """The error for ``ids[pos]``, a row outside its table (the chunk ``pos`` falls in)."""
        k = int((torch.tensor(counts).cumsum(0) <= pos).sum())
        return self._outside(self.tables[k], int(ids[pos]), what)

    def _outside(self, table: TableShard, row: int, what: str) -> IndexError:
        return IndexError(f"{what} of {self.cid} on ps{self.server}: row {row} is outside this server's "
                          f"{table.rows} rows of table {table.name!r}; nothing was changed")

    def when_ready(self, needed: int, fn: Callable[[BaseException | None], None]) -> None:
        """Run ``fn(None)`` once steps through ``needed`` are applied (``fn(err)`` on failure)."""
        with self.lock:
            if self.failed is None and self.complete_through < needed:
                self.waiters.append((needed, time.monotonic(), fn))
                return
            err = self.failed
        fn(err)

    def _wake(self, inline: bool = False) -> None:
        with self.lock:
            ready = [w for w in self.waiters if self.failed or w[0] <= self.complete_through]
            self.waiters = [w for w in self.waiters if w not in ready]
            err = self.failed
        now = time.monotonic()
        for _, since, fn in ready:
            self.counters.wait_s += now - since
            if inline:
                fn(err)
            else:
                # Not inline on the distributed-autograd engine's thread (inside a gradient
                # push): answering a lookup records a new graph and sends a message from it.
                _ANSWERS.submit(fn, err)

    # -- gradients ----------------------------------------------------------------------------
    def push(self, trainer: int, step: int, ids: torch.Tensor, counts: list[int], grad: torch.Tensor) -> None:
        """One trainer's gradient for ``step`` (rows as looked up; ``dist_autograd`` push, on the
        distributed-autograd engine's thread); applies when the step is due."""
        self.counters.push_messages += 1
        self.push_parts(trainer, step, [(ids, counts, grad)], inline=False)

    def push_parts(self, trainer: int, step: int, parts: list[tuple[torch.Tensor, list[int], torch.Tensor]],
                   *, inline: bool = True, borrowed: bool = False) -> None:
        """One trainer's gradients for ``step``, one ``(ids, counts, grad)`` per lookup it made;
        applies when the step is due (sync: every trainer's arrived). ``inline``: lookups this
        completes are answered on this thread (an RPC thread) rather than handed to another.
        ``borrowed``: the tensors are the caller's only for this call (a shared-memory channel's
        request): copied if the step keeps them for later."""
        self.counters.gradients += 1
        self.counters.bytes_in += sum(g.numel() * g.element_size() for _, _, g in parts)
        try:
            with self.lock:
                if self.failed is not None:
                    raise RuntimeError(f"{self.cid} on ps{self.server} failed earlier") from self.failed
                last = self.arrived.get(step, 0) + 1 == self.num_trainers
                if self.staleness == 0:
                    if borrowed and not last:
                        parts = [(i.clone(), c, g.clone()) for i, c, g in parts]
                    self.pending[step].extend(parts)
                    if last:
                        self._apply(self.pending.pop(step))
                else:
                    self._apply(parts)
                if self.staleness or last:
                    self.counters.updates_applied += 1
                self.arrived[step] += 1
                while self.arrived.get(self.complete_through + 1, 0) == self.num_trainers:
                    self.arrived.pop(self.complete_through + 1)
                    self.complete_through += 1
        except BaseException as e:
            with self.lock:
                self.failed = e
            self._wake(inline)
            raise
        self._wake(inline)

    def _apply(self, contributions: list[tuple[torch.Tensor, list[int], torch.Tensor]]) -> None:
        """Sum the contributions per distinct row and run the optimizer on each table."""
        if self.fault == "update":
            raise RuntimeError(f"injected fault in the update of {self.cid} on ps{self.server}")
        if self.accumulates:
            # Plain SGD: add every contribution straight in (rows may repeat across trainers).
            what = f"sgd update of {self.cid} on ps{self.server}"
            kernels = native.lib() if all(self._kernels(i) is not None and g.dtype == torch.float32
                                          for i, _, g in contributions) else None
            # A native call checks its own contribution; with several, none may land if one is bad.
            if kernels is None or len(contributions) > 1:
                check_finite([g for _, _, g in contributions], what)
            if kernels is not None:
                for ids, counts, grad in contributions:
                    self._sgd_native(kernels, ids, counts, grad, what)
                return
            for ids, counts, grad in contributions:
                distinct = ascending_per_table(ids, counts)
                for table, i, g in zip(self.tables, ids.split(counts), self._split(grad, counts)):
                    if i.numel():
                        table.optim.accumulate(table.weight, i, g, self.scale, distinct=distinct)
            return
        per_table: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in self.tables]
        for ids, counts, grad in contributions:
            for k, (i, g) in enumerate(zip(ids.split(counts), self._split(grad, counts))):
                per_table[k][0].append(i)
                per_table[k][1].append(g)
        kernels = self._kernels(contributions[0][0]) if contributions else None
        if (kernels is not None and self.tables and self.tables[0].optim.spec.name in native.OPTIMIZERS
                and all(g.dtype == torch.float32 for _, _, g in contributions)):
            self._apply_native(kernels, per_table)
            return
        updates = []
        for table, (ids_l, grads_l) in zip(self.tables, per_table):
            ids = torch.cat(ids_l)
            if ids.numel() == 0:
                continue
            grads = torch.cat(grads_l)
            if len(ids_l) == 1:
                rows, summed = ids, grads  # already distinct: the trainer deduplicated
                if self.scale != 1.0:
                    summed = summed * self.scale
            else:
                rows, inverse = torch.unique(ids, return_inverse=True)
                summed = torch.zeros(rows.numel(), table.dim).index_add_(0, inverse, grads)
                if self.scale != 1.0:
                    summed.mul_(self.scale)
            updates.append((table, rows, summed))
        # Compute every table's update before writing any, so a failure applies nothing (and
        # no snapshot of the touched rows is needed to undo one).
        computed = [(table, rows, table.optim.compute(table.weight, rows, g)) for table, rows, g in updates]
        for table, rows, (w, state) in computed:
            table.optim.commit(table.weight, rows, w, state)

    def _apply_native(self, kernels, per_table: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
        """:meth:`_apply` for adagrad, rowwise_adagrad and adam through the native kernels: each
        table's contributions summed per distinct row (``hy_sum_rows``), every table's new rows
        computed (``hy_opt_compute``) before any is written (``hy_scatter_rows``)."""
        spec = self.tables[0].optim.spec
        kind = native.OPTIMIZERS[spec.name]
        bad = torch.empty(1, dtype=torch.int64)
        computed = []
        for table, (ids_l, grads_l) in zip(self.tables, per_table):
            d = table.dim
            if len(ids_l) == 1:
                rows, summed, gscale = ids_l[0].contiguous(), grads_l[0].contiguous(), self.scale
            else:
                ids, grads = torch.cat(ids_l), torch.cat(grads_l)
                rows, summed = torch.empty_like(ids), torch.empty_like(grads)
                nu = kernels.hy_sum_rows(ids.numel(), ids.data_ptr(), grads.data_ptr(), d, self.scale, table.rows,
                                         rows.data_ptr(), summed.data_ptr(), bad.data_ptr())
                if nu < 0:
                    raise self._native_error(nu, ids, bad, table, "gradient push")
                rows, summed, gscale = rows[:nu], summed[:nu], 1.0
            n = rows.numel()
            if n == 0:
                continue
            st = table.optim.state
            s1 = st.get("sum", st.get("exp_avg"))
            s2, s3 = st.get("exp_avg_sq"), st.get("step")
            new_w = torch.empty(n, d)
            new = {k: torch.empty((n, *v.shape[1:]), dtype=v.dtype) for k, v in st.items()}
            o1 = new.get("sum", new.get("exp_avg"))
            o2, o3 = new.get("exp_avg_sq"), new.get("step")
            ptr = native.ptr
            code = kernels.hy_opt_compute(
                kind, n, d, table.rows, rows.data_ptr(), summed.data_ptr(), gscale, table.weight.data_ptr(),
                ptr(s1), ptr(s2), ptr(s3), spec.lr, spec.eps, spec.weight_decay, spec.beta1, spec.beta2,
                new_w.data_ptr(), ptr(o1), ptr(o2), ptr(o3), bad.data_ptr())
            if code == native.NOT_FINITE:
                raise FloatingPointError(
                    f"{spec.name} update produced non-finite weights for {int((~torch.isfinite(new_w)).any(1).sum())} "
                    "rows; nothing was applied")
            if code:
                raise self._native_error(code, rows, bad, table, "gradient push")
            computed.append((table, rows, new_w, new))
        for table, rows, new_w, new in computed:
            kernels.hy_scatter_rows(table.weight.data_ptr(), table.dim, rows.data_ptr(), rows.numel(), new_w.data_ptr())
            for k, v in new.items():
                width = v[0].numel() if v.dim() > 1 else 1
                kernels.hy_scatter_rows(table.optim.state[k].data_ptr(), width, rows.data_ptr(), rows.numel(),
                                        v.data_ptr())

    def _native_error(self, code: int, ids: torch.Tensor, bad: torch.Tensor, table, what: str) -> Exception:
        if code == native.BAD_ID:
            return self._outside(table, int(ids[int(bad)]), what)
        return RuntimeError(f"{what} of {self.cid} on ps{self.server}: native kernel failed (code {code})")

    def _sgd_native(self, kernels, ids: torch.Tensor, counts: list[int], grad: torch.Tensor, what: str) -> None:
        """One trainer's SGD contribution in one native call (checked whole before any write)."""
        grad = grad.contiguous()
        cnt, bad = torch.tensor(counts, dtype=torch.int64), torch.empty(1, dtype=torch.int64)
        alpha = -self.tables[0].optim.spec.lr * self.scale
        code = kernels.hy_sgd(len(self.tables), self._addr.data_ptr(), self._dims.data_ptr(), self._nrows.data_ptr(),
                              cnt.data_ptr(), ids.data_ptr(), grad.data_ptr(), alpha, bad.data_ptr())
        if code == native.BAD_ID:
            raise self._bad_id(ids, counts, int(bad), "gradient push")
        if code == native.NOT_FINITE:
            check_finite(self._split(grad, counts), what)  # raises, naming the rows
        if code:
            raise RuntimeError(f"{what}: native kernel failed (code {code})")


class ParameterServer:
    """Everything one server process holds: its collections, by id."""

    def __init__(self, server: int) -> None:
        self.server = server
        self.collections: dict[str, CollectionShard] = {}


_SERVER: ParameterServer | None = None
# Answers lookups that waited for a step to complete (one thread keeps answers in order).
_ANSWERS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid-ps-answer")


def _server() -> ParameterServer:
    if _SERVER is None:
        raise RuntimeError(f"{rpc.get_worker_info().name} holds no parameter-server state")
    return _SERVER


def _collection(cid: str) -> CollectionShard:
    try:
        return _server().collections[cid]
    except KeyError:
        raise KeyError(f"{rpc.get_worker_info().name} holds no collection {cid!r}") from None


# -- RPC entry points (run on the server) ---------------------------------------------------------


def rpc_create(cid: str, server: int, layouts, optimizer: dict, num_trainers: int, staleness: int,
               gradient_scaling: str, start_step: int, init_seed: int | None) -> list[str]:
    """Create (or replace) this server's shards of collection ``cid``; returns the table names."""
    global _SERVER
    if _SERVER is None:
        _SERVER = ParameterServer(server)
    shard = CollectionShard(
        cid=cid, server=server, layouts=layouts, optimizer=SparseOptimSpec(**optimizer),
        num_trainers=num_trainers, staleness=staleness, gradient_scaling=gradient_scaling,
        start_step=start_step,
    )
    for t in shard.tables:
        if init_seed is not None:
            t.init_uniform(init_seed)
        else:
            t.weight.zero_()
    _SERVER.collections[cid] = shard
    return [t.name for t in shard.tables]


def rpc_write_rows(cid: str, table: str, start: int, rows: torch.Tensor) -> None:
    """Overwrite local rows ``[start, start + len(rows))`` of ``table`` (initial load, restore)."""
    shard = _collection(cid)
    t = next(t for t in shard.tables if t.name == table)
    with shard.lock:
        t.weight[start : start + rows.shape[0]] = rows


def rpc_write_state(cid: str, table: str, state: dict[str, torch.Tensor]) -> None:
    """Replace a table shard's optimizer state (restore)."""
    shard = _collection(cid)
    t = next(t for t in shard.tables if t.name == table)
    with shard.lock:
        for k, v in state.items():
            t.optim.state[k].copy_(v)


@rpc.functions.async_execution
def rpc_read_shard(cid: str, table: str, after_step: int = -1):
    """A copy of this server's rows of ``table`` and their optimizer state, once every trainer's
    updates through ``after_step`` are applied."""
    shard = _collection(cid)
    t = next(t for t in shard.tables if t.name == table)
    fut: torch.futures.Future = torch.futures.Future()

    def answer(err: BaseException | None) -> None:
        if err is not None:
            fut.set_exception(RuntimeError(f"ps{shard.server}: collection {cid} failed: {err!r}"))
            return
        with shard.lock:
            fut.set_result((t.weight.clone(), {k: v.clone() for k, v in t.optim.state.items()}))

    shard.when_ready(after_step, answer)
    return fut


def rpc_stats(cid: str) -> dict:
    shard = _collection(cid)
    d = shard.counters.as_dict()
    d["complete_through"] = shard.complete_through
    held = huge_page_bytes()  # the whole process's, every collection's tables together
    if held is not None:
        d["huge_page_bytes"] = held
    return d


def rpc_set_fault(cid: str, fault: str | None) -> None:
    """Test hook: make the next update of ``cid`` raise (``"update"``) or clear it."""
    _collection(cid).fault = fault


@rpc.functions.async_execution
def rpc_lookup(cid: str, trainer: int, step: int, ids: torch.Tensor, counts: list[int], n_raw: int,
               pushes: list[tuple[int, list]] | None = None):
    """Rows for one trainer's step; waits (without a thread) until the step may read.

    ``pushes`` is ``None`` under the ``dist_autograd`` gradient push: the rows are recorded by
    distributed autograd and their gradient comes back through ``_Lookup.backward``. Otherwise
    (``rpc`` push) the rows are plain, and ``pushes`` carries the gradients this trainer owed
    (``[(step, [(ids, counts, grad), ...]), ...]``), applied before anything is looked up."""
    fut: torch.futures.Future = torch.futures.Future()

    def done(rows: torch.Tensor | None, err: BaseException | None = None) -> None:
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(rows)

    _lookup(_collection(cid), trainer, step, ids, counts, n_raw, pushes, done)
    return fut


def _lookup(shard: CollectionShard, trainer: int, step: int, ids: torch.Tensor, counts: list[int], n_raw: int,
            pushes: list[tuple[int, list]] | None, done: Callable, out: Callable[[int], torch.Tensor] | None = None,
            borrowed: bool = False) -> None:
    """A lookup, however it came (RPC or a shared-memory channel): apply the ``pushes`` it
    carries, then, once the step may read, ``done(rows)`` or ``done(None, error)``. ``out(n)``
    gives where to gather ``n`` floats of rows (a channel's reply), if not a fresh tensor."""
    cid = shard.cid
    plain = pushes is not None
    shard.counters.lookups += 1
    if pushes:
        try:
            for pstep, parts in pushes:
                shard.push_parts(trainer, pstep, parts, borrowed=borrowed)
        except BaseException as e:  # noqa: BLE001 - the lookup fails with the push's error
            done(None, RuntimeError(f"ps{shard.server}: gradient push of {cid} failed: {e}"))
            return
    shard.counters.ids_requested += n_raw
    shard.counters.bytes_in += ids.numel() * ids.element_size()
    needed = step - 1 - shard.staleness

    def answer(err: BaseException | None) -> None:
        if err is not None:
            done(None, RuntimeError(f"ps{shard.server}: collection {cid} failed: {err!r}"))
            return
        try:
            lag = step - 1 - shard.complete_through
            shard.counters.max_lag = max(shard.counters.max_lag, lag)
            if len(shard.counters.lags) < 10_000:
                shard.counters.lags.append(lag)
            # May run on a backward thread (the one that completed the step): grad mode is off there.
            if plain:
                rows = shard.gather(ids, counts, out=out)
            else:
                with torch.enable_grad():
                    rows = _Lookup.apply(shard.anchor, shard, trainer, step, ids, counts)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer
            done(None, e)
            return
        done(rows)

    shard.when_ready(needed, answer)


def rpc_open_channel(cid: str, trainer: int, host: str, path: str, capacity: int) -> bool:
    """Serve ``trainer``'s lookups of ``cid`` through the shared-memory channel the trainer set up
    in ``path`` (:mod:`hybrid.ps.channel`); ``False`` when the trainer is on another host."""
    if host != channel.host_id():
        return False
    shard = _collection(cid)
    directory = channel.ServerEnd.check_directory(path)

    def handler(ints: list[int], tensors: list[torch.Tensor], reply: Callable) -> None:
        # Gradients are read in place from the channel (borrowed: the next request overwrites
        # them), and copied only where a sync step keeps them for its last trainer's push.
        step, n_raw, ids, counts, pushes = channel.decode_lookup(ints, tensors)
        shard.counters.channel_lookups += 1
        _lookup(shard, trainer, step, ids, counts, n_raw, pushes, reply, out=end.rows_buffer, borrowed=True)

    end = channel.ServerEnd(directory, capacity, f"hybrid-ps-channel-t{trainer}", handler)
    old = shard.channels.pop(trainer, None)
    if old is not None:
        old.close()
    shard.channels[trainer] = end
    return True


def rpc_push(cid: str, trainer: int, steps: list[tuple[int, list]]) -> None:
    """A trainer's owed row gradients sent on their own (``rpc`` push, no lookup followed soon):
    ``[(step, [(ids, counts, grad), ...]), ...]``."""
    shard = _collection(cid)
    shard.counters.push_messages += 1
    for step, parts in steps:
        shard.push_parts(trainer, step, parts)


@rpc.functions.async_execution
def rpc_read(cid: str, after_step: int, ids: torch.Tensor, counts: list[int]):
    """Rows without gradient (evaluation), once steps through ``after_step`` are applied."""
    shard = _collection(cid)
    fut: torch.futures.Future = torch.futures.Future()

    def answer(err: BaseException | None) -> None:
        if err is not None:
            fut.set_exception(RuntimeError(f"ps{shard.server}: collection {cid} failed: {err!r}"))
        else:
            fut.set_result(shard.gather(ids, counts))

    shard.when_ready(after_step, answer)
    return fut
