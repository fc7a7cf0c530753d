"""``python -m benchmarks.allreduce`` with a few calls: two real gloo processes per run, one JSON
line per way (gloo's two event-loop policies, the trainers' ring) with ordered percentiles, every
way's sum checked by the benchmark, and bad arguments refused. Nothing here is timed."""

import json

from tests.support.cli import run_hybrid


def test_allreduce_reports_every_way_with_ordered_percentiles_and_each_process_cpu():
    res = run_hybrid(["--floats", "1000", "--calls", "40", "--rounds", "1"], module="benchmarks.allreduce",
                     timeout=120)
    assert res.returncode == 0, res.output
    lines = [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
    assert [l["loop"] for l in lines] == ["stock", "batch", "ring"], lines
    for line in lines:
        assert line["floats"] == 1000 and line["calls"] == 40, line
        walls = [line["wall_ms"][k] for k in ("p10", "p50", "p75", "p90", "p99")]
        assert 0 < walls[0] and walls == sorted(walls), line
        assert walls[0] <= line["mean_wall_ms"] <= walls[-1], line
        assert len(line["cpu_ms_per_call"]) == 2 and all(c > 0 for c in line["cpu_ms_per_call"]), line
    assert "stock: all-reduce of 1000 floats between 2 processes, 40 calls: p10" in res.stderr, res.output
    for ratio in ("batch / stock: mean call", "ring / stock: mean call", "ring / batch: mean call"):
        assert ratio in res.stderr, res.output


def test_allreduce_refuses_a_count_below_one():
    res = run_hybrid(["--calls", "0"], module="benchmarks.allreduce", timeout=60)
    assert res.returncode == 2, res.output
    assert res.stderr.strip() == ("benchmarks.allreduce: --floats, --calls and --rounds: got 56609, 0 and 2; "
                                  "expected integers >= 1"), res.output
