"""A training config's sections and choices as a user may mistype them: one ``error:`` line naming
the section or key and where it was written, exit code 2, no traceback."""

from __future__ import annotations

import re

import pytest

from hybrid import cli
from hybrid.plan import PlanError
from hybrid.train.config import load_config

PLAN = "conf/plans/dlrm.yaml"


@pytest.mark.parametrize("override,shown", [
    ("model=3", "3"), ("model=[1]", r"\[1\]"), ("data=3", "3"), ("data=[a]", r"\['a'\]"),
])
def test_a_model_or_data_section_that_is_not_a_mapping_is_named(override, shown):
    section = override.split("=")[0]
    with pytest.raises(PlanError, match=rf"^override {re.escape(repr(override))}: {section}: got {shown}; expected a mapping"):
        load_config("conf/train/dlrm.yaml", [override], model="dlrm")


@pytest.mark.parametrize("section", ["model", "data"])
def test_a_config_file_whose_section_is_a_scalar_is_one_line_and_exit_2(tmp_path, capsys, section):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(f"train:\n  steps: 2\n{section}: 3\n")
    assert cli.main(["plan", "check", PLAN, "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {cfg}:3: {section}: got 3; expected a mapping (the {section} section's keys)\n"


def test_an_unknown_dense_optimizer_lists_the_choices_once():
    with pytest.raises(PlanError) as e:
        load_config(None, ["train.optimizer=lion"], model="dlrm")
    assert str(e.value) == ("override 'train.optimizer=lion': train.optimizer: got 'lion'; "
                            "expected one of 'sgd', 'adagrad', 'adam'")


def test_a_python_tag_in_a_training_config_is_refused_as_the_config_s(tmp_path, capsys):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("train:\n  steps: !!python/name:os.system\n")
    assert cli.main(["plan", "check", PLAN, "--config", str(cfg)]) == 2
    assert capsys.readouterr().err == (
        f"error: {cfg}:2:10: refusing YAML tag '!!python/name:os.system': a training config is plain data "
        "(mappings, lists, strings, numbers, booleans) and may not construct Python objects; remove the tag\n")
