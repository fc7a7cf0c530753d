"""benchmarks.dynamic_steps's full-table mode: a table filled to its capacity, then steps whose new
ids each evict a row."""

from benchmarks.dynamic_steps import full_table


def test_full_table_steps_evict_and_report_their_plan_and_commit():
    got = full_table(20_000, steps=3)  # asserts the table stayed full and rows were evicted
    assert set(got) == {"plan", "commit"} and all(v > 0 for v in got.values())
