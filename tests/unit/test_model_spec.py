"""Naming a model (``package.module:attr`` or a name in the ``hybrid.models`` entry-point group)
and what a :class:`hybrid.train.ModelSpec` does with it. User packages are written into
``tmp_path`` and put on ``sys.path``; entry points come from a real ``*.dist-info`` there, read by
``importlib.metadata`` itself."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from hybrid import cli
from hybrid.plan import PlanError
from hybrid.train import CTRTask, ModelSpec, model_schema, resolve_model
from hybrid.train.config import load_config
from tests.unit.test_plan_models import write

_names = itertools.count()

USER_MODULE = """
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from hybrid.train import ModelSpec


class Tiny(nn.Module):
    num_dense = 3

    def __init__(self, rows, device=None):
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=rows, feature_names=["a"]),
            EmbeddingBagConfig(name="t_b", embedding_dim=4, num_embeddings=7, feature_names=["b"]),
        ], device=device)
        self.mlp = nn.Linear(3 + 8, 1, device=device)

    def forward(self, dense, sparse):
        return self.mlp(torch.cat([dense, self.ebc(sparse).values()], dim=1))


def build(*, rows=50, device=None):
    return Tiny(rows, device)


spec = ModelSpec(build=build, task="ctr")
NOT_A_MODEL = 3


def picky(*, rows=50, width=4, device=None):
    if rows < 1:
        raise ValueError(f"model.rows: got {rows}; expected an integer >= 1")
    if width % 2:
        raise ValueError(f"width {width} is odd")
    return Tiny(rows, device)


def _load_weights(path):
    raise RuntimeError(f"no weights at {path}")


def broken(*, rows=50, device=None):
    _load_weights("/nowhere/w.pt")
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A module of one's own, outside the repository, importable by the name returned."""
    name = f"user_models_{next(_names)}"
    src = tmp_path / "src"
    src.mkdir()
    (src / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(src))
    yield name
    monkeypatch.delitem(__import__("sys").modules, name, raising=False)


def _distribution(site: Path, dist: str, entries: dict[str, str]) -> None:
    """An installed distribution as pip leaves it: ``<dist>-1.0.dist-info`` with its entry points."""
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[hybrid.models]\n{lines}")


def _error(ref, key="--model") -> PlanError:
    with pytest.raises(PlanError) as e:
        resolve_model(ref, key=key)
    assert e.value.category == "unknown_model" and e.value.key == key
    assert "\n" not in str(e.value)
    return e.value


# -- package.module:attr ------------------------------------------------------------------------

def test_module_attr_gives_the_spec_or_wraps_a_builder(user_module):
    spec = resolve_model(f"{user_module}:spec", key="--model")
    assert spec.task == "ctr" and spec.build.__name__ == "build"
    wrapped = resolve_model(f"{user_module}:build", key="--model")
    assert isinstance(wrapped, ModelSpec) and wrapped.build is spec.build and wrapped.task == "ctr"
    cls = resolve_model(f"{user_module}:Tiny", key="--model")  # a class builds a module too
    assert cls.options() == ["rows"]


def test_module_that_is_not_there():
    err = _error("no_such_pkg.models:build")
    assert err.detail.startswith("cannot import module 'no_such_pkg.models' for 'no_such_pkg.models:build' "
                                 "(ModuleNotFoundError: No module named 'no_such_pkg'); is it on PYTHONPATH? "
                                 "registered names: dcn, dlrm, sequential, two_tower"), err.detail


def test_module_that_fails_on_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_user_mod.py").write_text("x = 1\nraise RuntimeError('no GPU\\nhere')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _error("broken_user_mod:build")
    assert "cannot import module 'broken_user_mod'" in err.detail and "(RuntimeError: no GPU here)" in err.detail


