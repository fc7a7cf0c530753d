"""Parameter servers with real processes: 2 trainers and 1 or 2 servers, table-wise and row-wise.

One run trains four remote collections at once -- one per server optimizer -- for 10 sync steps,
and every trainer checks, step by step, that the remote collection's output equals a local
EmbeddingBagCollection holding the reference weights, and at the end that every server row and
its optimizer state equal single-process training on the global batch.
"""

import pytest
import torch
import torch.distributed as dist

from hybrid.launch.roles import role_of
from hybrid.ps.client import BadIdError, make_pipeline, step
from tests.harness import run_distributed
from tests.support.remote import remote_of
from tests.support.sparse import (
    ReferenceSparseOptimizer,
    global_batch,
    kjt_slice,
    make_ebc,
    sample_tables,
    touched_rows,
)

OPTIMIZERS = {"sgd": 0.5, "adagrad": 0.1, "rowwise_adagrad": 0.1, "adam": 0.05}
STEPS, BATCH = 10, 6


def _loss(values: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((values @ c) ** 2).mean() + values.sum(1).mean()


def _train(rank, world_size, *, num_servers, sharding, push="rpc", prefetch=False, lookups="auto", pool_on="trainer"):
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    t_n, me = role.num_trainers, role.index
    transport = lookups.split("|")[me] if "|" in lookups else lookups  # "a|b": trainer 0's, trainer 1's
    pipeline = make_pipeline(trainer=me, num_servers=num_servers, staleness=0, gradient_push=push, transport=transport)
    tables = sample_tables()
    c = torch.linspace(-1, 1, sum(t.embedding_dim * len(t.feature_names) for t in tables))
    remotes, refs = {}, {}
    for name, lr in OPTIMIZERS.items():
        ebc = make_ebc(seed=0)
        remotes[name] = remote_of(ebc, pipeline, cid=name, num_servers=num_servers, sharding=sharding,
                                  optimizer={"name": name, "lr": lr}, trainer=me, num_trainers=t_n, pool_on=pool_on)
        ref = make_ebc(seed=0)
        refs[name] = (ref, {t.name: ReferenceSparseOptimizer(name, ref.embedding_bags[t.name].weight.data, lr=lr)
                            for t in tables})
    dist.barrier()
    max_fwd_err = 0.0
    nxt = None
    for s in range(STEPS):
        data = global_batch(s, tables, t_n * BATCH)
        kjt = nxt if nxt is not None else kjt_slice(data, me * BATCH, (me + 1) * BATCH)
        with step(pipeline) as st:
            outs = {n: r(kjt) for n, r in remotes.items()}
            if prefetch and s + 1 < STEPS:
                # Sync prefetch: the next rows are asked for with this step's push and read once
                # every trainer's step is applied (checked by the next step's comparison).
                nxt = kjt_slice(global_batch(s + 1, tables, t_n * BATCH), me * BATCH, (me + 1) * BATCH)
                st.prefetch(nxt)
            for n, out in outs.items():
                local = refs[n][0](kjt).values()
                torch.testing.assert_close(out.values(), local, rtol=1e-6, atol=1e-6)
                max_fwd_err = max(max_fwd_err, float((out.values() - local).abs().max()))
                assert out.keys() == refs[n][0](kjt).keys()
            st.backward(sum(_loss(o.values(), c) for o in outs.values()))
        # The reference: one process, the global batch, the same loss (a mean over all samples).
        gkjt = kjt_slice(data, 0, t_n * BATCH)
        touched = touched_rows(data, tables)
        for n, (ref, opts) in refs.items():
            ref.zero_grad()
            _loss(ref(gkjt).values(), c).backward()
            for t in tables:
                opts[t.name].step(ref.embedding_bags[t.name].weight.grad, touched[t.name])
    pipeline.flush()
    dist.barrier()  # every trainer's last push is in, so the last step is applied everywhere
    result = {"max_fwd_err": max_fwd_err, "pools_on_server": {n: r.pools_on_server for n, r in remotes.items()}}
    if me == 0:
        for n, weights in _equal_to_reference(remotes, refs, tables).items():
            result[n] = remotes[n].stats()
            # The tables did move: the comparison is not trivially true.
            assert not torch.equal(weights["t0"], make_ebc(seed=0).embedding_bags["t0"].weight.data)
    pipeline.close()
    return result


def _equal_to_reference(remotes, refs, tables, where: str = "") -> dict[str, dict[str, torch.Tensor]]:
    """Every remote collection's rows and optimizer state equal its one-process reference's
    (``refs``: collection -> (local collection, per-table reference optimizer)); the rows read."""
    out = {}
    for n, remote in remotes.items():
        weights, states = remote.read_tables(with_state=True)
        ref, opts = refs[n]
        for t in tables:
            torch.testing.assert_close(weights[t.name], ref.embedding_bags[t.name].weight.data,
                                       rtol=1e-6, atol=1e-6, msg=lambda m: f"{where} {n} {t.name}: {m}")
            for k, v in opts[t.name].state.items():
                torch.testing.assert_close(states[t.name][k], v, rtol=1e-6, atol=1e-6,
                                           msg=lambda m: f"{where} {n} {t.name} state {k}: {m}")
        out[n] = weights
    return out


@pytest.mark.parametrize(
    "num_servers,sharding,push,prefetch,lookups,pool_on",
    [(1, "row_wise", "rpc", False, "auto", "trainer"), (2, "table_wise", "rpc", False, "auto", "trainer"),
     (2, "row_wise", "rpc", True, "auto", "trainer"), (2, "row_wise", "rpc", True, "rpc", "trainer"),
     (2, "row_wise", "rpc", True, "socket", "trainer"), (2, "row_wise", "dist_autograd", False, "auto", "trainer"),
     (2, "table_wise", "rpc", True, "auto", "server"), (1, "row_wise", "rpc", False, "socket", "server"),
     (2, "table_wise", "rpc", True, "rpc", "server"), (1, "row_wise", "rpc", True, "socket|auto", "auto")],
)
def test_sync_training_equals_single_process_for_every_optimizer(num_servers, sharding, push, prefetch, lookups,
                                                                 pool_on):
    """``lookups``: ``runtime.ps_transport`` -- auto, through shared memory (every server is on
    this host); socket, over a TCP step connection; rpc, over TensorPipe; under the dist_autograd
    push always RPC. ``pool_on: server``: the servers pool the bags (two servers table-wise:
    a group of tables of one dimension and pooling spread over both). ``socket|auto`` with
    ``pool_on: auto``: trainer 0 reaches the server over TCP and has it pool its bags, trainer 1
    through shared memory and pools its own -- one step, both kinds of push."""
    out = run_distributed(_train, 2 + num_servers, setup="hybrid", num_servers=num_servers, timeout=180,
                          sharding=sharding, push=push, prefetch=prefetch, lookups=lookups, pool_on=pool_on)
    stats = out[0]
    want = {"trainer": [False, False], "server": [True, True], "auto": [True, False]}[pool_on]  # auto: socket|auto
    assert [set(out[k]["pools_on_server"].values()) for k in (0, 1)] == [{want[0]}, {want[1]}], out[:2]
    for name in OPTIMIZERS:
        per_server = stats[name]
        for server, st in per_server.items():
            # One step message per server per step per trainer, however many tables and features.
            assert st["lookups"] == STEPS * 2, (server, st)
            assert st["gradients"] == STEPS * 2, (server, st)
            if push == "rpc" and prefetch:
                # Every push but each trainer's last went out with the next step's prefetched
                # lookup, in one message; the last went alone.
                assert st["push_messages"] == 2, (server, st)
            else:
                # Sync without a prefetch: each push goes at once, alone, so the step is applied
                # before the next lookup arrives (dist_autograd: the backward delivers each).
                assert st["push_messages"] == STEPS * 2, (server, st)
            assert st["updates_applied"] == STEPS, (server, st)
            via_channel = push == "rpc" and lookups in ("auto", "socket", "socket|auto")
            assert st["channel_lookups"] == (STEPS * 2 if via_channel else 0), (server, st)
            assert st["complete_through"] == STEPS - 1
            # Only deduplicated rows cross the wire: never anything table-sized.
            assert st["rows_served"] <= st["ids_requested"]
            assert st["bytes_out"] < STEPS * 2 * sum(4 * t.num_embeddings * t.embedding_dim for t in sample_tables())
        if pool_on == "server":
            # What the servers sent is the bags, pooled: every sample's features once, float32.
            bag_bytes = BATCH * sum(4 * t.embedding_dim * len(t.feature_names) for t in sample_tables())
            assert sum(st["bytes_out"] for st in per_server.values()) == STEPS * 2 * bag_bytes, per_server


def _train_twice(rank, world_size, *, num_servers, push):
    """Two collections on both servers; each step looks one up on two batches and the other once."""
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    t_n, me = role.num_trainers, role.index
    pipeline = make_pipeline(trainer=me, num_servers=num_servers, staleness=0, gradient_push=push)
    tables = sample_tables()
    c = torch.linspace(-1, 1, sum(t.embedding_dim * len(t.feature_names) for t in tables))
    uses = {"adagrad": 2, "rowwise_adagrad": 1}  # collection -> its lookups a step
    remotes, refs = {}, {}
    for name, n in uses.items():
        remotes[name] = remote_of(make_ebc(seed=0), pipeline, cid=name, num_servers=num_servers, sharding="row_wise",
                                  optimizer={"name": name, "lr": OPTIMIZERS[name]}, trainer=me, num_trainers=t_n)
        ref = make_ebc(seed=0)
        refs[name] = (ref, {t.name: ReferenceSparseOptimizer(name, ref.embedding_bags[t.name].weight.data,
                                                             lr=OPTIMIZERS[name]) for t in tables})
    dist.barrier()
    for s in range(STEPS):
        batches = [global_batch(s, tables, t_n * BATCH), global_batch(s, tables, t_n * BATCH, seed=3000)]
        kjts = [kjt_slice(d, me * BATCH, (me + 1) * BATCH) for d in batches]
        with step(pipeline) as st:
            st.backward(sum(_loss(remotes[name](kjts[k]).values(), c) for name, n in uses.items() for k in range(n)))
        for name, n in uses.items():
            ref, opts = refs[name]
            ref.zero_grad()
            sum(_loss(ref(kjt_slice(d, 0, t_n * BATCH)).values(), c) for d in batches[:n]).backward()
            touched = [touched_rows(d, tables) for d in batches[:n]]
            for t in tables:
                opts[t.name].step(ref.embedding_bags[t.name].weight.grad,
                                  torch.stack([m[t.name] for m in touched]).any(0))
    pipeline.flush()
    dist.barrier()
    result = None
    if me == 0:
        for weights in _equal_to_reference(remotes, refs, tables, where=push).values():
            assert not torch.equal(weights["t0"], make_ebc(seed=0).embedding_bags["t0"].weight.data)
        result = {name: remote.stats() for name, remote in remotes.items()}
    pipeline.close()
    return result


@pytest.mark.parametrize("push", ["rpc", "dist_autograd"])
def test_a_collection_looked_up_twice_in_a_step_pushes_once_a_step(push):
    """One collection looked up on two batches in each step, another once, both row-wise on two
    servers: the tables and optimizer states equal one process training on the global batches,
    and each server counts one push per trainer and step of each collection and applies each step
    once (under dist_autograd the backward delivers the once-looked-up collection's gradients and
    a step message the other's)."""
    out = run_distributed(_train_twice, 4, setup="hybrid", num_servers=2, timeout=180, push=push)
    for name, n in {"adagrad": 2, "rowwise_adagrad": 1}.items():
        for server, st in out[0][name].items():
            assert st["lookups"] == STEPS * 2 * n, (name, server, st)
            assert st["gradients"] == STEPS * 2, (name, server, st)
            assert st["updates_applied"] == STEPS, (name, server, st)
            assert st["complete_through"] == STEPS - 1, (name, server, st)


def _bad_ids(rank, world_size, *, policy):
    role = role_of(rank, world_size, 1)
    if not role.is_trainer:
        return None
    ebc = make_ebc(seed=0)
    pipeline = make_pipeline(trainer=0, num_servers=1, staleness=0)
    remote = remote_of(ebc, pipeline, cid="bad", num_servers=1, optimizer={"name": "sgd", "lr": 1.0}, id_policy=policy)
    data = global_batch(0, sample_tables(), 4)
    ln, ids, w = data["f0"]
    ids = ids.clone()
    ids[0], ids[-1] = 57, -3  # table t0 has 50 rows
    data["f0"] = (ln, ids, w)
    kjt = kjt_slice(data, 0, 4)
    before = remote.read_tables()
    err = None
    with step(pipeline) as st:
        try:
            out = remote(kjt)
            st.backward(out.values().sum())
        except BadIdError as e:
            err = str(e)
    after = remote.read_tables()
    pipeline.close()
    if policy == "modulo":
        fixed = dict(data)
        fixed["f0"] = (ln, torch.remainder(ids, 50), w)
        expect = ebc(kjt_slice(fixed, 0, 4)).values()
        return err, out.values().detach(), expect.detach(), before, after
    return err, None, None, before, after


SKIPS = {2, 3}  # steps whose forward leaves collection "b" out


def _skipping(rank, world_size, *, push, prefetch):
    role = role_of(rank, world_size, 1)
    if not role.is_trainer:
        return None
    t_n, me = role.num_trainers, role.index
    pipeline = make_pipeline(trainer=me, num_servers=1, staleness=0, gradient_push=push, timeout_s=60)
    tables = sample_tables()
    c = torch.linspace(-1, 1, sum(t.embedding_dim * len(t.feature_names) for t in tables))
    remotes, refs = {}, {}
    for name in ("a", "b"):
        remotes[name] = remote_of(make_ebc(seed=0), pipeline, cid=name, num_servers=1,
                                  optimizer={"name": "adam", "lr": 0.05}, trainer=me, num_trainers=t_n)
        ref = make_ebc(seed=0)
        refs[name] = (ref, {t.name: ReferenceSparseOptimizer("adam", ref.embedding_bags[t.name].weight.data, lr=0.05)
                            for t in tables})
    dist.barrier()

    def batch(s):
        return kjt_slice(global_batch(s, tables, t_n * BATCH), me * BATCH, (me + 1) * BATCH)

    errors = []
    for s in range(STEPS):
        used = ["a"] if s in SKIPS else ["a", "b"]
        try:
            with step(pipeline) as st:
                outs = [remotes[n](batch(s)).values() for n in used]
                if prefetch:
                    st.prefetch(batch(s + 1))  # for both collections, whether the next step uses both or not
                st.backward(sum(_loss(o, c) for o in outs))
        except RuntimeError as e:
            errors.append((s, str(e)))
            continue
        # The reference: one process, the global batch; a step that leaves "b" out leaves its rows
        # and optimizer state alone.
        data = global_batch(s, tables, t_n * BATCH)
        gkjt, touched = kjt_slice(data, 0, t_n * BATCH), touched_rows(data, tables)
        for n in used:
            ref, opts = refs[n]
            ref.zero_grad()
            _loss(ref(gkjt).values(), c).backward()
            for t in tables:
                opts[t.name].step(ref.embedding_bags[t.name].weight.grad, touched[t.name])
    pipeline.flush()
    dist.barrier()
    if me == 0:
        _equal_to_reference(remotes, refs, tables)
    pipeline.close()
    return errors


@pytest.mark.parametrize("push,prefetch", [("rpc", False), ("rpc", True), ("dist_autograd", False),
                                           ("dist_autograd", True)])
def test_a_step_that_leaves_a_collection_out_changes_none_of_its_rows(push, prefetch):
    """A model whose forward leaves one of its remote collections out of some steps trains as
    one process does, under Adam (a zero gradient would move rows): each server of the
    collection gets the trainer's push of the step without rows. Without it the next step's
    lookup waited for that push until the RPC timeout; a prefetched lookup the step did not use
    changed rows under dist_autograd, whose backward gives it a zero gradient -- there the step
    is refused before its backward, naming the collection, and changes nothing."""
    for errors in run_distributed(_skipping, 3, setup="hybrid", num_servers=1, timeout=120, push=push,
                                  prefetch=prefetch):
        if errors is None:
            continue
        if push == "dist_autograd" and prefetch:
            # Step 1 prefetched "b" for step 2, which left it out; step 2 did so for step 3.
            assert [s for s, _ in errors] == sorted(SKIPS), errors
            assert all(f"step {s} did not look up b, whose rows were prefetched" in m for s, m in errors), errors
        else:
            assert errors == [], errors


def test_bad_ids_error_policy_names_feature_id_and_size_and_changes_nothing():
    out = run_distributed(_bad_ids, 2, setup="hybrid", num_servers=1, timeout=90, policy="error")
    err, _, _, before, after = out[0]
    assert err is not None
    assert "feature 'f0'" in err and "57" in err and "-3" in err and "2 id(s)" in err and "50 rows" in err and "id_policy: modulo" in err
    for k in before:
        assert torch.equal(before[k], after[k])


def test_bad_ids_modulo_policy_wraps_ids():
    out = run_distributed(_bad_ids, 2, setup="hybrid", num_servers=1, timeout=90, policy="modulo")
    err, got, expect, before, after = out[0]
    assert err is None
    torch.testing.assert_close(got, expect)
    assert not torch.equal(before["t0"], after["t0"])  # the step went through


def _raw_state(cid):
    """On a server: its tables and optimizer state as they are (no waiting, even after a failure).
    Rows still waiting for their initial values (the background fill) are made first: raw memory
    of a pending row means nothing, and the fill would change it between two reads."""
    from hybrid.ps.server.service import server

    shard = server().shard(cid)
    with shard.lock:
        for t in shard.tables:
            t.ensure_range(0, t.rows)
        return {t.name: (t.weight.clone(), {k: v.clone() for k, v in t.optim.state.items()}) for t in shard.tables}


def _break_updates(cid):
    """On a server: every later update fails before any row is written (what a failing optimizer
    step does; the server holds only ``cid``)."""
    import hybrid.ps.server.shard as shard_module
    from hybrid.ps.server.service import server

    shard = server().shard(cid)

    def step_(*_args, **_kwargs):
        raise RuntimeError(f"injected fault in the update of {cid} on ps{shard.server}")

    shard_module.step_ = step_


def _failing_update(rank, world_size, *, num_servers, transport):
    import torch.distributed.rpc as rpc

    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    ebc = make_ebc(seed=0)
    pipeline = make_pipeline(trainer=0, num_servers=1, staleness=0, transport=transport)
    remote = remote_of(ebc, pipeline, cid="faulty", num_servers=1, optimizer={"name": "adagrad", "lr": 0.5})
    kjt = kjt_slice(global_batch(0, sample_tables(), 4), 0, 4)
    with step(pipeline) as st:  # one good step, so the optimizer state is not all zeros
        st.backward(remote(kjt).values().sum())
    pipeline.flush()
    before = rpc.rpc_sync("ps0", _raw_state, args=("faulty",))
    rpc.rpc_sync("ps0", _break_updates, args=("faulty",))
    err = None
    try:
        with step(pipeline) as st:
            st.backward(remote(kjt).values().sum())
        pipeline.flush()
        remote.read_tables()  # waits for the step: its failure comes back here at the latest
    except Exception as e:  # noqa: BLE001 - the point is what it says
        err = f"{type(e).__name__}: {e}"
    after = rpc.rpc_sync("ps0", _raw_state, args=("faulty",))
    return err, before, after


@pytest.mark.parametrize("transport", ["auto", "socket", "rpc"])
def test_exception_in_a_server_update_reaches_the_trainer_and_applies_nothing(transport):
    """Over every transport; over RPC the server's error comes back as the answer's value
    (torch's ``async_execution``), raised by the trainer as the error it is."""
    err, before, after = run_distributed(_failing_update, 2, setup="hybrid", num_servers=1, timeout=90,
                                         transport=transport)[0]
    assert err is not None and err.startswith("ServerError: ") and "injected fault in the update of faulty on ps0" in err, err
    assert any(st["sum"].abs().sum() > 0 for _, st in before.values())  # there was state to lose
    for name, (w, st) in before.items():
        assert torch.equal(w, after[name][0]), name
        for k, v in st.items():
            assert torch.equal(v, after[name][1][k]), (name, k)
