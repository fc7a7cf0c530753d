"""The messages between trainers and parameter servers: their one definition, and their encoding.

The hot path of a training step is one :class:`StepMessage` per trainer and server: for each
remote collection with something to say, one :class:`Part` carrying the gradients the trainer
owes for rows it looked up earlier (:class:`Push`) and the rows it wants now (:class:`Rows`).
The server applies the pushes, then answers once the step may read: one tensor of rows per part
(empty for a part without a lookup), in the order of the part's tables and ids, then one int64
tensor holding each part's *version*: the step through which every trainer's pushes are in its
rows (-1 for a part without a lookup, or one recorded by distributed autograd). A trainer's
hot-row cache (:mod:`hybrid.ps.client.cache`) keeps rows by it.

Ids are int64, and travel as int32 where every id of the tensor fits (:func:`_narrowed`: the
usual case, ids local to a server's shard; 4 of the 8 bytes an id takes on the wire saved), widened
back as they are read. Rows and gradients travel in their collection's ``wire_dtype``
(:class:`hybrid.ps.config.CollectionConfig`, float32 or bfloat16), which every tensor carries
with it; the layout below does not depend on it.

A collection pooled on its servers (``pool_on: server``) sends with each lookup its
:class:`Bags` -- which of the lookup's rows each of the trainer's bags sums -- and gets back
pooled bags instead of rows (one ``[bags, dim]`` block per group of tables, in group order). The
server keeps what turns the bags' gradients back into row gradients under the lookup's *tag* (a
number the trainer gives each of its lookups of the collection, increasing), and the push for it
carries only the bags' gradients and that tag.

Every transport (:mod:`hybrid.ps.transport`) carries a message as a :class:`Frame`: a flat list
of integers and a list of tensors, so the layout below is the whole wire format, versioned by
:data:`VERSION`::

    ints:    VERSION, trainer, flags, stream, seq, n_parts, then per part:
             collection, step, num_raw, has_lookup, [lookup tables, [bags]],
             n_pushes, [per push: step, tag, tables]
             where [tables] is: n, table index x n, count x n
             and [bags] is: has_bags, [tag, n_groups, per group: rows, dim, mean, features, weighted]
    tensors: per part: lookup ids (if any), per bag group: idx, offsets, [weights];
             then per push: ids, grad

Each trainer numbers its messages to a server (``stream``, ``seq``: one stream per
:class:`~hybrid.ps.transport.Transport`, ``seq`` from 1): a message may travel a frame channel
or its RPC fallback, and RPC may hand two messages to two threads, so the server handles a
stream's messages in the order they were sent whatever the way they came (a push of step ``s``
before one of ``s + 1``). ``seq`` 0: not numbered, handled as it comes (distributed-autograd
lookups: RPC records each on the thread that runs it, and they carry no pushes).

A message decoded from a transport's buffers may be a view into memory the transport reuses
for the next message: whoever keeps a tensor beyond handling the message copies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybrid.ops.reference import BagLayout

VERSION = 6
"""Bumped whenever the layout changes; a server refuses a message of another version."""

FLAG_AUTOGRAD = 1
"""The lookups are recorded by distributed autograd (``gradient_push: dist_autograd``); the
gradients come back through ``dist_autograd.backward``, not as pushes."""


class ProtocolError(RuntimeError):
    """A message that does not decode: another version, or damaged."""


@dataclass
class Rows:
    """Rows of several tables of one collection on one server."""

    tables: list[int]
    """Indices of the tables (into the collection's tables), in message order."""
    counts: list[int]
    """Ids per table."""
    ids: torch.Tensor
    """int64 row ids local to the server's shard, the tables' chunks concatenated."""

    def __post_init__(self) -> None:
        if len(self.tables) != len(self.counts):
            raise ProtocolError(f"{len(self.tables)} tables but {len(self.counts)} counts")

    def owned(self) -> Rows:
        """These rows in memory of their own (the ids may be a view into a transport's frame)."""
        return Rows(list(self.tables), list(self.counts), self.ids.clone())


@dataclass(kw_only=True)
class BagGroup(BagLayout):
    """How a server pools one group of a lookup's tables (one dimension and pooling): the
    group's rows are ``rows`` consecutive rows of the lookup, ``dim`` wide, pooled into bags as
    the :class:`BagLayout` says -- the trainer's route (:class:`hybrid.ops.reference.Route`) cut
    to this server: rows numbered within the group, bags sample by sample over the server's
    ``features`` features of the group; ``idx`` and ``offsets`` int32, ``weights`` float32 or
    None. The server works out the backward's index itself (:func:`hybrid.ops.bag_rows`)."""

    rows: int
    dim: int
    mean: bool
    features: int

    @property
    def bags(self) -> int:
        return self.offsets.numel() - 1

    def check(self) -> None:
        """:class:`ProtocolError` unless the tensors agree with each other."""
        n = self.idx.numel()
        for name in ("idx", "offsets"):
            t = getattr(self, name)
            if t.dtype != torch.int32 or t.dim() != 1:
                raise ProtocolError(f"bag group: {name} of {t.dtype}, {t.dim()}-d; expected 1-d int32")
        if self.features < 1 or self.offsets.numel() < 1 or self.bags % self.features:
            raise ProtocolError(f"bag group: {self.bags} bags for {self.features} features a sample")
        if self.weights is not None and (self.weights.dtype != torch.float32 or self.weights.numel() != n):
            raise ProtocolError(f"bag group: weights of {self.weights.numel()} {self.weights.dtype} for {n} ids")


@dataclass
class Bags:
    """A lookup pooled on its server (``pool_on: server``): its groups in the lookup's order."""

    tag: int
    groups: list[BagGroup]

    def numel(self) -> int:
        """Elements of the pooled reply."""
        return sum(g.bags * g.dim for g in self.groups)


@dataclass
class Push:
    """A trainer's gradient for the rows it received in one lookup of step ``step``."""

    step: int
    rows: Rows
    grad: torch.Tensor
    """Flat: one gradient row per id, table by table, rows of each table's width, in the
    collection's ``wire_dtype``; for a lookup pooled on the server (``tag`` >= 0), the bags'
    gradients, group by group, as the reply held the bags (``rows`` then lists nothing)."""
    tag: int = -1
    """The pooled lookup this gradient is for (its :attr:`Bags.tag`); -1: row gradients."""


@dataclass
class Part:
    """One collection's share of a message."""

    collection: int
    """The collection's handle on the receiving server (returned when it was created there)."""
    step: int = -1
    """The training step the lookup is for."""
    lookup: Rows | None = None
    """Rows wanted (None: the part only pushes)."""
    bags: Bags | None = None
    """With a lookup: pool its rows into these bags and answer the bags (None: answer the rows)."""
    num_raw: int = 0
    """Ids the trainer's batch held for this server before deduplication (for the counters)."""
    pushes: list[Push] = field(default_factory=list)
    """Gradients owed, applied before the lookup is answered."""


@dataclass
class StepMessage:
    """Everything one trainer sends one server at once."""

    trainer: int
    parts: list[Part]
    autograd: bool = False
    """See :data:`FLAG_AUTOGRAD`."""
    stream: int = 0
    """The trainer's numbered stream this message belongs to (set by the transport)."""
    seq: int = 0
    """Its number in the stream, from 1; 0: not numbered (handled as it comes)."""


@dataclass
class Frame:
    """A message as transports carry it."""

    ints: list[int]
    tensors: list[torch.Tensor]


def _tables(ints: list[int], rows: Rows) -> None:
    ints.append(len(rows.tables))
    ints.extend(rows.tables)
    ints.extend(rows.counts)


def encode(msg: StepMessage) -> Frame:
    """The frame of ``msg`` (tensors are referenced, not copied)."""
    ints = [VERSION, msg.trainer, FLAG_AUTOGRAD if msg.autograd else 0, msg.stream, msg.seq, len(msg.parts)]
    tensors: list[torch.Tensor] = []
    for p in msg.parts:
        ints += [p.collection, p.step, p.num_raw, int(p.lookup is not None)]
        if p.lookup is not None:
            _tables(ints, p.lookup)
            tensors.append(_narrowed(p.lookup.ids))
            ints.append(int(p.bags is not None))
            if p.bags is not None:
                ints += [p.bags.tag, len(p.bags.groups)]
                for g in p.bags.groups:
                    ints += [g.rows, g.dim, int(g.mean), g.features, int(g.weights is not None)]
                    tensors += [g.idx, g.offsets] + ([g.weights] if g.weights is not None else [])
        ints.append(len(p.pushes))
        for push in p.pushes:
            ints += [push.step, push.tag]
            _tables(ints, push.rows)
            tensors += [_narrowed(push.rows.ids), push.grad]
    return Frame(ints, tensors)


_INT32 = torch.iinfo(torch.int32)


def _narrowed(ids: torch.Tensor) -> torch.Tensor:
    """int64 ``ids`` as int32 where each fits (a copy, half the bytes), else as they are."""
    if ids.numel() == 0 or ids.dtype != torch.int64:
        return ids
    lo, hi = torch.aminmax(ids)
    return ids.to(torch.int32) if _INT32.min <= int(lo) and int(hi) <= _INT32.max else ids


class _Reader:
    def __init__(self, frame: Frame) -> None:
        self.ints, self.tensors = frame.ints, frame.tensors
        self.i = self.t = 0

    def int(self) -> int:
        if self.i >= len(self.ints):
            raise ProtocolError("message ends early (integers)")
        self.i += 1
        return self.ints[self.i - 1]

    def tensor(self) -> torch.Tensor:
        if self.t >= len(self.tensors):
            raise ProtocolError("message ends early (tensors)")
        self.t += 1
        return self.tensors[self.t - 1]

    def rows(self) -> Rows:
        n = self.int()
        if n < 0 or self.i + 2 * n > len(self.ints):
            raise ProtocolError(f"a table list of {n} entries does not fit the message")
        tables, counts = self.ints[self.i : self.i + n], self.ints[self.i + n : self.i + 2 * n]
        self.i += 2 * n
        ids = self.tensor()
        if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1 or ids.numel() != sum(counts):
            raise ProtocolError(f"ids of {ids.numel()} {ids.dtype} for counts summing to {sum(counts)}")
        return Rows(tables, counts, ids if ids.dtype == torch.int64 else ids.to(torch.int64))

    def bags(self) -> Bags | None:
        if not self.int():
            return None
        tag, n = self.int(), self.int()
        groups = []
        for _ in range(n):
            rows, dim, mean, features, weighted = self.int(), self.int(), bool(self.int()), self.int(), bool(self.int())
            idx, offsets = self.tensor(), self.tensor()
            weights = self.tensor() if weighted else None
            group = BagGroup(rows=rows, dim=dim, mean=mean, features=features, idx=idx, offsets=offsets,
                             weights=weights)
            group.check()
            groups.append(group)
        return Bags(tag, groups)


def decode(frame: Frame) -> StepMessage:
    """The message in ``frame``; :class:`ProtocolError` when it is not one of this version."""
    r = _Reader(frame)
    version = r.int()
    if version != VERSION:
        raise ProtocolError(f"message of protocol version {version}; this server speaks version {VERSION} "
                            f"(trainers and servers must run the same hybrid)")
    trainer, flags, stream, seq, n_parts = r.int(), r.int(), r.int(), r.int(), r.int()
    parts = []
    for _ in range(n_parts):
        part = Part(collection=r.int(), step=r.int(), num_raw=r.int())
        if r.int():
            part.lookup = r.rows()
            part.bags = r.bags()
        for _ in range(r.int()):
            step, tag = r.int(), r.int()
            rows = r.rows()
            part.pushes.append(Push(step, rows, r.tensor(), tag))
        parts.append(part)
    if r.i != len(r.ints) or r.t != len(r.tensors):
        raise ProtocolError("trailing data after the message")
    return StepMessage(trainer=trainer, parts=parts, autograd=bool(flags & FLAG_AUTOGRAD), stream=stream, seq=seq)
