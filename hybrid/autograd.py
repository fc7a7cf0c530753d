"""The bridge between local autograd (the dense part) and distributed autograd (the servers).

A training step has two gradients to move. The dense part runs an ordinary ``loss.backward()``
so DDP's allreduce and FSDP2's reduce-scatter hooks fire; the remote part goes back to the
servers through ``dist_autograd.backward``. The two meet at the rows the servers sent: each
received tensor (``remote``, recorded by distributed autograd) is fed to the model as a detached
copy (``local``); after the local backward, ``local.grad`` is the gradient the servers need, and
``dist_autograd.backward(ctx, [sum((remote * local.grad).sum())])`` delivers exactly it.

That is the ``dist_autograd`` gradient push. The default, ``rpc``, skips distributed autograd:
the same ``local.grad`` goes to each server in a plain RPC, and that RPC is not even sent on its
own -- it is owed until the trainer's next lookup of that server, which carries it (a server
applies it before it looks the rows up). A sync step then costs one message per server instead
of four (lookup, autograd backward, and their answers), and nothing waits for the push. An owed
push that no lookup picks up within :data:`FLUSH_AFTER_S` is sent on its own (a trainer
between steps for long, or a loop that stops), and :meth:`RemoteRuntime.wait_pushed` sends and
awaits whatever is owed.

Each step's distributed-autograd context lives on a thread of its own (:class:`_ContextThread`),
never on the training thread. That is deliberate: DDP writes its gradients into a current
distributed-autograd context instead of ``.grad``, and FSDP2 inside one never syncs, so the dense
part must run where no context is current. It also lets the lookups of step ``t+1`` go out
(prefetch) while step ``t`` is still open.

Typical use, through :func:`step`::

    with hybrid.step(model, optimizer) as s:
        loss = loss_fn(model(dense, sparse), labels)
        s.backward(loss)          # local backward, push to servers, optimizer step
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd

_RELEASE = object()

GRADIENT_PUSHES = ("rpc", "dist_autograd")
"""How row gradients reach the servers (``runtime.gradient_push``); see the module docstring."""

FLUSH_AFTER_S = 0.02
"""An owed gradient push (``rpc`` mode) that no lookup carried within this many seconds is sent
on its own, so a trainer that pauses between steps never holds up the others."""


class _ContextThread:
    """A daemon thread that opens one distributed-autograd context per step it is given and runs
    that step's calls inside it until the step is released."""

    def __init__(self, name: str) -> None:
        self.steps: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            rstep = self.steps.get()
            if rstep is None:
                return
            try:
                with dist_autograd.context() as ctx_id:
                    rstep.ctx_id = ctx_id
                    while True:
                        fn, fut = rstep.calls.get()
                        if fn is _RELEASE:
                            fut.set_result(None)
                            break
                        try:
                            fut.set_result(fn(ctx_id))
                        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                            fut.set_exception(e)
            except BaseException as e:  # noqa: BLE001
                rstep.broken = e
                # Drain so nobody waits forever on a call that will never run.
                while not rstep.calls.empty():
                    _, fut = rstep.calls.get_nowait()
                    if not fut.done():
                        fut.set_exception(e)

    def stop(self) -> None:
        self.steps.put(None)


@dataclass
class StepTimes:
    """Seconds spent in each part of one step (for the training loop's breakdown)."""

    lookup: float = 0.0
    """Waiting for rows from the servers (includes waiting for slower trainers in sync mode)."""
    dense: float = 0.0
    """Local forward and backward of the dense part (and pooling)."""
    push: float = 0.0
    """Handing gradients to the servers (waited for at the start of the next step)."""
    optimizer: float = 0.0


