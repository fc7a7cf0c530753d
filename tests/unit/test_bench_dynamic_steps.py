"""benchmarks.dynamic_steps's full-table mode: a table filled to its capacity, then steps whose new
ids each evict a row."""

from benchmarks.dynamic_steps import full_table, sightings


def test_full_table_steps_evict_and_report_their_plan_and_commit():
    got = full_table(20_000, steps=3)  # asserts the table stayed full and rows were evicted
    assert set(got) == {"plan", "commit"} and all(v > 0 for v in got.values())


def test_a_long_tail_of_ids_keeps_one_windows_sightings_with_admit_window_and_all_without():
    bounded, unbounded = sightings(5, steps=12, per_step=200), sightings(0, steps=12, per_step=200)
    assert unbounded["sightings"] == unbounded["most"] > 12 * 190  # every fresh id stays counted
    assert bounded["most"] <= 4 * 400 and bounded["sightings"] <= 2 * 400  # steps 10 and 11 only
    assert bounded["rows"] > 0 and unbounded["rows"] > 0  # recurring ids get rows either way
