"""Loading plan YAML onto the typed schema: defaults, overrides, and every load-time error."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hybrid.plan import (
    DDPOptions,
    FSDPOptions,
    LocalOptions,
    MixedPrecision,
    PlanError,
    PSOptions,
    SparseOptimizer,
    load_plan,
    plan_from_dict,
)
from tests.unit.test_plan_models import EBC, PS_RULE, write

PLANS = Path(__file__).resolve().parents[2] / "conf" / "plans"


def test_shipped_dlrm_plan_loads_with_the_documented_values():
    plan = load_plan(PLANS / "dlrm.yaml")
    assert (plan.model, plan.world_size, plan.topology.parameter_servers, plan.topology.backend) == ("dlrm", 3, 1, "auto")
    ps = plan.modules[EBC]
    assert ps.strategy == "parameter_server"
    assert ps.options == PSOptions(sharding="row_wise", optimizer=SparseOptimizer(name="rowwise_adagrad", lr=0.05))
    assert plan.modules["dense_arch"].options == DDPOptions()
    assert plan.modules["over_arch"].options == FSDPOptions(reshard_after_forward=True)
    assert plan.modules["*"].strategy == "ddp" and plan.default_rule is plan.modules["*"]
    assert plan.sync.staleness == 0 and plan.sync.gradient_scaling == "mean"
    line = (PLANS / "dlrm.yaml").read_text().splitlines().index("  dense_arch:") + 1
    assert plan.source.endswith("dlrm.yaml") and plan.modules["dense_arch"].where.endswith(f"dlrm.yaml:{line}")


@pytest.mark.parametrize("name, model", [("dcn", "dcn"), ("two_tower", "two_tower")])
def test_other_shipped_plans_load(name, model):
    plan = load_plan(PLANS / f"{name}.yaml")
    assert plan.model == model and plan.world_size == 3
    assert "*" in plan.modules
    assert any(r.strategy == "parameter_server" for r in plan.modules.values())


def test_defaults_fill_missing_and_empty_sections(tmp_path):
    plan = load_plan(write(tmp_path, """
        topology:      # only a comment below: means all defaults
        modules:
          "*": {strategy: local}
    """))
    assert plan.topology.parameter_servers == 1 and plan.sync.staleness == 0
    assert plan.model is None and plan.world_size is None
    assert plan.modules["*"].options == LocalOptions()


def test_every_option_reads_with_its_type(tmp_path):
    plan = load_plan(write(tmp_path, """
        modules:
          a:
            strategy: fsdp
            reshard_after_forward: false
            mixed_precision: {param_dtype: bfloat16, reduce_dtype: float32}
            cpu_offload: true
            activation_checkpointing: true
            wrap: [Linear, Perceptron]
          b: {strategy: ddp, bucket_cap_mb: 5, static_graph: true, gradient_as_bucket_view: true,
              find_unused_parameters: true, broadcast_buffers: false, comm_hook: bf16}
          c:
            strategy: parameter_server
            sharding: table_wise
            servers: [1, 0]
            id_policy: modulo
            optimizer: {name: adam, lr: 1e-3, eps: 1e-6, beta1: 0.8, beta2: 0.99, weight_decay: 0.1}
    """))
    assert plan.modules["a"].options == FSDPOptions(
        reshard_after_forward=False,
        mixed_precision=MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32"),
        cpu_offload=True,
        activation_checkpointing=True,
        wrap=["Linear", "Perceptron"],
    )
    assert plan.modules["b"].options == DDPOptions(
        bucket_cap_mb=5.0, static_graph=True, gradient_as_bucket_view=True, find_unused_parameters=True,
        broadcast_buffers=False, comm_hook="bf16"
    )
    c = plan.modules["c"].options
    assert (c.sharding, c.servers, c.id_policy) == ("table_wise", [1, 0], "modulo")
    assert c.optimizer == SparseOptimizer(name="adam", lr=1e-3, eps=1e-6, beta1=0.8, beta2=0.99, weight_decay=0.1)


def test_overrides_top_level_and_rules():
    plan = load_plan(
        PLANS / "dlrm.yaml",
        [
            "topology.parameter_servers=2",
            "world_size=5",
            "sync.staleness=1",
            "modules.over_arch.strategy=ddp",  # resets the fsdp options of the file
            "modules.over_arch.bucket_cap_mb=10",
            f"modules.{EBC}.sharding=table_wise",  # dotted module path, found in the file
            f"modules.{EBC}.optimizer.lr=1e-3",
            f"modules.{EBC}.servers=[0,1]",
            'modules."*".strategy=fsdp',
            "modules.inter_arch.foo.strategy=local",  # a new rule: the path ends at the option name
        ],
    )
    assert plan.topology.parameter_servers == 2 and plan.world_size == 5 and plan.sync.staleness == 1
    assert plan.modules["over_arch"].options == DDPOptions(bucket_cap_mb=10.0)
    ps = plan.modules[EBC].options
    assert (ps.sharding, ps.optimizer.lr, ps.servers, ps.optimizer.name) == ("table_wise", 1e-3, [0, 1], "rowwise_adagrad")
    assert plan.modules["*"].strategy == "fsdp"
    assert plan.modules["inter_arch.foo"].strategy == "local"


def test_override_of_nested_option_and_whole_rule():
    plan = plan_from_dict(
        {"modules": {"over_arch": {"strategy": "fsdp"}}},
        ["modules.over_arch.mixed_precision.param_dtype=bfloat16", "modules.dense_arch={strategy: ddp, static_graph: true}"],
    )
    assert plan.modules["over_arch"].options.mixed_precision == MixedPrecision(param_dtype="bfloat16")
    assert plan.modules["dense_arch"].options == DDPOptions(static_graph=True)


def test_plan_from_dict_accepts_an_omegaconf_config():
    cfg = OmegaConf.create({"topology": {"parameter_servers": 2}, "modules": {"x": {"strategy": "local"}}})
    plan = plan_from_dict(cfg)
    assert plan.topology.parameter_servers == 2 and plan.modules["x"].key == "x"


def test_python_object_tag_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    path = write(tmp_path, f"""
        model: dlrm
        modules:
          a: !!python/object/apply:os.system ["touch {marker}"]
    """)
    with pytest.raises(PlanError, match=r"plan\.yaml:3:6: refusing YAML tag '!!python/object/apply:os\.system'") as e:
        load_plan(path)
    assert e.value.category == "unsafe_yaml" and "may not construct Python objects" in str(e.value)
    assert not marker.exists()


def test_unknown_tag_is_refused(tmp_path):
    with pytest.raises(PlanError, match=r"plan\.yaml:1:8: refusing YAML tag '!env'") as e:
        load_plan(write(tmp_path, "model: !env HOME\n"))
    assert e.value.category == "unsafe_yaml"


def test_bad_yaml_names_file_line_and_column(tmp_path):
    path = write(tmp_path, """
        modules:
          dense_arch:
            strategy: ddp
           bucket_cap_mb: 3
    """)
    with pytest.raises(PlanError, match=r"plan\.yaml:4:4: invalid YAML: did not find expected key") as e:
        load_plan(path)
    assert e.value.category == "yaml_syntax"


def test_unquoted_star_key_gets_a_hint(tmp_path):
    with pytest.raises(PlanError, match=r'plan\.yaml:2:4: .*quote it, as in "\*":'):
        load_plan(write(tmp_path, "modules:\n  *:\n    strategy: ddp\n"))


def test_duplicate_key_is_an_error(tmp_path):
    path = write(tmp_path, """
        modules:
          dense_arch: {strategy: ddp}
          dense_arch: {strategy: fsdp}
    """)
    with pytest.raises(PlanError, match=r"plan\.yaml:3:3: duplicate key 'dense_arch'.*merge the two") as e:
        load_plan(path)
    assert e.value.category == "yaml_syntax"


def test_missing_file(tmp_path):
    with pytest.raises(PlanError, match=r"nope\.yaml: cannot read the plan file") as e:
        load_plan(tmp_path / "nope.yaml")
    assert e.value.category == "io"


def test_schema_error_names_file_line_and_key(tmp_path):
    path = write(tmp_path, """
        modules:
          dense_arch:
            strategy: ddp
            bucket_cap: 3
    """)
    with pytest.raises(
        PlanError,
        match=r"plan\.yaml:4: modules\.dense_arch\.bucket_cap: unknown option 'bucket_cap' for strategy ddp "
        r"\(did you mean 'bucket_cap_mb'\?\); ddp options: bucket_cap_mb, static_graph",
    ) as e:
        load_plan(path)
    assert e.value.category == "unknown_key" and e.value.key == "modules.dense_arch.bucket_cap"


def test_dynamic_ids_without_capacity_name_the_ids_line(tmp_path):
    path = write(tmp_path, """
        modules:
          ebc:
            strategy: parameter_server
            optimizer: {name: sgd, lr: 0.1}
            ids: dynamic
    """)
    with pytest.raises(PlanError, match=r"plan\.yaml:5: modules\.ebc\.ids: 'dynamic' needs capacity"):
        load_plan(path)


# (plan dict, category, message regex): every load-time category, with key, value and fix.
LOAD_ERRORS = [
    ({"topolgy": {}}, "unknown_key", r"^topolgy: unknown key 'topolgy' \(did you mean 'topology'\?\); a plan has model, world_size, topology, modules, sync"),
    ({"topology": {"servers": 2}}, "unknown_key", r"topology\.servers: unknown key 'servers'; known keys here: parameter_servers, backend"),
    ({"topology": {"parameter_servers": -1}}, "topology", r"topology\.parameter_servers: got -1; expected an integer >= 0"),
    ({"topology": {"parameter_servers": "two"}}, "bad_value", r"topology\.parameter_servers: got 'two'; expected an integer"),
    ({"topology": {"backend": "mpi"}}, "bad_value", r"topology\.backend: got 'mpi'; expected one of 'auto', 'gloo', 'nccl'"),
    ({"topology": 3}, "bad_value", r"topology: got 3; expected a mapping with keys parameter_servers, backend"),
    ({"world_size": 0}, "topology", r"world_size: got 0; expected a number of processes >= 1"),
    ({"sync": {"staleness": -2}}, "bad_value", r"sync\.staleness: got -2; expected 0 \(sync\) or an integer k >= 1"),
    ({"sync": {"gradient_scaling": "avg"}}, "bad_value", r"sync\.gradient_scaling: got 'avg'; expected one of 'mean', 'sum'"),
    ([1, 2], "bad_value", r"a plan is a mapping with keys model, world_size"),
    ({"modules": [1]}, "bad_value", r"modules: got \[1\]; expected a mapping of module path"),
    ({"modules": {"d": "ddp"}}, "bad_value", r"modules\.d: got 'ddp'; a rule is a mapping .* e\.g\. d: \{strategy: ddp\}"),
    ({"modules": {"d": {}}}, "bad_value", r"modules\.d\.strategy: missing; expected one of 'fsdp', 'ddp', 'parameter_server', 'local'"),
    ({"modules": {"d": {"strategy": "dpp"}}}, "bad_value", r"modules\.d\.strategy: got 'dpp' \(did you mean 'ddp'\?\); expected one of 'fsdp'"),
    ({"modules": {"d": {"strategy": "ddp", "reshard_after_forward": True}}}, "unknown_key",
     r"modules\.d\.reshard_after_forward: .*it is an option of fsdp, not ddp; ddp options: bucket_cap_mb"),
    ({"modules": {"d": {"strategy": "local", "x": 1}}}, "unknown_key", r"modules\.d\.x: unknown option 'x' for strategy local; local options: none"),
    ({"modules": {"d": {"strategy": "ddp", "bucket_cap_mb": "big"}}}, "bad_value", r"modules\.d\.bucket_cap_mb: got 'big'; expected a number"),
    ({"modules": {"d": {"strategy": "ddp", "bucket_cap_mb": 0}}}, "bad_value", r"modules\.d\.bucket_cap_mb: got 0\.0; expected a size in MiB > 0"),
    ({"modules": {"d": {"strategy": "ddp", "comm_hook": "int8"}}}, "bad_value", r"modules\.d\.comm_hook: got 'int8'; expected one of 'none', 'fp16', 'bf16'"),
    ({"modules": {"d": {"strategy": "ddp", "broadcast_buffers": "sometimes"}}}, "bad_value",
     r"modules\.d\.broadcast_buffers: got 'sometimes'; expected true, false or 'auto'"),
    ({"modules": {"d": {"strategy": "ddp", "broadcast_buffers": 1}}}, "bad_value", r"modules\.d\.broadcast_buffers: got 1; expected true, false or 'auto'"),
    ({"modules": {"d": {"strategy": "ddp", "static_graph": "maybe"}}}, "bad_value", r"modules\.d\.static_graph: got 'maybe'; expected true or false"),
    ({"modules": {"d": {"strategy": "fsdp", "mixed_precision": {"param_dtype": "bf16"}}}}, "bad_value",
     r"modules\.d\.mixed_precision\.param_dtype: got 'bf16' \(did you mean 'bfloat16'\?\); expected one of 'float32', 'bfloat16', 'float16'"),
    ({"modules": {"d": {"strategy": "fsdp", "mixed_precision": {"param": "bf16"}}}}, "unknown_key",
     r"modules\.d\.mixed_precision\.param: unknown key 'param' \(did you mean 'param_dtype'\?\); known keys here: param_dtype, reduce_dtype"),
    ({"modules": {"d": {"strategy": "fsdp", "mixed_precision": "bf16"}}}, "bad_value",
     r"modules\.d\.mixed_precision: got 'bf16'; expected a mapping with keys param_dtype, reduce_dtype or null"),
    ({"modules": {"d": {"strategy": "fsdp", "wrap": "Linear"}}}, "bad_value", r"modules\.d\.wrap: got 'Linear'; expected a list of strings"),
    ({"modules": {"d": {"strategy": "fsdp", "wrap": ["not a class"]}}}, "bad_value", r"modules\.d\.wrap\.0: got 'not a class'; expected a module class name"),
    ({"modules": {"e": {"strategy": "parameter_server"}}}, "bad_value", r"modules\.e\.optimizer: required; expected a mapping with keys name, lr, eps"),
    ({"modules": {"e": {"strategy": "parameter_server", "optimizer": {"lr": 1}}}}, "bad_value",
     r"modules\.e\.optimizer\.name: required; expected one of 'sgd', 'adagrad', 'rowwise_adagrad', 'adam'"),
    ({"modules": {"e": {"strategy": "parameter_server", "optimizer": {"name": "adamw"}}}}, "unknown_optimizer",
     r"modules\.e\.optimizer\.name: unknown sparse optimizer 'adamw' \(did you mean 'adam'\?\); the servers implement one of 'sgd', 'adagrad', 'rowwise_adagrad', 'adam'"),
    ({"modules": {"e": {**PS_RULE, "optimizer": {"name": "sgd", "lr": 0}}}}, "bad_value", r"modules\.e\.optimizer\.lr: got 0\.0; expected a learning rate > 0"),
    ({"modules": {"e": {**PS_RULE, "optimizer": {"name": "adam", "beta2": 1}}}}, "bad_value", r"modules\.e\.optimizer\.beta2: got 1\.0; expected a value in \[0, 1\)"),
    ({"modules": {"e": {**PS_RULE, "optimizer": "sgd"}}}, "bad_value", r"modules\.e\.optimizer: got 'sgd'; expected a mapping with keys name"),
    ({"modules": {"e": {**PS_RULE, "servers": "some"}}}, "bad_value", r"modules\.e\.servers: got 'some'; expected 'all' or a list of server indices"),
    ({"modules": {"e": {**PS_RULE, "servers": 1}}}, "bad_value", r"modules\.e\.servers: got 1; expected a list of integers or 'all'"),
    ({"modules": {"e": {**PS_RULE, "servers": [0, 0]}}}, "bad_value", r"modules\.e\.servers: got \[0, 0\]; expected distinct server indices >= 0"),
    ({"modules": {"e": {**PS_RULE, "servers": []}}}, "bad_value", r"modules\.e\.servers: got \[\]; expected 'all' or a non-empty list"),
    ({"modules": {"e": {**PS_RULE, "sharding": "column_wise"}}}, "bad_value",
     r"modules\.e\.sharding: got 'column_wise' \(did you mean 'row_wise'\?\); expected one of 'table_wise', 'row_wise'"),
    ({"modules": {"e": {**PS_RULE, "id_policy": "clamp"}}}, "bad_value", r"modules\.e\.id_policy: got 'clamp'; expected one of 'error', 'modulo'"),
    ({"modules": {"e": {**PS_RULE, "ids": "dynamic", "capacity": 9, "admit_window": 5}}}, "bad_value",
     r"modules\.e\.admit_window: got 5; expected 0 with admit_after: 1 \(every id gets a row on first touch"),
    ({"modules": {"e": {**PS_RULE, "ids": "dynamic", "capacity": 9, "admit_after": 2, "admit_window": -1}}}, "bad_value",
     r"modules\.e\.admit_window: got -1; expected a number of steps >= 0 \(0: sightings never forgotten\)"),
    ({"modules": {"e": {**PS_RULE, "ids": "dynamic"}}}, "bad_value",
     r"modules\.e\.ids: 'dynamic' needs capacity, the rows per table over all servers \(>= 1\); this rule has none"),
    ({"modules": {"e": {**PS_RULE, "ids": "dynamic", "capacity": -3}}}, "bad_value",
     r"modules\.e\.capacity: got -3; expected a number of rows >= 1 with ids: dynamic"),
    ({"modules": {"e": {**PS_RULE, "capacity": 100}}}, "bad_value",
     r"modules\.e\.capacity: got 100, which only ids: dynamic reads, and this rule has ids: range; remove it or set ids: dynamic"),
    ({"modules": {"e": {**PS_RULE, "evict": "lru"}}}, "bad_value", r"modules\.e\.evict: got 'lru', which only ids: dynamic reads"),
    ({"modules": {"e": {**PS_RULE, "partitions": 4}}}, "bad_value", r"modules\.e\.partitions: got 4, which only ids: dynamic reads"),
    ({"modules": {"e": {**PS_RULE, "admit_after": 2}}}, "bad_value", r"modules\.e\.admit_after: got 2, which only ids: dynamic reads"),
    ({"modules": {"e": {**PS_RULE, "admit_window": 3}}}, "bad_value", r"modules\.e\.admit_window: got 3, which only ids: dynamic reads"),
]


@pytest.mark.parametrize("d, category, message", LOAD_ERRORS, ids=[m[:40] for _, _, m in LOAD_ERRORS])
def test_load_errors(d, category, message):
    with pytest.raises(PlanError, match=message) as e:
        plan_from_dict(d)
    assert e.value.category == category


OVERRIDE_ERRORS = [
    (["nokey"], "bad_override", r"^command line: override 'nokey' is not key=value; e\.g\. topology\.parameter_servers=2"),
    (['modules."a.x=1'], "bad_override", r"override 'modules\.\"a\.x=1': cannot parse the key 'modules\.\"a\.x'"),
    (["sync.staleness=[1,"], "bad_override", r"override 'sync\.staleness=\[1,': cannot read the value '\[1,'"),
    (['world_size=!!python/object/apply:os.system ["true"]'], "unsafe_yaml", r"cannot read the value .*could not determine a constructor"),
    (["topology.parameter_servers.x=1"], "bad_override", r"override 'topology\.parameter_servers\.x=1': topology\.parameter_servers: cannot set 'x' inside it: it is 1"),
    (["topology.parameter_servers=x"], "bad_value", r"^override 'topology\.parameter_servers=x': topology\.parameter_servers: got 'x'; expected an integer"),
    (["topolgy.parameter_servers=2"], "unknown_key", r"override 'topolgy\.parameter_servers=2': topolgy: unknown key 'topolgy' \(did you mean 'topology'\?\)"),
    (["modules.dense_arch.strategy=fsdp", "modules.dense_arch.bucket_cap_mb=3"], "unknown_key",
     r"override 'modules\.dense_arch\.bucket_cap_mb=3': modules\.dense_arch\.bucket_cap_mb: .*it is an option of ddp, not fsdp"),
    # the mistake is named where it was made: the override that asked for dynamic ids, or the one
    # that gave a dynamic-only option to a rule with ids: range
    (["modules.sparse_arch.embedding_bag_collection.ids=dynamic"], "bad_value",
     r"^override 'modules\.sparse_arch\.embedding_bag_collection\.ids=dynamic': modules\.sparse_arch\.embedding_bag_collection\.ids: "
     r"'dynamic' needs capacity"),
    (["modules.sparse_arch.embedding_bag_collection.capacity=100"], "bad_value",
     r"^override 'modules\.sparse_arch\.embedding_bag_collection\.capacity=100': .*capacity: got 100, which only ids: dynamic reads"),
]


@pytest.mark.parametrize("overrides, category, message", OVERRIDE_ERRORS)
def test_override_errors_name_the_override(overrides, category, message):
    with pytest.raises(PlanError, match=message) as e:
        load_plan(PLANS / "dlrm.yaml", overrides)
    assert e.value.category == category


def test_plan_error_keeps_key_category_and_location():
    with pytest.raises(PlanError) as e:
        plan_from_dict({"sync": {"staleness": -1}})
    err = e.value
    assert isinstance(err, ValueError)
    assert (err.category, err.key, err.where) == ("bad_value", "sync.staleness", "")
    assert str(err.under("x").at("f.yaml:3")) == "f.yaml:3: x.sync.staleness: " + err.detail


@pytest.mark.parametrize("override,message", [
    ("runtime.kill_grace_s=-1", r"runtime\.kill_grace_s: got -1\.0; expected a number of seconds above 0"),
    ("runtime.rpc_timeout_s=0", r"runtime\.rpc_timeout_s: got 0\.0; expected a number of seconds above 0"),
    ("runtime.pg_timeout_s=nan", r"runtime\.pg_timeout_s: got nan; expected"),
    ("runtime.num_worker_threads=0", r"runtime\.num_worker_threads: got 0; expected at least 1"),
    ("runtime.transports=[ibv]", r"runtime\.transports: got \['ibv'\]; expected a non-empty list of 'uv', 'shm'"),
    ("runtime.channels=[]", r"runtime\.channels: got \[\]; expected a non-empty list of 'basic'"),
])
def test_runtime_values_are_checked_and_named(override, message):
    """Timeouts, threads and TensorPipe's transports and channels are checked before any process
    starts (else torch fails later with its own words, from every process)."""
    from hybrid.train.config import load_config

    with pytest.raises(PlanError, match=message):
        load_config(None, [override], model="dlrm")


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    from hybrid.plan import load_plan
    from hybrid.train.config import load_config

    bad = tmp_path / "p.yaml"
    bad.write_bytes(b"world_size: 3\nmodules:\n  x: {strategy: ddp}  # gr\xfc\xdfe\n")
    with pytest.raises(PlanError, match=r"p\.yaml:3: the plan file is not UTF-8 text \(byte 0xfc\)"):
        load_plan(bad)
    with pytest.raises(PlanError, match=r"p\.yaml:3: the training config file is not UTF-8 text"):
        load_config(str(bad), [], model="dlrm")


def test_runtime_gradient_push_is_checked_and_named():
    from hybrid.train.config import load_config

    assert load_config(None, [], model="dlrm").runtime.gradient_push == "rpc"
    assert load_config(None, ["runtime.gradient_push=dist_autograd"], model="dlrm").runtime.gradient_push == "dist_autograd"
    with pytest.raises(PlanError, match=r"runtime\.gradient_push: got 'bogus'; expected one of 'rpc', 'dist_autograd'"):
        load_config(None, ["runtime.gradient_push=bogus"], model="dlrm")
