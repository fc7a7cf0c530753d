"""Trainer 0's view of its servers for the run summary: counters summed over the collections, the
process's own figures (CPU, huge pages) taken once, and the CPU a server spent while training.
The summary line itself is checked on a real run in ``tests/distributed/test_train.py``."""

import pytest

from hybrid.train.loop import _cpu_per_step, merge_server_stats


def test_counters_add_up_over_collections_and_process_figures_count_once():
    ebc = {"ps0": {"lookups": 10, "bytes_in": 100, "cpu_s": 5.0, "huge_page_bytes": 2048, "unique_ratio": 0.5},
           "ps1": {"lookups": 7, "bytes_in": 70, "cpu_s": 3.0}}
    seq = {"ps0": {"lookups": 4, "bytes_in": 40, "cpu_s": 5.0, "huge_page_bytes": 2048,
                   "dynamic": {"t": {"rows": 3, "sightings": 1, "admitted": 3, "evicted": 0, "hits": 2,
                                     "looked_up": 5}}}}
    got = merge_server_stats([ebc, seq])
    assert got["ps0"]["lookups"] == 14 and got["ps0"]["bytes_in"] == 140
    assert got["ps0"]["cpu_s"] == 5.0 and got["ps0"]["huge_page_bytes"] == 2048  # one process, not two
    assert got["ps0"]["dynamic_rows"] == 3 and got["ps0"]["dynamic_looked_up"] == 5
    assert got["ps1"] == {"lookups": 7, "bytes_in": 70, "cpu_s": 3.0}


def test_cpu_while_training_is_the_difference_of_two_readings_over_their_wall_time():
    before = {"ps0": {"cpu_s": 10.0}, "ps1": {"cpu_s": 1.0}}
    after = {"ps0": {"cpu_s": 12.5}, "ps1": {"cpu_s": 2.0}, "ps2": {"cpu_s": 9.0}}
    _cpu_per_step(after, before, 100.0, 110.0)
    assert after["ps0"]["train_cpu_s"] == pytest.approx(2.5) and after["ps0"]["train_cpu_share"] == pytest.approx(0.25)
    assert after["ps1"]["train_cpu_s"] == pytest.approx(1.0) and after["ps1"]["train_cpu_share"] == pytest.approx(0.1)
    assert "train_cpu_s" not in after["ps2"]  # no reading before: nothing to say
