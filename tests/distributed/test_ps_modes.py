"""Async mode (staleness 1 with prefetch), weighted collections and the plain nn.EmbeddingBag
stand-in, with real processes."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybrid.launch.roles import role_of
from hybrid.ps.client import BadBatchError, make_pipeline, step
from tests.harness import run_distributed
from tests.support.remote import remote_bag, remote_of
from tests.support.sparse import global_batch, kjt_slice, make_ebc, teacher_task, sample_tables

B = 16


def _slow_channel_reads(delay_s: float) -> None:
    """This server's channel threads pick each message up ``delay_s`` late: a message a trainer
    sends through RPC meanwhile (while a prefetch's rows are outstanding) arrives first."""
    from hybrid.ps.transport import channel

    read = channel.read_frame

    def late(region, seq):
        time.sleep(delay_s)
        return read(region, seq)

    channel.read_frame = late


def _async(rank, world_size, *, num_servers, pool_on, slow_channel=False):
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        if slow_channel:
            _slow_channel_reads(0.02)
        return None
    tables = sample_tables()
    ebc = make_ebc(seed=0)
    pipeline = make_pipeline(trainer=role.index, num_servers=num_servers, staleness=1)
    remote = remote_of(ebc, pipeline, cid="a", num_servers=num_servers, optimizer={"name": "adagrad", "lr": 0.3},
                       trainer=role.index, num_trainers=role.num_trainers, staleness=1, pool_on=pool_on)
    dist.barrier()
    # A learnable task: the target is a fixed function of the ids.
    batch, head, opt = teacher_task(tables, trainer=role.index, num_trainers=role.num_trainers, batch=B)

    losses = []
    nxt = batch(0)
    for s in range(60):
        kjt, y = nxt
        with step(pipeline, optimizer=opt) as st:
            out = remote(kjt)
            nxt = batch(s + 1)
            st.prefetch(nxt[0])  # the next step's rows travel while this one computes
            loss = ((head(out.values()).squeeze(1) - y) ** 2).mean()
            st.backward(loss)
        losses.append(loss.item())
    pipeline.flush()
    dist.barrier()
    stats = None
    if role.index == 0:
        # Each trainer's last prefetch (of a step never run) may still be on its way: it is
        # not part of any step, so nothing waited for it. Give it a moment to be answered.
        deadline = time.monotonic() + 10
        while (stats := remote.stats())["ps0"]["answered"] < 2 * 61 and time.monotonic() < deadline:
            time.sleep(0.05)
    pipeline.close()
    return losses, stats


@pytest.mark.parametrize("pool_on,slow_channel", [("trainer", False), ("server", False), ("server", True)],
                         ids=["trainer", "server", "server-slow-channel"])
def test_async_staleness_one_trains_and_never_reads_rows_older_than_k(pool_on, slow_channel):
    """With a slow channel, each trainer's last push (sent by ``flush`` over RPC while its last
    prefetch is on the channel) reaches the server first: the server still handles the prefetch
    (with the push it carries) before it, so the last lookups are answered and counted."""
    out = run_distributed(_async, 3, setup="hybrid", num_servers=1, timeout=150, pool_on=pool_on,
                          slow_channel=slow_channel)
    for losses, _ in out[:2]:
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        assert last < 0.5 * first, (first, last)
    stats = out[0][1]["ps0"]
    assert stats["max_lag"] <= 1, stats
    assert stats["lookups"] == stats["answered"] == 2 * 61  # 60 steps and one prefetched lookup per trainer


def _weighted_and_bag(rank, world_size):
    if rank == 1:
        return None
    ebc = make_ebc(seed=3, weighted=True)
    pipeline = make_pipeline(trainer=0, num_servers=1, staleness=0)
    remote = remote_of(ebc, pipeline, cid="w", num_servers=1, optimizer={"name": "sgd", "lr": 1.0}, seed=3)
    kjt = kjt_slice(global_batch(0, sample_tables(), 8, weighted=True), 0, 8)
    with step(pipeline) as st:
        out = remote(kjt)
        torch.testing.assert_close(out.values(), ebc(kjt).values())
        st.backward(out.values().pow(2).sum())
    ebc(kjt).values().pow(2).sum().backward()
    expect = {t: ebc.embedding_bags[t].weight.detach() - ebc.embedding_bags[t].weight.grad
              for t in ("t0", "t1", "t2")}
    got = remote.read_tables()
    for t in expect:
        torch.testing.assert_close(got[t], expect[t], rtol=1e-6, atol=1e-6)
    # A plain nn.EmbeddingBag, 2-D and offsets forms, with per-sample weights.
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(20, 3, mode="sum")
    rbag = remote_bag(bag, pipeline, cid="bag", num_servers=1, optimizer={"name": "sgd", "lr": 0.1})
    x = torch.tensor([[1, 2, 3], [4, 4, 19]])
    psw = torch.rand(2, 3)
    with torch.no_grad():
        torch.testing.assert_close(rbag(x), bag(x))
        torch.testing.assert_close(rbag(x, per_sample_weights=psw), bag(x, per_sample_weights=psw))
        flat, offs = torch.tensor([1, 5, 5, 7]), torch.tensor([0, 1, 1])
        torch.testing.assert_close(rbag(flat, offs), bag(flat, offs))
    # Weights that require grad get it, bit for bit torch's, in a collection and a bag alike.
    kjt_w = kjt_slice(global_batch(1, sample_tables(), 8, weighted=True), 0, 8)

    def learned(kjt):
        return KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                                   weights=kjt.weights().detach().clone().requires_grad_())

    with torch.no_grad():  # the local twin as the servers' tables are now
        for t, w in remote.read_tables().items():
            ebc.embedding_bags[t].weight.copy_(w)
    ours, theirs = learned(kjt_w), learned(kjt_w)
    with step(pipeline) as st:
        st.backward(remote(ours).values().pow(3).sum())
    ebc(theirs).values().pow(3).sum().backward()
    assert ours.weights().grad is not None and torch.equal(ours.weights().grad, theirs.weights().grad)
    with torch.no_grad():  # an evaluation takes them as plain weights
        plain = KeyedJaggedTensor.from_lengths_sync(keys=kjt_w.keys(), values=kjt_w.values(), lengths=kjt_w.lengths(),
                                                    weights=kjt_w.weights().detach())
        torch.testing.assert_close(remote(learned(kjt_w)).values(), remote(plain).values())
    assert list(rbag.state_dict()) == list(bag.state_dict()) == ["weight"]
    # Gradients scaled by each id's frequency in the batch: not what the servers apply, so refused.
    with pytest.raises(ValueError, match=r"nn\.EmbeddingBag with scale_grad_by_freq=True is not supported"):
        remote_bag(nn.EmbeddingBag(20, 3, mode="mean", scale_grad_by_freq=True), pipeline, cid="freq", num_servers=1,
                   optimizer={"name": "sgd", "lr": 0.1})
    assert torch.equal(rbag.state_dict()["weight"], bag.weight.detach())
    psw_ours, psw_theirs = psw.clone().requires_grad_(), psw.clone().requires_grad_()
    with step(pipeline) as st:
        st.backward(rbag(x, per_sample_weights=psw_ours).pow(2).sum())
    bag(x, per_sample_weights=psw_theirs).pow(2).sum().backward()
    assert torch.equal(psw_ours.grad, psw_theirs.grad)
    # Bags pooled on the servers give no gradient to their weights: refused before anything is sent.
    on_server = remote_of(ebc, pipeline, cid="ws", num_servers=1, optimizer={"name": "sgd", "lr": 1.0}, seed=3,
                          pool_on="server")
    with pytest.raises(BadBatchError, match="pools its bags on the servers.*pool_on: trainer"):
        with step(pipeline) as st:
            st.backward(on_server(learned(kjt_w)).values().sum())
    with step(pipeline) as st:  # detached, they are taken
        st.backward(on_server(kjt_w).values().sum())
    pipeline.close()
    return True