def test_missing_attribute_and_one_that_is_no_model(user_module):
    err = _error(f"{user_module}:buidl")
    assert err.detail == (f"'{user_module}' has no attribute 'buidl' (did you mean 'build'?) "
                          f"(looking up '{user_module}:buidl'); registered names: dcn, dlrm, sequential, two_tower")
    err = _error(f"{user_module}:NOT_A_MODEL")
    assert err.detail == (f"'{user_module}:NOT_A_MODEL' is a int; expected a hybrid.train.ModelSpec or a callable "
                          "that builds an nn.Module; registered names: dcn, dlrm, sequential, two_tower")
    assert "expected package.module:attr" in _error(f"{user_module}:").detail
    assert "no model" in _error("").detail


# -- entry points -------------------------------------------------------------------------------

def test_the_examples_are_registered_entry_points():
    import recsys_examples

    assert resolve_model("dlrm", key="model") is recsys_examples.dlrm
    assert resolve_model("two_tower", key="model").task == "retrieval"


def test_unknown_name_says_what_was_tried_and_what_is_known():
    err = _error("dlrn", key="model.name")
    assert err.detail == ("unknown model 'dlrn' (did you mean 'dlrm'?); registered in entry-point group "
                          "'hybrid.models': dcn, dlrm, sequential, two_tower; or name one as package.module:attr")


def test_a_distribution_registers_a_model_by_name(tmp_path, user_module, monkeypatch, capsys):
    site = tmp_path / "site"
    _distribution(site, "acme_models", {"acme_tiny": f"{user_module}:spec", "acme_broken": "acme_nowhere:spec"})
    monkeypatch.syspath_prepend(str(site))
    from hybrid.train.spec import known_models

    assert {"acme_tiny", "acme_broken", "dlrm"} <= set(known_models())
    assert resolve_model("acme_tiny", key="--model").build.__module__ == user_module
    err = _error("acme_broken")
    assert err.detail.startswith("model 'acme_broken' (entry point acme_broken = acme_nowhere:spec): cannot load it "
                                 "(ModuleNotFoundError: No module named 'acme_nowhere')"), err.detail
    # The plan commands take the registered name as they take the examples'.
    plan = write(tmp_path, 'model: acme_tiny\nworld_size: 2\nmodules:\n  ebc: {strategy: parameter_server, optimizer: {name: sgd, lr: 0.1}}\n'
                           '  "*": {strategy: ddp}\n')
    assert cli.main(["plan", "check", str(plan)]) == 0, capsys.readouterr().err
    assert "on acme_tiny: 2 processes = 1 trainer + 1 parameter server; 2 modules" in capsys.readouterr().out


def test_a_name_registered_twice_is_refused(tmp_path, user_module, monkeypatch):
    site = tmp_path / "site"
    _distribution(site, "acme_one", {"acme_twice": f"{user_module}:spec"})
    _distribution(site, "acme_two", {"acme_twice": f"{user_module}:build"})
    monkeypatch.syspath_prepend(str(site))
    assert _error("acme_twice").detail == (f"model 'acme_twice' is registered more than once in 'hybrid.models' "
                                           f"({user_module}:build, {user_module}:spec); name one as package.module:attr")


# -- where the name came from -------------------------------------------------------------------

def test_config_and_flag_and_plan_errors_name_their_key(tmp_path, user_module):
    config = tmp_path / "train.yaml"
    config.write_text("train: {steps: 3}\nmodel:\n  name: dlrn\n")
    with pytest.raises(PlanError, match=rf"^{config}:3: model.name: unknown model 'dlrn'"):
        load_config(config)
    with pytest.raises(PlanError, match=r"^--model: cannot import module 'nope'"):
        load_config(None, model_flag="nope:build")
    with pytest.raises(PlanError, match=r"^plans/x.yaml: model: unknown model 'dlrn'"):
        load_config(None, model="dlrn", plan_source="plans/x.yaml")
    with pytest.raises(PlanError, match=rf"^{config}:3: model.name: the config trains 'dlrn' but --model names 'dlrm'"):
        load_config(config, model_flag="dlrm")
    with pytest.raises(PlanError, match=r"^--model: --model names 'dcn' but the plan is written for 'dlrm'"):
        load_config(None, model="dlrm", model_flag="dcn")
    with pytest.raises(PlanError, match=r"model.name: no model: set model.name, the plan's model: or --model"):
        load_config(None)


