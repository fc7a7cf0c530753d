"""What the frame channels share: the layout of a frame in a byte region, and the two ends.

A frame channel carries a trainer's step messages to one server outside RPC, up to
:data:`WINDOW` of them unanswered at a time: the message's frame (:mod:`hybrid.ps.protocol`) is
laid out in a byte region (:func:`write_frame`), the other end finds it in a region of its own
(:func:`read_frame`) and answers the same way. How the bytes get there is each channel's own:
shared pages and a FIFO doorbell on one host (:mod:`hybrid.ps.transport.shm`), a TCP connection
across hosts (:mod:`hybrid.ps.transport.tcp`). :class:`TrainerEnd` and :class:`ServerEnd` hold
the rest: the window with its RPC fallback, the deadline, the replies' futures, and the server's
thread that decodes, hands the message to the server and writes the reply (rows gathered
straight into the reply's region).

Each message ``seq`` has its slots, fixed by its number: its request in slot ``seq %
WINDOW`` of the request region, its reply in slot ``seq % REPLY_SLOTS`` of the trainer's reply
region (:func:`slots`). Replies come back in the order the server completes them (a lookup that
waits for its step is passed by a later message that need not), each naming its message.

A region's layout::

    header: magic, sequence number, kind (step, rows, error, held), number of ints, number of tensors
    ints, then per tensor: dtype code, elements, offset; then the tensors, each 64-byte aligned
"""

from __future__ import annotations

import functools
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from hybrid.ps import protocol
from hybrid.ps.protocol import Frame, StepMessage
from hybrid.ps.transport import Transport, call

MAGIC = 0x48594252  # "HYBR"
STEP, ROWS, ERROR, HELD = 1, 2, 3, 4
HEADER = struct.Struct("<qqqqq")  # magic, seq, kind, number of ints, number of tensors
ENTRY = struct.Struct("<qqq")  # dtype code, elements, offset
ALIGN = 64
DTYPES = {0: torch.int64, 1: torch.float32, 2: torch.uint8, 3: torch.bfloat16, 4: torch.float16, 5: torch.int32}
CODES = {v: k for k, v in DTYPES.items()}


WINDOW = 2
"""Messages of a channel unanswered at a time: an async trainer's lookup two steps ahead is sent
while the one a step ahead is still unanswered (:mod:`hybrid.ps.client.pipeline`)."""
REPLY_SLOTS = WINDOW + 1
"""Slots of a trainer's reply region: a reply's rows are used in place until the reply of the
message :data:`REPLY_SLOTS` later overwrites them."""


class ChannelError(RuntimeError):
    """The server at the other end died, closed the channel, or did not answer in time."""


_HELD: dict[tuple[int, int], list[torch.Tensor]] = {}
"""Replies larger than their channel's reply slot, by (server end, message), until fetched."""
_HELD_LOCK = threading.Lock()
_ENDS = iter(range(1 << 62))  # each server end's number in _HELD's keys (next() is atomic under the GIL)


def rpc_take_held(end: int, seq: int) -> list[torch.Tensor]:
    """Server entry point: the rows of a reply that did not fit its channel (a ``held`` frame
    named it), handed over once."""
    with _HELD_LOCK:
        rows = _HELD.pop((end, seq), None)
    if rows is None:
        raise KeyError(f"no held reply to message {seq} of channel {end}")
    return rows


def layout(n_ints: int, nbytes: list[int]) -> tuple[list[int], int]:
    """Offsets of a frame's tensors (``nbytes`` each) after its header, and the frame's end."""
    offset = HEADER.size + 8 * n_ints + ENTRY.size * len(nbytes)
    offsets = []
    for n in nbytes:
        offset = (offset + ALIGN - 1) // ALIGN * ALIGN
        offsets.append(offset)
        offset += n
    return offsets, offset


def _head(seq: int, kind: int, frame: Frame) -> tuple[bytes, list[int], int]:
    """A frame's header (magic, sequence, kind, counts, its ints and tensor entries), where its
    tensors go, and its end."""
    tensors = frame.tensors
    offsets, end = layout(len(frame.ints), [t.numel() * t.element_size() for t in tensors])
    meta = struct.pack(f"<{len(frame.ints)}q", *frame.ints) + b"".join(
        ENTRY.pack(CODES[t.dtype], t.numel(), off) for t, off in zip(tensors, offsets))
    return HEADER.pack(MAGIC, seq, kind, len(frame.ints), len(tensors)) + meta, offsets, end


