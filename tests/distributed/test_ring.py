"""The trainers' all-reduce ring (:mod:`hybrid.dense.ring`) on real processes: what it sums, in
which order, DDP through it, and how it fails."""

from __future__ import annotations

import gc
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from hybrid import ops
from hybrid.dense import ring as ring_mod
from hybrid.dense.ddp import apply_ddp
from tests.distributed.test_dense import B, DDPOpts, build, data, make_opt
from tests.harness import run_distributed

pytestmark = pytest.mark.skipif(not ops.AVAILABLE, reason="hybrid._C is not built")

SIZES = (1, 2, 3, 7, 1000, 56_609)


def _inputs(world_size: int, n: int) -> list[torch.Tensor]:
    """Every rank's buffer: magnitudes over six decades, so that the order of a sum shows."""
    g = torch.Generator().manual_seed(n)
    return [torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 4, (n,), generator=g).float()
            for _ in range(world_size)]


def ring_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """Chunk ``c`` of ``N`` (elements ``[n c / N, n (c + 1) / N)``) summed from rank ``c`` on
    around the ring: ``x[c+k] + (... + (x[c+1] + x[c]))``."""
    size, n = len(xs), xs[0].numel()
    out = torch.empty(n)
    for c in range(size):
        b, e = n * c // size, n * (c + 1) // size
        acc = xs[c][b:e].clone()
        for k in range(1, size):
            acc = xs[(c + k) % size][b:e] + acc
        out[b:e] = acc
    return out


def _sums(rank: int, world_size: int):
    ring_mod.configure(dist.group.WORLD, address="127.0.0.1", timeout_s=30)
    ring = ring_mod.ring_of(dist.group.WORLD)
    other = dist.new_group(list(range(world_size)))
    out = []
    for n in SIZES:
        x = _inputs(world_size, n)[rank]
        a, b = x.clone(), (2 * x).clone()
        fa, fb = ring.allreduce_(a), ring.allreduce_(b)  # two queued before either is waited for
        assert fb.wait() is b and fa.wait() is a
        out.append((a, b))
    calls = ring.calls
    ring_mod.close_all()
    return out, calls, ring_mod.ring_of(other) is None


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_sums_in_ring_order_and_every_trainer_gets_the_same_bits(world_size):
    results = run_distributed(_sums, world_size, timeout=60)
    for k, n in enumerate(SIZES):
        xs = _inputs(world_size, n)
        want_a, want_b = ring_order_sum(xs), ring_order_sum([2 * x for x in xs])
        if world_size == 2:
            assert torch.equal(want_a, xs[0] + xs[1])
        for rank, (out, calls, other_has_none) in enumerate(results):
            got_a, got_b = out[k]
            assert torch.equal(got_a, want_a), (n, rank)
            assert torch.equal(got_b, want_b), (n, rank)
            assert calls == 2 * len(SIZES) and other_has_none
    if world_size == 3:  # the order is the ring's: not what a left-to-right sum gives
        xs = _inputs(3, 56_609)
        assert not torch.equal(ring_order_sum(xs), xs[0] + xs[1] + xs[2])


def _ddp(rank: int, world_size: int, *, steps: int):
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, group, dtype, cap in (("gloo", None, torch.float32, 25.0), ("ring", dist.group.WORLD, torch.float32, 25.0),
                                    ("gloo64", None, torch.float64, 25.0), ("ring64", dist.group.WORLD, torch.float64, 25.0),
                                    ("gloo_small", None, torch.float32, 1e-4), ("ring_small", dist.group.WORLD, torch.float32, 1e-4)):
        ring_mod.configure(group, address="127.0.0.1", timeout_s=30)
        model = build().to(dtype)
        apply_ddp(model, "", mesh=mesh, options=DDPOpts(bucket_cap_mb=cap), on_launch=None)
        opt = make_opt("sgd", model.parameters())
        for s in range(steps):
            x, y = (t.to(dtype) for t in data(s, world_size * B))
            opt.zero_grad()
            F.mse_loss(model(x[rank * B:(rank + 1) * B]), y[rank * B:(rank + 1) * B]).backward()
            opt.step()
        ring = ring_mod.ring_of(mesh.get_group())
        out[name] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, ring.calls if ring else None)
        ring_mod.configure(None, address="127.0.0.1", timeout_s=30)
    return out


def test_ddp_through_the_ring_trains_the_same_bits_as_through_gloo():
    """Two trainers, five steps of DDP (one bucket a step): the ring's mean is gloo's, bit for bit,
    and the ring is what DDP used (one all-reduce a step); with a bucket per parameter (several
    all-reduces queued in a backward, in DDP's order) the same; a float64 model's bucket, which the ring does not
    sum, goes through the process group from the same hook."""
    for out in run_distributed(_ddp, 2, timeout=60, steps=5):
        for a, b in (("gloo", "ring"), ("gloo64", "ring64"), ("gloo_small", "ring_small")):
            gloo, ring = out[a], out[b]
            # DDP sizes the buckets of its first step and of the later ones its own way: with a
            # tiny cap there are several a step.
            want = {"ring": 5, "ring64": 0}.get(b)
            assert gloo[1] is None and (ring[1] == want if want is not None else ring[1] > 10), (b, ring[1])
            assert gloo[0].keys() == ring[0].keys()
            assert all(torch.equal(gloo[0][k], ring[0][k]) for k in gloo[0])
        assert all(v.dtype == torch.float64 for v in out["ring64"][0].values())


