"""Matching plan rules to a model's modules, and every resolve-time error."""

from __future__ import annotations

import pytest
from torch import nn

from hybrid.plan import CATEGORIES, PlanError, plan_from_dict, resolve
from hybrid.plan.match import _glob_regex
from tests.unit.test_plan_load import LOAD_ERRORS, OVERRIDE_ERRORS
from tests.unit.test_plan_models import EBC, PS_RULE, OwnParams, PlainEmbeddings, dcn, dlrm

DDP, FSDP, LOCAL = {"strategy": "ddp"}, {"strategy": "fsdp"}, {"strategy": "local"}


def resolved(modules, model=None, world_size=3, **top):
    return resolve(plan_from_dict({"modules": modules, **top}), model or dlrm(), world_size=world_size)


def placement(r):
    return {e.fqn: (e.strategy, e.rule_key) for e in r.entries}


def test_exact_rules_and_a_default_that_covers_nothing():
    r = resolved({EBC: PS_RULE, "dense_arch": DDP, "over_arch": FSDP, "*": DDP})
    assert placement(r) == {EBC: ("parameter_server", EBC), "dense_arch": ("ddp", "dense_arch"), "over_arch": ("fsdp", "over_arch")}
    assert [e.module_type for e in r.entries] == ["EmbeddingBagCollection", "DenseArch", "OverArch"]
    assert (r.world_size, r.num_trainers, r.num_servers) == (3, 2, 1)
    assert [e.fqn for e in r.by_strategy("fsdp")] == ["over_arch"]
    assert r.entry("dense_arch").options.bucket_cap_mb == 25.0


def test_default_covers_each_maximal_unruled_subtree_never_the_root():
    r = resolved({EBC: PS_RULE, "*": FSDP})
    # inter_arch has no parameters and the root contains a ruled module.
    assert placement(r) == {EBC: ("parameter_server", EBC), "dense_arch": ("fsdp", "*"), "over_arch": ("fsdp", "*")}


def test_default_alone_covers_the_root():
    assert placement(resolved({"*": FSDP})) == {"": ("fsdp", "*")}


def test_default_goes_as_deep_as_the_rules_force_it():
    # Only the Perceptrons' inner Linear layers are ruled: over_arch.model.1 (a bare Linear) is
    # the one subtree left, so the default covers exactly it.
    r = resolved({EBC: PS_RULE, "**._linear": FSDP, "*": DDP})
    assert placement(r) == {
        EBC: ("parameter_server", EBC),
        "dense_arch.model._mlp.0._linear": ("fsdp", "**._linear"),
        "dense_arch.model._mlp.1._linear": ("fsdp", "**._linear"),
        "over_arch.model.0._mlp.0._linear": ("fsdp", "**._linear"),
        "over_arch.model.1": ("ddp", "*"),
    }


def test_single_star_stays_inside_one_name():
    r = resolved({EBC: PS_RULE, "d*_arch": DDP, "over_arch.model.*": FSDP})
    assert placement(r) == {
        EBC: ("parameter_server", EBC),
        "dense_arch": ("ddp", "d*_arch"),
        "over_arch.model.0": ("fsdp", "over_arch.model.*"),
        "over_arch.model.1": ("fsdp", "over_arch.model.*"),
    }


def test_glob_applies_at_the_outermost_match_and_skips_modules_without_parameters():
    # "*_arch" matches inter_arch too (no parameters: skipped); "dense_arch.**" matches the
    # whole subtree and applies at its top, dense_arch.model.
    r = resolved({"**.embedding_bag_collection": PS_RULE, "[do]*_arch": DDP, "*": LOCAL})
    assert placement(r) == {EBC: ("parameter_server", "**.embedding_bag_collection"), "dense_arch": ("ddp", "[do]*_arch"), "over_arch": ("ddp", "[do]*_arch")}
    r = resolved({EBC: PS_RULE, "dense_arch.**": DDP, "*": LOCAL})
    assert placement(r)["dense_arch.model"] == ("ddp", "dense_arch.**")