@dataclass
class RemoteStep:
    """The remote half of one training step: its context, lookups, and gradients to push."""

    step: int
    calls: queue.Queue = field(default_factory=queue.Queue)
    ctx_id: int | None = None
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    prefetched: dict[str, Any] = field(default_factory=dict)
    broken: BaseException | None = None
    times: StepTimes = field(default_factory=StepTimes)
    pushed: Future | None = None
    inflight: list[Any] = field(default_factory=list)
    """Lookups sent in this step whose rows the model has not consumed yet."""
    sent: bool = False
    direct: bool = False
    """``rpc`` gradient push: no distributed-autograd context, calls run inline."""
    deferred: list[Any] = field(default_factory=list)
    """Lookups of this step routed but held back until the previous step pushes (sync prefetch)."""
    on_grads: Callable[[RemoteStep], None] | None = None
    """``rpc`` push: called inside ``s.backward`` as soon as every received row has its gradient
    (before the rest of the backward, the allreduce and the optimizer step)."""
    in_backward: bool = False
    ready: int = 0

    def call(self, fn: Callable[[int | None], Any]) -> Future:
        """Run ``fn(ctx_id)`` on this step's context thread (inline, ``ctx_id=None``, in ``rpc``
        mode); returns its future."""
        fut: Future = Future()
        if self.broken is not None:
            fut.set_exception(self.broken)
        elif self.direct:
            try:
                fut.set_result(fn(None))
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                fut.set_exception(e)
        else:
            self.calls.put((fn, fut))
        return fut

    def add_pair(self, remote: torch.Tensor, dest: PushDest | None = None) -> torch.Tensor:
        """Register rows received in this step; returns the local leaf to compute with.
        ``dest`` says where their gradient goes in ``rpc`` mode."""
        local = remote.detach().requires_grad_(True)
        self.pairs.append((remote, local, dest))
        if self.on_grads is not None:
            local.register_post_accumulate_grad_hook(self._grad_ready)
        return local

    def _grad_ready(self, _local: torch.Tensor) -> None:
        # Runs once per backward per received tensor, after its gradient is complete. Only the
        # step's own backward (s.backward) pushes early; any other leaves the push to its end.
        if not self.in_backward:
            return
        self.ready += 1
        if self.ready == len(self.pairs):
            self.on_grads(self)

    def send_deferred(self) -> None:
        """Send this step's deferred lookups (each carries what its server is owed)."""
        deferred, self.deferred = self.deferred, []
        for pending in deferred:
            pending.send()

    def push(self) -> Future:
        """Send the gradients of every registered pair to the servers, then release the context.

        Every pair is pushed, even one whose rows the loss did not use (zero gradient): a server
        counts one gradient per trainer per step before it applies the step.
        """
        pairs, self.pairs = self.pairs, []

        def _backward(ctx_id: int) -> None:
            if not pairs:
                return
            roots = [(remote * _grad_of(local)).sum() for remote, local, _ in pairs]
            dist_autograd.backward(ctx_id, [torch.stack(roots).sum()])

        self.pushed = self.call(_backward)
        self.release()
        return self.pushed

    def release(self) -> Future:
        fut: Future = Future()
        self.calls.put((_RELEASE, fut))
        return fut


def _grad_of(local: torch.Tensor) -> torch.Tensor:
    """The gradient of received rows; zeros for rows the loss did not use (a server still
    counts one gradient per trainer per step)."""
    return local.grad if local.grad is not None else torch.zeros_like(local)


@dataclass(frozen=True)
class PushDest:
    """Where the gradient of rows from one lookup goes (``rpc`` mode): a collection that can
    ``push_to(server, [(step, parts)])``, the server, and the ids and per-table counts asked."""

    owner: Any
    server: int
    ids: torch.Tensor
    counts: list[int]