def _peer_fails(rank: int, world_size: int, *, how: str):
    ring_mod.configure(dist.group.WORLD, address="127.0.0.1", timeout_s=2.0)
    ring = ring_mod.ring_of(dist.group.WORLD)
    if rank == 1:
        if how == "hangs":
            time.sleep(4.0)  # never takes part, for longer than the timeout
        ring_mod.close_all()  # its connections end as a dead process's do
        return None
    if how == "dies":
        time.sleep(0.5)
    errors = []
    for _ in range(2):
        started = time.monotonic()
        try:
            ring.allreduce_(torch.ones(1000)).wait()
        except RuntimeError as e:
            errors.append((str(e), time.monotonic() - started))
    ring_mod.close_all()
    return errors


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_dead_or_hung_trainer_fails_the_all_reduce_naming_it(how):
    errors = run_distributed(_peer_fails, 2, timeout=60, how=how)[0]
    assert len(errors) == 2, errors
    (first, took), (again, took_again) = errors
    assert first.startswith("ddp all-reduce: ") and "trainer1 (127.0.0.1:" in first, first
    if how == "dies":
        assert "closed its connection" in first or "failed" in first, first
        assert took < 1.0
    else:
        assert "sent nothing for 2 s (runtime.pg_timeout_s)" in first, first
        assert 1.9 < took < 3.5
    assert again == first and took_again < 0.1  # the ring stays failed, and says why at once


def _close_in_flight(rank: int, world_size: int):
    ring_mod.configure(dist.group.WORLD, address="127.0.0.1", timeout_s=30)
    ring = ring_mod.ring_of(dist.group.WORLD)
    if rank == 1:
        time.sleep(1.0)  # takes no part; rank 0's all-reduce is in flight meanwhile
        ring_mod.close_all()
        return None
    fut = ring.allreduce_(torch.ones(1000))
    time.sleep(0.2)
    started = time.monotonic()
    # The ring's last reference dropped, not closed: its destructor closes it, holding the GIL,
    # while the ring's thread is in the all-reduce.
    ring_mod._RINGS.clear()
    del ring
    gc.collect()
    took = time.monotonic() - started
    try:
        fut.wait()
    except RuntimeError as e:
        return took, str(e)
    return took, None


def test_dropping_a_ring_with_an_all_reduce_in_flight_fails_it_and_returns():
    """The ring's thread drops the failed all-reduce's Python value, which needs the GIL that a
    destructor run from Python holds: closing lets go of it while it waits for the thread."""
    took, error = run_distributed(_close_in_flight, 2, timeout=60)[0]
    assert took < 5.0 and error is not None and error.startswith("ddp all-reduce: "), (took, error)


def test_the_listener_takes_only_the_connection_with_the_token_and_rank():
    """Set-up: a connection that does not send the trainer's token and rank is dropped; the
    right one is taken; none within the timeout is an error naming the trainer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    token = b"t" * ring_mod.TOKEN_BYTES

    def clients():
        for payload in (b"x" * 40, token + ring_mod._HELLO.pack(5), token + ring_mod._HELLO.pack(1)):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(payload)
            kept.append(c)

    kept: list[socket.socket] = []
    t = threading.Thread(target=clients)
    t.start()
    conn = ring_mod._accept(listener, token, 1, time.monotonic() + 10, "trainer1", 10)
    t.join()
    assert conn.getpeername() == kept[2].getsockname()
    for c in (conn, *kept):
        c.close()
    with pytest.raises(RuntimeError, match=r"ddp all-reduce: trainer1 did not connect within runtime.pg_timeout_s \(0.3 s\)"):
        ring_mod._accept(listener, token, 1, time.monotonic() + 0.3, "trainer1", 0.3)
    listener.close()


def test_the_ring_refuses_a_buffer_it_cannot_sum():
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    ring = torch.classes.hybrid.Ring(0, 2, a.detach(), c.detach(), 1.0, "trainer1 (left)", "trainer1 (right)")
    try:
        for bad, what in ((torch.ones(4, dtype=torch.float64), "Double"), (torch.ones(4, 2).t(), "not contiguous")):
            with pytest.raises(RuntimeError, match=f"contiguous float32 CPU tensor, got .*{what}"):
                torch.ops.hybrid.ring_allreduce_(ring, bad, torch.futures.Future())
    finally:
        ring.close()
        b.close()
        d.close()
