"""Byte estimates and the printed plan table, checked against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from hybrid.plan import PlanError, estimate_memory, format_plan, plan_from_dict, resolve, summarize
from tests.unit.test_plan_models import EBC, PS_RULE, PlainEmbeddings, dlrm, numel

DDP, FSDP = {"strategy": "ddp"}, {"strategy": "fsdp"}
# DLRM over_arch with dim 8, 4 tables: Linear(8 + C(5,2)=18 -> 16) then Linear(16 -> 1).
OVER_ARCH_SHAPES = [(16, 18), (16,), (1, 16), (1,)]


def estimates(modules, world_size=3, servers=1, model=None, **kw):
    model = model or dlrm()
    plan = plan_from_dict({"topology": {"parameter_servers": servers}, "modules": modules})
    r = resolve(plan, model, world_size=world_size)
    return {m.entry.fqn: m for m in estimate_memory(r, model, **kw)}


def test_ddp_holds_params_grads_and_optimizer_state_on_every_trainer():
    model = dlrm()
    for opt, state in (("sgd", 0), ("adagrad", 1), ("adam", 2)):
        est = estimates({EBC: PS_RULE, "*": DDP}, dense_optimizer=opt)
        assert est["dense_arch"].params == numel(model.dense_arch) == 16 * 13 + 16 + 8 * 16 + 8
        assert est["dense_arch"].trainer_bytes == numel(model.dense_arch) * 4 * (2 + state)
        assert est["dense_arch"].server_bytes == {}


@pytest.mark.parametrize("trainers", [1, 2, 3, 5])
def test_fsdp_is_the_dim0_shard_of_ddp(trainers):
    ddp = estimates({EBC: PS_RULE, "*": DDP}, world_size=trainers + 1)["over_arch"].trainer_bytes
    fsdp = estimates({EBC: PS_RULE, "*": FSDP}, world_size=trainers + 1)["over_arch"].trainer_bytes
    by_hand = sum(math.ceil(s[0] / trainers) * math.prod(s[1:]) for s in OVER_ARCH_SHAPES) * 4 * 3
    assert fsdp == by_hand
    # Padding each parameter's rows to a multiple of T costs at most one row per parameter.
    assert ddp / trainers <= fsdp <= ddp / trainers + sum(math.prod(s[1:]) for s in OVER_ARCH_SHAPES) * 12
    if trainers == 1:
        assert fsdp == ddp


def test_row_wise_servers_hold_their_share_of_every_table():
    # 4 tables x 100 rows x dim 8, rowwise_adagrad keeps 1 float per row.
    est = estimates({EBC: PS_RULE, "*": DDP}, world_size=4, servers=2)[EBC]
    assert est.trainer_bytes == 0 and est.params == 4 * 100 * 8
    assert est.server_bytes == {0: 4 * 50 * (8 + 1) * 4, 1: 4 * 50 * (8 + 1) * 4}
    # 3 servers: rows r % 3 == 0 -> 34 rows on ps0, 33 on ps1 and ps2.
    est = estimates({EBC: PS_RULE, "*": DDP}, world_size=4, servers=3)[EBC]
    assert est.server_bytes == {0: 4 * 34 * 9 * 4, 1: 4 * 33 * 9 * 4, 2: 4 * 33 * 9 * 4}
    assert est.max_server_bytes == 4 * 34 * 9 * 4


def test_table_wise_places_whole_tables_and_counts_optimizer_state():
    # Tables of 100, 60, 30, 20 rows (dim 8), adam = 2 * 8 + 1 floats per row: greedy by bytes
    # puts t0 on ps0, then t1, t2 and t3 each on the lighter ps1 (60, 90, then 110 rows).
    rule = {**PS_RULE, "sharding": "table_wise", "optimizer": {"name": "adam"}}
    est = estimates({EBC: rule, "*": DDP}, world_size=4, servers=2, model=dlrm(rows=(100, 60, 30, 20)))[EBC]
    assert est.server_bytes == {0: 100 * (8 + 17) * 4, 1: 110 * (8 + 17) * 4}


def test_servers_subset_leaves_other_servers_empty():
    rule = {**PS_RULE, "servers": [1], "optimizer": {"name": "sgd"}}
    est = estimates({EBC: rule, "*": DDP}, world_size=4, servers=2)[EBC]
    assert est.server_bytes == {0: 0, 1: 4 * 100 * 8 * 4}


def test_plain_torch_embeddings_are_one_table_each():
    est = estimates({"bag": PS_RULE, "emb": {**PS_RULE, "optimizer": {"name": "adagrad"}}, "*": DDP}, model=PlainEmbeddings())
    assert est["bag"].server_bytes == {0: 1000 * (16 + 1) * 4}
    assert est["emb"].server_bytes == {0: 500 * (4 + 4) * 4}
    assert est["head"].trainer_bytes == 21 * 4 * 3


def test_nested_fsdp_counts_each_parameter_once():
    est = estimates({EBC: PS_RULE, "dense_arch": DDP, "over_arch": FSDP, "over_arch.model.1": FSDP})
    assert est["over_arch.model.1"].params == 17
    assert est["over_arch"].params == 16 * 18 + 16
    assert sum(m.params for m in est.values()) == numel(dlrm())


def test_unknown_dense_optimizer():
    with pytest.raises(PlanError, match=r"dense_optimizer: got 'lamb'; expected one of 'sgd', 'adagrad', 'adam'"):
        estimates({"*": DDP}, dense_optimizer="lamb")


def test_format_plan_table():
    model = dlrm()
    plan = plan_from_dict({
        "model": "dlrm",
        "modules": {
            EBC: PS_RULE,
            "dense_arch": {"strategy": "ddp", "bucket_cap_mb": 10, "broadcast_buffers": False, "comm_hook": "bf16"},
            "over_arch": {"strategy": "fsdp", "mixed_precision": {"param_dtype": "bfloat16"}, "wrap": ["Linear"]},
            "*": DDP,
        },
        "sync": {"staleness": 2},
    })
    text = format_plan(resolve(plan, model, world_size=3), model)
    lines = text.splitlines()
    assert lines[0] == (
        "plan (in memory), model dlrm: world size 3 = 2 trainers + 1 parameter server; "
        "async (staleness 2), embedding gradients mean"
    )
    assert lines[1].split() == ["module", "type", "matched", "by", "strategy", "options", "params", "per", "trainer", "per", "server"]
    row = {ln.split()[0]: ln for ln in lines[3:6]}
    assert "parameter_server  row_wise rowwise_adagrad lr=0.05" in row[EBC]
    assert row[EBC].split()[-5:] == ["3,200", "0", "B", "14.1", "KiB"]  # 400 rows x (8 + 1) x 4 B
    assert "bucket=10MB no-buffer-sync bf16-hook" in row["dense_arch"]
    assert row["dense_arch"].split()[-4:] == ["360", "4.2", "KiB", "-"]
    assert "reshard bf16/fp32 wrap=Linear" in row["over_arch"]
    # over_arch wraps Linear: one indented row per FSDP unit (its Linears, then the outer unit).
    units = [ln.split() for ln in lines if "fsdp unit" in ln]
    assert [u[1] for u in units] == ["Linear", "Linear", "(outer"], units
    assert [u[0] for u in units][-1] == "over_arch"
    total = next(ln for ln in lines if ln.startswith("total")).split()
    assert total == ["total", f"{numel(model):,}", "6.2", "KiB", "14.1", "KiB"]
    assert "bytes: params + grads + adagrad state" in lines[-2]
    assert lines[-1] == "per server (rows + sparse optimizer state): ps0 14.1 KiB"


def test_summarize():
    plan = plan_from_dict({"modules": {EBC: PS_RULE, "dense_arch": DDP, "*": FSDP}})
    r = resolve(plan, dlrm(), world_size=3)
    assert summarize(r) == "3 processes = 2 trainers + 1 parameter server; 3 modules (1 parameter_server, 1 ddp, 1 fsdp)"


def test_embedding_collection_tables_are_counted_per_config():
    import torch
    from torch import nn
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    class Sequence(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            configs = [EmbeddingConfig(name=f"s{i}", embedding_dim=4, num_embeddings=10 * (i + 1), feature_names=[f"s{i}"]) for i in range(2)]
            self.ec = EmbeddingCollection(tables=configs, device=torch.device("meta"))
            self.head = nn.Linear(4, 1)

    rule = {**PS_RULE, "sharding": "table_wise", "optimizer": {"name": "sgd"}}
    est = estimates({"ec": rule, "*": DDP}, world_size=3, servers=2, model=Sequence())
    # table_wise: the larger s1 (20 rows) to ps0, then s0 (10 rows) to the lighter ps1.
    assert est["ec"].server_bytes == {0: 20 * 4 * 4, 1: 10 * 4 * 4}
    assert est["ec"].params == 30 * 4
