"""``hybrid plan show/check --world-size N``: a bad N is named as the flag that gave it."""

from __future__ import annotations

import pytest

from hybrid import cli


@pytest.mark.parametrize("action", ["show", "check"])
@pytest.mark.parametrize("n", ["0", "-3"])
def test_a_world_size_flag_below_1_is_named_as_the_flag(capsys, action, n):
    assert cli.main(["plan", action, "conf/plans/dlrm.yaml", "--world-size", n]) == 2
    out = capsys.readouterr()
    assert out.err == f"error: --world-size: got {n}; expected a number of processes >= 1\n" and not out.out


def test_a_world_size_in_the_plan_below_1_is_named_where_it_was_written(capsys):
    assert cli.main(["plan", "check", "conf/plans/dlrm.yaml", "world_size=0"]) == 2
    assert capsys.readouterr().err == ("error: override 'world_size=0': world_size: got 0; "
                                       "expected a number of processes >= 1\n")