def test_config_options_are_the_builder_s_keywords(user_module):
    ref = f"{user_module}:build"
    cfg = load_config(None, ["model.rows=9"], model_flag=ref)
    assert (cfg.model_name, cfg.model_kwargs) == (ref, {"rows": 9})
    named = load_config(None, [f"model.name={ref}", "model.rows=9"], model=ref)  # config and plan agree
    assert (named.model_name, named.model_kwargs, named.spec.build) == (ref, {"rows": 9}, cfg.spec.build)
    assert cfg.out_dir == Path(f"runs/{user_module}_build")  # a usable directory name
    with pytest.raises(PlanError, match=r"override 'model.rowz=9': model.rowz: .*:build takes no option 'rowz' "
                                        r"\(did you mean 'rows'\?\); it takes rows"):
        load_config(None, ["model.rowz=9"], model_flag=ref)


def test_a_bad_model_option_is_named_where_it_was_written(tmp_path, user_module, capsys):
    """A value the builder refuses points at the override that gave it, not at the config file;
    a value of the file at its line; the plan's overrides under ``hybrid train`` as typed (``plan.``)."""
    from hybrid.train.loop import load_run

    ref = f"{user_module}:picky"
    plan = str(write(tmp_path, 'modules: {"*": {strategy: ddp}}\ntopology: {parameter_servers: 0}\n'))
    config = write(tmp_path, f"model:\n  name: {ref}\n  rows: 5\n  width: 4\ntrain: {{steps: 3}}\n", "c.yaml")
    load_run(plan, str(config), [], 1)  # the files alone are good
    for overrides, message in [
        (["model.rows=0"], rf"^override 'model.rows=0': model: building '{ref}' failed: model.rows: got 0"),
        # The builder names no option: the model section's line and the overrides that changed it.
        (["train.steps=4", "model.width=3"], rf"^{config}:1 and override 'model.width=3': model: building '{ref}' "
                                             r"failed: width 3 is odd"),
        (["plan.sync.staleness=-1"], r"^override 'plan.sync.staleness=-1': sync.staleness: got -1"),
        (["data.source=csv", "data.train_paths=[/no/t.csv]"],
         r"^override 'data.train_paths=\[/no/t.csv\]': data.train_paths: '/no/t.csv' is not a file"),
        (["plan.topology.parameter_servers=2"], r"^override 'plan.topology.parameter_servers=2': "
                                                r"topology.parameter_servers: 2 parameter server\(s\) leave no trainer"),
    ]:
        with pytest.raises(PlanError, match=message):
            load_run(plan, str(config), overrides, 2 if "servers" in message else 1)
    config.write_text(config.read_text().replace("rows: 5", "rows: 0"))
    with pytest.raises(PlanError, match=rf"^{config}:3: model: building '{ref}' failed: model.rows: got 0"):
        load_run(plan, str(config), [], 1)
    config.write_text(config.read_text().replace("rows: 0", "rows: 5"))
    assert cli.main(["train", "--plan", plan, "--config", str(config), "model.rows=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: override 'model.rows=0': model: building") and err.count("\n") == 1, err


def test_a_builder_that_raises_is_reported_as_the_user_s_code_failing(tmp_path, user_module, capsys):
    """A builder raising anything but the ValueError/TypeError that refuse an option is the user's
    code failing, not bad input: its traceback (the user's frames, not hybrid's), then one last
    line naming the model, exit code 1 -- from `plan check`, `train` and `launch` alike."""
    ref = f"{user_module}:broken"
    plan = str(write(tmp_path, 'modules: {"*": {strategy: ddp}}\ntopology: {parameter_servers: 0}\n'))
    last = f"error: building the model '{ref}' on device meta failed: RuntimeError: no weights at /nowhere/w.pt"
    for argv in (["plan", "check", plan, "--model", ref], ["train", "--plan", plan, "--model", ref]):
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        lines = err.splitlines()
        assert lines[0] == "Traceback (most recent call last):" and lines[-1] == last, err
        assert f"{user_module}.py\", line" in err and "in _load_weights" in err, err
        assert "hybrid/" not in err, err  # only the builder's frames
    assert cli._check_train(["--plan", plan, "--model", ref], 2)[0] == 1  # hybrid launch, before any process
    assert capsys.readouterr().err.splitlines()[-1] == last


# -- the spec -----------------------------------------------------------------------------------

def test_device_and_seed_go_to_a_builder_only_when_it_takes_them():
    calls = []

    def with_both(*, width=2, seed=None, device=None):
        calls.append((seed, device))
        return nn.Linear(width, 1, device=device)

    def with_neither(*, width=2):
        return nn.Linear(width, 1)

    ModelSpec(build=with_both).make_model({"width": 3}, device=torch.device("meta"), seed=5)
    assert calls == [(5, torch.device("meta"))]
    plain = ModelSpec(build=with_neither)
    a, b = plain.make_model(seed=7), plain.make_model(seed=7)  # seeded before the build: the same weights
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, plain.make_model(seed=8).weight)
    assert plain.make_model(device="meta").weight.device.type == "cpu"
    assert ModelSpec(build=lambda **kw: nn.Linear(1, 1)).options() is None
    with pytest.raises(TypeError, match=r"returned int; a model builder returns an nn.Module"):
        ModelSpec(build=lambda: 3).make_model()