def frame_pieces(seq: int, kind: int, frame: Frame) -> tuple[list, int]:
    """The bytes :func:`write_frame` would lay out, as pieces to send one after the other (the
    header, then each tensor's own memory after the zeros that align it), and their length:
    a frame sent from where its tensors are, without a copy."""
    head, offsets, end = _head(seq, kind, frame)
    pieces, at = [head], len(head)
    for t, off in zip(frame.tensors, offsets):
        if off > at:
            pieces.append(bytes(off - at))
        flat = t.reshape(-1).contiguous()
        pieces.append(memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b"")
        at = off + flat.numel() * flat.element_size()
    return pieces, end


def write_frame(region: torch.Tensor, seq: int, kind: int, frame: Frame,
                room: Callable[[int], bool] | None = None) -> int:
    """Lay out ``frame`` in ``region`` (uint8); its end, or 0 if it does not fit (in the region,
    or in what ``room(end)`` can make ready: shared memory reserved as it is needed)."""
    tensors = frame.tensors
    head, offsets, end = _head(seq, kind, frame)
    if end > region.numel() or (room is not None and not room(end)):
        return 0
    # Through the region's buffer and pointers rather than a tensor view per piece: this runs
    # once per message on both ends, and each view costs more than the header's bytes.
    memoryview(region.numpy())[: len(head)] = head
    base = region.data_ptr()
    for t, off in zip(tensors, offsets):
        if t.data_ptr() != base + off:  # rows gathered in place need no copy
            region[off : off + t.numel() * t.element_size()].view(t.dtype).copy_(t.reshape(-1))
    return end


def read_frame(region: torch.Tensor, seq: int) -> tuple[int, Frame]:
    """The message in ``region``: its kind and frame (tensors are views into ``region``)."""
    buf = memoryview(region.numpy())  # read in place: no copy, no tensor per header field
    size = len(buf)
    magic, got_seq, kind, n_ints, n_tensors = HEADER.unpack_from(buf)
    if magic != MAGIC or got_seq != seq or not 0 <= n_ints < size or not 0 <= n_tensors < size:
        raise ChannelError(f"corrupt message in the channel (magic {magic:#x}, sequence {got_seq} where {seq} "
                           f"was due)")
    end = HEADER.size + 8 * n_ints + ENTRY.size * n_tensors
    if end > size:
        raise ChannelError("corrupt message in the channel (header larger than the region)")
    ints = list(struct.unpack_from(f"<{n_ints}q", buf, HEADER.size))
    tensors = []
    for k in range(n_tensors):
        code, n, off = ENTRY.unpack_from(buf, HEADER.size + 8 * n_ints + ENTRY.size * k)
        dtype = DTYPES.get(code)
        if dtype is None or n < 0 or off < end or off + n * dtype.itemsize > size:
            raise ChannelError("corrupt message in the channel (a tensor outside the region)")
        # a view of the region's memory (frombuffer refuses an empty one)
        tensors.append(torch.frombuffer(buf, dtype=dtype, count=n, offset=off) if n else torch.empty(0, dtype=dtype))
    return kind, Frame(ints, tensors)


def error_frame(err: BaseException | str) -> Frame:
    text = str(err).encode("utf-8") or b"error"
    return Frame([], [torch.frombuffer(bytearray(text), dtype=torch.uint8)])