def test_double_star_may_match_no_component():
    r = resolved({"**.bag": PS_RULE, "**.emb": PS_RULE, "*": DDP}, model=PlainEmbeddings())
    assert placement(r) == {"bag": ("parameter_server", "**.bag"), "emb": ("parameter_server", "**.emb"), "head": ("ddp", "*")}
    assert _glob_regex("a.**").fullmatch("a.b.c") and not _glob_regex("a.**").fullmatch("a")
    assert not _glob_regex("a.*").fullmatch("a.b.c") and _glob_regex("a.?").fullmatch("a.b")


def test_exact_path_beats_glob():
    r = resolved({EBC: PS_RULE, "**._linear": FSDP, "over_arch.model.0._mlp.0._linear": DDP, "*": DDP})
    assert placement(r)["over_arch.model.0._mlp.0._linear"] == ("ddp", "over_arch.model.0._mlp.0._linear")
    assert placement(r)["dense_arch.model._mlp.0._linear"] == ("fsdp", "**._linear")


def test_equal_globs_that_agree_are_fine():
    r = resolved({EBC: PS_RULE, "dense_arch.*": DDP, "dense_arch.mod*": DDP, "*": DDP})
    assert placement(r)["dense_arch.model"][0] == "ddp"


def test_nested_fsdp_is_allowed_and_applied_inner_first():
    r = resolved({EBC: PS_RULE, "over_arch": FSDP, "over_arch.model.0": FSDP, "over_arch.model.1": FSDP, "dense_arch": DDP})
    assert [e.fqn for e in r.entries] == [EBC, "dense_arch", "over_arch", "over_arch.model.0", "over_arch.model.1"]
    assert [e.fqn for e in r.apply_order()] == [EBC, "dense_arch", "over_arch.model.0", "over_arch.model.1", "over_arch"]


def test_fsdp_on_a_parent_may_own_its_parameters_around_inner_fsdp():
    r = resolved({"": FSDP, "a": FSDP}, model=OwnParams(), world_size=2, topology={"parameter_servers": 0})
    assert [e.fqn for e in r.apply_order()] == ["a", ""]


def test_dcn_cross_net_is_a_module_with_parameters():
    r = resolved({EBC: PS_RULE, "*": DDP}, model=dcn())
    assert placement(r) == {EBC: ("parameter_server", EBC), "dense_arch": ("ddp", "*"), "inter_arch": ("ddp", "*"), "over_arch": ("ddp", "*")}


def test_plain_torch_embeddings_can_go_to_servers():
    r = resolved({"bag": PS_RULE, "emb": PS_RULE, "head": DDP}, model=PlainEmbeddings())
    assert [e.module_type for e in r.by_strategy("parameter_server")] == ["EmbeddingBag", "Embedding"]


def test_idle_servers_only_warn():
    r = resolved({"*": DDP}, world_size=3, topology={"parameter_servers": 1})
    assert r.num_servers == 1 and placement(r) == {"": ("ddp", "*")}


