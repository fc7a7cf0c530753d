"""The shared-memory channel's two ends in one process (real files in /dev/shm, real FIFOs and a
real server thread; no RPC): messages cross intact, errors and silence come back as errors
naming the server, a dead end is noticed at once, and what does not fit or would overlap goes
back to the caller (who sends it over RPC)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from hybrid.ps import channel

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")


def _pair(handler, capacity=1 << 16, timeout_s=5.0):
    directory = Path(tempfile.mkdtemp(prefix="hybrid-ps-test-", dir="/dev/shm"))
    for name in ("req", "rep"):
        with open(directory / name, "wb") as f:
            f.truncate(capacity)
    for name in ("to_server", "to_trainer"):
        os.mkfifo(directory / name, 0o600)
    trainer = channel.TrainerEnd("ps7", directory, capacity, timeout_s)  # opens its read end first
    server = channel.ServerEnd(channel.ServerEnd.check_directory(str(directory)), capacity, "test-channel", handler)
    trainer.bell_out = os.open(directory / "to_server", os.O_WRONLY | os.O_NONBLOCK)
    shutil.rmtree(directory)  # both ends hold everything open
    return trainer, server


def _lookup(ids, counts=(2, 1), pushes=()):
    return channel.encode_lookup(5, 9, torch.tensor(ids), list(counts), list(pushes))


def test_a_lookup_and_its_pushes_cross_intact_and_rows_come_back():
    seen = []

    def handler(ints, tensors, reply):
        step, n_raw, ids, counts, pushes = channel.decode_lookup(ints, tensors)
        seen.append((step, n_raw, ids.clone(), counts, [(s, [(i.clone(), c, g.clone()) for i, c, g in parts])
                                                         for s, parts in pushes]))
        reply(ids.to(torch.float32) * 2)

    trainer, server = _pair(handler)
    grad = torch.randn(3, 4)
    pushes = [(3, [(torch.tensor([1, 2, 7]), [2, 1], grad)]), (4, [])]
    fut = trainer.send(*_lookup([4, 5, 6], pushes=pushes))
    assert trainer.send(*_lookup([1, 2, 3])) is None, "a second request while one is unanswered goes over RPC"
    assert fut.wait().tolist() == [8.0, 10.0, 12.0]
    step, n_raw, ids, counts, got = seen[0]
    assert (step, n_raw, ids.tolist(), counts) == (5, 9, [4, 5, 6], [2, 1])
    assert got[0][0] == 3 and got[0][1][0][0].tolist() == [1, 2, 7] and got[0][1][0][1] == [2, 1]
    assert torch.equal(got[0][1][0][2], grad.reshape(-1)) and got[1] == (4, [])
    # and the next request, in the same mapping
    assert trainer.send(*_lookup([1, 1, 1])).wait().tolist() == [2.0, 2.0, 2.0]
    trainer.close()


def test_a_request_nobody_waits_for_is_collected_by_the_next_send():
    release = threading.Event()

    def handler(ints, tensors, reply):
        _, _, ids, _, _ = channel.decode_lookup(ints, tensors)
        rows = ids.to(torch.float32)
        threading.Thread(target=lambda: (release.wait(5), reply(rows))).start()

    trainer, _ = _pair(handler)
    abandoned = trainer.send(*_lookup([7, 8, 9]))  # e.g. a prefetch discarded for another batch
    assert trainer.send(*_lookup([1, 2, 3])) is None, "its reply is not in yet: this one goes over RPC"
    release.set()
    deadline = time.monotonic() + 5
    fut = None
    while fut is None and time.monotonic() < deadline:
        fut = trainer.send(*_lookup([1, 2, 3]))
    assert fut is not None, "the channel stayed taken by a reply nobody waited for"
    assert abandoned.wait().tolist() == [7.0, 8.0, 9.0]  # and the late waiter still gets its rows
    assert fut.wait().tolist() == [1.0, 2.0, 3.0]
    trainer.close()


def test_rows_gathered_in_place_and_a_reply_from_another_thread():
    def handler(ints, tensors, reply):
        _, _, ids, _, _ = channel.decode_lookup(ints, tensors)
        out = server.rows_buffer(ids.numel())
        out.copy_(ids.to(torch.float32))
        threading.Thread(target=reply, args=(out,)).start()  # as a lookup completed by another trainer's push

    trainer, server = _pair(handler)
    assert trainer.send(*_lookup([3, 1, 2])).wait().tolist() == [3.0, 1.0, 2.0]
    trainer.close()


def test_a_server_error_comes_back_as_the_lookups_error():
    def handler(ints, tensors, reply):
        raise KeyError("ps7 holds no collection 'x'")

    trainer, _ = _pair(handler)
    with pytest.raises(RuntimeError, match="ps7 holds no collection 'x'"):
        trainer.send(*_lookup([1, 2, 3])).wait()
    trainer.close()


def test_a_silent_server_is_named_after_the_timeout_and_a_closed_one_at_once():
    trainer, server = _pair(lambda ints, tensors, reply: None, timeout_s=0.5)
    with pytest.raises(channel.ChannelError, match="ps7 did not answer within runtime.rpc_timeout_s: timeout \\(500 ms\\)"):
        trainer.send(*_lookup([1, 2, 3])).wait()
    assert trainer.send(*_lookup([1, 2, 3])) is None, "a broken channel sends nothing more"
    trainer.close()

    trainer, server = _pair(lambda ints, tensors, reply: server.close())  # as a server that died mid-request
    with pytest.raises(channel.ChannelError, match="ps7 closed the shared-memory channel: EOF"):
        trainer.send(*_lookup([1, 2, 3])).wait()
    trainer.close()


def test_a_request_too_big_for_the_mapping_is_left_to_rpc():
    trainer, _ = _pair(lambda ints, tensors, reply: reply(torch.zeros(1)), capacity=4096)
    assert trainer.send(*_lookup(list(range(1000)), counts=(1000,))) is None
    assert trainer.outstanding is None
    assert trainer.send(*_lookup([1, 2, 3])).wait().tolist() == [0.0]
    trainer.close()


def test_the_trainer_closing_its_end_stops_the_server_thread():
    trainer, server = _pair(lambda ints, tensors, reply: reply(torch.zeros(1)))
    trainer.close()
    server.thread.join(timeout=5)
    assert not server.thread.is_alive()


def test_corrupt_frames_are_refused():
    region = torch.zeros(4096, dtype=torch.uint8)
    assert channel._write_frame(region, 3, channel.LOOKUP, [1, 2], [torch.arange(4)])
    with pytest.raises(channel.ChannelError, match="sequence 3 where 4 was due"):
        channel._read_frame(region, 4)
    region[0] = 0
    with pytest.raises(channel.ChannelError, match="corrupt message"):
        channel._read_frame(region, 3)


def test_only_a_private_directory_of_this_user_under_dev_shm_is_accepted(tmp_path):
    with pytest.raises(PermissionError, match="not a private directory"):
        channel.ServerEnd.check_directory(str(tmp_path))  # not under /dev/shm
    d = Path(tempfile.mkdtemp(prefix="hybrid-ps-test-", dir="/dev/shm"))
    try:
        os.chmod(d, 0o755)
        with pytest.raises(PermissionError, match="not a private directory"):
            channel.ServerEnd.check_directory(str(d))
        os.chmod(d, 0o700)
        assert channel.ServerEnd.check_directory(str(d)) == d
        link = Path("/dev/shm") / (d.name + "-link")
        link.symlink_to(d)
        try:
            with pytest.raises(PermissionError, match="not a private directory"):
                channel.ServerEnd.check_directory(str(link))
        finally:
            link.unlink()
    finally:
        shutil.rmtree(d)


def test_runtime_option_names_a_bad_channel():
    from hybrid.launch.init import RuntimeOptions
    from hybrid.plan.errors import PlanError

    with pytest.raises(PlanError, match="ps_channel.*'shm'.*auto, rpc"):
        RuntimeOptions(ps_channel="shm")