def slots(region: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``region`` cut into ``n`` equal slots; message ``seq`` takes slot ``seq % n``."""
    size = region.numel() // n
    return [region[k * size : (k + 1) * size] for k in range(n)]


class TrainerEnd(Transport, ABC):
    """A trainer's end of a frame channel to one server. Message ``seq`` is laid out in its slot of
    ``req`` (:data:`WINDOW` slots) and answered in its slot of ``rep`` (:data:`REPLY_SLOTS`
    slots). It goes on the channel once every message up to ``seq - WINDOW`` is answered (the
    server is done with a request once it answers it, so its slot is free); a push-only message
    there is waited for (it is answered at once), one that waits for rows is not (its step may
    need this message's push). Such a message, one too big for a slot, and distributed-autograd
    lookups go over ``fallback`` (RPC), numbered in this channel's stream: the server handles
    them in their turn.

    A reply's rows are views into its slot, used in place until the message
    :data:`REPLY_SLOTS` later is sent: by then its rows were consumed (pooled, copied to a
    device) as they were received, when each lookup of the message waited for it. A reply taken
    in before every lookup of it waited (while waiting for another message's reply) and still
    unread then is copied out of its slot first. Subclasses move the bytes (:meth:`_post`,
    :meth:`_receive`) and say what they are (:attr:`Transport.what`: ``shared-memory channel``,
    ``TCP step connection``)."""

    def __init__(self, server: str, req: torch.Tensor, rep: torch.Tensor, *, fallback: Transport,
                 timeout_s: float) -> None:
        super().__init__()
        self.server = server
        self.fallback = fallback
        self.timeout_s = timeout_s
        self.req_slots, self.rep_slots = slots(req, WINDOW), slots(rep, REPLY_SLOTS)
        self.seq = 0
        self.pending: dict[int, _Reply] = {}
        """The unanswered messages, by number."""
        self.in_region: list[_Reply | None] = [None] * REPLY_SLOTS
        """Per slot of ``rep``, the reply taken in whose tensors are views into it."""
        self.closed = False

    @abstractmethod
    def _post(self, seq: int, end: int) -> bool:
        """Message ``seq``, the frame :meth:`_write` laid out (``end`` bytes), goes to the server;
        ``False`` if the server is gone."""

    def _write(self, seq: int, frame: Frame) -> int:
        """Lay out message ``seq`` for :meth:`_post`: here, in its slot of ``req``; its end, or 0
        if it does not fit (in the slot, or in what :meth:`_room` can make ready)."""
        return write_frame(self.req_slots[seq % WINDOW], seq, STEP, frame, functools.partial(self._room, seq))

    def _room(self, seq: int, nbytes: int) -> bool:
        """Whether the first ``nbytes`` of message ``seq``'s request slot can be written (here:
        always; shared memory reserves them first)."""
        return True

    @abstractmethod
    def _receive(self, left_s: float, block: bool) -> int | bool | None:
        """Wait up to ``left_s`` for the next reply to arrive in its slot of ``rep`` (not at all
        without ``block``): the number of the message it answers once it is there (one of
        :attr:`pending`), ``False`` if none came, ``None`` at end-of-file (the server closed its
        end). May raise :class:`ChannelError`."""

    def deliver(self, msg: StepMessage):
        if self.closed or msg.autograd:
            return self.fallback.deliver(msg)
        seq = self.seq + 1
        while self.pending and (old := min(self.pending)) <= seq - WINDOW:  # its slots are seq's
            if not self._take(block=not self.pending[old].answers_rows):
                return self.fallback.deliver(msg)
        if self.closed:  # a reply taken in above found the channel broken
            return self.fallback.deliver(msg)
        self._keep_unread(seq % REPLY_SLOTS)
        end = self._write(seq, protocol.encode(msg))
        if not end:
            return self.fallback.deliver(msg)
        if not self._post(seq, end):
            self.closed = True  # the server is gone: RPC says so, naming it
            return self.fallback.deliver(msg)
        self.seq = seq
        fut = self.pending[seq] = _Reply(self, lookups=sum(p.lookup is not None for p in msg.parts))
        return fut

    def _keep_unread(self, index: int) -> None:
        """Before a message whose reply goes to slot ``index`` of ``rep`` is sent: the reply lying
        there, if nobody has waited for it yet, gets its own copy of its tensors."""
        fut, self.in_region[index] = self.in_region[index], None
        if fut is not None and not fut.read and fut.result is not None:
            fut.result = [t.clone() for t in fut.result]

    def _take(self, block: bool) -> bool:
        """Take in the next reply and complete its message's future (rows or error); without
        ``block``, ``False`` if none has arrived. A channel found broken (end-of-file, no answer
        within the timeout, a corrupt reply) fails every unanswered message and takes no more.
        A message whose future nobody waits for (a prefetch discarded for another batch) is
        taken in by a later wait or send."""
        try:
            got = self._receive(self.timeout_s, block)
            if got is False and not block:
                return False
            if got is None:
                raise ChannelError(f"parameter server {self.server} closed the {self.what}: EOF")
            if got is False:
                raise ChannelError(f"parameter server {self.server} did not answer within runtime.rpc_timeout_s: "
                                   f"timeout ({self.timeout_s * 1000:.0f} ms)")
            fut = self.pending[got]
            kind, frame = read_frame(self.rep_slots[got % REPLY_SLOTS], got)
            if kind == ERROR:
                fut.error = RuntimeError(bytes(frame.tensors[0].numpy()).decode("utf-8", "replace"))
            elif kind == HELD:  # too large for the slot: the server holds the rows for RPC
                try:
                    fut.result = call(self.server, rpc_take_held, (frame.ints[0], got), timeout_s=self.timeout_s).wait()
                except Exception as e:  # noqa: BLE001 - the message's error, naming the server
                    fut.error = RuntimeError(f"parameter server {self.server}: fetching a reply larger than the "
                                             f"{self.what} failed: {e}")
            else:
                fut.result = frame.tensors  # views: valid until message got + REPLY_SLOTS is sent
                self.in_region[got % REPLY_SLOTS] = fut
            fut.done = True
            del self.pending[got]
        except ChannelError as e:
            self.closed = True
            for fut in self.pending.values():
                fut.error, fut.done = e, True
            self.pending.clear()
        return True


class _Reply:
    """The future of a message sent through a channel."""

    def __init__(self, end: TrainerEnd, *, lookups: int) -> None:
        self.end = end
        self.answers_rows = lookups > 0
        self.lookups = lookups
        """Parts of the message that ask for rows: each one's lookup waits for the reply once."""
        self.waits = 0
        self.done = False
        self.result: list[torch.Tensor] | None = None
        self.error: BaseException | None = None

    @property
    def read(self) -> bool:
        """Whether every lookup of the message waited for it: their rows are then consumed (see
        :class:`TrainerEnd`)."""
        return self.waits >= self.lookups

    def wait(self) -> list[torch.Tensor]:
        while not self.done:
            self.end._take(block=True)
        self.waits += 1
        if self.error is not None:
            raise self.error
        return self.result


class ServerEnd(ABC):
    """A server's end of one trainer's channel: a daemon thread that waits for each message in
    its slot of ``req`` (:meth:`_next`), decodes it, hands it to the server and answers in its
    slot of ``rep`` (:meth:`_post_reply`) from whichever thread completes it, the rows gathered
    straight into the reply's slot. ``reply_slots``: :data:`REPLY_SLOTS` where ``rep`` is the
    trainer's own memory; where it is the server's, from which each reply is sent, a slot per
    message that may be unanswered (:data:`WINDOW`)."""

    what = "channel"

    def __init__(self, req: torch.Tensor, rep: torch.Tensor, name: str, *, reply_slots: int) -> None:
        self.req_slots, self.rep_slots = slots(req, WINDOW), slots(rep, reply_slots)
        self.lock = threading.Lock()
        self.seq = 0
        self.number = next(_ENDS)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    @abstractmethod
    def _next(self, seq: int) -> bool:
        """Wait for message ``seq`` in its slot of ``req``; ``False`` when the trainer closed its
        end."""

    @abstractmethod
    def _post_reply(self, seq: int, end: int) -> None:
        """The reply to message ``seq``, the first ``end`` bytes of its slot of ``rep``, goes to the
        trainer (nothing if it is gone)."""

    def close(self) -> None:
        """Stop serving (the thread ends at its next wait)."""

    def _run(self) -> None:
        from hybrid.ps.server.service import server

        while self._next(self.seq + 1):
            self.seq += 1
            seq = self.seq
            try:
                _, frame = read_frame(self.req_slots[seq % WINDOW], seq)
                msg = protocol.decode(frame)
                server().handle_step(msg, lambda rows, err, seq=seq: self.reply(seq, rows, err),
                                     lambda sizes, dtypes, seq=seq: self.buffers(seq, sizes, dtypes), via_channel=True)
            except BaseException as e:  # noqa: BLE001 - the trainer gets it as the message's error
                try:
                    self.reply(seq, None, e)
                except BaseException:  # noqa: BLE001 - keep serving; the trainer's wait times out
                    pass
        self.close()
        self.drop_held()

    def _region(self, seq: int) -> torch.Tensor:
        return self.rep_slots[seq % len(self.rep_slots)]

    def _room(self, seq: int, nbytes: int) -> bool:
        """Whether the first ``nbytes`` of message ``seq``'s reply slot can be written (here:
        always; shared memory reserves them first)."""
        return True

    def buffers(self, seq: int, sizes: list[int], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        """Where each part's rows (``sizes`` elements of ``dtypes``) of the reply to message
        ``seq`` go: in place in the reply's frame, so that they are gathered straight into it
        (fresh tensors when they would not fit)."""
        region = self._region(seq)
        nbytes = [n * d.itemsize for n, d in zip(sizes, dtypes)]
        offsets, end = layout(0, nbytes)
        if end > region.numel() or not self._room(seq, end):
            return [torch.empty(n, dtype=d) for n, d in zip(sizes, dtypes)]
        return [region[off : off + b].view(d) for off, b, d in zip(offsets, nbytes, dtypes)]

    def reply(self, seq: int, rows: list[torch.Tensor] | None, err: BaseException | None = None) -> None:
        """Answer message ``seq`` (from whichever thread completes it)."""
        region = self._region(seq)
        room = functools.partial(self._room, seq)
        if err is not None:
            end = write_frame(region, seq, ERROR, error_frame(err), room)
        else:
            end = write_frame(region, seq, ROWS, Frame([], rows), room)
            if not end:  # larger than the slot (or than the memory it could get): fetched over RPC
                lo, hi = region.data_ptr(), region.data_ptr() + region.numel()
                held = [t.clone() if lo <= t.data_ptr() < hi else t for t in rows]  # the slot is reused
                with _HELD_LOCK:
                    _HELD[(self.number, seq)] = held
                end = write_frame(region, seq, HELD, Frame([self.number], []), room)
        self._post_reply(seq, end)

    def drop_held(self) -> None:
        """Forget this end's replies nobody fetched (the trainer is gone)."""
        with _HELD_LOCK:
            for key in [k for k in _HELD if k[0] == self.number]:
                del _HELD[key]
