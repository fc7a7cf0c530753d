"""The project's central correctness check: a torchrec DLRM with 4 tables trained for 20 steps by
2 trainers and 2 parameter servers equals one process training the plain model on the global
batch -- losses and every parameter (dense and every table row) -- for dense all-DDP, all-FSDP
and DDP-bottom/FSDP-top, tables table-wise and row-wise, with SGD and with Adagrad. The hybrid
model's tables are built on meta and filled by the servers; the plain model's by
``hybrid.init_tables`` (no table is ever copied from a trainer).

All twelve configurations run in one set of processes, one after the other (``compose`` with a
``name`` keeps their tables apart on the servers), to keep the suite fast.
"""

import copy
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import hybrid
from hybrid.launch.init import RuntimeOptions
from hybrid.launch.roles import role_of
from hybrid.plan import plan_from_dict
from tests.harness import run_distributed
from tests.support.sparse import ReferenceSparseOptimizer, global_batch, kjt_slice, touched_rows

STEPS, B = 20, 8
TABLES = [
    EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=40 + 10 * i, feature_names=[f"f{i}"])
    for i in range(4)
]
DENSE = {
    "ddp": {"dense_arch": {"strategy": "ddp"}, "over_arch": {"strategy": "ddp"}},
    "fsdp": {"dense_arch": {"strategy": "fsdp"}, "over_arch": {"strategy": "fsdp"}},
    "mixed": {"dense_arch": {"strategy": "ddp"}, "over_arch": {"strategy": "fsdp"}},
}
LR = {"sgd": (0.1, 0.5), "adagrad": (0.05, 0.1), "adam": (0.1, 0.05)}  # (dense, sparse)
SPARSE_OPT = {"sgd": "sgd", "adagrad": "rowwise_adagrad", "adam": "adam"}


class TwiceDLRM(DLRM):
    """A DLRM whose step looks its tables up twice: its sparse input is the sum of two batches'
    pooled rows (``sparse_b`` may be ``sparse_a`` itself)."""

    def forward(self, dense_features, sparse_a, sparse_b):
        embedded_sparse = self.sparse_arch(sparse_a) + self.sparse_arch(sparse_b)
        return self.over_arch(self.inter_arch(dense_features=self.dense_arch(dense_features),
                                              sparse_features=embedded_sparse))


