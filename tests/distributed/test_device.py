"""GPU trainers. Remote collections: the rows arrive on the trainer's device, pooled outputs and
their gradients match a local collection on that device, and the servers (on the host) train the
same rows. ``hybrid train``'s loop: batches go to the trainer's device and a run (NCCL among the
trainers) matches one CPU process. Runs where CUDA is available; skipped elsewhere."""

import json

import pytest
import torch
import torch.distributed as dist

from hybrid.launch.roles import role_of
from hybrid.ps.client import make_pipeline, step
from tests.distributed.test_train import STEPS, _overrides, reference_losses
from tests.harness import run_distributed
from tests.support.cli import REPO
from tests.support.remote import remote_of
from tests.support import sparse
from tests.support.sparse import global_batch, kjt_slice, make_ebc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def _on_gpu(rank, world_size, *, pool_on):
    role = role_of(rank, world_size, 1)
    if not role.is_trainer:
        return None
    device = torch.device("cuda", 0)
    ebc = make_ebc(seed=0)
    pipeline = make_pipeline(trainer=0, num_servers=1, staleness=0, device=device)
    remote = remote_of(ebc, pipeline, cid="g", num_servers=1, optimizer={"name": "sgd", "lr": 0.5}, pool_on=pool_on)
    local = make_ebc(seed=0).to(device)
    kjt = kjt_slice(global_batch(0, sparse.sample_tables(), 8), 0, 8)
    with step(pipeline) as s:
        out = remote(kjt)
        assert out.values().device == device
        want = local(kjt.to(device))
        torch.testing.assert_close(out.values(), want.values(), rtol=1e-6, atol=1e-6)
        s.backward(out.values().pow(2).sum())
    want.values().pow(2).sum().backward()
    got = remote.read_tables()
    for name, bag in local.embedding_bags.items():
        expect = (bag.weight.detach() - 0.5 * bag.weight.grad).cpu()
        torch.testing.assert_close(got[name], expect, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # outside a step (evaluation): the trained rows, on the trainer's GPU
        for bag in local.embedding_bags.values():
            bag.weight -= 0.5 * bag.weight.grad
        read = remote(kjt).values()
        assert read.device == device
        torch.testing.assert_close(read, local(kjt.to(device)).values(), rtol=1e-5, atol=1e-6)
    pipeline.close()
    dist.barrier()
    return True


@pytest.mark.parametrize("pool_on", ["trainer", "server"])
def test_rows_reach_the_trainer_s_gpu_and_train_as_a_local_collection_there(pool_on):
    """``pool_on: server``: the servers' pooled bags reach the GPU instead of rows."""
    assert run_distributed(_on_gpu, 2, setup="hybrid", num_servers=1, timeout=120, start="spawn", pool_on=pool_on)[0]


def _train(rank, world_size, *, tmp, overrides):
    from hybrid.launch.roles import role_of
    from hybrid.train.loop import load_run, run_process

    plan, cfg, _, resolved = load_run(str(REPO / "conf/plans/dlrm.yaml"), str(REPO / "conf/train/dlrm.yaml"),
                                      overrides, world_size)
    # The job as `hybrid train` runs it (backend auto: NCCL among the trainers on a GPU machine).
    return run_process(role_of(rank, world_size, 1), plan, cfg, resolved, init_method=f"file://{tmp}/rdzv")


def test_hybrid_train_moves_batches_to_the_gpu_and_matches_one_cpu_process(tmp_path):
    # compose puts the dense modules on the GPU: a batch left in host memory would fail the first
    # forward, so a finished run shows that the loop moved every batch (train and eval).
    out = tmp_path / "run"
    over = _overrides("dlrm", out)
    assert run_distributed(_train, 2, setup="none", timeout=240, start="spawn", tmp=str(tmp_path),
                           overrides=over) == [0, 0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in rows if r["kind"] == "train"]
    assert len(got) == STEPS and [r["step"] for r in rows if r["kind"] == "eval"] == [0, 3, STEPS]
    want = reference_losses("dlrm", over, world_size=2)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)


def test_hybrid_launch_forks_workers_that_train_on_the_gpu(tmp_path):
    """``hybrid launch`` forks its workers from a server that imported torch, torchrec and
    fbgemm_gpu (whose import asks whether CUDA is available): the trainers still use the GPU and
    train as one CPU process does."""
    from tests.support.cli import run_hybrid

    out = tmp_path / "run"
    over = _overrides("dlrm", out)
    res = run_hybrid(["launch", "-n", "2", "train", "--plan", "conf/plans/dlrm.yaml", "--config",
                      "conf/train/dlrm.yaml", *over], timeout=300)
    assert res.returncode == 0, res.output
    assert "on cuda" in res.stderr + res.stdout, res.output  # "materialized the model on cuda:0"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in rows if r["kind"] == "train"]
    want = reference_losses("dlrm", over, world_size=2)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)


# Every mode a GPU trainer can run in gives what the same job gives with the trainer on the CPU
# (which the rest of the suite checks against one process): the batch handed over on the GPU as
# the loop hands it, the next batch prefetched each step, then an evaluation read on the device.
VARIANTS = {
    "async_hot_rows": dict(staleness=1, hot_rows=16, optimizer={"name": "adagrad", "lr": 0.3}),
    "dist_autograd": dict(gradient_push="dist_autograd", optimizer={"name": "rowwise_adagrad", "lr": 0.2}),
    "sequence": dict(kind="sequence", optimizer={"name": "adam", "lr": 0.05}),
    "wire_bfloat16": dict(wire_dtype="bfloat16", optimizer={"name": "sgd", "lr": 0.5}),
    "weighted_on_server": dict(weighted=True, pool_on="server", optimizer={"name": "adagrad", "lr": 0.3}),
    "dynamic": dict(dynamic=True, optimizer={"name": "rowwise_adagrad", "lr": 0.1}),
    # learned position weights computed in the forward on the device, the raw batch prefetched
    "learned_weights": dict(weighted=True, learned=True, optimizer={"name": "sgd", "lr": 0.3}),
}
GPU_STEPS, GPU_BATCH = 5, 8