class _Owed:
    """Gradient pushes computed but not sent yet (``rpc`` mode), per (collection, server).

    A lookup of that server takes them (:meth:`take`) and carries them; :meth:`flush` sends the
    rest on their own. A daemon thread flushes what waits longer than :data:`FLUSH_AFTER_S`."""

    def __init__(self, flush_after_s: float = FLUSH_AFTER_S) -> None:
        self.flush_after_s = flush_after_s
        self.cond = threading.Condition()
        self.items: dict[tuple[int, int], tuple[Any, int, list[tuple[int, list]]]] = {}
        self.since = 0.0
        self.sent: list[torch.futures.Future] = []
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="hybrid-push-flush", daemon=True)
        self.thread.start()

    def add(self, step: int, pairs: list) -> None:
        with self.cond:
            for _, local, dest in pairs:
                g = _grad_of(local)
                key = (id(dest.owner), dest.server)
                _, _, steps = self.items.setdefault(key, (dest.owner, dest.server, []))
                if steps and steps[-1][0] == step:
                    steps[-1][1].append((dest.ids, dest.counts, g))
                else:
                    steps.append((step, [(dest.ids, dest.counts, g)]))
            if not self.since:
                # Nothing was owed: the flusher waits without a deadline; give it one. (Otherwise
                # it already waits for the older deadline, which still holds.)
                self.since = time.monotonic()
                self.cond.notify_all()

    def take(self, owner: Any, server: int) -> list[tuple[int, list]]:
        """What ``owner`` owes ``server``, as ``[(step, [(ids, counts, grad), ...]), ...]``."""
        with self.cond:
            item = self.items.pop((id(owner), server), None)
            if not self.items:
                self.since = 0.0
            return item[2] if item is not None else []

    def flush(self) -> None:
        """Send everything owed, each on its own RPC (collected by :meth:`reap`)."""
        with self.cond:
            items, self.items, self.since = list(self.items.values()), {}, 0.0
            for owner, server, steps in items:
                self.sent.append(owner.push_to(server, steps))

    def reap(self, wait: bool) -> None:
        """Drop finished sends, raising the first failure; with ``wait``, wait for all of them."""
        with self.cond:
            sent = self.sent
            self.sent = [] if wait else [f for f in sent if not f.done()]
        for f in sent:
            if wait or f.done():
                f.wait()  # an RPC future: it fails by itself past the RPC deadline

    def _run(self) -> None:
        with self.cond:
            while not self.closed:
                if not self.items:
                    self.cond.wait()
                    continue
                left = self.since + self.flush_after_s - time.monotonic()
                if left > 0:
                    self.cond.wait(left)
                    continue
                try:
                    self.flush()
                except BaseException:  # noqa: BLE001 - a failed send surfaces in reap()
                    pass

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class RemoteRuntime:
    """Per-trainer-process bookkeeping of steps: numbering, contexts, and the current step.

    ``gradient_push``: ``rpc`` (plain RPCs, carried by the next lookup) or ``dist_autograd``;
    ``flush_after_s``: how long an owed push waits for a lookup to carry it (``rpc``)."""

    def __init__(self, *, trainer: int, start_step: int = 0, timeout_s: float = 300.0,
                 gradient_push: str = "rpc", flush_after_s: float = FLUSH_AFTER_S) -> None:
        if gradient_push not in GRADIENT_PUSHES:
            raise ValueError(f"gradient_push must be one of {', '.join(GRADIENT_PUSHES)}, got {gradient_push!r}")
        self.trainer = trainer
        self.next_step = start_step
        self.timeout_s = timeout_s
        self.direct = gradient_push == "rpc"
        # Three threads: the open step, the prefetched next one, and one still pushing.
        self._threads = [] if self.direct else [_ContextThread(f"hybrid-ctx{i}") for i in range(3)]
        self.owed = _Owed(flush_after_s) if self.direct else None
        self._open: dict[int, RemoteStep] = {}
        self.current: RemoteStep | None = None
        self.last_pushed: Future | None = None
        self.last_times: StepTimes | None = None

    def push(self, rstep: RemoteStep) -> None:
        """Hand the gradients of ``rstep``'s rows to the servers (``rpc``: owe them)."""
        if self.direct:
            pairs, rstep.pairs, rstep.ready = rstep.pairs, [], 0
            if pairs:
                self.owed.add(rstep.step, pairs)
            nxt = self._open.get(rstep.step + 1)
            if nxt is not None:
                nxt.send_deferred()  # the next step's lookups carry this push
        else:
            self.last_pushed = rstep.push()

    def _get(self, step: int) -> RemoteStep:
        rstep = self._open.get(step)
        if rstep is None:
            rstep = RemoteStep(step, direct=self.direct, on_grads=self.push if self.direct else None)
            self._open[step] = rstep
            if not self.direct:
                self._threads[step % len(self._threads)].steps.put(rstep)
        return rstep

    def begin(self) -> RemoteStep:
        """Open the next step and make it current."""
        if self.current is not None:
            raise RuntimeError(
                f"step {self.current.step} is still open: finish it (s.backward(loss)) before the next"
            )
        if self.direct:
            self.owed.reap(wait=False)  # owed pushes ride on this step's lookups
        else:
            self.wait_pushed()
        self.current = self._get(self.next_step)
        return self.current

    def ahead(self, k: int = 1) -> RemoteStep:
        """The step ``k`` after the next one to run (for prefetching its lookups)."""
        base = self.next_step if self.current is None else self.current.step
        return self._get(base + k)

    def end(self, pushed: bool) -> None:
        """Close the current step.

        A step that ends without ``s.backward`` (an exception) but did send lookups still owes
        the servers its gradient: zeros are pushed for every row it received, so the other
        trainers are not left waiting for this one. A step that sent nothing is not counted.
        """
        rstep, self.current = self.current, None
        if rstep is None:
            return
        self.last_times = rstep.times
        if not pushed and not rstep.sent:
            rstep.release()
            # Keep the (unused) context thread slot for this step number.
            self._open.pop(rstep.step, None)
            return
        self._open.pop(rstep.step, None)
        self.next_step = rstep.step + 1
        if not pushed:
            for pending in rstep.inflight:
                for s, r in pending.wait(self.timeout_s).items():
                    rstep.add_pair(r, pending.dest(s))
            rstep.inflight.clear()
            self.push(rstep)

    def wait_pushed(self) -> None:
        """Block until the previous step's gradients reached the servers; raise its error."""
        if self.direct:
            t0 = time.perf_counter()
            self.owed.flush()
            self.owed.reap(wait=True)
            if self.last_times is not None:
                self.last_times.push += time.perf_counter() - t0
            return
        if self.last_pushed is not None:
            t0 = time.perf_counter()
            fut, self.last_pushed = self.last_pushed, None
            fut.result(timeout=self.timeout_s)
            if self.last_times is not None:
                self.last_times.push += time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.wait_pushed()
        finally:
            for rstep in self._open.values():
                rstep.release()
            self._open.clear()
            for t in self._threads:
                t.stop()
            if self.owed is not None:
                self.owed.close()