def build_dlrm(seed: int = 0, *, plain: bool = False, cls: type[DLRM] = DLRM) -> DLRM:
    """The DLRM (of class ``cls``) with its tables on meta (for compose), or, ``plain``, filled as
    the servers fill them (``hybrid.init_tables``); the dense part is the same either way."""
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=copy.deepcopy(TABLES), device=torch.device("meta"))
    model = cls(embedding_bag_collection=ebc, dense_in_features=13,
                dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    if plain:
        hybrid.init_tables(ebc, seed=seed)
    return model


def make_plan(dense: str, sharding: str, opt: str, num_servers: int, world_size: int, staleness: int = 0,
              hot_rows: int = 0):
    """``sharding`` ``table_wise+pool_on_server``: table-wise with ``pool_on: server``."""
    sharding, _, pool = sharding.partition("+")
    modules = {
        "sparse_arch.embedding_bag_collection": {
            "strategy": "parameter_server", "sharding": sharding,
            "optimizer": {"name": SPARSE_OPT[opt], "lr": LR[opt][1]},
            **({"pool_on": "server"} if pool == "pool_on_server" else {}),
            **({"hot_rows": hot_rows} if hot_rows else {}),
        },
        **copy.deepcopy(DENSE[dense]),
    }
    return plan_from_dict({"world_size": world_size, "topology": {"parameter_servers": num_servers},
                           "modules": modules, "sync": {"staleness": staleness}})


def global_data(step: int, n: int):
    g = torch.Generator().manual_seed(500 + step)
    dense = torch.randn(n, 13, generator=g)
    labels = torch.randint(0, 2, (n,), generator=g).float()
    return dense, labels, global_batch(step, TABLES, n)


def dense_opt(opt: str, params):
    lr = LR[opt][0]
    return torch.optim.SGD(params, lr=lr) if opt == "sgd" else torch.optim.Adagrad(params, lr=lr, eps=1e-8)


def full(v):
    return v.full_tensor() if isinstance(v, DTensor) else v


class _Reference:
    """One process training the plain DLRM (tables filled as the servers fill them) on each
    step's global batch: its dense part with ``make_dense_opt(params)``, each table with the
    servers' own update for ``opt`` (:class:`ReferenceSparseOptimizer`). ``sparse(s, n)``: the
    step's global sparse batches, one per argument of the model's forward after the dense
    features (default: the one of :func:`global_data`)."""

    def __init__(self, opt: str, make_dense_opt, *, cls: type[DLRM] = DLRM, sparse=None) -> None:
        self.model = build_dlrm(plain=True, cls=cls)
        self.sparse_batches = sparse or (lambda s, n: [global_data(s, n)[2]])
        self.tables = {t.name: self.model.sparse_arch.embedding_bag_collection.embedding_bags[t.name].weight
                       for t in TABLES}
        self.dense_opt = make_dense_opt([p for n, p in self.model.named_parameters() if "embedding_bags" not in n])
        self.sparse = {n: ReferenceSparseOptimizer(SPARSE_OPT[opt], w.data, lr=LR[opt][1]) for n, w in self.tables.items()}

    def step(self, s: int, n: int) -> float:
        """Step ``s`` on its global batch of ``n`` samples; the loss."""
        dense_x, labels, _ = global_data(s, n)
        batches = self.sparse_batches(s, n)
        self.dense_opt.zero_grad()
        for w in self.tables.values():
            w.grad = None
        logits = self.model(dense_x, *(kjt_slice(data, 0, n) for data in batches)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        self.dense_opt.step()
        touched = [touched_rows(data, TABLES) for data in batches]
        for name, w in self.tables.items():
            self.sparse[name].step(w.grad, torch.stack([t[name] for t in touched]).any(0))
        return loss.item()


def _equivalence(rank, world_size, *, num_servers, configs):
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    t_n, me = role.num_trainers, role.index
    report = {}
    for ci, (dense, sharding, opt) in enumerate(configs):
        model, ref = build_dlrm(), _Reference(opt, lambda params, opt=opt: dense_opt(opt, params))
        plain_keys = list(ref.model.state_dict())
        hybrid.compose(model, make_plan(dense, sharding, opt, num_servers, world_size), role=role, name=f"c{ci}")
        assert list(model.state_dict()) == plain_keys
        optimizer = dense_opt(opt, model.parameters())
        losses, ref_losses = [], []
        for s in range(STEPS):
            dense_x, labels, data = global_data(s, t_n * B)
            lo, hi = me * B, (me + 1) * B
            with hybrid.step(model, optimizer) as st:
                logits = model(dense_x[lo:hi], kjt_slice(data, lo, hi)).squeeze(1)
                loss = F.binary_cross_entropy_with_logits(logits, labels[lo:hi])
                st.backward(loss)
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / t_n)
            ref_losses.append(ref.step(s, t_n * B))
        got = {k: full(v).detach() for k, v in model.state_dict().items()}
        want = ref.model.state_dict()
        assert list(got) == list(want)
        worst = 0.0
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{dense}/{sharding}/{opt} {k}: {m}")
            worst = max(worst, float((got[k] - want[k]).abs().max()))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
        # Everything moved, so the equality above is not the trivial one of nothing training.
        init = build_dlrm(plain=True).state_dict()
        for k in want:
            assert not torch.equal(got[k], init[k]), f"{k} did not change in {dense}/{sharding}/{opt}"
        report[(dense, sharding, opt)] = {"max_abs_diff": worst, "first_loss": losses[0], "last_loss": losses[-1]}
    return report


ALL = [(d, s, o) for d in ("ddp", "fsdp", "mixed") for s in ("table_wise", "row_wise") for o in ("sgd", "adagrad")]
ALL += [("ddp", "table_wise+pool_on_server", "adagrad"), ("fsdp", "table_wise+pool_on_server", "sgd")]


@pytest.mark.slow
def test_hybrid_dlrm_equals_single_process_training_in_every_configuration():
    out = run_distributed(_equivalence, 4, setup="hybrid", num_servers=2, timeout=420, configs=ALL)
    report = out[0]
    assert set(report) == set(ALL)
    for cfg, r in report.items():
        assert r["last_loss"] < r["first_loss"], (cfg, r)


class _MetaNet(torch.nn.Module):
    """Tables and a dense tower, all built on the meta device by the test."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=copy.deepcopy(TABLES), device=torch.device("meta"))
        self.tower = torch.nn.Sequential(torch.nn.Linear(4 * 8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, kjt):
        return self.tower(self.ebc(kjt).values())


def _meta(rank, world_size, *, num_servers):
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    plan = plan_from_dict({"world_size": world_size, "topology": {"parameter_servers": num_servers}, "modules": {
        "ebc": {"strategy": "parameter_server", "sharding": "row_wise", "optimizer": {"name": "sgd", "lr": 0.5}},
        "tower": {"strategy": "fsdp"}}})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _MetaNet()
    shapes = {n: p.shape for n, p in model.named_parameters() if not n.startswith("ebc")}
    hybrid.compose(model, plan, role=role, name="meta", init_tables="server")
    # Nothing is left on meta, and each trainer allocated only its shard of the tower.
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    local = {n: p.to_local().numel() for n, p in model.named_parameters()}
    assert local.keys() == shapes.keys()
    # FSDP2 shards dim 0: at most ceil(rows / trainers) rows each.
    assert all(local[n] <= -(-shp[0] // role.num_trainers) * shp[1:].numel() for n, shp in shapes.items()), local
    assert sum(local.values()) < sum(shp.numel() for shp in shapes.values())
    # The shards together are the tower one process builds from the same seed, and the tables
    # are the servers' rows that hybrid.init_tables gives a local collection.
    torch.manual_seed(0)
    plain = _MetaNet()  # outside meta: the tower built for real from seed 0
    hybrid.init_tables(plain.ebc, seed=0)
    want = plain.state_dict()
    got = model.state_dict()
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(full(got[k]), v), k
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    losses = []
    for s in range(3):
        _, labels, data = global_data(s, role.num_trainers * B)
        lo, hi = role.index * B, (role.index + 1) * B
        with hybrid.step(model, optimizer) as st:
            loss = F.binary_cross_entropy_with_logits(model(kjt_slice(data, lo, hi)).squeeze(1), labels[lo:hi])
            st.backward(loss)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(not torch.equal(full(p).detach(), before[n]) for n, p in model.named_parameters())

    # A DDP/FSDP module refuses to run inside a distributed-autograd context (its gradients
    # would go into the context, unsynchronized); a context current on another thread only is
    # no reason to refuse.
    _, _, data = global_data(0, role.num_trainers * B)
    batch = kjt_slice(data, role.index * B, (role.index + 1) * B)
    opened, release = threading.Event(), threading.Event()

    def hold_a_context() -> None:
        with dist_autograd.context():
            opened.set()
            release.wait(30)

    holder = threading.Thread(target=hold_a_context)
    holder.start()
    try:
        assert opened.wait(30) and dist_autograd._get_debug_info()["num_autograd_contexts"] == 1
        model(batch)
    finally:
        release.set()
        holder.join()
    with dist_autograd.context() as ctx, pytest.raises(
            RuntimeError, match=rf"^tower \(a DDP/FSDP module\) ran inside distributed-autograd context {ctx}:"):
        model(batch)

    # A buffer computed in __init__ (DLRM's interaction indices) cannot come back from meta: refused.
    with torch.device("meta"):
        dlrm = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=copy.deepcopy(TABLES),
                                                                    device=torch.device("meta")),
                    dense_in_features=13, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    with pytest.raises(ValueError, match=r"buffer inter_arch\.triu_indices of InteractionArch was built on the meta"):
        hybrid.compose(dlrm, make_plan("fsdp", "row_wise", "sgd", num_servers, world_size), role=role,
                       name="meta_dlrm", init_tables="server")
    return losses


def test_a_model_built_on_meta_is_sharded_then_materialized():
    """Construct on meta, shard, materialize: each trainer allocates only its FSDP shard, tables
    are initialized by the servers, and the model trains; its FSDP tower refuses to run inside a
    distributed-autograd context (and runs beside one open on another thread)."""
    out = run_distributed(_meta, 3, setup="hybrid", num_servers=1, timeout=120)
    assert out[0] is not None and out[1] is not None


def _prefetch_then_other_batch(rank, world_size, *, num_servers, push):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from hybrid.ps.client import BadIdError, pipeline_of

    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    t_n, me = role.num_trainers, role.index
    lo, hi = me * B, (me + 1) * B
    out = {}
    for ci, (dense, staleness) in enumerate((("ddp", 0), ("ddp", 1), ("fsdp", 1))):
        model = build_dlrm()
        hybrid.compose(model, make_plan(dense, "row_wise", "sgd", num_servers, world_size, staleness), role=role,
                       name=f"p{ci}", runtime_options=RuntimeOptions(gradient_push=push))
        optimizer = dense_opt("sgd", model.parameters())

        def batch(s):
            return kjt_slice(global_data(s, t_n * B)[2], lo, hi)

        def run_step(s, kjt, nxt):
            dense_x, labels, _ = global_data(s, t_n * B)
            with hybrid.step(model, optimizer) as st:
                logits = model(dense_x[lo:hi], kjt).squeeze(1)
                st.prefetch(nxt)
                loss = F.binary_cross_entropy_with_logits(logits, labels[lo:hi])
                st.backward(loss)
            return loss.item()

        losses, kjt, dropped = [], batch(0), []
        pipeline_of(model).prefetch(kjt)  # before the first step: for the first step
        for s in range(STEPS):
            nxt = batch(s + 1)
            try:
                losses.append(run_step(s, kjt, nxt))
            except RuntimeError as e:
                dropped.append((s, str(e)))
            # Step 5 runs on an equal copy of the batch prefetched for it: the prefetched rows
            # serve it. Step 6 runs on another batch: the prefetched rows are discarded and it
            # looks its own up (rpc), or it fails naming the reason (dist_autograd).
            kjt = batch(s + 1) if s == 4 else kjt_slice(global_batch(s + 1, TABLES, t_n * B, seed=3000), lo, hi) \
                if s == 5 else nxt
        report = {"losses": losses, "dropped": dropped}
        # A bad id in the batch to prefetch: the step fails with the routing's own error, and
        # the next step runs (its rows not prefetched).
        good = batch(STEPS + 1)
        values = good.values().clone()
        values[-1] = 10**6
        bad = KeyedJaggedTensor.from_lengths_sync(keys=good.keys(), values=values, lengths=good.lengths())
        try:
            run_step(STEPS, kjt, bad)
        except BadIdError as e:
            report["error"] = str(e)
        report["after"] = run_step(STEPS + 1, good, batch(STEPS + 2))
        pipe = pipeline_of(model)
        pipe.flush()
        # The last step's prefetch may still be on its way: wait for its replies, and for the
        # other trainer's, so that the server has counted every lookup before it is asked.
        for st in pipe.open_steps.values():
            for lk in st.prefetched.values():
                for fut, _ in (lk.futures or {}).values():
                    fut.wait()
        dist.barrier()
        report["lookups"] = model.sparse_arch.embedding_bag_collection.stats()["ps0"]["lookups"]
        out[(dense, staleness)] = report
    return out


@pytest.mark.parametrize("push", ["rpc", "dist_autograd"])
def test_a_step_on_another_batch_than_the_one_prefetched_looks_its_rows_up(push):
    """A step run on an equal copy of the batch prefetched for it uses the prefetched rows; one
    run on another batch discards them and looks its own up (rpc) or fails at once, naming why
    (dist_autograd: every recorded lookup must take part in the backward; without this check
    the backward waited out the RPC timeout), and the next step runs; in sync and async mode. A
    bad id in a batch to prefetch fails that step with the routing's own error, and the next
    step runs. A prefetch before the first step is the first step's: per trainer, one lookup for
    it and one per prefetch, plus one for the discarding step (rpc) or one less prefetch and one
    lookup for the step after the failed one (dist_autograd), and one for the step after the bad
    id."""
    for out in run_distributed(_prefetch_then_other_batch, 3, setup="hybrid", num_servers=1, timeout=150,
                               push=push):
        if out is None:
            continue
        assert set(out) == {("ddp", 0), ("ddp", 1), ("fsdp", 1)}
        for cfg, r in out.items():
            failed = 1 if push == "dist_autograd" else 0
            assert len(r["losses"]) == STEPS - failed and all(0.0 < x < 2.0 for x in r["losses"]), (cfg, r["losses"])
            if failed:
                ((s, message),) = r["dropped"]
                assert s == 6 and "step 6 runs on another batch than the one prefetched" in message, (cfg, message)
            else:
                assert r["dropped"] == [], cfg
            assert "f3" in r["error"] and "1000000" in r["error"], (cfg, r["error"])
            assert 0.0 < r["after"] < 2.0, cfg
            assert r["lookups"] == 2 * (1 + STEPS + 1 + 1 + 1 - failed), (cfg, r["lookups"])


def _two_ahead(rank, world_size, *, num_servers):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from hybrid.ps.client import BadIdError, pipeline_of

    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    t_n, me = role.num_trainers, role.index
    lo, hi = me * B, (me + 1) * B
    report = {"depth": {}}
    for ci, (dense, staleness, hot) in enumerate((("ddp", 0, 0), ("fsdp", 1, 0), ("ddp", 2, 100), ("ddp", 1, 0))):
        model = build_dlrm()
        hybrid.compose(model, make_plan(dense, "row_wise", "sgd", num_servers, world_size, staleness, hot),
                       role=role, name=f"two{ci}")
        report["depth"][(dense, staleness, hot)] = pipeline_of(model).depth
    pipe = pipeline_of(model)  # async, under DDP
    optimizer = dense_opt("sgd", model.parameters())
    sent = []  # per message: (its lookups' steps, its pushes' steps, sent inside a backward)
    for transport in pipe.transports.values():
        def recording(msg, send=transport.send):
            sent.append(([p.step for p in msg.parts if p.lookup is not None],
                         sorted({q.step for p in msg.parts for q in p.pushes}),
                         torch._C._current_graph_task_id() != -1))
            return send(msg)
        transport.send = recording

    def batch(s):
        return kjt_slice(global_data(s, t_n * B)[2], lo, hi)

    def run_step(s, *coming):
        dense_x, labels, _ = global_data(s, t_n * B)
        with hybrid.step(model, optimizer) as st:
            logits = model(dense_x[lo:hi], batch(s)).squeeze(1)
            st.prefetch(*coming)
            report.setdefault("depths", set()).add(st.prefetch_depth)
            report.setdefault("waiting", []).append(s + 2 in pipe.open_steps)  # not before the push
            loss = F.binary_cross_entropy_with_logits(logits, labels[lo:hi])
            st.backward(loss)
        return loss.item()

    report["losses"] = [run_step(s, batch(s + 1), batch(s + 2), batch(s + 3)) for s in range(STEPS)]
    # A bad id in the batch two steps ahead: its routing fails inside the all-reduce, and the
    # step's s.backward raises the routing's own error once the step is done (the dense
    # optimizer stepped); the next step runs on its prefetched rows, and the one after looks up.
    good = batch(STEPS + 2)
    values = good.values().clone()
    values[-1] = 10**6
    bad = KeyedJaggedTensor.from_lengths_sync(keys=good.keys(), values=values, lengths=good.lengths())
    before = [p.detach().clone() for p in model.over_arch.parameters()]
    try:
        run_step(STEPS, batch(STEPS + 1), bad)
    except BadIdError as e:
        report["error"] = str(e)
    report["stepped"] = all(not torch.equal(a, p) for a, p in zip(before, model.over_arch.parameters()))
    report["after"] = [run_step(s, batch(s + 1), batch(s + 2)) for s in (STEPS + 1, STEPS + 2)]
    pipe.flush()
    for st in pipe.open_steps.values():  # the last prefetches are answered, not waited for
        for lk in st.prefetched.values():
            for fut, _ in (lk.futures or {}).values():
                fut.wait()
    dist.barrier()
    report["sent"] = sent
    report["stats"] = model.sparse_arch.embedding_bag_collection.stats()
    return report


def test_async_under_ddp_asks_two_steps_ahead_while_the_all_reduce_runs():
    """Async mode on CPU trainers under DDP prefetches two batches ahead (``s.prefetch_depth``
    2; 1 in sync mode, without DDP and with a hot-row cache): the lookup two steps ahead waits for the step's push and
    leaves inside the backward, with DDP's all-reduce under way, carrying the push (one message
    a step). Training goes on within the staleness bound, every lookup answered; a bad id in
    the batch two ahead raises the routing's error after its step, and training goes on."""
    for r in run_distributed(_two_ahead, 4, setup="hybrid", num_servers=2, timeout=150):
        if r is None:
            continue
        assert r["depth"] == {("ddp", 0, 0): 1, ("fsdp", 1, 0): 1, ("ddp", 2, 100): 1, ("ddp", 1, 0): 2}
        assert r["depths"] == {2} and not any(r["waiting"])
        assert all(0.0 < x < 2.0 for x in r["losses"] + r["after"]), r["losses"]
        assert "f3" in r["error"] and "1000000" in r["error"], r["error"]
        assert r["stepped"]
        ahead = [m for m in r["sent"] if any(2 <= s <= STEPS + 1 for s in m[0])]
        assert len(ahead) == 2 * STEPS  # one message to each of the 2 servers per step
        for lookups, pushes, in_backward in ahead:
            assert in_backward and pushes == [lookups[0] - 2] and len(set(lookups)) == 1, (lookups, pushes)
        for name, st in r["stats"].items():
            # Steps 0 .. STEPS + 4 looked up once each by each trainer (the last two prefetched;
            # the bad batch never left).
            assert st["lookups"] == st["answered"] == 2 * (STEPS + 5), (name, st)
            assert st["max_lag"] <= 1, (name, st)


