"""``wire_dtype`` without processes: the plan option's checks, and the two ends of a conversion --
a server shard's replies and gradients (``CollectionShard``) and the trainer's router -- in this
process. The distributed test is ``tests/distributed/test_ps_wire.py``."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybrid.plan import PlanError, load_plan, plan_from_dict
from hybrid.plan.schema import PSOptions
from hybrid.ps.client.routing import Router
from hybrid.ps.config import CollectionConfig, OptimizerSpec
from hybrid.ps.protocol import Rows
from hybrid.ps.server.shard import CollectionShard
from hybrid.ps.sharding import TableSpec, shard_tables
from tests.unit.test_plan_models import PS_RULE

PLANS = Path(__file__).resolve().parents[2] / "conf" / "plans"
ALLOWED = r"expected one of 'float32', 'bfloat16'"
TABLES = (TableSpec("a", 50, 4, ("fa",)), TableSpec("b", 30, 8, ("fb",), pooling="mean"))


@pytest.mark.parametrize("value", ["float16", "bf16", 16])
def test_a_bad_wire_dtype_names_the_key_and_the_allowed_values(value):
    with pytest.raises(PlanError, match=rf"modules\.e\.wire_dtype: got {value!r}.*; {ALLOWED}") as e:
        plan_from_dict({"modules": {"e": {**PS_RULE, "wire_dtype": value}}})
    assert e.value.category == "bad_value"


def test_wire_dtype_loads_from_a_plan_and_an_override_and_defaults_to_float32():
    key = "sparse_arch.embedding_bag_collection"
    assert load_plan(PLANS / "dlrm.yaml").modules[key].options.wire_dtype == "float32"
    plan = load_plan(PLANS / "dlrm.yaml", [f"modules.{key}.wire_dtype=bfloat16"])
    assert plan.modules[key].options.wire_dtype == "bfloat16"
    with pytest.raises(PlanError, match=rf"override 'modules\.{key}\.wire_dtype=int8': "
                                        rf"modules\.{key}\.wire_dtype: got 'int8'; {ALLOWED}"):
        load_plan(PLANS / "dlrm.yaml", [f"modules.{key}.wire_dtype=int8"])


def test_typed_configs_built_in_python_check_wire_dtype_too():
    with pytest.raises(PlanError, match=rf"wire_dtype: got 'float16'; {ALLOWED}"):
        PSOptions(optimizer=OptimizerSpec(name="sgd"), wire_dtype="float16")
    with pytest.raises(PlanError, match=rf"wire_dtype: got 'half'; {ALLOWED}") as e:
        _config("half")
    assert e.value.key == "wire_dtype"


def _config(wire_dtype: str, *, storage_dtype: str = "float32", name: str = "adagrad") -> CollectionConfig:
    return CollectionConfig(cid="ebc", tables=TABLES, layouts=tuple(shard_tables(list(TABLES), 1, "table_wise")),
                            optimizer=OptimizerSpec(name=name, lr=0.1), num_trainers=1, wire_dtype=wire_dtype,
                            storage_dtype=storage_dtype)


def _shard(wire_dtype: str, **kw) -> CollectionShard:
    shard = CollectionShard(_config(wire_dtype, **kw), 0, start_step=0, huge_pages=False)
    for t in shard.tables:
        t.initialize(3)
    return shard


ROWS = Rows([0, 1], [3, 2], torch.tensor([1, 7, 49, 0, 29]))


def _flat(shard: CollectionShard, rows: Rows) -> torch.Tensor:
    """The rows' float32 values as the tables hold them, flat."""
    return torch.cat([shard.by_index[t].weight[i].float().reshape(-1)
                      for t, i in zip(rows.tables, rows.ids.split(rows.counts))])


@pytest.mark.parametrize("storage_dtype", ["float32", "bfloat16"])
def test_a_bfloat16_reply_is_each_row_rounded_to_nearest_even_into_the_given_buffer(storage_dtype):
    shard = _shard("bfloat16", storage_dtype=storage_dtype)
    full = _flat(shard, ROWS)
    got = shard.gather(ROWS)
    assert got.dtype == torch.bfloat16 and torch.equal(got, full.to(torch.bfloat16))
    if storage_dtype == "bfloat16":
        assert torch.equal(got.float(), full)  # stored in 16 bits already: nothing is lost
    else:
        assert not torch.equal(got.float(), full)
    out = torch.full((64,), -1.0, dtype=torch.bfloat16)  # a transport's buffer, larger than the reply
    shard.gather(ROWS, out=out)
    assert torch.equal(out[: got.numel()], got)
    assert shard.counters.bytes_out == 2 * 2 * got.numel()  # two replies, 2 bytes an element
    assert torch.equal(_shard("float32", storage_dtype=storage_dtype).gather(ROWS), full)


def test_a_server_widens_bfloat16_gradients_before_its_optimizer_and_refuses_another_dtype():
    grad = torch.randn(3 * 4 + 2 * 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    low, ref = _shard("bfloat16"), _shard("float32")
    low.push(0, 0, [(ROWS, grad)])
    ref.push(0, 0, [(ROWS, grad.float())])  # the same values, sent as float32
    for a, b in zip(low.tables, ref.tables):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.optim.state["sum"], b.optim.state["sum"])
    assert low.counters.bytes_in == 2 * grad.numel()
    with pytest.raises(TypeError, match=r"a gradient of torch\.float32; this collection's wire_dtype is bfloat16"):
        _shard("bfloat16").push(0, 0, [(ROWS, grad.float())])


def test_the_router_computes_in_float32_and_rounds_the_rows_gradient_once_to_the_wire_dtype():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["fa", "fb"], values=torch.tensor([1, 7, 1, 49, 0, 29, 0]),
                                              lengths=torch.tensor([2, 2, 0, 3]))
    router = Router(_config("bfloat16"))
    routed = router.route(kjt, where="test")
    reply = _shard("bfloat16").gather(routed.requests[0])
    c = torch.linspace(-1, 1, 4 + 8)
    pooled, grads = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        leaf = reply.to(dtype).detach().requires_grad_(True)
        pooled[dtype] = router.pool(routed, {0: leaf})
        ((pooled[dtype] @ c) ** 2).sum().backward()
        grads[dtype] = leaf.grad
    assert pooled[torch.bfloat16].dtype == torch.float32
    assert torch.equal(pooled[torch.bfloat16], pooled[torch.float32])
    assert grads[torch.bfloat16].dtype == torch.bfloat16
    assert torch.equal(grads[torch.bfloat16], grads[torch.float32].to(torch.bfloat16))