_RUNTIME: RemoteRuntime | None = None


def runtime() -> RemoteRuntime | None:
    """This process's remote runtime (set by the composer on trainers), or ``None``."""
    return _RUNTIME


def set_runtime(rt: RemoteRuntime | None) -> None:
    global _RUNTIME
    if _RUNTIME is not None and rt is not _RUNTIME:
        _RUNTIME.close()
    _RUNTIME = rt


class StepHandle:
    """What ``with hybrid.step(...) as s`` gives the training loop."""

    def __init__(self, rt: RemoteRuntime | None, rstep: RemoteStep | None, optimizer) -> None:
        self._rt, self._rstep, self._optimizer = rt, rstep, optimizer
        self.backward_done = False
        self._t0 = time.perf_counter()

    @property
    def step(self) -> int | None:
        return None if self._rstep is None else self._rstep.step

    @property
    def times(self) -> StepTimes:
        return self._rstep.times if self._rstep is not None else StepTimes()

    def backward(self, loss: torch.Tensor) -> None:
        """Local backward (dense hooks fire), push to the servers, then the dense optimizer."""
        if self.backward_done:
            raise RuntimeError("s.backward(loss) was already called in this step")
        if self._rstep is not None:
            self._rstep.in_backward, self._rstep.ready = True, 0  # rpc push: rows' gradients go out when complete
        try:
            loss.backward()
        finally:
            if self._rstep is not None:
                self._rstep.in_backward = False
        t1 = time.perf_counter()
        if self._rstep is not None:
            self._rstep.times.dense += t1 - self._t0 - self._rstep.times.lookup
            self._rt.push(self._rstep)
        if self._optimizer is not None:
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
        if self._rstep is not None:
            self._rstep.times.optimizer += time.perf_counter() - t1
        self.backward_done = True


@contextmanager
def step(model: torch.nn.Module | None = None, optimizer=None) -> Iterator[StepHandle]:
    """One training step of a composed model; see the module docstring.

    ``optimizer`` is the dense optimizer (stepped and zeroed by ``s.backward``). Works without
    remote modules too (plain local training), so the same loop serves both.
    """
    rt = runtime()
    rstep = rt.begin() if rt is not None else None
    handle = StepHandle(rt, rstep, optimizer)
    try:
        yield handle
    finally:
        if rt is not None:
            rt.end(pushed=handle.backward_done)
