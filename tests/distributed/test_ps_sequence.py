"""Unpooled tables on parameter servers with real processes: a torchrec ``EmbeddingCollection``
and a plain ``nn.Embedding`` (with ``padding_idx``), 2 trainers and 1 or 2 servers, table-wise
and row-wise.

One run trains one remote EmbeddingCollection per server optimizer and one remote nn.Embedding
for 6 sync steps; every trainer checks, step by step, that the remote output equals the local
module holding the reference weights (values, lengths, indices), with empty sequences and one
sequence far longer than the rest in every batch, and at the end that every server row and its
optimizer state equal single-process training on the global batch.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybrid.launch.roles import role_of
from hybrid.ps.client import make_pipeline, step
from hybrid.ps.init import init_tables
from tests.harness import run_distributed
from tests.support.remote import remote_embedding, remote_of
from tests.support.sparse import ReferenceSparseOptimizer, kjt_slice

# Rounding must not decide the comparisons: a gradient is summed in another order by two trainers
# than by one process (an ulp apart). SGD runs at 0.1, not 0.5: with this loss (squared
# projections, sequences of 37 ids) SGD at 0.5 is an expanding map, and that ulp grows about
# tenfold a step (1e-4 by step 4 between two float32 one-process references). The Adagrads start
# from an accumulator of 0.1: from 0, a first step moves a row by lr * g / |g|, whose sign and
# size an ulp decides where a row's gradient nearly cancels (the 7-row table's many duplicates).
OPTIMIZERS = {"sgd": 0.1, "adagrad": 0.1, "rowwise_adagrad": 0.1, "adam": 0.05}
ACCUMULATOR = 0.1
STEPS, BATCH, DIM, LONG = 6, 4, 4, 37
EMB_ROWS, EMB_LEN, PAD = 11, 5, 0


def seq_tables() -> list[EmbeddingConfig]:
    """One dimension (an EmbeddingCollection's rule): a plain table, a table read by two
    features, and a tiny one (many duplicate ids)."""
    return [
        EmbeddingConfig(name="t0", embedding_dim=DIM, num_embeddings=50, feature_names=["s0"]),
        EmbeddingConfig(name="t1", embedding_dim=DIM, num_embeddings=30, feature_names=["s1", "s2"]),
        EmbeddingConfig(name="t2", embedding_dim=DIM, num_embeddings=7, feature_names=["s3"]),
    ]


def make_ec(seed: int = 0, need_indices: bool = True) -> EmbeddingCollection:
    ec = EmbeddingCollection(tables=seq_tables(), need_indices=need_indices, device=torch.device("meta"))
    return init_tables(ec, seed=seed)


def seq_batch(step: int, batch: int) -> dict:
    """Per feature: lengths (empty sequences, and sample ``step % batch`` of length ``LONG``) and
    ids, deterministic in ``step``; plus ``emb``: a [batch, EMB_LEN] id tensor with padding."""
    g = torch.Generator().manual_seed(500 + step)
    out = {}
    for t in seq_tables():
        for f in t.feature_names:
            lengths = torch.randint(0, 4, (batch,), generator=g)
            lengths[step % batch] = LONG
            lengths[(step + 1) % batch] = 0
            ids = torch.randint(0, t.num_embeddings, (int(lengths.sum()),), generator=g)
            out[f] = (lengths, ids, None)
    emb = torch.randint(0, EMB_ROWS, (batch, EMB_LEN), generator=g)
    emb[:, -1] = PAD
    return out, emb


def _loss(jts: dict, c: torch.Tensor, batch: int) -> torch.Tensor:
    """A per-sample loss, mean over the batch (as DDP averages)."""
    total = 0
    for k, jt in enumerate(jts.values()):
        v = jt.values()
        total = total + ((v @ c) ** 2).sum() * (k + 1) + v.sum()
    return total / batch


def _emb_loss(out: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((out @ c) ** 3).sum(-1).mean() + out.mean()


def _accumulator(name: str) -> dict:
    return {"initial_accumulator_value": ACCUMULATOR} if "adagrad" in name else {}


def _optimizer(name: str, lr: float) -> dict:
    return {"name": name, "lr": lr, **_accumulator(name)}


def _train(rank, world_size, *, num_servers, sharding, push, prefetch):
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    t_n, me = role.num_trainers, role.index
    pipeline = make_pipeline(trainer=me, num_servers=num_servers, staleness=0, gradient_push=push)
    c = torch.linspace(-1, 1, DIM)
    remotes, refs = {}, {}
    for name, lr in OPTIMIZERS.items():
        remotes[name] = remote_of(make_ec(), pipeline, cid=f"ec_{name}", num_servers=num_servers, sharding=sharding,
                                  optimizer=_optimizer(name, lr), trainer=me, num_trainers=t_n)
        ref = make_ec()
        refs[name] = (ref, {t.name: ReferenceSparseOptimizer(name, ref.embeddings[t.name].weight.data, lr=lr,
                                                             **_accumulator(name))
                            for t in seq_tables()})
    emb_opt = ("adam", 0.05)
    emb_remote = remote_embedding(nn.Embedding(EMB_ROWS, DIM, padding_idx=PAD, device="meta"), pipeline,
                                  cid="model.items", num_servers=num_servers, sharding=sharding,
                                  optimizer={"name": emb_opt[0], "lr": emb_opt[1]}, trainer=me, num_trainers=t_n)
    emb_ref = init_tables(nn.Embedding(EMB_ROWS, DIM, padding_idx=PAD, device="meta"), path="model.items")
    emb_ref_opt = ReferenceSparseOptimizer(emb_opt[0], emb_ref.weight.data, lr=emb_opt[1])
    dist.barrier()
    nxt = None
    for s in range(STEPS):
        data, emb_ids = seq_batch(s, t_n * BATCH)
        kjt = nxt if nxt is not None else kjt_slice(data, me * BATCH, (me + 1) * BATCH)
        mine = emb_ids[me * BATCH : (me + 1) * BATCH]
        with step(pipeline) as st:
            outs = {n: r(kjt) for n, r in remotes.items()}
            emb_out = emb_remote(mine)
            if prefetch and s + 1 < STEPS:  # the collections' next rows ride on this step's push
                nxt = kjt_slice(seq_batch(s + 1, t_n * BATCH)[0], me * BATCH, (me + 1) * BATCH)
                st.prefetch(nxt)
            for n, out in outs.items():
                local = refs[n][0](kjt)
                assert list(out) == list(local)
                for f, jt in out.items():
                    torch.testing.assert_close(jt.values(), local[f].values(), rtol=1e-6, atol=1e-6)
                    assert torch.equal(jt.lengths(), local[f].lengths()), f
                    assert torch.equal(jt.weights(), local[f].weights()), f  # need_indices: the ids
            assert emb_out.shape == (BATCH, EMB_LEN, DIM)
            torch.testing.assert_close(emb_out, emb_ref(mine), rtol=1e-6, atol=1e-6)
            assert not emb_out[:, -1].any()  # the padding positions
            st.backward(sum(_loss(o, c, BATCH) for o in outs.values()) + _emb_loss(emb_out, c))
        # The reference: one process, the global batch, the same loss.
        gkjt = kjt_slice(data, 0, t_n * BATCH)
        for n, (ref, opts) in refs.items():
            ref.zero_grad()
            _loss(ref(gkjt), c, t_n * BATCH).backward()
            for t in seq_tables():
                ids = torch.cat([data[f][1] for f in t.feature_names])
                touched = torch.zeros(t.num_embeddings, dtype=torch.bool)
                touched[ids] = True
                opts[t.name].step(ref.embeddings[t.name].weight.grad, touched)
        emb_ref.zero_grad()
        _emb_loss(emb_ref(emb_ids), c).backward()
        touched = torch.zeros(EMB_ROWS, dtype=torch.bool)
        touched[emb_ids[emb_ids != PAD]] = True  # the padding row is never looked up
        emb_ref_opt.step(emb_ref.weight.grad, touched)
    pipeline.flush()
    dist.barrier()  # every trainer's last push is in, so the last step is applied everywhere
    result = {}
    if me == 0:
        for n, remote in remotes.items():
            weights, states = remote.read_tables(with_state=True)
            ref, opts = refs[n]
            for t in seq_tables():
                torch.testing.assert_close(weights[t.name], ref.embeddings[t.name].weight.data,
                                           rtol=1e-6, atol=1e-6, msg=lambda m: f"{n} {t.name}: {m}")
                for k, v in opts[t.name].state.items():
                    torch.testing.assert_close(states[t.name][k], v, rtol=1e-6, atol=1e-6,
                                               msg=lambda m: f"{n} {t.name} state {k}: {m}")
            result[n] = remote.stats()
            assert not torch.equal(weights["t0"], make_ec().embeddings["t0"].weight.data)  # the tables moved
        weights, states = emb_remote.collection.read_tables(with_state=True)
        torch.testing.assert_close(weights["model_items"], emb_ref.weight.data, rtol=1e-6, atol=1e-6)
        for k, v in emb_ref_opt.state.items():
            torch.testing.assert_close(states["model_items"][k], v, rtol=1e-6, atol=1e-6)
        assert not weights["model_items"][PAD].any()
        sd = emb_remote.state_dict()
        assert list(sd) == ["weight"] and torch.equal(sd["weight"], weights["model_items"])
        assert list(remotes["sgd"].state_dict()) == list(make_ec().state_dict())
        result["emb"] = emb_remote.collection.stats()
    pipeline.close()
    return result


@pytest.mark.parametrize("num_servers,sharding,push,prefetch", [
    (1, "table_wise", "rpc", False), (2, "row_wise", "rpc", True), (2, "table_wise", "dist_autograd", False)])
def test_embedding_collection_and_embedding_train_as_one_process(num_servers, sharding, push, prefetch):
    out = run_distributed(_train, 2 + num_servers, setup="hybrid", num_servers=num_servers, timeout=180,
                          sharding=sharding, push=push, prefetch=prefetch)
    stats = out[0]
    for name in [*OPTIMIZERS, "emb"]:
        for server, st in stats[name].items():
            # One step message per server per step per trainer, with only deduplicated rows.
            assert st["lookups"] == STEPS * 2, (name, server, st)
            assert st["updates_applied"] == STEPS, (name, server, st)
            assert st["rows_served"] < st["ids_requested"], (name, server, st)


def _read_outside_a_step(rank, world_size, *, num_servers):
    """Evaluation (no step open, no grad) reads the same rows; an empty batch gives empty
    sequences; a KJT lacking a feature is refused by name."""
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    pipeline = make_pipeline(trainer=0, num_servers=num_servers, staleness=0)
    remote = remote_of(make_ec(need_indices=False), pipeline, cid="ec", num_servers=num_servers,
                       optimizer={"name": "sgd", "lr": 0.1})
    local = make_ec(need_indices=False)
    data, _ = seq_batch(0, 3)
    kjt = kjt_slice(data, 0, 3)
    with torch.no_grad():
        out, ref = remote(kjt), local(kjt)
    for f in ref:
        assert torch.equal(out[f].values(), ref[f].values()) and out[f].weights_or_none() is None
    empty = KeyedJaggedTensor.from_lengths_sync(keys=["s0", "s1", "s2", "s3"], values=torch.zeros(0, dtype=torch.long),
                                                lengths=torch.zeros(8, dtype=torch.long))
    with torch.no_grad():
        out = remote(empty)
    assert all(jt.values().shape == (0, DIM) and jt.lengths().tolist() == [0, 0] for jt in out.values())
    lacking = KeyedJaggedTensor.from_lengths_sync(keys=["s0"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"lacks features \['s1', 's2', 's3'\]"):
        remote(lacking)
    pipeline.close()
    return True


def test_reads_outside_a_step_empty_batches_and_missing_features():
    assert run_distributed(_read_outside_a_step, 3, setup="hybrid", num_servers=2, timeout=120)[0]
