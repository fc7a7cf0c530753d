"""Memory accounting (P2 of issue 18): a server computes the bytes of its shards (rows and
optimizer state) before allocating and refuses a collection that does not fit; ``hybrid launch``
refuses a plan whose servers do not fit this machine; ``hybrid plan show`` prints the same
per-server figures. Built in this process, no RPC."""
from __future__ import annotations

import pytest

from hybrid.errors import PlanError
from hybrid.launch.init import RuntimeOptions
from hybrid.plan import check_server_memory, format_plan, plan_from_dict, resolve, server_table_bytes
from hybrid.ps.config import CollectionConfig, OptimizerSpec, TableSpec
from hybrid.ps.server import memory
from hybrid.ps.server.service import DoesNotFit, ParameterServer, ServerOptions
from hybrid.ps.sharding import shard_tables
from recsys_examples import build_dlrm

TABLES = [TableSpec("small", 10, 4, ("fa",)), TableSpec("big", 1000, 8, ("fb",))]


def _config(sharding: str, num_servers: int) -> CollectionConfig:
    return CollectionConfig(cid="ebc", tables=tuple(TABLES), layouts=tuple(shard_tables(TABLES, num_servers, sharding)),
                            optimizer=OptimizerSpec(name="adagrad", lr=0.1), num_trainers=1)


def test_a_server_counts_rows_and_optimizer_state_of_what_it_holds():
    # adagrad keeps one float per element: 2 x dim floats per row.
    assert _config("table_wise", 1).bytes_on(0) == {"small": 10 * 8 * 4, "big": 1000 * 16 * 4}
    row_wise = _config("row_wise", 3)
    assert row_wise.bytes_on(1) == {"small": 3 * 8 * 4, "big": 333 * 16 * 4}  # rows 1, 4, 7 and 1, 4, ..., 997
    assert sum(sum(row_wise.bytes_on(s).values()) for s in range(3)) == 10 * 8 * 4 + 1000 * 16 * 4


def test_a_collection_that_does_not_fit_is_refused_before_anything_is_allocated():
    room, _ = memory.available_memory()
    assert room > 0
    fraction = 1000 * 16 * 4 / room / 2  # half of what the big table needs
    ps = ParameterServer(0, ServerOptions(huge_pages=False, memory_fraction=fraction))
    with pytest.raises(DoesNotFit) as e:
        ps.create(_config("table_wise", 1), start_step=0, init="seed")
    msg = str(e.value)
    assert msg.startswith("ps0 (ebc): tables need 62.8 KiB") and "the largest, big: 62.5 KiB" in msg, msg
    assert f"runtime.server_memory_fraction={fraction:g}" in msg and "GiB available (" in msg, msg
    assert ps.collections == {}
    roomy = ParameterServer(0, ServerOptions(huge_pages=False))
    try:
        roomy.create(_config("table_wise", 1), start_step=0, init="seed")
        assert [t.weight.shape for t in roomy.shard("ebc").tables] == [(10, 4), (1000, 8)]
    finally:
        roomy.close()  # its background fill, which would log after the test's output is gone


def _dlrm_plan(servers: int, rows: int):
    model = build_dlrm(num_embeddings=rows, embedding_dim=16, features=["C1", "C2"], device="meta")
    plan = plan_from_dict({"world_size": 1 + servers, "topology": {"parameter_servers": servers}, "modules": {
        "sparse_arch.embedding_bag_collection": {"strategy": "parameter_server", "sharding": "row_wise",
                                                 "optimizer": {"name": "rowwise_adagrad", "lr": 0.1}},
        "*": {"strategy": "ddp"}}})
    return resolve(plan, model, world_size=1 + servers), model


def test_the_plan_report_prints_the_bytes_of_every_server():
    resolved, model = _dlrm_plan(2, 1001)
    per = server_table_bytes(resolved, model)
    key = "sparse_arch.embedding_bag_collection.t_C1"
    assert per[0][key] == 501 * (16 + 1) * 4 and per[1][key] == 500 * (16 + 1) * 4
    text = format_plan(resolved, model)
    assert text.splitlines()[-1] == "per server (rows + sparse optimizer state): ps0 66.5 KiB, ps1 66.4 KiB", text


def test_a_plan_whose_servers_do_not_fit_this_machine_is_refused():
    resolved, model = _dlrm_plan(2, 10_000_000_000)  # 2 tables x 680 GB
    with pytest.raises(PlanError) as e:
        check_server_memory(resolved, model, fraction=0.8)
    assert e.value.category == "memory"
    assert str(e.value).startswith("ps0, ps1 on this machine: tables need 1266.60 GiB"), str(e.value)
    check_server_memory(*_dlrm_plan(2, 1000), fraction=0.8)  # fits: no error


@pytest.mark.parametrize("fraction", [0.0, 1.5, -0.1])
def test_server_memory_fraction_is_a_share(fraction):
    with pytest.raises(PlanError, match=r"server_memory_fraction: got .*; expected a share of memory in \(0, 1\]"):
        RuntimeOptions(server_memory_fraction=fraction)
