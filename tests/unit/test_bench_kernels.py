"""``python -m benchmarks.kernels`` on a tiny table: every kernel reports, and the server's updates
equal FBGEMM's on the same rows, ids and gradients (so the two are compared like with like).
Nothing here is timed."""

import json

from benchmarks.kernels import FBGEMM_OPTIMIZERS, OPTIMIZERS
from tests.support.cli import run_hybrid


def test_kernels_report_every_kernel_and_the_server_updates_as_fbgemm_does():
    res = run_hybrid(["--rows", "3000", "--ids", "512", "--seconds", "0.01", "--repeat", "2"],
                     module="benchmarks.kernels", timeout=120)
    assert res.returncode == 0, res.output
    lines = [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
    checks = {l["optimizer"]: l["max_abs_diff"] for l in lines if "check" in l}
    assert set(checks) == set(FBGEMM_OPTIMIZERS), lines
    assert all(d <= 1e-6 for d in checks.values()), checks  # float32 rounding apart
    got = {(l["kernel"], l["optimizer"]): l for l in lines if "kernel" in l}
    expected = {("gather_index_select", None), ("gather_embedding", None), ("gather_hybrid_op", None),
                ("server_lookup", None), ("fbgemm_lookup", None), ("fbgemm_update_warm", "rowwise_adagrad"),
                ("server_message", "sgd")}
    expected |= {("server_update", o) for o in OPTIMIZERS} | {("fbgemm_update", o) for o in FBGEMM_OPTIMIZERS}
    assert set(got) == expected, sorted(got)
    for l in got.values():
        assert l["rows_per_s"] > 0 and len(l["runs_rows_per_s"]) == 2, l
        assert l["rows"] == 3000 and l["dim"] == 32 and l["ids_per_call"] == 512, l
    # The ceiling is the best gather of each round: no gather exceeds it.
    assert max(l["of_ceiling"] for k, l in got.items() if k[0].startswith("gather_")) <= 1.0
    assert {k for k, l in got.items() if "vs_fbgemm" in l} == {("server_lookup", None)} | {
        ("server_update", o) for o in FBGEMM_OPTIMIZERS}
    # A step message costs at least its lookup and its push (apart from timing noise: the calls differ).
    assert got[("server_message", "sgd")]["over_shard_calls"] > 0.5
    assert "of ceiling" in res.stderr and "the time of server_lookup + server_update" in res.stderr
