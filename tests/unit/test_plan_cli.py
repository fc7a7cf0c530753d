"""``hybrid plan show/check`` on models named ``package.module:attr`` (builders in this module)."""

from __future__ import annotations

import pytest
import torch

from hybrid import cli
from tests.unit.test_plan_models import EBC, dlrm, write

TINY = f"{__name__}:tiny_dlrm"
NO_DEVICE = f"{__name__}:no_device"
SEEN: list = []
"""The device each build of ``tiny_dlrm`` was asked for."""


def tiny_dlrm(device=None):
    SEEN.append(device)
    return dlrm()


def no_device():
    return dlrm()


PLAN = f"""
    model: {TINY}
    world_size: 3
    topology: {{parameter_servers: 1}}
    modules:
      {EBC}:
        strategy: parameter_server
        optimizer: {{name: rowwise_adagrad, lr: 0.05}}
      over_arch: {{strategy: fsdp}}
      "*": {{strategy: ddp}}
"""


@pytest.fixture
def devices():
    """The devices ``tiny_dlrm`` is built on during the test."""
    SEEN.clear()
    return SEEN


@pytest.fixture
def plan(tmp_path):
    return str(write(tmp_path, PLAN))


def test_show_prints_the_table_built_on_meta(plan, devices, capsys):
    assert cli.main(["plan", "show", plan]) == 0
    out = capsys.readouterr().out
    assert "world size 3 = 2 trainers + 1 parameter server; sync (staleness 0)" in out
    assert EBC in out and "dense_arch" in out and "over_arch" in out and "total" in out
    assert devices == [torch.device("meta")]


