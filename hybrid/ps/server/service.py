"""A parameter-server process: its collections, and the entry points trainers call.

:func:`start` makes this process a server (``hybrid.launch`` calls it on server ranks). Trainers
then reach it through the module-level ``rpc_*`` functions (RPC runs them here) and, for the
step's messages, through whatever transport they chose (:mod:`hybrid.ps.transport`), which ends
in :meth:`ParameterServer.handle_step` either way.

One step message (:class:`hybrid.ps.protocol.StepMessage`): for each part, the pushes it carries
are applied (or kept until the step's last trainer's is in), then the part's lookup is answered
once the step may read; the reply -- one tensor of rows per part -- goes back when every part's
rows are gathered (a collection pooled on its servers answers its bags pooled, and its pushes
carry the bags' gradients: :meth:`CollectionShard.gather_pooled`, :meth:`CollectionShard.unpool`).
A lookup that must wait is a callback, completed by whoever completes the
step it waits for; answers that a distributed-autograd backward completes are handed to
:attr:`ParameterServer.answers` (a lookup recorded from the engine's thread would make a graph
there).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed.rpc as rpc

from hybrid.ps import protocol
from hybrid.ps.config import CollectionConfig, collection_handle
from hybrid.ps.protocol import Frame, Part, Rows, StepMessage
from hybrid.log import logger
from hybrid.ps.server.memory import huge_page_bytes, human_bytes, memory_shortfall
from hybrid.ps.server.shard import CollectionShard

Reply = Callable[[list[torch.Tensor] | None, BaseException | None], None]
"""Where a step message's answer goes: ``reply(rows_per_part, None)`` or ``reply(None, error)``."""
Buffers = Callable[[list[int], list[torch.dtype]], list[torch.Tensor]]
"""Given each part's reply size (elements) and dtype (its collection's wire dtype), where to
gather the rows (a transport's own memory)."""


@dataclass(kw_only=True)
class ServerOptions:
    """How a server keeps its tables (from the training config's ``runtime`` section)."""

    huge_pages: bool = True
    """Tables and optimizer state in transparent huge pages (:mod:`hybrid.ps.server.memory`)."""
    memory_fraction: float = 0.8
    """A collection whose shards here need more than this share of the memory still available
    is refused before anything is allocated (``runtime.server_memory_fraction``)."""
    address: str = "127.0.0.1"
    """Where this server listens for trainers' step connections (``runtime.address``)."""


class DoesNotFit(RuntimeError):
    """A collection's shards would not fit in this server's memory; nothing was allocated."""