# (modules, resolve kwargs, category, message regex): every resolve-time category.
RESOLVE_ERRORS = [
    ({"dense_arh": DDP, "*": DDP}, {}, "unknown_module", r"modules\.dense_arh: no module 'dense_arh' in the model; did you mean 'dense_arch'"),
    ({"embedding_bag_collection": PS_RULE, "*": DDP}, {}, "unknown_module",
     r"no module 'embedding_bag_collection' in the model; did you mean 'sparse_arch\.embedding_bag_collection'\?"),
    ({"**.nothing": DDP, "*": DDP}, {}, "unknown_module",
     r"modules\.\*\*\.nothing: the pattern '\*\*\.nothing' matches no module; top-level modules: sparse_arch, dense_arch, inter_arch, over_arch"),
    ({"inter_arch": DDP, "*": DDP}, {}, "no_parameters", r"modules\.inter_arch: module 'inter_arch' \(InteractionArch\) has no parameters.*remove the rule"),
    ({"inter*": DDP, "*": DDP}, {}, "no_parameters", r"modules\.inter\*: the pattern 'inter\*' matches only modules without parameters \(inter_arch\)"),
    ({"dense_arch": PS_RULE, "*": DDP}, {}, "not_an_embedding",
     r"modules\.dense_arch: parameter_server needs an embedding module \(EmbeddingBagCollection, EmbeddingCollection, nn\.EmbeddingBag or nn\.Embedding\); 'dense_arch' is a DenseArch"),
    ({"sparse_arch": PS_RULE, "*": DDP}, {}, "not_an_embedding", r"'sparse_arch' is a SparseArch; did you mean 'sparse_arch\.embedding_bag_collection'\?"),
    ({"*": PS_RULE}, {}, "not_an_embedding", r"modules\.\*: parameter_server needs an embedding module"),
    ({EBC: PS_RULE, "dense_arch": DDP, "dense_arch.model._mlp.0": FSDP, "*": DDP}, {}, "fsdp_under_ddp",
     r"modules\.dense_arch\.model\._mlp\.0: fsdp on 'dense_arch\.model\._mlp\.0' lies inside 'dense_arch', which rule 'dense_arch' already puts under ddp; only fsdp may nest inside fsdp"),
    ({EBC: PS_RULE, "dense_arch": FSDP, "dense_arch.model": DDP, "*": DDP}, {}, "ddp_under_fsdp",
     r"ddp on 'dense_arch\.model' lies inside 'dense_arch', which rule 'dense_arch' already puts under fsdp"),
    ({EBC: PS_RULE, "sparse_arch": DDP, "*": DDP}, {}, "nested_rules", r"parameter_server on 'sparse_arch\.embedding_bag_collection' lies inside 'sparse_arch'.*rule the children of 'sparse_arch' one by one"),
    ({EBC: PS_RULE, "dense_arch.*": DDP, "dense_arch.mod*": FSDP, "*": DDP}, {}, "conflicting_rules",
     r"modules\.dense_arch\.mod\*: module 'dense_arch\.model' is matched by 'dense_arch\.\*' \(ddp\) and 'dense_arch\.mod\*' \(fsdp\).*add an exact rule for 'dense_arch\.model'"),
    ({EBC: PS_RULE, "dense_arch": DDP}, {}, "no_rule", r"modules: module 'over_arch' \(OverArch, 321 parameters\) matches no rule; add a rule for it or a default rule \"\*\": \{strategy: ddp\}"),
    ({EBC: PS_RULE, "*": DDP}, {"world_size": 2, "topology": {"parameter_servers": 2}}, "topology",
     r"topology\.parameter_servers: 2 parameter server\(s\) leave no trainer in world_size=2: start at least 3 processes or lower topology\.parameter_servers"),
    ({EBC: PS_RULE, "*": DDP}, {"world_size": 0}, "topology", r"world_size: got 0; expected a number of processes >= 1"),
    ({EBC: PS_RULE, "*": DDP}, {"topology": {"parameter_servers": 0}}, "topology",
     r"topology\.parameter_servers: 0 with \d+ trainers, but 'sparse_arch\.embedding_bag_collection' \(rule 'sparse_arch\.embedding_bag_collection'\) uses parameter_server; set parameter_servers >= 1"),
    ({EBC: {**PS_RULE, "servers": [0, 2]}, "*": DDP}, {"world_size": 4, "topology": {"parameter_servers": 2}}, "topology",
     r"modules\.sparse_arch\.embedding_bag_collection\.servers: server indices \[2\] do not exist: topology\.parameter_servers=2 gives ps0\.\.ps1"),
    ({EBC: PS_RULE, "over_arch": {"strategy": "fsdp", "wrap": ["Linaer"]}, "*": DDP}, {}, "bad_value",
     r"modules\.over_arch\.wrap\.0: no module of class 'Linaer' under 'over_arch'; classes there: Linear, MLP, Perceptron, Sequential"),
]


@pytest.mark.parametrize("modules, kwargs, category, message", RESOLVE_ERRORS, ids=[c for _, _, c, _ in RESOLVE_ERRORS])
def test_resolve_errors(modules, kwargs, category, message):
    kwargs = dict(kwargs)
    world_size = kwargs.pop("world_size", 3)
    with pytest.raises(PlanError, match=message) as e:
        resolved(modules, world_size=world_size, **kwargs)
    assert e.value.category == category


