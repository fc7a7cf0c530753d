"""A trainer's steps of one composed model: lookups, prefetches and gradient pushes in order.

:class:`StepPipeline` is the one object that owns "prefetch the next step, push the previous
one". Each step (``with hybrid.step(model, optimizer) as s``):

1. the remote collections' lookups go out -- or were prefetched during the step before -- as one
   message per server (:class:`hybrid.ps.protocol.StepMessage`, every collection's part in it);
2. the rows enter the dense graph as detached leaves, so the dense forward and ``loss.backward()``
   run locally (DDP's allreduce and FSDP2's reduce-scatter fire as usual) and, once every leaf
   has its gradient, each holds exactly what its server needs;
3. those gradients go back by the model's :class:`GradientPush`: by default they are *owed* to
   each server and ride on the next message to it; in sync mode (``staleness`` 0) that is the
   next step's prefetched lookup, sent the moment the gradients are complete, so a sync step is
   one message per server; without a prefetch they go at once on their own. With
   ``gradient_push: dist_autograd`` the lookups run in a per-step distributed-autograd context
   and ``dist_autograd.backward`` delivers the gradients, as in PyTorch's RPC tutorials;
4. the dense optimizer steps.

A server answers a lookup of step ``t`` once the trainers' pushes through step ``t - 1 - k``
(staleness ``k``) are applied, so prefetching never reads rows a sync step should not see.
Whatever is owed is sent before anything that reads the tables outside a step (evaluation,
``state_dict``, checkpoints: :meth:`StepPipeline.flush`).
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hybrid.errors import InputError, first_line
from hybrid.ps.protocol import Part, Push, Rows, StepMessage
from hybrid.ps.transport import ReplyFuture, Transport

if TYPE_CHECKING:
    from hybrid.ps.client.cache import CacheSplit
    from hybrid.ps.client.collection import RemoteCollection
    from hybrid.ps.client.routing import RoutedBatch

NO_ROWS = Rows([], [], torch.empty(0, dtype=torch.int64))
"""What a pooled lookup's push lists (its server kept the rows)."""


class ServerError(RuntimeError):
    """A parameter server failed, died or did not answer in time; the message names it."""


@dataclass
class StepTimes:
    """Seconds spent in each part of one step (for the training loop's breakdown)."""

    lookup: float = 0.0
    """Waiting for rows from the servers (includes waiting for slower trainers in sync mode)."""
    dense: float = 0.0
    """Local forward and backward of the dense part (and pooling)."""
    push: float = 0.0
    """Handing gradients to the servers (waited for where the pipeline must flush)."""
    optimizer: float = 0.0


@dataclass(eq=False)  # one lookup is itself only: lists of lookups are searched by identity
class Lookup:
    """One collection's lookup of one step: routed, then sent, then its rows consumed."""

    collection: RemoteCollection
    routed: RoutedBatch
    kjt: Any
    step: int
    futures: dict[int, tuple[ReplyFuture, int]] | None = None
    """Server -> (the message's reply future, this lookup's part in it), once sent."""
    splits: dict[int, CacheSplit] = field(default_factory=dict)
    """Server -> what the collection's hot-row cache kept back from its request (sent: the rest)."""

    def wait(self, timeout_s: float) -> dict[int, torch.Tensor]:
        out = {}
        for s, (fut, part) in self.futures.items():
            name = self.collection.server_names[s]
            try:
                reply = fut.wait()
            except Exception as e:  # noqa: BLE001 - every failure of a peer gets its name
                raise _server_error("lookup", name, e) from e
            split = self.splits.pop(s, None)
            out[s] = (reply[part] if split is None
                      else self.collection.hot_rows.join(split, reply[part], int(reply[-1][part])))
        return out


class TableFullError(InputError):
    """A dynamic table is full and its ``evict`` policy frees no row: the step failed on the
    server and changed nothing (a data / plan mistake: exit code 2 in a run)."""