class _Inbox:
    """Each trainer stream's step messages handled in the order the trainer sent them
    (:mod:`hybrid.ps.protocol`: ``stream``, ``seq``). A message that comes before one sent
    earlier -- the earlier one still on a frame channel while this one took RPC, or two RPC
    threads -- is held and handled, by the thread that handles the missing one, right after it.
    Only the handling is ordered (pushes applied or kept, lookups registered); answers still come
    whenever each lookup may read."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.expected: dict[tuple[int, int], int] = {}
        self.held: dict[tuple[int, int], dict[int, Callable[[], None]]] = {}
        self.running: set[tuple[int, int]] = set()  # streams whose expected message is being handled

    def handle(self, msg: StepMessage, fn: Callable[[], None], again: Callable[[], None]) -> None:
        """Run ``fn`` (which handles ``msg``, answering its errors itself) in ``msg``'s turn;
        ``again`` instead when the message came a second time (its turn past, or a copy of it
        already held)."""
        if msg.seq <= 0:
            fn()
            return
        key, seq = (msg.trainer, msg.stream), msg.seq
        with self.lock:
            expected = self.expected.get(key, 1)
            held = self.held.setdefault(key, {})
            if seq > expected and seq not in held:
                held[seq] = fn
                return
            turn = seq == expected and key not in self.running
            if turn:
                self.running.add(key)
        if not turn:
            again()
            return
        while fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - the next message's turn must still come
                logger.exception("ps: handling message %d of trainer %d failed", seq, msg.trainer)
            seq += 1
            with self.lock:
                self.expected[key] = seq
                waiting = self.held.get(key)
                fn = waiting.pop(seq, None) if waiting else None
                if fn is None:
                    self.running.discard(key)

    def held_count(self) -> int:
        """Messages waiting for one sent before them."""
        with self.lock:
            return sum(len(w) for w in self.held.values())


class _Lookup(torch.autograd.Function):
    """Rows out in forward; their gradient goes to the shard's step bookkeeping in backward
    (``gradient_push: dist_autograd``): the backward of a trainer's last recorded lookup of a
    step pushes every one's gradient, as the trainer's one push of the step
    (:meth:`CollectionShard.recorded_part`). Its input is a per-shard anchor leaf, so
    distributed autograd records the exchange without the table being a graph leaf."""

    @staticmethod
    def forward(ctx, anchor, server, shard, trainer, step, rows):  # noqa: D401
        ctx.server, ctx.shard, ctx.trainer, ctx.step, ctx.rows = server, shard, trainer, step, rows
        out = shard.gather(rows)
        ctx.index = shard.record(trainer, step)
        return out

    @staticmethod
    def backward(ctx, grad):
        parts = ctx.shard.recorded_part(ctx.trainer, ctx.step, ctx.index, (ctx.rows, grad.contiguous()))
        if parts is not None:
            ctx.shard.counters.push_messages += 1
            ctx.server.push(ctx.shard, ctx.trainer, ctx.step, parts, inline=False)
        return None, None, None, None, None, None


class ParameterServer:
    """Everything one server process holds: its collections, by handle."""

    def __init__(self, index: int, options: ServerOptions) -> None:
        self.index = index
        self.options = options
        self.collections: dict[int, CollectionShard] = {}
        self.anchor = torch.zeros((), requires_grad=True)
        self.lock = threading.Lock()
        # Answers to lookups completed on a distributed-autograd engine thread, in order.
        self.answers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid-ps-answer")
        self.filler = _Filler(self)
        self.inbox = _Inbox()

    def create(self, config: CollectionConfig, *, start_step: int, init: str) -> int:
        """Create (or replace) this server's shard of ``config``; returns its handle. Raises
        :class:`DoesNotFit`, allocating nothing, when the shard would not fit in memory."""
        handle = collection_handle(config.cid)
        with self.lock:
            old = self.collections.get(handle)
            if old is not None and old.cid != config.cid:
                raise ValueError(f"ps{self.index}: collections {old.cid!r} and {config.cid!r} share handle {handle}; "
                                 f"rename one (compose(..., name=...))")
            self.collections.pop(handle, None)  # a replaced shard's memory comes back first
        del old
        short = memory_shortfall(config.bytes_on(self.index), fraction=self.options.memory_fraction,
                                 who=f"ps{self.index} ({config.cid})",
                                 fix="add parameter servers (topology.parameter_servers), shard row_wise, "
                                     "or make the tables smaller")
        if short is not None:
            raise DoesNotFit(short)
        started = time.perf_counter()
        # Range tables are allocated untouched and their rows made on first use and by the
        # background fill (hybrid.ps.server.lazy): the trainers do not wait for gigabytes of
        # memory to be written. Dynamic tables create each row at admission.
        shard = CollectionShard(config, self.index, start_step=start_step, huge_pages=self.options.huge_pages,
                                init=init)
        for t in shard.tables:
            if t.lazy is None and init == "zeros":
                t.weight.zero_()
        with self.lock:
            self.collections[handle] = shard
        self.filler.wake()
        logger.info("created %s: %d tables, %s (rows + optimizer state) in %.1f s; their initial rows are made "
                    "as they are first used and in the background", config.cid, len(shard.tables),
                    human_bytes(sum(config.bytes_on(self.index).values())), time.perf_counter() - started)
        return handle

    def close(self) -> None:
        """Stop the background fill (before RPC shuts down); tables stay usable."""
        self.filler.stop()

    def shard(self, handle: int | str) -> CollectionShard:
        key = collection_handle(handle) if isinstance(handle, str) else handle
        try:
            return self.collections[key]
        except KeyError:
            raise KeyError(f"ps{self.index} holds no collection {handle!r}") from None

    # -- the step's messages ----------------------------------------------------------------------
    def push(self, shard: CollectionShard, trainer: int, step: int, parts, *, inline: bool = True,
             keeps_copy: bool = True, unpooled: bool = False) -> None:
        """Apply (or keep) one trainer's gradients, then answer the lookups that were waiting for
        them (here, or on :attr:`answers` when ``inline`` is false). ``keeps_copy``, ``unpooled``:
        as :meth:`CollectionShard.push` takes them."""
        try:
            shard.push(trainer, step, parts, keeps_copy=keeps_copy, unpooled=unpooled)
        finally:
            for fn, err in shard.ready_waiters():
                if inline:
                    fn(err)
                else:
                    self.answers.submit(fn, err)

    def handle_step(self, msg: StepMessage, reply: Reply, buffers: Buffers | None = None, *,
                    via_channel: bool = False) -> None:
        """Apply the message's pushes, then answer its lookups once each may read; in its turn
        among its stream's messages (:class:`_Inbox`)."""
        self.inbox.handle(msg, lambda: self._handle_step(msg, reply, buffers, via_channel),
                          lambda: reply(None, RuntimeError(f"ps{self.index}: message {msg.seq} of trainer "
                                                           f"{msg.trainer}'s stream came twice; handled once")))

    def _handle_step(self, msg: StepMessage, reply: Reply, buffers: Buffers | None, via_channel: bool) -> None:
        borrowed: list[tuple[CollectionShard, int]] = []  # kept pushes that still read the frame
        try:
            shards = [self.shard(p.collection) for p in msg.parts]
            for part, shard in zip(msg.parts, shards):
                if part.lookup is None and part.pushes:
                    shard.counters.push_messages += 1
                if msg.autograd and part.bags is not None:
                    raise ValueError(f"{shard.cid}: a lookup pooled on the server cannot be recorded by "
                                     f"distributed autograd (pool_on: server needs gradient_push: rpc)")
                by_step: dict[int, list] = {}
                unpooled = any(push.tag >= 0 for push in part.pushes)
                for push in part.pushes:
                    if (push.tag >= 0) != unpooled:
                        raise ValueError(f"{shard.cid}: pooled and row gradients in one message")
                    # A pooled lookup's gradient comes back as row gradients of its own memory.
                    by_step.setdefault(push.step, []).append(
                        shard.unpool(msg.trainer, push.tag, push.grad, step=push.step) if unpooled else (push.rows, push.grad))
                for step, parts in by_step.items():
                    if unpooled:
                        self.push(shard, msg.trainer, step, parts, keeps_copy=False, unpooled=True)
                        continue
                    # A channel's frame is reused once the message is answered; a sync push kept
                    # for the step's other pushes needs a copy, unless the answer waits for that
                    # step to be applied (a lookup of a later step of the same collection; an
                    # answer that fails first makes the kept push its own: _own).
                    waits = part.lookup is not None and part.step - 1 - shard.staleness >= step
                    if via_channel and waits:
                        borrowed.append((shard, step))
                    self.push(shard, msg.trainer, step, parts, keeps_copy=via_channel and not waits)
            # One tensor of rows per part, then the parts' versions (see hybrid.ps.protocol).
            sizes = [0 if p.lookup is None else p.bags.numel() if p.bags is not None else shard.numel(p.lookup)
                     for p, shard in zip(msg.parts, shards)]
            sizes.append(len(msg.parts))
            dtypes = [shard.wire_dtype for shard in shards] + [torch.int64]
            out = (buffers(sizes, dtypes) if buffers is not None
                   else [torch.empty(n, dtype=d) for n, d in zip(sizes, dtypes)])
            out[-1].fill_(-1)
        except BaseException as e:  # noqa: BLE001 - the trainer gets it as the message's error
            _own(msg.trainer, borrowed)
            reply(None, RuntimeError(f"ps{self.index}: {e}"))
            return
        _Answer(self, msg, shards, out, reply, via_channel, borrowed).start()

    def read(self, handle: int, after_step: int, rows: Rows, done: Reply) -> None:
        """Rows without gradient (evaluation), once steps through ``after_step`` are applied."""
        shard = self.shard(handle)

        def answer(err: BaseException | None) -> None:
            if err is not None:
                done(None, RuntimeError(f"ps{self.index}: collection {shard.cid} failed: {err!r}"))
                return
            try:
                done([shard.gather(rows, update=False)], None)
            except BaseException as e:  # noqa: BLE001
                done(None, e)

        shard.when_ready(after_step, answer)