def _aborted(rank, world_size, *, num_servers, configs, abort, push):
    """Sync training with a prefetch every step, where every trainer raises inside step
    ``abort`` after its forward -- under ``rpc`` a forward on another batch than the one
    prefetched for it, so that prefetched lookup is discarded; under ``dist_autograd`` (which
    refuses that) on an equal copy of it -- and goes on; the reference skips that step."""
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    t_n, me = role.num_trainers, role.index
    lo, hi = me * B, (me + 1) * B
    steps = 8
    report = {}
    for ci, (dense, sharding, opt) in enumerate(configs):
        model, ref = build_dlrm(), _Reference(opt, lambda params, opt=opt: torch.optim.SGD(params, lr=LR[opt][0]))
        hybrid.compose(model, make_plan(dense, sharding, opt, num_servers, world_size), role=role, name=f"a{ci}",
                       runtime_options=RuntimeOptions(gradient_push=push))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR[opt][0])
        kjt = kjt_slice(global_data(0, t_n * B)[2], lo, hi)
        errors = []
        for s in range(steps):
            dense_x, labels, data = global_data(s, t_n * B)
            nxt = kjt_slice(global_data(s + 1, t_n * B)[2], lo, hi)
            if s == abort:  # rpc: another batch, its prefetched lookup discarded; dist_autograd: an equal copy
                kjt = kjt_slice(data if push == "dist_autograd" else global_batch(s, TABLES, t_n * B, seed=3000),
                                lo, hi)
            try:
                with hybrid.step(model, optimizer) as st:
                    logits = model(dense_x[lo:hi], kjt).squeeze(1)
                    st.prefetch(nxt)
                    loss = F.binary_cross_entropy_with_logits(logits, labels[lo:hi])
                    if s == abort:
                        raise ValueError(f"user error in step {s}")
                    st.backward(loss)
            except ValueError as e:
                errors.append(str(e))
            kjt = nxt
            if s != abort:
                ref.step(s, t_n * B)
        got = {k: full(v).detach() for k, v in model.state_dict().items()}
        want = ref.model.state_dict()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{dense}/{sharding}/{opt} {k}: {m}")
        report[(dense, sharding, opt)] = errors
    return report