def test_own_parameters_of_a_split_parent():
    with pytest.raises(PlanError, match=r"module '<root>' has its own parameters \(scale\) but rules split its children \(a: ddp, b: fsdp\).*give 'the root' itself a rule") as e:
        resolved({"a": DDP, "b": FSDP}, model=OwnParams(), world_size=2, topology={"parameter_servers": 0})
    assert e.value.category == "own_parameters"


def test_unsupported_pooling_is_refused():
    with pytest.raises(PlanError, match=r"modules\.bag: table 'bag' pools with 'max'; the parameter servers support 'sum' and 'mean'") as e:
        resolved({"bag": PS_RULE, "*": DDP}, model=PlainEmbeddings(mode="max"))
    assert e.value.category == "unsupported_table"


@pytest.mark.parametrize("option,shown", [({"max_norm": 1.0}, "max_norm=1.0"),
                                          ({"scale_grad_by_freq": True}, "scale_grad_by_freq=True"),
                                          ({"sparse": True}, "sparse=True")])
def test_embedding_options_the_servers_lack_are_refused(option, shown):
    model = PlainEmbeddings()
    model.emb = nn.Embedding(500, 4, padding_idx=0, **option)
    with pytest.raises(PlanError, match=rf"modules\.emb: nn\.Embedding 'emb' has {shown}, which the parameter "
                                        rf"servers do not support; build it without \(padding_idx is supported\)") as e:
        resolved({"emb": PS_RULE, "*": DDP}, model=model)
    assert e.value.category == "unsupported_table"


@pytest.mark.parametrize("option,shown", [({"scale_grad_by_freq": True}, "scale_grad_by_freq=True"),
                                          ({"max_norm": 1.0}, "max_norm=1.0"),
                                          ({"padding_idx": 0}, "padding_idx=0")])
def test_embedding_bag_options_the_servers_lack_are_refused(option, shown):
    """The servers would pool and update plain rows, training on other numbers than torch's
    (frequency-scaled gradients, renormalized rows, a padding id left out of its bag)."""
    model = PlainEmbeddings()
    model.bag = nn.EmbeddingBag(1000, 16, mode="sum", **option)
    with pytest.raises(PlanError, match=rf"modules\.bag: nn\.EmbeddingBag 'bag' has {shown}, which the parameter "
                                        rf"servers do not support; build it without$") as e:
        resolved({"bag": PS_RULE, "*": DDP}, model=model)
    assert e.value.category == "unsupported_table"


def test_resolve_errors_name_the_file_line(tmp_path):
    from hybrid.plan import load_plan
    from tests.unit.test_plan_models import write

    plan = load_plan(write(tmp_path, """
        modules:
          "*": {strategy: ddp}
          dense_arh: {strategy: ddp}
    """))
    with pytest.raises(PlanError, match=r"plan\.yaml:3: modules\.dense_arh: no module 'dense_arh'"):
        resolve(plan, dlrm(), world_size=2)


LOCATED_PLAN = f"""
    world_size: 3
    topology:
      parameter_servers: 1
    modules:
      {EBC}:
        strategy: parameter_server
        servers: all
        optimizer: {{name: sgd, lr: 0.1}}
      dense_arch: {{strategy: ddp}}
      "*": {{strategy: fsdp}}
"""


@pytest.mark.parametrize("overrides, message", [
    # A value from the command line is named as the override, never as the file's line.
    ([f"modules.{EBC}.servers=[1]"], rf"^override 'modules\.{EBC}\.servers=\[1\]': modules\.{EBC}\.servers: "
                                     r"server indices \[1\] do not exist"),
    (["topology.parameter_servers=3"], r"^override 'topology\.parameter_servers=3': topology\.parameter_servers: "
                                       r"3 parameter server\(s\) leave no trainer in world_size=3"),
    ([f"modules.{EBC}.hot_rows=8"], rf"^override 'modules\.{EBC}\.hot_rows=8': modules\.{EBC}\.hot_rows: got 8"),
    (["modules.dense_arch.wrap=[Nope]", "modules.dense_arch.strategy=fsdp"],
     r"^override 'modules\.dense_arch\.wrap=\[Nope\]': modules\.dense_arch\.wrap\.0: no module of class 'Nope'"),
    # An error about a whole rule names its line and the overrides that changed it.
    (["modules.dense_arch.strategy=parameter_server", "modules.dense_arch.optimizer={name: sgd, lr: 0.1}"],
     r"plan\.yaml:9 and override 'modules\.dense_arch\.strategy=parameter_server' and override "
     r"'modules\.dense_arch\.optimizer=\{name: sgd, lr: 0\.1\}': modules\.dense_arch: parameter_server needs an "
     r"embedding module"),
])
def test_plan_errors_name_the_override_that_set_the_value(tmp_path, overrides, message):
    from hybrid.plan import load_plan
    from tests.unit.test_plan_models import write

    path = write(tmp_path, LOCATED_PLAN)
    resolve(load_plan(path), dlrm(), world_size=3)  # the file alone is a good plan
    with pytest.raises(PlanError, match=message):
        resolve(load_plan(path, overrides), dlrm(), world_size=3)


