"""The step message's wire format (:mod:`hybrid.ps.protocol`): every kind of message survives
encode and decode; a frame of another version, a short one, one with trailing data or ids that
do not match their counts is refused with ProtocolError."""

from __future__ import annotations

import pytest
import torch

from hybrid.ps.protocol import (VERSION, BagGroup, Bags, Frame, Part, ProtocolError, Push, Rows, StepMessage, decode,
                                encode)


def _rows(n: int, tables=(0, 2)) -> Rows:
    counts = [n // 2, n - n // 2][: len(tables)]
    return Rows(list(tables), counts, torch.arange(sum(counts), dtype=torch.int64))


def _same(a: StepMessage, b: StepMessage) -> None:
    head = lambda m: (m.trainer, m.autograd, m.stream, m.seq, len(m.parts))  # noqa: E731
    assert head(a) == head(b)
    for p, q in zip(a.parts, b.parts):
        assert (p.collection, p.step, p.num_raw) == (q.collection, q.step, q.num_raw)
        assert (p.lookup is None) == (q.lookup is None)
        if p.lookup is not None:
            assert (p.lookup.tables, p.lookup.counts) == (q.lookup.tables, q.lookup.counts)
            assert torch.equal(p.lookup.ids, q.lookup.ids)
        assert (p.bags is None) == (q.bags is None)
        if p.bags is not None:
            assert p.bags.tag == q.bags.tag and len(p.bags.groups) == len(q.bags.groups)
            for g, h in zip(p.bags.groups, q.bags.groups):
                assert (g.rows, g.dim, g.mean) == (h.rows, h.dim, h.mean)
                assert g.features == h.features
                for name in ("idx", "offsets", "weights"):
                    a, b = getattr(g, name), getattr(h, name)
                    assert (a is None and b is None) or torch.equal(a, b), name
        assert len(p.pushes) == len(q.pushes)
        for x, y in zip(p.pushes, q.pushes):
            assert x.tag == y.tag
            assert x.step == y.step and x.rows.tables == y.rows.tables and x.rows.counts == y.rows.counts
            assert torch.equal(x.rows.ids, y.rows.ids) and torch.equal(x.grad, y.grad) and x.grad.dtype == y.grad.dtype


def _group(rows: int, bags: int, *, mean: bool = False, weighted: bool = False) -> BagGroup:
    """A bag group of ``rows`` rows of dim 4, one id per row plus one, in ``bags`` bags of one
    feature."""
    n = rows + 1
    idx = torch.cat([torch.arange(rows), torch.zeros(1, dtype=torch.int64)]).to(torch.int32)
    offsets = torch.linspace(0, n, bags + 1).round().to(torch.int32)
    return BagGroup(rows=rows, dim=4, mean=mean, features=1, idx=idx, offsets=offsets,
                    weights=torch.rand(n) if weighted else None)


NO_ROWS = Rows([], [], torch.empty(0, dtype=torch.int64))


@pytest.mark.parametrize("msg", [
    StepMessage(trainer=0, parts=[Part(7, step=3, lookup=_rows(5), num_raw=9)]),
    StepMessage(trainer=1, parts=[Part(7, step=4, lookup=_rows(6), num_raw=9,
                                       bags=Bags(12, [_group(3, 2, weighted=True), _group(3, 4, mean=True),
                                                      _group(0, 1)]),
                                       pushes=[Push(3, NO_ROWS, torch.randn(8), tag=11)])]),
    StepMessage(trainer=1, parts=[Part(7, pushes=[Push(2, _rows(4), torch.randn(16))])]),
    StepMessage(trainer=2, parts=[
        Part(7, step=3, lookup=_rows(6), num_raw=6, pushes=[Push(2, _rows(4), torch.randn(12)),
                                                            Push(1, _rows(2, (1,)), torch.randn(8))]),
        Part(11, step=3, lookup=_rows(0, ()), num_raw=0),
        Part(12, pushes=[Push(2, _rows(3), torch.randn(6).to(torch.bfloat16))]),
    ], autograd=True),
    StepMessage(trainer=0, parts=[]),
    StepMessage(trainer=3, parts=[Part(7, pushes=[Push(2, _rows(4), torch.randn(16))])], stream=2**62 + 5, seq=41),
], ids=["lookup", "pooled", "push", "both-several-parts", "empty", "numbered"])
def test_every_message_kind_round_trips(msg):
    frame = encode(msg)
    assert frame.ints[0] == VERSION
    _same(decode(Frame(list(frame.ints), list(frame.tensors))), msg)


@pytest.mark.parametrize("ids, wire", [
    ([0, 5, 2**31 - 1, 7], torch.int32),
    ([-2**31, 0, 3, 1], torch.int32),
    ([0, 2**31, 1, 2], torch.int64),
    ([-2**31 - 1, 0, 1, 2], torch.int64),
    ([2**62 + 9, -5, 1, 2], torch.int64),
], ids=["int32-top", "int32-bottom", "above-int32", "below-int32", "raw-hashed"])
def test_ids_travel_as_int32_where_they_fit_and_come_back_as_the_same_int64(ids, wire):
    """A lookup's and a push's ids go on the wire in 4 bytes each when every id of the tensor
    fits, in 8 otherwise; either way they decode to the same int64 ids."""
    rows = Rows([0, 2], [2, 2], torch.tensor(ids, dtype=torch.int64))
    msg = StepMessage(trainer=0, parts=[Part(7, step=3, lookup=rows, num_raw=4,
                                             pushes=[Push(2, rows, torch.randn(8))])])
    frame = encode(msg)
    assert [t.dtype for t in frame.tensors] == [wire, wire, torch.float32]
    back = decode(Frame(list(frame.ints), list(frame.tensors)))
    _same(back, msg)
    assert back.parts[0].lookup.ids.dtype == torch.int64 and back.parts[0].pushes[0].rows.ids.dtype == torch.int64


def test_another_version_a_short_frame_trailing_data_and_bad_ids_are_refused():
    frame = encode(StepMessage(trainer=0, parts=[Part(7, step=3, lookup=_rows(5), num_raw=9)]))
    with pytest.raises(ProtocolError, match=f"protocol version {VERSION + 1}; this server speaks version {VERSION}"):
        decode(Frame([VERSION + 1, *frame.ints[1:]], frame.tensors))
    with pytest.raises(ProtocolError, match="ends early|does not fit"):
        decode(Frame(frame.ints[:-2], frame.tensors))
    with pytest.raises(ProtocolError, match="ends early"):
        decode(Frame(frame.ints, []))
    with pytest.raises(ProtocolError, match="trailing data"):
        decode(Frame([*frame.ints, 0], frame.tensors))
    with pytest.raises(ProtocolError, match="ids of 4 torch.int64 for counts summing to 5"):
        decode(Frame(frame.ints, [torch.arange(4)]))
    with pytest.raises(ProtocolError, match="ids of 5 torch.int16"):
        decode(Frame(frame.ints, [torch.arange(5, dtype=torch.int16)]))
    with pytest.raises(ProtocolError, match="does not fit"):
        decode(Frame([VERSION, 0, 0, 0, 0, 1, 7, 3, 9, 1, 1000], frame.tensors))


def test_bag_groups_whose_tensors_disagree_are_refused():
    good = _group(3, 2, weighted=True)
    msg = StepMessage(trainer=0, parts=[Part(7, step=3, lookup=_rows(6), bags=Bags(0, [good]))])
    frame = encode(msg)
    decode(frame)
    for k, bad, match in [(1, good.idx.long(), "idx of torch.int64, 1-d; expected 1-d int32"),
                          (3, good.weights[:-1], "weights of 3 torch.float32 for 4 ids")]:
        tensors = list(frame.tensors)
        tensors[k] = bad
        with pytest.raises(ProtocolError, match=match):
            decode(Frame(frame.ints, tensors))
    ints = list(frame.ints)
    assert ints[-3] == good.features  # ..., features, weighted, then the part's number of pushes
    ints[-3] = 3  # 2 bags are not whole samples of 3 features
    with pytest.raises(ProtocolError, match="2 bags for 3 features a sample"):
        decode(Frame(ints, frame.tensors))