@pytest.mark.parametrize("push", ["rpc", "dist_autograd"])
def test_a_step_that_raises_before_its_backward_changes_nothing(push):
    """Every trainer raises inside one step, after its forward, and trains on: the tables and the
    dense part end as one process training on every other step -- with Adam, where a zero
    gradient would still move rows, and (rpc) with the step's prefetched lookup discarded (its
    forward ran on another batch), pooling on the trainers and on the servers; for both gradient
    pushes (distributed autograd cannot pool on the servers)."""
    configs = [("ddp", "row_wise", "adam")]
    if push == "rpc":
        configs.append(("ddp", "table_wise+pool_on_server", "adam"))
    out = run_distributed(_aborted, 3, setup="hybrid", num_servers=1, timeout=150, configs=configs, abort=3,
                          push=push)
    for r in out[:2]:
        assert r == {c: ["user error in step 3"] for c in configs}


def _second_batch(s: int, n: int) -> dict:
    """Step ``s``'s other global sparse batch for :class:`TwiceDLRM`: on odd steps the step's own
    batch again (the trainers pass the same object twice), on even ones another."""
    return global_data(s, n)[2] if s % 2 else global_batch(s, TABLES, n, seed=3000)


def _twice(rank, world_size, *, num_servers, configs, push):
    """Sync training of :class:`TwiceDLRM` -- two lookups of the remote collection in each step,
    the first one prefetched -- against one process doing the same on the global batches."""
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    t_n, me = role.num_trainers, role.index
    lo, hi = me * B, (me + 1) * B
    steps = 8
    report = {}
    for ci, (dense, sharding, opt) in enumerate(configs):
        model = build_dlrm(cls=TwiceDLRM)
        ref = _Reference(opt, lambda params, opt=opt: dense_opt(opt, params), cls=TwiceDLRM,
                         sparse=lambda s, n: [global_data(s, n)[2], _second_batch(s, n)])
        hybrid.compose(model, make_plan(dense, sharding, opt, num_servers, world_size), role=role, name=f"w{ci}",
                       runtime_options=RuntimeOptions(gradient_push=push))
        optimizer = dense_opt(opt, model.parameters())
        kjt = kjt_slice(global_data(0, t_n * B)[2], lo, hi)
        losses, ref_losses = [], []
        for s in range(steps):
            dense_x, labels, _ = global_data(s, t_n * B)
            nxt = kjt_slice(global_data(s + 1, t_n * B)[2], lo, hi)
            other = kjt if s % 2 else kjt_slice(_second_batch(s, t_n * B), lo, hi)
            with hybrid.step(model, optimizer) as st:
                logits = model(dense_x[lo:hi], kjt, other).squeeze(1)
                st.prefetch(nxt)
                loss = F.binary_cross_entropy_with_logits(logits, labels[lo:hi])
                st.backward(loss)
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / t_n)
            ref_losses.append(ref.step(s, t_n * B))
            kjt = nxt
        got = {k: full(v).detach() for k, v in model.state_dict().items()}
        want = ref.model.state_dict()
        assert list(got) == list(want)
        init = build_dlrm(plain=True).state_dict()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{push} {dense}/{sharding}/{opt} {k}: {m}")
            assert not torch.equal(got[k], init[k]), f"{k} did not change in {dense}/{sharding}/{opt}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
        report[(dense, sharding, opt)] = model.sparse_arch.embedding_bag_collection.stats()["ps0"]["updates_applied"]
    return report