class _Filler:
    """The background thread that makes the initial rows no lookup has asked for yet, table
    after table, one part per hold of the shard's lock (:meth:`LazyRows.fill_next`). It runs
    while work is left and ends; :meth:`wake` (a new collection) starts it again."""

    def __init__(self, server: ParameterServer) -> None:
        self.server = server
        self.cv = threading.Condition()
        self.running = False
        self.again = False
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.filled_s: float | None = None
        """Seconds the last fill took, from its start to nothing left (logged)."""

    def wake(self) -> None:
        with self.cv:
            if self.stopping:
                return
            self.again = True
            if not self.running:
                self.running = True
                self.thread = threading.Thread(target=self._run, name="hybrid-ps-fill", daemon=True)
                self.thread.start()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        started = time.perf_counter()
        try:  # the lowest CPU priority: steps' lookups and updates come first; the fill takes what is left
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        while True:
            with self.cv:
                if self.stopping or not self.again:
                    self.running = False
                    return
                self.again = False
            try:
                self._fill_all()
            except BaseException as e:  # noqa: BLE001 - lookups still make their own rows
                logger.warning("ps%d: the background fill of initial rows stopped: %r", self.server.index, e)
                with self.cv:
                    self.running = False
                return
            if not self.stopping:
                logger.info("initial rows of every table made (background fill: %.1f s)",
                            time.perf_counter() - started)

    def _fill_all(self) -> None:
        for shard in list(self.server.collections.values()):
            for t in shard.tables:
                while t.lazy is not None and not self.stopping and t.lazy.fill_next(shard.lock):
                    if self.server.collections.get(collection_handle(shard.cid)) is not shard:
                        return  # replaced: its memory goes; wake() came with the new one
            if self.stopping:
                return


