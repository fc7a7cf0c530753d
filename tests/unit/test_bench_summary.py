"""The benchmark's repeat logic (``python -m benchmarks.run --repeat N``), without processes: runs go
round-robin over the systems and each system reports its median run."""

import pytest

from benchmarks import run as bench


def _line(system: str, sps: float) -> dict:
    return {"system": system, "samples_per_s": sps, "final_loss": 0.5}


def test_median_run_is_the_middle_run_and_lists_every_run():
    runs = [_line("a", 30.0), _line("a", 10.0), _line("a", 20.0)]
    got = bench.median_run(runs)
    assert got["samples_per_s"] == 20.0
    assert got["runs_samples_per_s"] == [30.0, 10.0, 20.0]  # in run order
    assert bench.median_run([_line("a", 30.0), _line("a", 10.0)])["samples_per_s"] == 10.0  # lower middle


def test_a_failed_run_makes_the_system_report_the_failure():
    got = bench.median_run([_line("a", 30.0), {"system": "a", "error": "boom"}])
    assert got == {"system": "a", "error": "boom"}


def test_rounds_alternate_the_systems(monkeypatch):
    order = []

    def fake_run_systems(w, systems, **kwargs):
        order.append(systems[0])
        return [_line(systems[0], float(len(order)))]

    monkeypatch.setattr(bench, "run_systems", fake_run_systems)
    lines = bench.run_rounds(None, ["x", "y"], repeat=3, timeout_s=1.0)
    assert order == ["x", "y", "x", "y", "x", "y"]
    assert [l["runs_samples_per_s"] for l in lines] == [[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]]
    assert [l["samples_per_s"] for l in lines] == [3.0, 4.0]


def test_repeat_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeat", "0"])
    assert "--repeat: got 0" in capsys.readouterr().err


def test_ratios_pair_the_runs_of_one_round():
    # Round 2 ran while the machine was slow: both systems lost half their speed. Round by round
    # "a" is 1.2x, 1.2x and 0.9x "b"; the ratio of the medians (20 / 20 = 1.0x) would hide that.
    a = {**_line("a", 20.0), "runs_samples_per_s": [24.0, 12.0, 18.0]}
    b = {**_line("b", 20.0), "runs_samples_per_s": [20.0, 10.0, 20.0]}
    assert bench.round_ratios(a, b) == pytest.approx([1.2, 1.2, 0.9])
    assert bench.paired_ratio(a, b) == pytest.approx(1.2)
    # A single run (or lines without per-run numbers) is the plain ratio.
    assert bench.paired_ratio(_line("a", 30.0), _line("b", 20.0)) == pytest.approx(1.5)


def test_targets_show_every_rounds_ratio():
    sync = {**_line("hybrid_sync", 10.0), "first_loss": 0.7, "median_step_s": 0.01,
            "runs_samples_per_s": [9.0, 10.0, 11.0]}
    dmp = {**_line("torchrec_dmp", 10.0), "first_loss": 0.7, "median_step_s": 0.01,
           "runs_samples_per_s": [10.0, 10.0, 10.0]}
    table = bench.ratio_table([sync, dmp])
    assert "hybrid_sync >= 1.4x torchrec_dmp: 1.00x  MISSED  (rounds: 0.90, 1.00, 1.10)" in table
    # Across emulated hosts the targets are those of the multi-host path.
    net = {"network": {"kind": "emulated"}}
    table = bench.ratio_table([{**sync, **net, "runs_samples_per_s": [13.0, 14.0, 15.0]}, {**dmp, **net}])
    assert "hybrid_sync >= 1.3x torchrec_dmp: 1.40x  met  (rounds: 1.30, 1.40, 1.50)" in table