def test_topology_and_module_errors_name_the_plan_file_and_line(tmp_path):
    """Process counts that do not fit the plan's topology, and a plan whose modules section is
    empty, point at the plan line of the key concerned."""
    from hybrid.plan import load_plan
    from tests.unit.test_plan_models import write

    path = write(tmp_path, LOCATED_PLAN.replace("servers: all", "servers: [1]"))
    with pytest.raises(PlanError, match=rf"^{path}:7: modules\.{EBC}\.servers: server indices \[1\] do not exist"):
        resolve(load_plan(path), dlrm(), world_size=3)
    # one process holds the tables itself, but the indices must still fit the plan's topology
    with pytest.raises(PlanError, match=rf"^{path}:7: modules\.{EBC}\.servers: server indices \[1\] do not exist: "
                                        r"topology\.parameter_servers=1"):
        resolve(load_plan(path), dlrm(), world_size=1)
    resolve(load_plan(path, ["topology.parameter_servers=0"]), dlrm(), world_size=1)  # no servers: nothing to fit
    path = write(tmp_path, LOCATED_PLAN.replace("parameter_servers: 1", "parameter_servers: 3"))
    with pytest.raises(PlanError, match=rf"^{path}:3: topology\.parameter_servers: 3 parameter server\(s\) leave no "
                                        r"trainer in world_size=3") as e:
        resolve(load_plan(path), dlrm(), world_size=3)
    assert e.value.category == "topology"
    path = write(tmp_path, LOCATED_PLAN.replace("parameter_servers: 1", "parameter_servers: 0"))
    with pytest.raises(PlanError, match=rf"^{path}:3: topology\.parameter_servers: 0 with 3 trainers, but "):
        resolve(load_plan(path), dlrm(), world_size=3)
    path = write(tmp_path, "world_size: 3\nmodules:   # no rule yet\nsync: {staleness: 0}\n")
    with pytest.raises(PlanError, match=rf"^{path}:2: modules: module '<root>' \(DLRM, .*\) matches no rule") as e:
        resolve(load_plan(path), dlrm(), world_size=3)
    assert e.value.category == "no_rule"


def test_every_error_category_is_tested():
    tested = {c for _, c, _ in LOAD_ERRORS} | {c for _, c, _ in OVERRIDE_ERRORS} | {c for *_, c, _ in RESOLVE_ERRORS}
    # Tested by name elsewhere: YAML files in test_plan_load, models in test_plan_cli, tables that
    # do not fit a server in test_server_memory, and above.
    tested |= {"yaml_syntax", "unsafe_yaml", "io", "unknown_model", "own_parameters", "unsupported_table", "memory"}
    assert tested == set(CATEGORIES)


def test_a_module_tree_without_embeddings_needs_no_servers():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    r = resolved({"0": FSDP, "*": DDP}, model=model, world_size=2, topology={"parameter_servers": 0})
    assert placement(r) == {"0": ("fsdp", "0"), "2": ("ddp", "*")}
    assert r.num_trainers == 2


def test_one_process_holds_the_tables_whatever_the_topology():
    for servers in (0, 2):
        r = resolved({EBC: PS_RULE, "*": DDP}, world_size=1, topology={"parameter_servers": servers})
        assert (r.num_trainers, r.num_servers, r.in_process) == (1, 0, True)
    assert not resolved({EBC: PS_RULE, "*": DDP}).in_process
