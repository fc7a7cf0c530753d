"""The frame channels' two ends in one process -- shared memory (real memfd files and pipes, the
server's end opening them through /proc) and a TCP step connection (a real connected socket) --
with the server's real thread and a real :class:`ParameterServer` holding a collection; no RPC:
step messages cross intact and are answered with the rows, errors and silence come back as errors naming the server, a dead end is
noticed at once, and what cannot go through the channel goes to the fallback transport (RPC in a
job). The TCP listener takes only a connection that brings its token."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from hybrid.ps.config import CollectionConfig, OptimizerSpec, collection_handle
from hybrid.ps.protocol import Part, Push, Rows, StepMessage, encode
from hybrid.ps.server import service
from hybrid.ps.sharding import TableSpec, shard_tables
from hybrid.ps.transport import LocalTransport
from hybrid.ps.transport import channel, shm, tcp
from hybrid.ps.transport.shm import ChannelError, ShmTransport, _ServerEnd
from hybrid.ps.transport.tcp import SocketTransport, _SocketServerEnd

KINDS = ["shm", "socket"]

TABLES = (TableSpec("a", 20, 2, ("fa",)), TableSpec("b", 10, 2, ("fb",)))


class _Recorder(LocalTransport):
    """The fallback: records what the channel handed over and hands it to the server in this
    process as RPC would (encoded, decoded, through ``rpc_step``)."""

    def __init__(self) -> None:
        super().__init__("ps0")
        self.sent: list[StepMessage] = []

    def deliver(self, msg: StepMessage):
        self.sent.append(msg)
        return super().deliver(msg)


@pytest.fixture
def server():
    srv = service.start(0, service.ServerOptions(huge_pages=False))
    config = CollectionConfig(cid="c", tables=TABLES, layouts=tuple(shard_tables(list(TABLES), 1, "table_wise")),
                              optimizer=OptimizerSpec(name="sgd", lr=1.0), num_trainers=1)
    srv.create(config, start_step=0, init="zeros")
    shard = srv.shard("c")
    with shard.lock:  # as the server's own writes: the background fill makes rows under this lock
        for t in shard.tables:
            t.ensure_range(0, t.rows)  # the rows are made now, not at the first lookup (over the values below)
            t.weight.copy_(torch.arange(t.weight.numel(), dtype=torch.float32).view_as(t.weight))
    return srv


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def _pair(kind: str, capacity=1 << 16, timeout_s=5.0):
    """The trainer's end, the server's end and the fallback of a fresh channel of ``kind``."""
    fallback = _Recorder()
    if kind == "socket":
        listener = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(listener.getsockname())
        conn, _ = listener.accept()
        listener.close()
        return (SocketTransport("ps0", client, capacity, fallback=fallback, timeout_s=timeout_s),
                _SocketServerEnd(conn, capacity, "test-socket"), fallback)
    made = shm._Made(capacity)  # as ShmTransport.open, the server's end opening the files as rpc_open_channel
    try:
        trainer = ShmTransport("ps0", made, capacity, fallback=fallback, timeout_s=timeout_s)
        end = _ServerEnd(shm.open_files(made.files()), capacity, "test-channel")
    finally:
        made.close()  # each end holds its own descriptors
    return trainer, end, fallback


def _lookup(step: int, ids=(1, 3, 4), pushes=()) -> StepMessage:
    rows = Rows([0, 1], [2, 1], torch.tensor(ids, dtype=torch.int64))
    return StepMessage(trainer=0, parts=[Part(collection_handle("c"), step=step, lookup=rows, num_raw=5,
                                              pushes=list(pushes))])


def test_a_lookup_and_its_push_cross_intact_and_rows_come_back(server, kind):
    trainer, _, fallback = _pair(kind)
    got = trainer.send(_lookup(0)).wait()
    # table a rows 1 and 3 (2 wide), table b row 4
    assert got[0].tolist() == [2.0, 3.0, 6.0, 7.0, 8.0, 9.0]
    grad = torch.ones(6)
    push = Push(0, Rows([0, 1], [2, 1], torch.tensor([1, 3, 4])), grad)
    got = trainer.send(_lookup(1, pushes=[push])).wait()  # step 0's push rides on step 1's lookup
    assert got[0].tolist() == [1.0, 2.0, 5.0, 6.0, 7.0, 8.0]  # read after step 0 was applied (sgd, lr 1)
    shard = server.shard("c")
    assert shard.counters.channel_lookups == 2 and shard.counters.gradients == 1 and shard.complete_through == 0
    assert fallback.sent == []
    trainer.close()


def test_a_reply_s_rows_are_used_in_place_until_the_reply_three_messages_later(server, kind):
    """No copy of a reply: its rows are views of the trainer's reply region, whose three slots
    take the replies in turn, so the rows of message n hold while n + 1's and n + 2's are used
    and are overwritten by n + 3's."""
    trainer, _, _ = _pair(kind)
    first = trainer.send(_lookup(0)).wait()[0]
    want = first.clone()
    for _ in range(2):
        later = trainer.send(_lookup(0, ids=(0, 1, 2))).wait()[0]
        assert torch.equal(first, want) and later.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    fourth = trainer.send(_lookup(0, ids=(0, 1, 2))).wait()[0]
    assert fourth.data_ptr() == first.data_ptr() and torch.equal(first, later) and not torch.equal(first, want)
    trainer.close()