def test_weighted_collection_and_plain_embedding_bag_match_local():
    assert run_distributed(_weighted_and_bag, 2, setup="hybrid", num_servers=1, timeout=90)[0]


def _position_weighted(rank, world_size, *, transport, push="rpc"):
    """TorchRec's learned position weights (``PositionWeightedModuleCollection``) before a
    weighted collection on the servers, trained a few steps beside the same pair held locally.
    Over a socket ``pool_on: auto`` would pool on the server: the learned weights keep the
    pooling on the trainer."""
    if rank == 1:
        return None
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection

    lr = 0.1
    ebc = make_ebc(seed=5, weighted=True)
    keys = [f for t in sample_tables(mean=False) for f in t.feature_names]
    ours_pw = PositionWeightedModuleCollection({k: 4 for k in keys})
    theirs_pw = PositionWeightedModuleCollection({k: 4 for k in keys})
    pipeline = make_pipeline(trainer=0, num_servers=1, staleness=0, transport=transport, gradient_push=push)
    remote = remote_of(ebc, pipeline, cid="pw", num_servers=1, optimizer={"name": "sgd", "lr": lr}, seed=5)
    assert remote.pools_on_server == (transport == "socket" and push == "rpc")
    ours_opt = torch.optim.SGD(ours_pw.parameters(), lr=lr)
    theirs_opt = torch.optim.SGD(theirs_pw.parameters(), lr=lr)
    batches = [kjt_slice(global_batch(s, sample_tables(mean=False), B), 0, B) for s in range(6)]
    pipeline.prefetch(batches[0])  # over the socket, with bags to pool: dropped once the weights need grad
    for s, kjt in enumerate(batches):
        ours_opt.zero_grad()
        with step(pipeline) as st:
            out = remote(ours_pw(kjt))
            if s + 1 < len(batches):  # the raw batch: its weights are computed in the next forward
                st.prefetch(batches[s + 1])
            st.backward(out.values().tanh().sum())
        ours_opt.step()
        theirs_opt.zero_grad()
        ebc.zero_grad()
        ebc(theirs_pw(kjt)).values().tanh().sum().backward()
        theirs_opt.step()
        with torch.no_grad():
            for p in ebc.parameters():
                p -= lr * p.grad
    got = remote.read_tables()
    for t in got:
        torch.testing.assert_close(got[t], ebc.embedding_bags[t].weight.detach(), rtol=1e-6, atol=1e-6)
    # Each step's rows were asked for once (the first step's twice over the socket, its bags
    # dropped): the prefetched ones served the step whose forward weighted them.
    assert remote.stats()["ps0"]["lookups"] == len(batches) + (transport == "socket" and push == "rpc")
    with pytest.raises(BadBatchError, match="weighted .* holds no per-sample weights"):
        remote(batches[0])
    for k in keys:
        moved = ours_pw.position_weights[k].detach()
        assert not torch.equal(moved, torch.ones(4)), k  # learned
        torch.testing.assert_close(moved, theirs_pw.position_weights[k].detach(), rtol=1e-6, atol=1e-6)
    pipeline.close()
    return True


@pytest.mark.parametrize("transport,push", [("auto", "rpc"), ("socket", "rpc"), ("auto", "dist_autograd")])
def test_learned_position_weights_train_with_their_tables_on_a_server(transport, push):
    assert run_distributed(_position_weighted, 2, setup="hybrid", num_servers=1, timeout=90, transport=transport,
                           push=push)[0]