@pytest.mark.parametrize("push", ["rpc", "dist_autograd"])
def test_a_step_that_looks_a_collection_up_twice_equals_single_process_training(push):
    """A model whose step runs the remote collection's forward twice -- on two batches, or twice
    on the same one -- trains as one process does on the global batches, for both gradient
    pushes: each server applies a step once, with both trainers' gradients of both lookups (a
    server that counted each lookup's push as a trainer's would apply a step before the other
    trainer's gradient is in, and apply it twice)."""
    configs = [("ddp", "row_wise", "adagrad"), ("fsdp", "table_wise", "sgd")]
    if push == "rpc":
        configs.append(("ddp", "table_wise+pool_on_server", "adagrad"))
    out = run_distributed(_twice, 3, setup="hybrid", num_servers=1, timeout=180, configs=configs, push=push)
    for r in out[:2]:
        assert r == {c: 8 for c in configs}, r


class _PositionWeighted(torch.nn.Module):
    """TorchRec's FeatureProcessedEmbeddingBagCollection (learned position weights before a
    weighted collection) and a tower."""

    def __init__(self, device: str = "cpu") -> None:
        from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
        from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

        super().__init__()
        ebc = EmbeddingBagCollection(tables=copy.deepcopy(TABLES), is_weighted=True, device=torch.device(device))
        pw = PositionWeightedModuleCollection({t.feature_names[0]: 4 for t in TABLES})
        self.fpebc = FeatureProcessedEmbeddingBagCollection(ebc, pw)
        torch.manual_seed(0)
        self.tower = torch.nn.Linear(4 * 8, 1)

    def forward(self, kjt):
        return self.tower(self.fpebc(kjt).values())


