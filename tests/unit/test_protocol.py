"""The step message's wire format (:mod:`hybrid.ps.protocol`): every kind of message survives
encode and decode; a frame of another version, a short one, one with trailing data or ids that
do not match their counts is refused with ProtocolError."""

from __future__ import annotations

import pytest
import torch

from hybrid.ps.protocol import VERSION, Frame, Part, ProtocolError, Push, Rows, StepMessage, decode, encode


def _rows(n: int, tables=(0, 2)) -> Rows:
    counts = [n // 2, n - n // 2][: len(tables)]
    return Rows(list(tables), counts, torch.arange(sum(counts), dtype=torch.int64))


def _same(a: StepMessage, b: StepMessage) -> None:
    assert (a.trainer, a.autograd, len(a.parts)) == (b.trainer, b.autograd, len(b.parts))
    for p, q in zip(a.parts, b.parts):
        assert (p.collection, p.step, p.num_raw) == (q.collection, q.step, q.num_raw)
        assert (p.lookup is None) == (q.lookup is None)
        if p.lookup is not None:
            assert (p.lookup.tables, p.lookup.counts) == (q.lookup.tables, q.lookup.counts)
            assert torch.equal(p.lookup.ids, q.lookup.ids)
        assert len(p.pushes) == len(q.pushes)
        for x, y in zip(p.pushes, q.pushes):
            assert x.step == y.step and x.rows.tables == y.rows.tables and x.rows.counts == y.rows.counts
            assert torch.equal(x.rows.ids, y.rows.ids) and torch.equal(x.grad, y.grad) and x.grad.dtype == y.grad.dtype


@pytest.mark.parametrize("msg", [
    StepMessage(trainer=0, parts=[Part(7, step=3, lookup=_rows(5), num_raw=9)]),
    StepMessage(trainer=1, parts=[Part(7, pushes=[Push(2, _rows(4), torch.randn(16))])]),
    StepMessage(trainer=2, parts=[
        Part(7, step=3, lookup=_rows(6), num_raw=6, pushes=[Push(2, _rows(4), torch.randn(12)),
                                                            Push(1, _rows(2, (1,)), torch.randn(8))]),
        Part(11, step=3, lookup=_rows(0, ()), num_raw=0),
        Part(12, pushes=[Push(2, _rows(3), torch.randn(6).to(torch.bfloat16))]),
    ], autograd=True),
    StepMessage(trainer=0, parts=[]),
], ids=["lookup", "push", "both-several-parts", "empty"])
def test_every_message_kind_round_trips(msg):
    frame = encode(msg)
    assert frame.ints[0] == VERSION
    _same(decode(Frame(list(frame.ints), list(frame.tensors))), msg)


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
    with pytest.raises(ProtocolError, match="ids of 5 torch.int32"):
        decode(Frame(frame.ints, [torch.arange(5, dtype=torch.int32)]))
    with pytest.raises(ProtocolError, match="does not fit"):
        decode(Frame([VERSION, 0, 0, 1, 7, 3, 9, 1, 1000], frame.tensors))