def test_spec_fields_are_checked():
    with pytest.raises(ValueError, match=r"ModelSpec.task: got 'ranking'; expected one of 'ctr', 'retrieval'"):
        ModelSpec(build=nn.Identity, task="ranking")
    with pytest.raises(TypeError, match=r"ModelSpec.task: got 3"):
        ModelSpec(build=nn.Identity, task=3)
    with pytest.raises(TypeError, match=r"ModelSpec.build: got 'x'"):
        ModelSpec(build="x")
    own = CTRTask(name="clicks")
    assert ModelSpec(build=nn.Identity, task=own).make_task() is own


def test_default_schema_reads_the_collections_and_num_dense(user_module):
    spec = resolve_model(f"{user_module}:build", key="--model")
    model = spec.make_model({"rows": 11}, device="meta")
    schema = spec.data_schema(model)
    assert (schema.num_dense, schema.features, schema.num_embeddings, schema.task) == (3, ["a", "b"], [11, 7], "ctr")
    del type(model).num_dense
    assert model_schema(model).num_dense == 0


def test_example_schemas():
    import recsys_examples

    dlrm = recsys_examples.dlrm
    s = dlrm.data_schema(dlrm.make_model({"num_dense": 5, "features": ["x", "y"]}, device="meta"))
    assert (s.num_dense, s.features, s.task) == (5, ["x", "y"], "ctr")
    tt = recsys_examples.two_tower
    s = tt.data_schema(tt.make_model(device="meta"))
    assert (s.num_dense, s.task, s.query_features) == (0, "retrieval", ["user_id", "user_history"])


@pytest.mark.parametrize("kwargs,message", [
    ({"top_mlp": [8, 2]}, "model.top_mlp: the last width is the model's output, 1; got [8, 2]"),
    ({"top_mlp": [-8, 1]}, "model.top_mlp: got -8; expected an integer >= 1"),
    ({"bottom_mlp": [0, 4], "embedding_dim": 4}, "model.bottom_mlp: got 0; expected an integer >= 1"),
    ({"num_embeddings": "lots"}, "model.num_embeddings: got 'lots'; expected an integer >= 1"),
    ({"num_embeddings": [10, 0]}, "model.num_embeddings: got 0; expected an integer >= 1"),
    ({"embedding_dim": 0}, "model.embedding_dim: got 0; expected an integer >= 1"),
    ({"top_mlp": "8,1"}, "model.top_mlp: got '8,1'; expected a list of layer widths"),
])
def test_example_models_name_a_bad_size(kwargs, message):
    """The examples' builders refuse a bad size with its model.* key (a run shows the line once,
    before any process trains) instead of torch's words from inside the layers."""
    from recsys_examples.models import build_dlrm

    args = {"num_embeddings": 10, "embedding_dim": 4, "features": ["a", "b"], "num_dense": 3, "bottom_mlp": [8, 4],
            "top_mlp": [8, 1], **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        build_dlrm(**args)