class _Answer:
    """The lookups of one step message, answered together once each part's step may read."""

    def __init__(self, server: ParameterServer, msg: StepMessage, shards: list[CollectionShard],
                 out: list[torch.Tensor], reply: Reply, via_channel: bool,
                 borrowed: list[tuple[CollectionShard, int]]) -> None:
        self.server, self.msg, self.shards, self.out, self.reply = server, msg, shards, out, reply
        self.via_channel = via_channel
        self.borrowed = borrowed
        self.lock = threading.Lock()
        self.left = sum(p.lookup is not None for p in msg.parts)
        self.failed = False

    def start(self) -> None:
        if self.left == 0:
            self.reply(self.out, None)
            return
        for i, (part, shard) in enumerate(zip(self.msg.parts, self.shards)):
            if part.lookup is None:
                continue
            shard.counters.lookups += 1
            shard.counters.channel_lookups += int(self.via_channel)
            shard.counters.ids_requested += part.num_raw
            shard.counters.bytes_in += part.lookup.ids.numel() * 8
            if part.bags is not None:
                shard.counters.bytes_in += sum(t.numel() * t.element_size() for g in part.bags.groups
                                               for t in (g.idx, g.offsets, g.weights) if t is not None)
            shard.when_ready(part.step - 1 - shard.staleness,
                             lambda err, i=i, part=part, shard=shard: self._one(i, part, shard, err))

    def _fail(self, e: BaseException) -> None:
        """Answer with the first error. The answer may come before this message's kept pushes
        are applied: they stop borrowing the channel's frame first."""
        with self.lock:
            first, self.failed = not self.failed, True
        if not first:
            return
        _own(self.msg.trainer, self.borrowed)
        self.reply(None, RuntimeError(f"ps{self.server.index}: {e}"))

    def _one(self, i: int, part: Part, shard: CollectionShard, err: BaseException | None) -> None:
        try:
            if err is not None:
                raise RuntimeError(f"collection {shard.cid} failed: {err!r}")
            lag = part.step - 1 - shard.complete_through
            shard.counters.max_lag = max(shard.counters.max_lag, lag)
            if len(shard.counters.lags) < 10_000:
                shard.counters.lags.append(lag)
            if self.msg.autograd:
                with torch.enable_grad():  # may run on a backward thread, where grad mode is off
                    self.out[i] = _Lookup.apply(self.server.anchor, self.server, shard, self.msg.trainer, part.step,
                                                part.lookup.owned())
            else:
                # Read before the rows: every push through it is in them (a later one may be too).
                self.out[-1][i] = shard.complete_through
                if part.bags is not None:
                    shard.gather_pooled(self.msg.trainer, part.lookup, part.bags, self.out[i], step=part.step)
                else:
                    shard.gather(part.lookup, out=self.out[i], step=part.step)
            shard.counters.answered += 1
        except BaseException as e:  # noqa: BLE001 - handed to the trainer
            self._fail(e)
            return
        with self.lock:
            self.left -= 1
            done = self.left == 0 and not self.failed
        if done:
            self.reply(self.out, None)
            # The trainer has its rows; while it computes, sync dynamic tables plan the update.
            for part, shard in zip(self.msg.parts, self.shards):
                if part.lookup is not None:
                    shard.plan_ahead(part.step)


def _own(trainer: int, borrowed: list[tuple[CollectionShard, int]]) -> None:
    """Before an answer that may come ahead of the steps its message's kept pushes wait for: they
    stop borrowing the channel's frame."""
    for shard, step in borrowed:
        shard.own_pending(trainer, step)


# -- this process's server, and the RPC entry points ------------------------------------------------

