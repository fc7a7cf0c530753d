"""``python -m benchmarks.readers`` on small files: every reader reports at every trainer count,
and trainer 0 gets its share of the global batches (every record of the written files is good,
so a pass yields ``records // (trainers x batch)`` batches). Nothing here is timed."""

import json

from tests.support.cli import run_hybrid

READERS = {"criteo", "csv", "csv_quoted", "parquet", "parquet_rows", "sequence_csv", "sequence_parquet", "sequence_parquet_rows"}


def test_readers_report_every_reader_and_trainer_count():
    res = run_hybrid(["--records", "1200", "--batch", "100", "--trainers", "1,3", "--repeat", "1"],
                     module="benchmarks.readers", timeout=120)
    assert res.returncode == 0, res.output
    lines = [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
    got = {(l["reader"], l["trainers"]): l for l in lines if "trainers" in l}
    assert set(got) == {(r, w) for r in READERS for w in (1, 3)}, sorted(got)
    for (reader, w), l in got.items():
        assert l["batches"] == 1200 // (w * 100), l
        assert l["cpu_ms_per_batch"] > 0, l
    resumes = {l["reader"]: l for l in lines if "resume_record" in l}
    assert set(resumes) == {"criteo", "csv", "csv_quoted", "parquet"} and all(l["resume_record"] > 0 for l in resumes.values()), resumes
    assert "parquet: the row path costs" in res.stderr and "sequence_parquet: the row path costs" in res.stderr