class _PositionWeights(torch.nn.Module):
    """TorchRec's position weighting (``PositionWeightedModuleCollection``: each id weighted by a
    learned weight for its position in its bag, all ones at first) in plain torch operators.
    torchrec's own calls fbgemm operators that fbgemm's CPU build, the one the GPU machines this
    test ran on could carry, has no CUDA kernels for; test_ps_modes and test_compose train it with
    the tables on the servers."""

    def __init__(self, features: list[str], max_length: int):
        super().__init__()
        self.features = features
        self.position_weight = torch.nn.Parameter(torch.ones(len(features), max_length))

    def forward(self, kjt):
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        assert kjt.keys() == self.features, kjt.keys()
        lengths = kjt.lengths()
        starts = torch.cumsum(lengths, 0) - lengths  # each bag's first position in values
        position = torch.arange(lengths.sum(), device=lengths.device) - starts.repeat_interleave(lengths)
        feature = torch.arange(len(self.features), device=lengths.device).repeat_interleave(kjt.stride())
        weights = self.position_weight[feature.repeat_interleave(lengths), position]
        return KeyedJaggedTensor(kjt.keys(), kjt.values(), weights=weights, lengths=lengths, stride=kjt.stride())


def _variant_job(rank, world_size, *, device, variant):
    from hybrid.ps.config import DynamicIds
    from tests.distributed.test_dynamic_ids import _collection, _loss, _raw, _seq_loss

    role = role_of(rank, world_size, 1)
    if not role.is_trainer:
        return None
    opts = dict(VARIANTS[variant])
    staleness, hot_rows = opts.pop("staleness", 0), opts.pop("hot_rows", 0)
    push, kind = opts.pop("gradient_push", "rpc"), opts.pop("kind", "bag")
    weighted, dynamic = opts.pop("weighted", False), opts.pop("dynamic", False)
    learned = opts.pop("learned", False)
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    tables = sparse.sample_tables(mean=not weighted)
    module = make_ebc(seed=0, weighted=weighted) if kind == "bag" else _collection("sequence", tables)
    pipeline = make_pipeline(trainer=0, num_servers=1, staleness=staleness, gradient_push=push, device=dev)
    if dynamic:
        opts["dynamic"] = DynamicIds(capacity=64, evict="lru", partitions=4)
    remote = remote_of(module, pipeline, cid=variant, num_servers=1, staleness=staleness, hot_rows=hot_rows, **opts)
    c = torch.linspace(-1, 1, sum(t.embedding_dim * len(t.feature_names) for t in tables), device=dev)
    weigh, pw_opt = (lambda kjt: kjt), None
    if learned:
        pw = _PositionWeights([f for t in tables for f in t.feature_names], 4).to(dev)
        weigh, pw_opt = pw, torch.optim.SGD(pw.parameters(), lr=0.2)

    def batch(s):
        data = global_batch(s, tables, GPU_BATCH, weighted=weighted and not learned)
        return kjt_slice(_raw(data, s) if dynamic else data, 0, GPU_BATCH).to(dev)

    outs, nxt = [], batch(0)
    for s in range(GPU_STEPS):
        kjt = nxt
        pipeline.flush()  # async: every push applied before the step, so both runs see the same rows
        with step(pipeline, optimizer=pw_opt) as st:
            out = remote(weigh(kjt))
            nxt = batch(s + 1)
            st.prefetch(nxt)
            if kind == "bag":
                assert out.values().device == dev
                outs.append(out.values().detach().cpu())
                st.backward(_loss(out.values(), c))
            else:
                values = {f: jt.values() for f, jt in out.items()}
                assert all(v.device == dev for v in values.values())
                outs.extend(v.detach().cpu() for v in values.values())
                st.backward(_seq_loss(values, GPU_BATCH))
    pipeline.flush()
    if learned:
        outs.extend(p.detach().cpu() for p in pw.parameters())
    with torch.no_grad():  # evaluation: the trained rows, read onto the trainer's device
        out = remote(weigh(batch(GPU_STEPS)))
        values = [out.values()] if kind == "bag" else [jt.values() for jt in out.values()]
        assert all(v.device == dev for v in values)
        outs.extend(v.cpu() for v in values)
    state = remote.read_dynamic() if dynamic else remote.read_tables(with_state=True)
    pipeline.close()
    dist.barrier()
    return outs, state


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_gpu_trainer_trains_as_a_cpu_trainer_in_every_mode(variant):
    runs = {d: run_distributed(_variant_job, 2, setup="hybrid", num_servers=1, timeout=180, start="spawn",
                               device=d, variant=variant)[0] for d in ("cpu", "cuda")}
    (cpu_outs, cpu_state), (gpu_outs, gpu_state) = runs["cpu"], runs["cuda"]
    # Pooling and the loss's reductions run in another order on the GPU: float32 rounding apart;
    # bfloat16 on the wire can round a gradient to the neighbouring value.
    tol = dict(rtol=2e-2, atol=2e-3) if variant == "wire_bfloat16" else dict(rtol=1e-5, atol=1e-5)
    assert len(gpu_outs) == len(cpu_outs)
    for i, (g, c) in enumerate(zip(gpu_outs, cpu_outs)):
        torch.testing.assert_close(g, c, **tol, msg=lambda m: f"{variant} output {i}: {m}")
    torch.testing.assert_close(gpu_state, cpu_state, **tol, msg=lambda m: f"{variant} tables: {m}")