def _server_error(what: str, name: str, e: BaseException) -> ServerError | TableFullError:
    # The server's message (CapacityError) ends with the fix for its table's evict policy.
    full = re.search(r"([\w./-]+ on ps\d+: dynamic table .*?nothing was changed\. Raise the plan's capacity"
                     r"(?: or set evict: lru)?)", str(e))
    if full:
        return TableFullError(f"{what} on parameter server {name}: {full.group(1)}")
    first = first_line(e)
    hint = " (it died or closed the connection)" if any(w in first for w in ("EOF", "pipe", "ECONNRE")) else ""
    return ServerError(f"{what} on parameter server {name} failed{hint}: {first}")


@dataclass
class Received:
    """Rows one lookup got from one server in the current step, and where their gradient goes."""

    collection: RemoteCollection
    server: int
    rows: Rows
    remote: torch.Tensor
    local: torch.Tensor
    tag: int = -1
    """The pooled lookup the rows are bags of (``pool_on: server``); -1: rows."""


@dataclass
class StepState:
    """The remote half of one training step."""

    step: int
    received: list[Received] = field(default_factory=list)
    prefetched: dict[int, Lookup] = field(default_factory=dict)
    """id(collection) -> its lookup of this step, sent or deferred ahead of the forward."""
    deferred: list[Lookup] = field(default_factory=list)
    """Lookups routed ahead, to be sent with the previous step's gradient push (sync)."""
    postponed: list[tuple[Any, int]] = field(default_factory=list)
    """(sparse features, steps ahead) of prefetches two or more steps ahead, asked for before this
    step's push: routed and sent once it is owed (:meth:`StepPipeline.send_postponed`)."""
    postpone_error: Exception | None = None
    """What sending them raised inside the backward, raised by ``s.backward`` after the step."""
    inflight: list[Lookup] = field(default_factory=list)
    """Lookups sent for this step whose rows the model has not consumed yet."""
    times: StepTimes = field(default_factory=StepTimes)
    sent: bool = False
    in_backward: bool = False
    ready: int = 0
    pushed: bool = False
    aborted: bool = False
    """The step ended without its backward: its pushes carry no gradient."""
    context: Any = None
    """``dist_autograd``: the thread holding this step's context."""