_SERVER: ParameterServer | None = None


def start(index: int, options: ServerOptions) -> ParameterServer:
    """Make this process parameter server ``ps<index>``."""
    global _SERVER
    _SERVER = ParameterServer(index, options)
    return _SERVER


def close() -> None:
    """Stop this process's server's background work, if it is a server (shutdown)."""
    if _SERVER is not None:
        _SERVER.close()


def server() -> ParameterServer:
    if _SERVER is None:
        raise RuntimeError("this process is not a parameter server")
    return _SERVER


def _future_reply() -> tuple[torch.futures.Future, Reply]:
    fut: torch.futures.Future = torch.futures.Future()

    def reply(rows, err) -> None:
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(rows)

    return fut, reply


def rpc_create(config: CollectionConfig, start_step: int, init: str) -> int | str:
    """Create this server's shard of ``config``; its handle, or the message of a shard that does
    not fit (a plan mistake: an answer, not a server failure)."""
    try:
        return server().create(config, start_step=start_step, init=init)
    except DoesNotFit as e:
        return str(e)


@rpc.functions.async_execution
def rpc_step(ints: list[int], tensors: list[torch.Tensor]) -> torch.futures.Future:
    """A step message over RPC (:mod:`hybrid.ps.protocol`); answers one tensor per part."""
    fut, reply = _future_reply()
    try:
        msg = protocol.decode(Frame(ints, tensors))
    except protocol.ProtocolError as e:
        reply(None, e)
        return fut
    server().handle_step(msg, reply)
    return fut


@rpc.functions.async_execution
def rpc_read(handle: int, after_step: int, tables: list[int], counts: list[int], ids: torch.Tensor):
    fut, reply = _future_reply()
    server().read(handle, after_step, Rows(tables, counts, ids), reply)
    return fut.then(lambda f: f.value()[0])


def rpc_write_rows(handle: int, table: str, start: int, rows: torch.Tensor) -> None:
    """Overwrite local rows ``[start, start + len(rows))`` of ``table`` (initial load, restore)."""
    shard = server().shard(handle)
    t = shard.table(table)
    with shard.lock:
        if t.lazy is not None:
            t.lazy.overwrite(start, start + rows.shape[0])  # the rows written are not made first
        t.weight[start : start + rows.shape[0]] = rows


@rpc.functions.async_execution
def rpc_read_shard(handle: int, table: str, after_step: int = -1):
    """A copy of this server's rows of ``table`` and their optimizer state, once every trainer's
    updates through ``after_step`` are applied."""
    def read(t):
        t.ensure_range(0, t.rows)
        return t.weight.clone(), {k: v.clone() for k, v in t.optim.state.items()}

    return _read_when_ready(handle, table, after_step, read)


@rpc.functions.async_execution
def rpc_read_dynamic(handle: int, table: str, after_step: int = -1):
    """A dynamic table shard's ids, rows, optimizer state, map and counters
    (:meth:`TableShard.dynamic_rows`), once updates through ``after_step`` are applied."""
    return _read_when_ready(handle, table, after_step, lambda t: t.dynamic_rows())


def _read_when_ready(handle: int, table: str, after_step: int, read) -> torch.futures.Future:
    """A future of ``read(table shard)``, taken under the shard's lock once every trainer's
    updates through ``after_step`` are applied."""
    shard = server().shard(handle)
    t = shard.table(table)
    fut: torch.futures.Future = torch.futures.Future()

    def answer(err: BaseException | None) -> None:
        if err is not None:
            fut.set_exception(RuntimeError(f"ps{shard.server}: collection {shard.cid} failed: {err!r}"))
            return
        with shard.lock:
            fut.set_result(read(t))

    shard.when_ready(after_step, answer)
    return fut


def rpc_stats(handle: int) -> dict:
    """The counters of collection ``handle`` here, and two of the whole process (the same whatever
    the collection): ``cpu_s``, its CPU seconds so far, and ``huge_page_bytes``."""
    shard = server().shard(handle)
    d = shard.counters.as_dict()
    d["complete_through"] = shard.complete_through
    if shard.config.dynamic is not None:
        with shard.lock:
            d["dynamic"] = {t.name: t.dynamic.counters.as_dict(t.dynamic.rows, len(t.dynamic.seen))
                            for t in shard.tables}
    with shard.lock:
        d["rows_to_fill"] = shard.rows_to_fill()
    d["cpu_s"] = time.process_time()
    held = huge_page_bytes()  # the whole process's, every collection's tables together
    if held is not None:
        d["huge_page_bytes"] = held
    return d