def _complete_through(server, step: int) -> None:
    """As if steps through ``step`` were applied: the lookups waiting for them are answered."""
    shard = server.shard("c")
    with shard.lock:
        shard.complete_through = step
    for fn, err in shard.ready_waiters():
        fn(err)


def test_two_messages_wait_on_the_channel_and_a_third_goes_to_the_fallback(server, kind):
    """Two messages may be unanswered on the channel, each answered when it can be: a lookup
    that waits for its step is passed by the one after it. A third message while the first
    still waits for rows goes to the fallback (the first's step may need its push)."""
    trainer, _, fallback = _pair(kind)
    waiting = trainer.send(_lookup(5))  # step 5 waits for steps through 4: nobody answers it yet
    second = trainer.send(_lookup(0))
    assert fallback.sent == [] and second.wait()[0].tolist() == [2.0, 3.0, 6.0, 7.0, 8.0, 9.0]
    assert not waiting.done
    msg = _lookup(0, ids=(0, 1, 2))
    third = trainer.send(msg)
    assert fallback.sent == [msg], "it could wait forever behind the first"
    assert third.wait()[0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    _complete_through(server, 4)
    assert waiting.wait()[0].tolist() == [2.0, 3.0, 6.0, 7.0, 8.0, 9.0]
    assert trainer.send(_lookup(5)).wait()[0].numel() == 6  # the channel is free again
    assert fallback.sent == [msg] and server.shard("c").counters.channel_lookups == 3
    trainer.close()


def test_a_push_only_message_in_the_window_is_waited_for_not_passed_to_the_fallback(server, kind):
    trainer, _, fallback = _pair(kind)
    rows = Rows([0, 1], [2, 1], torch.tensor([1, 3, 4]))
    pushed = trainer.send(StepMessage(trainer=0, parts=[Part(collection_handle("c"), pushes=[Push(0, rows,
                                                                                              torch.ones(6))])]))
    waiting = trainer.send(_lookup(5))
    got = trainer.send(_lookup(1)).wait()[0]  # step 0 is applied: the push's answer came first
    assert pushed.done and fallback.sent == [] and not waiting.done
    assert got.tolist() == [1.0, 2.0, 5.0, 6.0, 7.0, 8.0]
    _complete_through(server, 4)
    assert waiting.wait()[0].tolist() == [1.0, 2.0, 5.0, 6.0, 7.0, 8.0]
    trainer.close()


def test_a_reply_nobody_waited_for_is_collected_by_the_next_send(server, kind):
    trainer, _, fallback = _pair(kind)
    abandoned = trainer.send(_lookup(0))  # e.g. a prefetch discarded for another batch
    deadline = time.monotonic() + 5
    while True:  # until the abandoned reply is in: before, a send goes to the fallback
        fut = trainer.send(_lookup(0, ids=(0, 1, 2)))
        if not fallback.sent or time.monotonic() > deadline:
            break
        fut.wait()
        fallback.sent.clear()
    assert not fallback.sent, "the channel stayed taken by a reply nobody waited for"
    assert abandoned.wait()[0].tolist() == [2.0, 3.0, 6.0, 7.0, 8.0, 9.0]  # the late waiter still gets its rows
    assert fut.wait()[0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    trainer.close()


def test_a_reply_collected_before_its_lookups_read_it_keeps_its_rows(server, kind):
    """An async step that prefetches the next batch before it reads its own rows: the next
    send collects the reply before its lookups have read it (here one of its two has), so
    when the message two on takes its half of the region, the reply keeps a copy; a reply every
    lookup has read stays a view (the test above)."""
    trainer, _, fallback = _pair(kind)
    second_part = Part(collection_handle("c"), step=0, lookup=Rows([0], [2], torch.tensor([0, 5])), num_raw=2)
    first = trainer.send(StepMessage(trainer=0, parts=[_lookup(0).parts[0], second_part]))  # two collections' lookups
    deadline = time.monotonic() + 5
    while True:  # until the first reply is in: the next send collects it, unread
        fut = trainer.send(_lookup(0, ids=(0, 1, 2)))
        if not fallback.sent or time.monotonic() > deadline:
            break
        fut.wait()
        fallback.sent.clear()
    assert not fallback.sent
    assert first.wait()[0].tolist() == [2.0, 3.0, 6.0, 7.0, 8.0, 9.0]  # the first lookup reads its rows
    fut.wait()
    for ids in ((5, 6, 7), (8, 9, 2), (1, 2, 3)):  # the last of these answers into the first reply's slot
        trainer.send(_lookup(0, ids=ids)).wait()
    assert first.wait()[1].tolist() == [0.0, 1.0, 10.0, 11.0]  # the second lookup reads its rows only now
    trainer.close()


def test_a_server_error_comes_back_as_the_message_s_error(server, kind):
    trainer, _, _ = _pair(kind)
    bad = StepMessage(trainer=0, parts=[Part(collection_handle("nope"), step=0,
                                             lookup=Rows([0], [1], torch.tensor([1])))])
    with pytest.raises(RuntimeError, match="ps0 holds no collection"):
        trainer.send(bad).wait()
    with pytest.raises(RuntimeError, match="outside this server's 20 rows of table 'a'"):
        trainer.send(_lookup(0, ids=(1, 25, 4))).wait()
    assert trainer.send(_lookup(0)).wait()[0].numel() == 6  # and the channel still works
    trainer.close()


def test_a_message_that_took_the_fallback_is_handled_after_those_still_on_the_channel(server, kind, monkeypatch):
    """Step 0's push rides on step 1's lookup through the channel, followed there by another
    lookup of step 1; step 1's push, sent while both lookups' rows are outstanding, takes the
    fallback and may reach the server first. The server handles the trainer's messages in the
    order they were sent: the lookups read the rows after step 0 only, then step 1 applies."""
    gate = threading.Event()
    read = channel.read_frame

    def held_read(region, seq):  # the server's channel thread is slow to pick the message up
        if threading.current_thread().name.startswith("test-"):
            gate.wait(5)
        return read(region, seq)

    monkeypatch.setattr(channel, "read_frame", held_read)
    trainer, _, fallback = _pair(kind)
    rows = Rows([0, 1], [2, 1], torch.tensor([1, 3, 4]))
    g0, g1 = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), torch.full((6,), 10.0)
    looked = trainer.send(_lookup(1, pushes=[Push(0, rows, g0)]))
    again = trainer.send(_lookup(1))
    pushed = trainer.send(StepMessage(trainer=0, parts=[Part(collection_handle("c"), pushes=[Push(1, rows, g1)])]))
    assert len(fallback.sent) == 1 and fallback.sent[0].parts[0].lookup is None
    shard = server.shard("c")
    deadline = time.monotonic() + 5
    while server.inbox.held_count() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.inbox.held_count() == 1 and shard.counters.gradients == 0, "step 1's push waits for step 0's"
    gate.set()
    got = looked.wait()[0]
    pushed.wait()
    start = torch.tensor([2.0, 3.0, 6.0, 7.0, 8.0, 9.0])  # table a rows 1 and 3, table b row 4 (sgd, lr 1)
    assert got.tolist() == (start - g0).tolist() and again.wait()[0].tolist() == (start - g0).tolist()
    a, b = shard.tables[0].weight, shard.tables[1].weight
    assert torch.cat([a[1], a[3], b[4]]).tolist() == (start - g0 - g1).tolist()
    assert shard.complete_through == 1 and server.inbox.held_count() == 0
    trainer.close()


def test_a_transport_numbers_its_messages_but_not_distributed_autograd_lookups(server):
    fallback = _Recorder()
    lookup = _lookup(0)
    lookup.autograd = True
    fallback.send(lookup).wait()
    fallback.send(_lookup(0)).wait()
    fallback.send(_lookup(0)).wait()
    assert [(m.stream, m.seq) for m in fallback.sent] == [(0, 0), (fallback.stream, 1), (fallback.stream, 2)]
    assert fallback.stream != _Recorder().stream


def test_a_message_whose_handing_over_raised_leaves_no_gap_in_the_stream(server):
    """A message that could not be handed over (the send raised) was never sent: the next one
    takes its number, so the server does not hold it, and every later one, for the gap."""

    class Refusing(_Recorder):
        refuse = True

        def deliver(self, msg: StepMessage):
            if self.refuse:
                self.refuse = False
                raise ConnectionError("no route to ps0")
            return super().deliver(msg)

    transport = Refusing()
    with pytest.raises(ConnectionError):
        transport.send(_lookup(0))
    got = transport.send(_lookup(0))
    assert got.done(), "held by the server for the message that was never sent"
    assert got.wait()[0].tolist() == [2.0, 3.0, 6.0, 7.0, 8.0, 9.0]
    assert [m.seq for m in transport.sent] == [1] and server.inbox.held_count() == 0


def test_rpc_messages_out_of_order_are_held_and_one_that_comes_twice_is_refused(server):
    """Two RPC threads may hand a stream's messages over in either order: the later one waits
    for the earlier; a message handled already (sent again) is refused, not applied twice."""
    rows = Rows([0, 1], [2, 1], torch.tensor([1, 3, 4]))

    def push(step: int, seq: int):
        msg = StepMessage(trainer=0, parts=[Part(collection_handle("c"), pushes=[Push(step, rows, torch.ones(6))])],
                          stream=77, seq=seq)
        frame = encode(msg)
        return service.rpc_step(frame.ints, list(frame.tensors))

    shard = server.shard("c")
    second = push(1, seq=2)
    assert not second.done() and shard.counters.gradients == 0 and server.inbox.held_count() == 1
    again = push(1, seq=2)  # while the first is held: refused at once, the first still to be handled
    assert again.done(), "the copy took the held message's place"
    with pytest.raises(RuntimeError, match="message 2 of trainer 0's stream came twice; handled once"):
        again.wait()
    assert server.inbox.held_count() == 1
    push(0, seq=1).wait()
    second.wait()
    assert shard.counters.gradients == 2 and shard.complete_through == 1 and server.inbox.held_count() == 0
    with pytest.raises(RuntimeError, match="message 1 of trainer 0's stream came twice; handled once"):
        push(0, seq=1).wait()
    assert shard.counters.gradients == 2
    assert shard.tables[0].weight[1].tolist() == [0.0, 1.0]  # 2, 3 less two steps of ones (sgd, lr 1)


def test_a_silent_server_is_named_after_the_timeout_and_a_closed_one_at_once(server, kind):
    trainer, end, fallback = _pair(kind, timeout_s=0.5)
    with pytest.raises(ChannelError, match="ps0 did not answer within runtime.rpc_timeout_s: timeout \\(500 ms\\)"):
        trainer.send(_lookup(9)).wait()  # step 9 waits for step 8, which never comes
    msg = _lookup(0)
    trainer.send(msg)
    assert fallback.sent == [msg], "a broken channel sends nothing more"
    trainer.close()

    trainer, end, fallback = _pair(kind)
    fut = trainer.send(_lookup(9))  # waits for step 8 ...
    end.close()  # ... when the server dies
    with pytest.raises(ChannelError, match=f"ps0 closed the {trainer.what}: EOF"):
        fut.wait()
    msg = _lookup(0)
    trainer.send(msg)
    assert fallback.sent == [msg]  # RPC then names the server
    trainer.close()


def test_a_server_that_closes_with_two_messages_unanswered_fails_both_naming_it(server, kind):
    trainer, end, fallback = _pair(kind)
    first, second = trainer.send(_lookup(9)), trainer.send(_lookup(8))  # both wait for steps nobody applies
    assert fallback.sent == [] and not first.done and not second.done
    end.close()
    for fut in (second, first):
        with pytest.raises(ChannelError, match=f"ps0 closed the {trainer.what}: EOF"):
            fut.wait()
    msg = _lookup(0)
    trainer.send(msg)
    assert fallback.sent == [msg]
    trainer.close()


@pytest.mark.parametrize("address", ["127.0.0.1", "::1"])
def test_the_step_listener_takes_only_the_connection_with_its_token_then_closes(server, address):
    server.options.address = address  # runtime.address: where the listener goes
    token = os.urandom(tcp.TOKEN_BYTES)
    host, port = tcp.rpc_open_socket(0, token, 1 << 16, 5.0)
    assert host == address and port
    stranger = socket.create_connection((host, port))
    stranger.sendall(b"x" * tcp.TOKEN_BYTES)
    stranger.settimeout(5)
    assert stranger.recv(1) == b"", "a connection without the token is dropped"
    stranger.close()
    sock = socket.create_connection((host, port))
    sock.sendall(token)
    trainer = SocketTransport("ps0", sock, 1 << 16, fallback=_Recorder(), timeout_s=5.0)
    assert trainer.send(_lookup(0)).wait()[0].tolist() == [2.0, 3.0, 6.0, 7.0, 8.0, 9.0]
    deadline = time.monotonic() + 5
    while any(t.name == "hybrid-ps-accept-t0" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(OSError):  # the listener is gone: nothing listens once the trainer is in
        socket.create_connection((host, port), timeout=1).close()
    trainer.close()


def test_a_failed_answer_leaves_no_kept_push_reading_the_frame(server, kind):
    """A sync push kept for the step's other trainer reads the channel's frame while its answer
    waits for the step; when another part of the message fails, the answer comes first, so the
    kept push is copied out before it: the channel's next message (which overwrites the frame)
    changes nothing of what the step applies."""
    config = CollectionConfig(cid="two", tables=TABLES, layouts=tuple(shard_tables(list(TABLES), 1, "table_wise")),
                              optimizer=OptimizerSpec(name="sgd", lr=1.0), num_trainers=2)
    server.create(config, start_step=0, init="zeros")
    shard = server.shard("two")
    with shard.lock:
        for t in shard.tables:
            t.ensure_range(0, t.rows)
    trainer, _, _ = _pair(kind)
    rows = Rows([0, 1], [2, 1], torch.tensor([1, 3, 4]))
    grad = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    bad = Push(0, rows, torch.ones(6, dtype=torch.bfloat16))  # not the collection's wire dtype: fails
    msg = StepMessage(trainer=0, parts=[
        Part(collection_handle("two"), step=1, lookup=rows, num_raw=3, pushes=[Push(0, rows, grad)]),
        Part(collection_handle("c"), step=0, pushes=[bad])])
    with pytest.raises(RuntimeError, match="wire_dtype"):
        trainer.send(msg).wait()
    assert shard.pending[0], "trainer 0's push is kept for trainer 1's"
    # The next message overwrites the frame the kept push came in.
    # The next message, laid out as the first (its gradient where the kept one lay), to other
    # collections of one trainer.
    for cid in ("one", "one-more"):
        server.create(CollectionConfig(cid=cid, tables=TABLES, layouts=config.layouts,
                                       optimizer=OptimizerSpec(name="sgd", lr=1.0), num_trainers=1),
                      start_step=0, init="zeros")
    got = trainer.send(StepMessage(trainer=0, parts=[
        Part(collection_handle("one"), step=1, lookup=rows, num_raw=3, pushes=[Push(0, rows, grad * 100)]),
        Part(collection_handle("one-more"), step=0, pushes=[Push(0, rows, grad)])])).wait()
    assert got[0].numel() == 6
    server.push(shard, 1, 0, [(rows, torch.zeros(6))])  # trainer 1's push completes step 0
    a, b = shard.tables[0].weight, shard.tables[1].weight
    assert a[1].tolist() == [-0.5, -1.0] and a[3].tolist() == [-1.5, -2.0] and b[4].tolist() == [-2.5, -3.0]
    trainer.close()


def test_a_frame_sent_from_its_tensors_is_the_frame_a_region_holds():
    """The step connection sends a frame's tensors from where they are (gathered by ``sendmsg``,
    however many calls the kernel takes): the bytes that arrive are those ``write_frame`` lays out
    in a region, for every dtype the wire carries, empty and strided tensors included."""
    from hybrid.ps.protocol import Frame
    from hybrid.ps.transport.channel import STEP, frame_pieces, write_frame

    g = torch.Generator().manual_seed(0)
    big = torch.randn(600_000, generator=g)  # 2.4 MB: more than one sendmsg takes on a socket pair
    frame = Frame([3, -1, 2**40], [torch.arange(7), big, torch.randn(5, generator=g).to(torch.bfloat16),
                                   torch.arange(9, dtype=torch.int32), torch.empty(0), torch.randn(4, 6)[:, ::2]])
    region = torch.zeros(4 << 20, dtype=torch.uint8)
    end = write_frame(region, 5, STEP, frame)
    pieces, n = frame_pieces(5, STEP, frame)
    assert n == end > big.numel() * 4
    a, b = socket.socketpair()
    a.settimeout(30), b.settimeout(30)  # never a hang: a stalled end raises instead
    got = bytearray()

    def read() -> None:
        while len(got) < 16 + n:
            got.extend(b.recv(1 << 16))

    reader = threading.Thread(target=read)
    reader.start()
    tcp._send_pieces(a, [tcp._PREFIX.pack(n, 5), *pieces])
    reader.join(timeout=30)
    a.close(), b.close()
    assert tcp._PREFIX.unpack(bytes(got[:16])) == (n, 5)
    assert bytes(got[16:]) == bytes(region[:end].numpy())


def test_the_server_refuses_channel_files_that_are_not_the_trainer_s():
    """A descriptor number that names another file in the trainer (another process in its place,
    another pid namespace) is refused, and nothing the server opened stays open: the trainer's
    messages then take another way."""
    made = shm._Made(1 << 12)
    try:
        files = made.files()
        before = sorted(os.listdir("/proc/self/fd"))
        wrong = shm.ChannelFiles(files.pid, files.fds, {**files.ids, "rep": files.ids["req"]})
        assert shm.open_files(wrong) is None
        assert shm.open_files(shm.ChannelFiles(files.pid, {**files.fds, "req": 10**6}, files.ids)) is None
        assert sorted(os.listdir("/proc/self/fd")) == before
        fds = shm.open_files(files)
        assert fds is not None and sorted(fds) == ["rep", "req", "to_server", "to_trainer"]
        for fd in fds.values():
            os.close(fd)
    finally:
        made.close()


def _reserved_bytes(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def test_shared_memory_is_reserved_as_messages_need_it(server, monkeypatch):
    """A channel holds the memory its messages needed, not its slots' whole size: each slot
    starts with a small reservation that grows (at least doubling) before a bigger message is
    written into it, in both directions."""
    monkeypatch.setattr(shm, "RESERVED_FIRST", 4096)
    capacity = 1 << 20
    trainer, end, fallback = _pair("shm", capacity)
    req, rep = trainer.req_fd, end.rep_fd
    assert _reserved_bytes(req) == 2 * 4096 and _reserved_bytes(rep) == 3 * 4096
    n = 3000  # 24 KB of ids out, 24 KB of rows back: more than a slot's first reservation
    ids = torch.arange(n, dtype=torch.int64) % 20
    msg = StepMessage(trainer=0, parts=[Part(collection_handle("c"), step=0,
                                             lookup=Rows([0, 1], [n, 0], ids), num_raw=n)])
    got = trainer.send(msg).wait()[0]
    assert fallback.sent == [] and torch.equal(got.view(n, 2)[:, 0], (ids * 2).float())
    grown_req, grown_rep = _reserved_bytes(req), _reserved_bytes(rep)
    assert 2 * 4096 < grown_req < 2 * 4096 + 64 * 1024 and 3 * 4096 < grown_rep < 3 * 4096 + 64 * 1024
    assert grown_req + grown_rep < (2 + 3) * capacity // 8
    trainer.close()


def test_a_message_without_memory_to_reserve_goes_over_the_fallback_and_its_reply_is_fetched(
        server, monkeypatch):
    """Out of memory, a request too big for its slot's reservation goes over RPC (nothing
    touches an unreserved page, which would kill the process with SIGBUS); a reply the server
    cannot reserve room for is held by the server and fetched over RPC (here: in this process)."""
    from hybrid.ps import transport

    monkeypatch.setattr(transport, "_HERE", {"ps0"})
    monkeypatch.setattr(shm, "RESERVED_FIRST", 4096)
    trainer, end, fallback = _pair("shm", 1 << 20)
    refuse = {trainer.req_fd}

    def fallocate(fd, offset, length):
        if fd in refuse:
            raise OSError(28, "No space left on device")
        return real(fd, offset, length)

    real = os.posix_fallocate
    monkeypatch.setattr(shm.os, "posix_fallocate", fallocate)
    n = 3000
    msg = StepMessage(trainer=0, parts=[Part(collection_handle("c"), step=0,
                                             lookup=Rows([0, 1], [n, 0], torch.arange(n) % 20), num_raw=n)])
    assert trainer.send(msg).wait()[0].numel() == 2 * n and fallback.sent == [msg]
    assert trainer.send(_lookup(0)).wait()[0].numel() == 6  # small ones still take the channel
    refuse.clear()
    refuse.add(end.rep_fd)
    got = trainer.send(msg).wait()[0]
    assert torch.equal(got, (torch.arange(n) % 20 * 2).repeat_interleave(2) + torch.tensor([0, 1]).repeat(n))
    assert len(fallback.sent) == 1 and channel._HELD == {}
    trainer.close()


def test_a_reply_larger_than_its_slot_is_held_by_the_server_and_fetched(server, kind, monkeypatch):
    """A lookup whose request fits its slot but whose rows do not: the server keeps the rows and
    answers that it holds them; the trainer fetches them over RPC (here: in this process), so
    the lookup gets every row. The server forgets a held reply once fetched."""
    from hybrid.ps import transport

    monkeypatch.setattr(transport, "_HERE", {"ps0"})
    tables = (TableSpec("w", 50, 16, ("f",)),)
    config = CollectionConfig(cid="wide", tables=tables, layouts=tuple(shard_tables(list(tables), 1, "table_wise")),
                              optimizer=OptimizerSpec(name="sgd", lr=1.0), num_trainers=1)
    server.create(config, start_step=0, init="zeros")
    shard = server.shard("wide")
    with shard.lock:
        shard.tables[0].ensure_range(0, 50)
        shard.tables[0].weight.copy_(torch.arange(50 * 16, dtype=torch.float32).view(50, 16))
    trainer, _, fallback = _pair(kind, 1 << 14)  # 16 KB slots: the ids (8 KB) fit, their rows (64 KB) do not
    n = 1000
    ids = torch.arange(n) % 50
    msg = StepMessage(trainer=0, parts=[Part(collection_handle("wide"), step=0, lookup=Rows([0], [n], ids),
                                             num_raw=n)])
    got = trainer.send(msg).wait()[0]
    assert torch.equal(got, (ids.unsqueeze(1) * 16 + torch.arange(16)).reshape(-1).float())
    assert trainer.send(_lookup(0)).wait()[0].tolist() == [2.0, 3.0, 6.0, 7.0, 8.0, 9.0]  # small ones as ever
    assert fallback.sent == [] and channel._HELD == {}
    trainer.close()


def test_a_large_push_sent_while_a_large_reply_comes_back_does_not_stall_the_connection(server):
    """Over TCP, a lookup whose reply is larger than the sockets' buffers and, before anyone
    waits for it, a message with a push as large: the server's thread sends the reply before it
    reads the next message, so the trainer takes replies in while it sends (else both ends
    would wait on each other for good). Both are answered, the push applied."""
    rows, dim, n = 200_000, 32, 100_000
    tables = (TableSpec("big", rows, dim, ("f",)),)
    config = CollectionConfig(cid="big", tables=tables, layouts=tuple(shard_tables(list(tables), 1, "table_wise")),
                              optimizer=OptimizerSpec(name="sgd", lr=1.0), num_trainers=1)
    server.create(config, start_step=0, init="zeros")
    trainer, _, fallback = _pair("socket", capacity=32 << 20, timeout_s=20.0)
    ids = torch.arange(n, dtype=torch.int64) * 2

    def lookup(step, pushes=()):
        return StepMessage(trainer=0, parts=[Part(collection_handle("big"), step=step, lookup=Rows([0], [n], ids),
                                                  num_raw=n, pushes=list(pushes))])

    first = trainer.send(lookup(0))  # 12.8 MB of rows come back
    sent: list = []
    push = Push(0, Rows([0], [n], ids), torch.ones(n * dim))  # 12.8 MB go out
    t = threading.Thread(target=lambda: sent.append(trainer.send(lookup(1, [push]))), daemon=True)
    t.start()
    t.join(30)
    assert sent, "the second message's send never returned"
    assert torch.equal(first.wait()[0], torch.zeros(n * dim))
    assert torch.equal(sent[0].wait()[0], torch.full((n * dim,), -1.0))  # read after step 0's push (sgd, lr 1)
    assert fallback.sent == []
    trainer.close()
