"""The shipped plans against the shipped example models (registered in the ``hybrid.models``
entry-point group by this project's pyproject.toml), so that a plan and its model can never drift
apart unnoticed."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybrid.cli import main

PLANS = Path(__file__).resolve().parents[2] / "conf" / "plans"
SHIPPED = {
    "dlrm": ["sparse_arch.embedding_bag_collection", "dense_arch", "over_arch"],
    "dcn": ["sparse_arch.embedding_bag_collection", "dense_arch", "inter_arch", "over_arch"],
    "two_tower": ["query_ebc", "item_ebc", "query_tower", "item_tower"],
    "sequential": ["embedding_collection", "input_head", "encoder", "output_head"],
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_plan_checks(name, capsys):
    assert main(["plan", "check", str(PLANS / f"{name}.yaml")]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith("plan OK: ") and f"on {name}: 3 processes = 2 trainers + 1 parameter server" in out


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_plan_shows_every_ruled_module(name, capsys):
    assert main(["plan", "show", str(PLANS / f"{name}.yaml")]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    rows = {line.split()[0] for line in out.splitlines()[3:]}
    assert set(SHIPPED[name]) <= rows
    assert "parameter_server" in out and "total" in rows


def test_shipped_plan_with_two_servers(capsys):
    argv = ["plan", "show", str(PLANS / "dlrm.yaml"), "topology.parameter_servers=2", "--world-size", "4"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "world size 4 = 2 trainers + 2 parameter servers" in capsys.readouterr().out


def test_sequential_plan_shows_every_block_as_its_own_fsdp_unit(capsys):
    assert main(["plan", "show", str(PLANS / "sequential.yaml")]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    units = [line.split() for line in out.splitlines() if "fsdp unit" in line]
    assert [u[0] for u in units] == ["encoder.blocks.0", "encoder.blocks.1", "encoder"], out
    assert [u[1] for u in units] == ["TransformerBlock", "TransformerBlock", "(outer"], out
    encoder = next(line.split() for line in out.splitlines() if line.startswith("encoder "))
    # The units' parameters add up to the encoder's (columns from the right: params, bytes, unit, server).
    assert sum(int(u[-4].replace(",", "")) for u in units) == int(encoder[-4].replace(",", ""))
    assert "parameter_server" in out and "row_wise" in out and "per server" in out