def test_show_with_world_size_overrides_and_options(plan, devices, capsys):
    argv = ["plan", "show", plan, "topology.parameter_servers=2", "--world-size", "5", "sync.staleness=1", "--dense-optimizer", "adam"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "world size 5 = 3 trainers + 2 parameter servers; async (staleness 1)" in out
    assert "params + grads + adam state" in out


def test_check_ok(plan, devices, capsys):
    assert cli.main(["plan", "check", plan]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"plan OK: {plan} on {TINY}: 3 processes = 2 trainers + 1 parameter server; 3 modules")


def test_model_flag_beats_the_plan_and_builders_without_device_work(plan, devices, capsys):
    assert cli.main(["plan", "check", plan, "--model", NO_DEVICE]) == 0
    assert f"on {NO_DEVICE}" in capsys.readouterr().out and devices == []


def test_check_reports_plan_errors_without_traceback(plan, devices, capsys):
    assert cli.main(["plan", "check", plan, "modules.dense_arh.strategy=ddp"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: override 'modules.dense_arh.strategy=ddp': modules.dense_arh: no module 'dense_arh'")
    assert "did you mean 'dense_arch'" in captured.err and "Traceback" not in captured.err


def test_topology_that_does_not_fit_the_world_size(plan, devices, capsys):
    assert cli.main(["plan", "check", plan, "--world-size", "2", "topology.parameter_servers=2"]) == 2
    assert "leave no trainer in world_size=2" in capsys.readouterr().err


def test_one_process_holds_the_tables(plan, devices, capsys):
    assert cli.main(["plan", "check", plan, "--world-size", "1"]) == 0
    assert cli.main(["plan", "show", plan, "--world-size", "1"]) == 0
    assert "1 trainer + 0 parameter servers" in capsys.readouterr().out


def test_unknown_model_lists_known_names(plan, devices, capsys):
    assert cli.main(["plan", "show", plan, "--model", "dlrn"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model: unknown model 'dlrn' (did you mean 'dlrm'?); registered in entry-point "
                          "group 'hybrid.models': dcn, dlrm, sequential, two_tower; or name one as package.module:attr"), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_plan_without_model_and_without_world_size(tmp_path, devices, capsys):
    path = str(write(tmp_path, '{modules: {"*": {strategy: ddp}}}\n'))
    assert cli.main(["plan", "check", path]) == 2
    assert ("error: model: no model: set `model:` in the plan, pass --model (package.module:attr or a registered "
            "name: dcn, dlrm, sequential, two_tower) or a --config that names one") in capsys.readouterr().err
    assert cli.main(["plan", "check", path, "--model", TINY]) == 0
    assert "(world size 2 = parameter_servers + 1 trainer; set world_size or pass --world-size)" in capsys.readouterr().out
    # A training config's model.name is the model, as a run finds it.
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  name: {TINY}\n")
    assert cli.main(["plan", "check", path, "--config", str(config)]) == 0, capsys.readouterr().err
    assert f"on {TINY}" in capsys.readouterr().out


def test_bad_yaml_and_missing_file(tmp_path, devices, capsys):
    assert cli.main(["plan", "check", str(write(tmp_path, "a: [1,\n"))]) == 2
    assert "plan.yaml:2:1: invalid YAML" in capsys.readouterr().err
    assert cli.main(["plan", "show", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml: cannot read the plan file" in capsys.readouterr().err


def test_a_plan_naming_a_module_that_is_not_there(tmp_path, capsys):
    path = str(write(tmp_path, PLAN.replace(TINY, "no_such_package.models:build")))
    assert cli.main(["plan", "show", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:1: model: cannot import module 'no_such_package.models' for "
                          "'no_such_package.models:build' (ModuleNotFoundError: No module named 'no_such_package')"), err


def test_usage_errors_exit_2(plan, devices, capsys):
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().err  # no command: the help
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "show"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "check", plan, "--bogus"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["plan"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--bogus" in err
    # one line each, naming the command: the usage is left to --help
    assert err.splitlines() == ["hybrid plan show: error: the following arguments are required: PLAN (--help for the usage)",
                                "hybrid: error: unrecognized arguments: --bogus (--help for the usage)",
                                "hybrid plan: error: the following arguments are required: ACTION (--help for the usage)"]


def test_console_script_entry_point_is_main():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "hybrid"]
    assert ep.value == "hybrid.cli:main"


SEQ = f"{__name__}:sequence_model"


def sequence_model(device=None):
    """Item histories in an EmbeddingCollection, actions in a plain nn.Embedding, a head."""
    from torch import nn
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    class Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.items = EmbeddingCollection(tables=[
                EmbeddingConfig(name="item", embedding_dim=16, num_embeddings=1000, feature_names=["hist"]),
                EmbeddingConfig(name="cat", embedding_dim=16, num_embeddings=10, feature_names=["cat"]),
            ], device=device)
            self.actions = nn.Embedding(4, 16, padding_idx=0, device=device)
            self.head = nn.Linear(16, 1, device=device)

    return Seq()


def test_show_lists_embedding_collections_and_embeddings_with_bytes_per_server(tmp_path, capsys):
    path = str(write(tmp_path, f"""
        model: {SEQ}
        world_size: 4
        topology: {{parameter_servers: 2}}
        modules:
          items: {{strategy: parameter_server, sharding: row_wise, optimizer: {{name: adam, lr: 0.01}}}}
          actions: {{strategy: parameter_server, sharding: table_wise, optimizer: {{name: sgd, lr: 0.1}}}}
          head: {{strategy: ddp}}
    """))
    assert cli.main(["plan", "show", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    items = next(line for line in lines if line.startswith("items "))
    actions = next(line for line in lines if line.startswith("actions "))
    assert "EmbeddingCollection" in items and "parameter_server" in items
    assert "Embedding" in actions and "parameter_server" in actions
    # Adam keeps 2 * dim + 1 floats per row beside the row: (16 + 33) * 4 bytes, on 505 of the
    # 1010 rows per server (row-wise); table-wise puts the 4 x 16 floats of actions (sgd) on ps0.
    item_bytes = 505 * (16 + 33) * 4
    assert items.split()[-1] == "KiB" and f"{item_bytes / 1024:.1f} KiB" in items, items
    assert actions.endswith("256 B"), actions
    assert lines[-1] == (f"per server (rows + sparse optimizer state): ps0 {(item_bytes + 256) / 1024:.1f} KiB, "
                         f"ps1 {item_bytes / 1024:.1f} KiB"), lines[-1]


def test_show_with_a_config_sizes_the_model_as_the_job_does(capsys):
    """``--config``: the model is built from the training config's model section (the shipped
    large sequential preset: 8 FSDP blocks, 20,000 x 768 items on the server), not the builder's
    defaults; a config for another model is refused by line."""
    assert cli.main(["plan", "show", "conf/plans/sequential.yaml"]) == 0
    default = capsys.readouterr().out
    assert cli.main(["plan", "show", "conf/plans/sequential.yaml", "--config", "conf/train/sequential_large.yaml"]) == 0
    large = capsys.readouterr().out
    assert "encoder.blocks.7" in large and "encoder.blocks.7" not in default
    assert "15,360,000" in large.splitlines()[3], large  # the item table's parameters
    # The config's dense optimizer (adam: two state tensors) sizes the trainers' bytes, unless
    # --dense-optimizer says otherwise.
    assert "params + grads + adam state" in large, large
    assert cli.main(["plan", "show", "conf/plans/sequential.yaml", "--config", "conf/train/sequential_large.yaml",
                     "--dense-optimizer", "sgd"]) == 0
    assert "params + grads + sgd state" in capsys.readouterr().out
    assert cli.main(["plan", "show", "conf/plans/sequential.yaml", "--dense-optimizer", "lamb"]) == 2
    assert capsys.readouterr().err.strip() == \
        "error: --dense-optimizer: got 'lamb'; expected one of 'sgd', 'adagrad', 'adam'"
    assert cli.main(["plan", "check", "conf/plans/sequential.yaml", "--config", "conf/train/dlrm.yaml"]) == 2
    assert "conf/train/dlrm.yaml:6: model.name" in capsys.readouterr().err