def _position_weighted(rank, world_size, *, num_servers):
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    lr = 0.5
    plan = plan_from_dict({"world_size": world_size, "topology": {"parameter_servers": num_servers}, "modules": {
        "fpebc._embedding_bag_collection": {"strategy": "parameter_server", "sharding": "row_wise",
                                           "optimizer": {"name": "sgd", "lr": lr}},
        "fpebc._feature_processors": {"strategy": "ddp"}, "tower": {"strategy": "ddp"}}})
    model, plain = _PositionWeighted("meta"), _PositionWeighted()
    hybrid.init_tables(plain.fpebc._embedding_bag_collection, seed=0)
    hybrid.compose(model, plan, role=role, name="pw")
    for k, v in plain.state_dict().items():
        assert torch.equal(full(model.state_dict()[k]), v), k
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    tables = {n: b.weight for n, b in plain.fpebc._embedding_bag_collection.embedding_bags.items()}
    ref_opt = torch.optim.SGD([p for n, p in plain.named_parameters() if "embedding_bags" not in n], lr=lr)
    ref_sparse = {n: ReferenceSparseOptimizer("sgd", w.data, lr=lr) for n, w in tables.items()}
    t_n, lo, hi = role.num_trainers, role.index * B, (role.index + 1) * B
    nxt = global_data(0, t_n * B)
    for s in range(5):
        _, labels, data = nxt
        with hybrid.step(model, optimizer) as st:
            logits = model(kjt_slice(data, lo, hi)).squeeze(1)
            nxt = global_data(s + 1, t_n * B)
            st.prefetch(kjt_slice(nxt[2], lo, hi))  # the raw batch: the forward computes its weights
            st.backward(F.binary_cross_entropy_with_logits(logits, labels[lo:hi]))
        ref_opt.zero_grad()
        for w in tables.values():
            w.grad = None
        F.binary_cross_entropy_with_logits(plain(kjt_slice(data, 0, t_n * B)).squeeze(1), labels).backward()
        ref_opt.step()
        touched = touched_rows(data, TABLES)
        for n, w in tables.items():
            ref_sparse[n].step(w.grad, touched[n])
    got, want = model.state_dict(), plain.state_dict()
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(full(got[k]).detach(), want[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
    moved = got["fpebc._feature_processors.position_weights.f0"]
    assert not torch.equal(moved, torch.ones(4))  # the position weights learned
    return True


def test_feature_processed_collection_learns_its_position_weights_with_tables_on_a_server():
    assert all(run_distributed(_position_weighted, 3, setup="hybrid", num_servers=1, timeout=120)[:2])