class GradientPush:
    """How a step's row gradients reach the servers: the interface of both implementations, and
    the pushes both send as step messages -- owed to a server, then sent and reaped (every push
    of ``gradient_push: rpc``; an aborted step's under ``dist_autograd``)."""

    autograd = False
    """Lookups are recorded by distributed autograd."""

    def __init__(self) -> None:
        self.owed: dict[int, list[tuple[RemoteCollection, Push]]] = {}
        self.sent: list[tuple[str, ReplyFuture]] = []

    def start(self, pipeline: StepPipeline, state: StepState) -> None:
        """A step is opened (before anything of it is sent)."""

    def call(self, state: StepState, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (which sends this step's messages) where the step's sends must run."""
        return fn()

    def take(self, server: int) -> list[tuple[RemoteCollection, Push]]:
        """Gradients owed to ``server`` that the message about to go there should carry."""
        return self.owed.pop(server, [])

    def owe(self, state: StepState) -> None:
        """Owe each server the pushes of the step's received rows: their gradients, or, for a
        step that ended without its backward, no rows (the step counts as pushed and changes
        nothing: a zero gradient would still move rows under Adam or weight decay; a pooled
        lookup's server drops it at this trainer's next pooled push)."""
        for r in state.received:
            if state.aborted:
                push = Push(state.step, NO_ROWS, r.remote.new_empty(0))
            else:
                grad = r.local.grad if r.local.grad is not None else torch.zeros_like(r.local)
                grad = grad.reshape(-1).to("cpu")  # the wire carries host tensors, in the leaf's (wire) dtype
                # A pooled lookup's server kept its rows: the bags' gradients and the tag say it all.
                push = Push(state.step, r.rows, grad) if r.tag < 0 else Push(state.step, NO_ROWS, grad, r.tag)
            self.owed.setdefault(r.server, []).append((r.collection, push))
        state.received = []

    def owe_skipped(self, pipeline: StepPipeline, state: StepState) -> None:
        """Owe each server of every collection the step did not look up the trainer's push of the
        step, without rows. A server answers a later step's lookups only once every trainer has
        pushed every step before it (sync, and within the staleness bound), so a model that
        leaves a collection out of a step must still say so; the step changes none of its rows,
        as one process's step that does not use a table. Call before the step's received rows
        are owed (a looked-up collection reaches every one of its servers)."""
        used = {id(r.collection) for r in state.received}
        for c in pipeline.collections:
            if id(c) not in used:
                empty = torch.empty(0, dtype=getattr(torch, c.config.wire_dtype))
                for s in c.servers:
                    self.owed.setdefault(s, []).append((c, Push(state.step, NO_ROWS, empty)))

    def send_owed(self, pipeline: StepPipeline) -> None:
        """Send what is owed on messages of its own (what no lookup is about to carry)."""
        for server in list(self.owed):
            parts, _ = pipeline.parts_for(server, [], self.take(server))
            msg = StepMessage(trainer=pipeline.trainer, parts=parts)
            self.sent.append((pipeline.server_names[server], pipeline.transports[server].send(msg)))

    def reap(self, wait: bool) -> None:
        """Drop finished sends, raising the first failure; with ``wait``, wait for all."""
        sent, self.sent = self.sent, []
        for name, fut in sent:
            if not wait and not _done(fut):
                self.sent.append((name, fut))
                continue
            try:
                fut.wait()
            except Exception as e:  # noqa: BLE001
                raise _server_error("gradient push", name, e) from e

    def push(self, pipeline: StepPipeline, state: StepState) -> None:
        """The step's received rows all have their gradients: deliver them."""
        raise NotImplementedError

    def before_step(self, pipeline: StepPipeline) -> None:
        """A new step begins: raise the failure of an earlier delivery, if any."""
        raise NotImplementedError

    def wait(self, pipeline: StepPipeline) -> None:
        """Block until every gradient handed over so far reached its server; raise its error."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class RidingPush(GradientPush):
    """``gradient_push: rpc``: gradients are owed to their server and ride on the next message
    to it; in sync mode they leave at once (with the next step's deferred lookups)."""

    def push(self, pipeline: StepPipeline, state: StepState) -> None:
        self.owe(state)
        nxt = pipeline.open_steps.get(state.step + 1)
        deferred = nxt.deferred if nxt is not None else []
        if nxt is not None:
            nxt.deferred = []
        if deferred:
            pipeline.send(nxt, deferred)  # the next step's lookups carry this push
        if pipeline.staleness == 0:
            self.send_owed(pipeline)

    def wait(self, pipeline: StepPipeline) -> None:
        self.send_owed(pipeline)
        self.reap(wait=True)

    def before_step(self, pipeline: StepPipeline) -> None:
        self.reap(wait=False)


def _done(fut: ReplyFuture) -> bool:
    done = getattr(fut, "done", None)
    return done() if callable(done) else bool(done)


_RELEASE = object()


class _ContextThread:
    """Holds one step's distributed-autograd context on a thread of its own and runs that step's
    calls inside it until released. DDP writes gradients into a current context instead of
    ``.grad`` and FSDP2 inside one never syncs, so the training thread never has one."""

    def __init__(self, step: int) -> None:
        self.calls: queue.Queue = queue.Queue()
        self.broken: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"hybrid-ctx-{step}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import torch.distributed.autograd as dist_autograd

        try:
            with dist_autograd.context() as ctx_id:
                while True:
                    fn, fut = self.calls.get()
                    if fn is _RELEASE:
                        fut.set_result(None)
                        return
                    try:
                        fut.set_result(fn(ctx_id))
                    except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                        fut.set_exception(e)
        except BaseException as e:  # noqa: BLE001
            self.broken = e
            while not self.calls.empty():
                _, fut = self.calls.get_nowait()
                if not fut.done():
                    fut.set_exception(e)

    def run(self, fn: Callable[[int], Any]) -> Future:
        fut: Future = Future()
        if self.broken is not None:
            fut.set_exception(self.broken)
        else:
            self.calls.put((fn, fut))
        return fut

    def release(self) -> Future:
        return self.run(_RELEASE)  # type: ignore[arg-type]


class DistAutogradPush(GradientPush):
    """``gradient_push: dist_autograd``: each step's lookups run in a distributed-autograd
    context and ``dist_autograd.backward(ctx, [sum((rows * grad).sum())])`` delivers exactly the
    received rows' gradients to the servers' recorded lookups."""

    autograd = True

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.timeout_s = timeout_s
        self.last: Future | None = None

    def start(self, pipeline: StepPipeline, state: StepState) -> None:
        if state.context is None:
            state.context = _ContextThread(state.step)

    def call(self, state: StepState, fn: Callable[[], Any]) -> Any:
        return state.context.run(lambda _ctx: fn()).result(timeout=self.timeout_s)

    def push(self, pipeline: StepPipeline, state: StepState) -> None:
        import torch.distributed.autograd as dist_autograd

        if state.aborted:  # no backward: each server gets the step's pushes without rows, as a plain message
            self.owe(state)
            self.send_owed(pipeline)
            state.context.release()
            return
        received, state.received = state.received, []
        if self.owed:  # collections the step left out: plain messages, as no backward reaches them
            self.send_owed(pipeline)

        def backward(ctx_id: int) -> None:
            if received:
                roots = [(r.remote * (r.local.grad.to(r.remote.device) if r.local.grad is not None
                                      else torch.zeros_like(r.remote))).sum() for r in received]
                dist_autograd.backward(ctx_id, [torch.stack(roots).sum()])

        self.last = state.context.run(backward)
        state.context.release()

    def wait(self, pipeline: StepPipeline) -> None:
        if self.last is not None:
            last, self.last = self.last, None
            last.result(timeout=self.timeout_s)
        self.reap(wait=True)

    def before_step(self, pipeline: StepPipeline) -> None:
        self.wait(pipeline)


def same_batch(a, b, *, weights: bool = True) -> bool:
    """Whether sparse batches ``a`` and ``b`` (KeyedJaggedTensors) are the same object or hold
    the same keys, batch size, lengths, ids and (with ``weights``) per-sample weights, so that
    one's routing and rows serve the other (a step may run on an equal copy of the batch
    prefetched for it); without ``weights``, whether one's rows serve the other."""
    if a is b:
        return True
    if list(a.keys()) != list(b.keys()) or a.stride() != b.stride():
        return False
    wa, wb = a.weights_or_none(), b.weights_or_none()
    if weights and (wa is None) != (wb is None):
        return False
    pairs = [(a.lengths(), b.lengths()), (a.values(), b.values())] + ([(wa, wb)] if weights and wa is not None else [])
    return all(x.device == y.device and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
               for x, y in pairs)


def _serves(lk: Lookup, collection: RemoteCollection, kjt) -> bool:
    """Whether ``lk``, prefetched for this step, serves ``collection``'s lookup of ``kjt``: routed
    for the pooling the collection does now (``pool_on: auto`` turns to the trainer for learned
    weights), for ``kjt`` or an equal copy. Pooled on the trainer, the same ids with other
    per-sample weights (computed in the model's forward, as learned position weights are) serve
    too: the rows asked for are the same, and ``lk`` is routed again for the weights."""
    if (lk.routed.bags is not None) != collection.pools_on_server:
        return False
    if same_batch(lk.kjt, kjt):
        return True
    if lk.routed.bags is None and same_batch(lk.kjt, kjt, weights=False):
        lk.routed, lk.kjt = collection.route(kjt, step=True), kjt
        return True
    return False


class StepPipeline:
    """One composed model's steps on one trainer (see the module docstring)."""

    def __init__(self, *, trainer: int, transports: dict[int, Transport], server_names: list[str],
                 push: GradientPush, staleness: int, timeout_s: float, start_step: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.trainer = trainer
        self.device = torch.device(device)
        """Where the received rows go (the trainer's device); gradients go back in host memory."""
        self.transports = transports
        self.server_names = server_names
        self.push_strategy = push
        self.staleness = staleness
        self.timeout_s = timeout_s
        self.next_step = start_step
        self.open_steps: dict[int, StepState] = {}
        self.current: StepState | None = None
        self.last_times: StepTimes | None = None
        self.collections: list[RemoteCollection] = []
        self.depth = 1
        """How many coming batches a step prefetches (``s.prefetch_depth``): 2 where the composer
        hooked :meth:`reduction_launched` into DDP (:meth:`can_overlap_reduction`), else 1."""

    # -- steps ----------------------------------------------------------------------------------
    def _state(self, step: int) -> StepState:
        state = self.open_steps.get(step)
        if state is None:
            state = self.open_steps[step] = StepState(step)
            self.push_strategy.start(self, state)
        return state

    def begin(self) -> StepState:
        """Open the next step and make it current."""
        if self.current is not None:
            raise RuntimeError(f"step {self.current.step} is still open: finish it (s.backward(loss)) before the next")
        self.push_strategy.before_step(self)
        self.current = self._state(self.next_step)
        return self.current

    def end(self, backward_done: bool) -> None:
        """Close the current step. A step that ends without its backward (an exception) but did
        send lookups still pushes, without gradients, for every lookup it made, so the other
        trainers are not left waiting for this one and the tables do not change; a step that sent
        nothing is not counted."""
        state, self.current = self.current, None
        if state is None:
            return
        self.last_times = state.times
        if not backward_done and not state.sent:
            self.open_steps.pop(state.step, None)
            if state.context is not None:
                state.context.release()
            return
        self.next_step = state.step + 1
        if not backward_done:
            state.aborted = True
            for lookup in state.inflight:
                for s, rows in lookup.wait(self.timeout_s).items():
                    self._receive(state, lookup, s, rows)
            state.inflight.clear()
            self.gradients_ready(state)
        self.open_steps.pop(state.step, None)

    def gradients_ready(self, state: StepState) -> None:
        """Every row received in ``state`` has its gradient (or never will): deliver them."""
        if state.pushed:
            return
        state.pushed = True
        self.push_strategy.owe_skipped(self, state)
        self.push_strategy.push(self, state)

    def check_prefetched_used(self, state: StepState) -> None:
        """Before the step's backward under ``gradient_push: dist_autograd``: refuse a step that
        left out a collection whose rows were prefetched for it. Distributed autograd's backward
        reaches every lookup its context recorded, so those rows would be trained on a zero
        gradient (a change under Adam or weight decay) instead of left alone. The step then
        ends as one that raised: it changes nothing."""
        if not self.push_strategy.autograd:
            return
        left = [lk.collection.cid for lk in state.prefetched.values() if lk.futures is not None]
        if left:
            raise RuntimeError(
                f"step {state.step} did not look up {', '.join(left)}, whose rows were prefetched for it; under "
                f"runtime.gradient_push: dist_autograd the backward reaches every lookup a step made and would "
                f"train those rows on a zero gradient: prefetch only the steps that use a collection, or use "
                f"gradient_push: rpc (this step changes nothing)")

    def _grad_hook(self, state: StepState) -> Callable[[torch.Tensor], None]:
        def hook(_leaf: torch.Tensor) -> None:
            # Only the step's own backward pushes early; any other leaves the push to its end.
            if state.in_backward:
                state.ready += 1
                if state.ready == len(state.received):
                    self.gradients_ready(state)
        return hook

    # -- lookups --------------------------------------------------------------------------------
    def parts_for(self, server: int, lookups: list[Lookup], owed: list[tuple[RemoteCollection, Push]]
                  ) -> tuple[list[Part], dict[int, int]]:
        """The parts of one message to ``server`` -- each lookup's, with what is owed to it --
        and the part of each collection (by ``id``)."""
        parts: dict[int, Part] = {}
        for lk in lookups:
            c = lk.collection
            request = lk.routed.requests[server]
            if c.hot_rows is not None:  # the rows it holds fresh enough for this step are not asked for
                request, lk.splits[server] = c.hot_rows.split(server, request, lk.step)
            parts[id(c)] = Part(collection=c.handle, step=lk.step, lookup=request, num_raw=lk.routed.num_raw[server],
                                bags=None if lk.routed.bags is None else lk.routed.bags[server])
        for c, push in owed:
            part = parts.get(id(c))
            if part is None:
                part = parts[id(c)] = Part(collection=c.handle)
            part.pushes.append(push)
        return list(parts.values()), {key: k for k, key in enumerate(parts)}

    def send(self, state: StepState, lookups: list[Lookup]) -> None:
        """Send ``lookups`` (of step ``state.step``), one message per server, carrying what is
        owed to that server."""
        servers = sorted({s for lk in lookups for s in lk.routed.requests})

        def go() -> None:
            for s in servers:
                mine = [lk for lk in lookups if s in lk.routed.requests]
                parts, index = self.parts_for(s, mine, self.push_strategy.take(s))
                fut = self.transports[s].send(StepMessage(trainer=self.trainer, parts=parts,
                                                          autograd=self.push_strategy.autograd))
                for lk in mine:
                    if lk.futures is None:
                        lk.futures = {}
                    lk.futures[s] = (fut, index[id(lk.collection)])

        self.push_strategy.call(state, go)
        state.sent = True
        state.inflight.extend(lk for lk in lookups if lk not in state.inflight)

    def lookup(self, collection: RemoteCollection, kjt) -> tuple[RoutedBatch, dict[int, torch.Tensor]]:
        """The current step's rows of ``collection`` for ``kjt`` (prefetched ones if it is the
        batch that was prefetched, or an equal copy: :func:`same_batch`), as leaves of the dense
        graph."""
        state = self.current
        t0 = time.perf_counter()
        lk = state.prefetched.pop(id(collection), None)
        if lk is not None and not _serves(lk, collection, kjt):
            if self.push_strategy.autograd:
                # The prefetched lookup stays in flight: the step ends as one that raised.
                raise RuntimeError(
                    f"{collection.cid}: step {state.step} runs on another batch than the one prefetched for it; "
                    f"under runtime.gradient_push: dist_autograd every lookup a step made takes part in its "
                    f"backward, so prefetched rows cannot be dropped: prefetch the batch the step runs (an equal "
                    f"copy will do), or use gradient_push: rpc")
            # Another batch than the one prefetched (or routed for pooling on the servers where
            # the collection now pools itself): its rows are discarded, and nothing is ever
            # pushed for them (a server drops a lookup kept without a push).
            for kept in (state.inflight, state.deferred):
                if lk in kept:
                    kept.remove(lk)
            lk = None
        if lk is None:
            lk = Lookup(collection, collection.route(kjt, step=True), kjt, state.step)
            self.send(state, [lk])
        elif lk.futures is None:  # deferred, and the previous step has not pushed
            if lk in state.deferred:
                state.deferred.remove(lk)
            self.send(state, [lk])
        rows = lk.wait(self.timeout_s)
        if lk in state.inflight:
            state.inflight.remove(lk)
        out = {s: self._receive(state, lk, s, r) for s, r in rows.items()}
        state.times.lookup += time.perf_counter() - t0
        return lk.routed, out

    def _receive(self, state: StepState, lk: Lookup, server: int, remote: torch.Tensor) -> torch.Tensor:
        # The rows come in host memory; on a GPU trainer they are copied to its device (from
        # pinned memory where the transport gave it, without blocking this thread). The leaf
        # keeps the reply's dtype (the collection's wire_dtype): the router widens it inside the
        # graph, so the leaf's gradient is already in the dtype it is pushed in.
        local = remote.to(self.device, non_blocking=remote.is_pinned()).detach().requires_grad_(True)
        state.received.append(Received(lk.collection, server, lk.routed.requests[server], remote, local,
                                       lk.routed.tag))
        local.register_post_accumulate_grad_hook(self._grad_hook(state))
        return local

    def can_overlap_reduction(self) -> bool:
        """Whether this trainer looks up two steps ahead, the second lookup sent while DDP's
        all-reduce runs: in async mode (a lookup of step t + 2 may then read rows once step t is
        pushed), with gradients riding the step messages (under ``dist_autograd`` a lookup
        belongs to its own step's context), on a CPU trainer (on a GPU the backward and the
        all-reduce run on the device's streams, so the thread is not waiting there, and the hook
        runs on autograd's device thread), for a model with remote collections and no hot-row
        cache (its rows serve a lookup within the staleness bound of their reply: made two steps
        ahead, a lookup finds none fresh enough at staleness 2, where one step ahead it found
        about a tenth)."""
        return (self.staleness >= 1 and not self.push_strategy.autograd and self.device.type == "cpu"
                and bool(self.collections) and all(c.hot_rows is None for c in self.collections))

    def reduction_launched(self) -> None:
        """DDP's comm hook, once it has launched a bucket's all-reduce: the step's postponed
        lookups go now, while the trainer would otherwise wait for the network. Inside autograd
        an error would come out as another exception: it is kept for ``s.backward`` to raise."""
        state = self.current
        try:
            self.send_postponed()
        except Exception as e:  # noqa: BLE001 - raised again by s.backward, outside autograd
            if state is not None:
                state.postpone_error = e

    def send_postponed(self) -> None:
        """Route and send the current step's postponed prefetches (two or more steps ahead), once
        its gradients are owed (they ride on these lookups): from :meth:`reduction_launched`, or
        by ``s.backward`` after the backward where no all-reduce did."""
        state = self.current
        if state is None or not state.pushed:
            return
        if state.postpone_error is not None:
            e, state.postpone_error = state.postpone_error, None
            raise e
        while state.postponed:
            kjt, ahead = state.postponed.pop(0)
            self.prefetch(kjt, ahead)

    def prefetch(self, kjt, ahead: int = 1) -> None:
        """Route the batch of the step ``ahead`` steps on (for every collection whose features
        ``kjt`` holds; with no step open, ``ahead`` 1 is the next step to run) and ask for its
        rows: at once where the step may already read them (staleness >= ``ahead``, or no step
        open), else together with this step's gradient push. A lookup two or more steps ahead
        asked for before this step's push is postponed until the push is owed and rides on it
        (:meth:`send_postponed`): it may read rows this step updates, and it has a whole step to
        come back."""
        if ahead > self.staleness + 1:
            raise ValueError(f"prefetch {ahead} steps ahead: staleness {self.staleness} allows at most "
                             f"{self.staleness + 1} (the lookup would wait for a push sent after it)")
        if ahead > 1 and self.current is not None and not self.current.pushed:
            self.current.postponed.append((kjt, ahead))
            return
        base = self.next_step - 1 if self.current is None else self.current.step
        state = self._state(base + ahead)
        lookups = []
        for c in self.collections:
            if not c.accepts(kjt) or id(c) in state.prefetched:
                continue
            lk = Lookup(c, c.route(kjt, step=True), kjt, state.step)
            state.prefetched[id(c)] = lk
            lookups.append(lk)
        if not lookups:
            return
        defer = (not self.push_strategy.autograd and self.current is not None and ahead == 1
                 and self.staleness == 0 and not self.current.pushed)
        if defer:
            state.deferred.extend(lookups)
        else:
            self.send(state, lookups)

    def finished_step(self) -> int:
        """The last step whose gradients this trainer delivered (sent), after sending what is owed."""
        self.flush()
        return (self.current.step if self.current is not None else self.next_step) - 1

    def flush(self) -> None:
        """Send whatever gradients are owed and wait until they reached the servers."""
        t0 = time.perf_counter()
        self.push_strategy.wait(self)
        if self.last_times is not None:
            self.last_times.push += time.perf_counter() - t0

    def forget_rows(self) -> None:
        """Empty every collection's hot-row cache (the servers' rows were replaced)."""
        for c in self.collections:
            if c.hot_rows is not None:
                c.hot_rows.clear()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            for state in self.open_steps.values():
                if state.context is not None:
                    state.context.release()
            self.open_steps.clear()
            for t in self.transports.values():
                t.close()


class StepHandle:
    """What ``with hybrid.step(...) as s`` gives the training loop."""

    def __init__(self, pipeline: StepPipeline | None, state: StepState | None, optimizer) -> None:
        self._pipeline, self._state, self._optimizer = pipeline, state, optimizer
        self.backward_done = False
        self._t0 = time.perf_counter()

    @property
    def step(self) -> int | None:
        return None if self._state is None else self._state.step

    @property
    def times(self) -> StepTimes:
        return self._state.times if self._state is not None else StepTimes()

    @property
    def prefetch_depth(self) -> int:
        """How many coming batches :meth:`prefetch` uses: 2 in async mode on a CPU trainer whose
        dense part is under DDP (the second batch's lookup leaves while DDP's all-reduce runs
        and has a whole step to come back), else 1; 0 for a plain model."""
        return self._pipeline.depth if self._pipeline is not None else 0

    def prefetch(self, *kjts) -> None:
        """Ask for the rows the coming steps' batches (their sparse features, the next step's
        first) will need: the first :attr:`prefetch_depth` of ``kjts``; the rest are ignored
        (asked for by the steps after). A batch asked for by an earlier step is not asked for
        again."""
        if self._pipeline is not None:
            for ahead, kjt in enumerate(kjts[:self._pipeline.depth], start=1):
                self._pipeline.prefetch(kjt, ahead)

    def backward(self, loss: torch.Tensor) -> None:
        """Local backward (dense hooks fire), push to the servers, then the dense optimizer."""
        if self.backward_done:
            raise RuntimeError("s.backward(loss) was already called in this step")
        state = self._state
        if state is not None:
            self._pipeline.check_prefetched_used(state)
            state.in_backward, state.ready = True, 0
        try:
            loss.backward()
        finally:
            if state is not None:
                state.in_backward = False
        t1 = time.perf_counter()
        failed = None
        if state is not None:
            state.times.dense += t1 - self._t0 - state.times.lookup
            self._pipeline.gradients_ready(state)
            try:
                self._pipeline.send_postponed()  # what no all-reduce sent
            except Exception as e:  # noqa: BLE001 - a later batch's: this step still completes
                failed = e
        if self._optimizer is not None:
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
        if state is not None:
            state.times.optimizer += time.perf_counter() - t1
        self.backward_done = True
        if failed is not None:
            raise failed


def pipeline_of(model: torch.nn.Module | StepPipeline | None) -> StepPipeline | None:
    """The pipeline ``hybrid.compose`` attached to ``model`` (``None`` for a plain model); a
    pipeline itself (remote collections built by hand) is its own."""
    if isinstance(model, StepPipeline):
        return model
    return getattr(model, "_hybrid_pipeline", None) if model is not None else None


@contextmanager
def step(model: torch.nn.Module | None = None, optimizer=None) -> Iterator[StepHandle]:
    """One training step of a composed ``model`` (or of a :class:`StepPipeline`); see the module
    docstring.

    ``optimizer`` is the dense optimizer (stepped and zeroed by ``s.backward``). Works for a
    plain model too (plain local training), so the same loop serves both.
    """
    pipeline = pipeline_of(model)
    state = pipeline.begin() if pipeline is not None else None
    handle = StepHandle(pipeline, state, optimizer)
    try:
        yield handle
    finally:
        if pipeline is not None:
            pipeline.end(handle.backward_done)
