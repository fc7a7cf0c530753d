"""Server tables in transparent huge pages (:mod:`hybrid.ps.server.memory`): the tensors behave as
``torch.empty``'s, start on a 2 MiB boundary and sit in a mapping the kernel may back by huge
pages; switched off, or small, they are plain tensors."""
from __future__ import annotations

import gc

import pytest
import torch

from hybrid.ps.config import OptimizerSpec as SparseOptimSpec
from hybrid.ps.server import memory
from hybrid.ps.server.optim import RowSparseOptimizer


def _mapping_flags(addr: int) -> dict[str, str]:
    """The ``/proc/self/smaps`` fields of the mapping that holds ``addr``."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = lo <= addr < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def test_a_table_is_an_ordinary_writable_tensor_that_outlives_its_mapping_object():
    t = memory.table_tensor(70_000, 16)
    assert t.shape == (70_000, 16) and t.dtype == torch.float32 and t.is_contiguous()
    t.copy_(torch.arange(70_000 * 16, dtype=torch.float32).view(70_000, 16))
    gc.collect()  # the mmap object is referenced by the tensor alone
    assert float(t[69_999, 15]) == 70_000 * 16 - 1
    rows = t.index_select(0, torch.tensor([3, 69_998]))
    t.index_copy_(0, torch.tensor([0]), rows[:1])
    assert torch.equal(t[0], t[3])


@pytest.mark.skipif(not memory.huge_pages_available(), reason="this kernel offers no transparent huge pages")
def test_a_table_starts_on_a_huge_page_and_its_mapping_may_take_huge_pages():
    t = memory.table_tensor(100_000, 32)
    assert t.data_ptr() % memory.HUGE_PAGE == 0
    t.zero_()
    flags = _mapping_flags(t.data_ptr())
    assert flags.get("THPeligible") == "1", flags


def test_optimizer_state_is_allocated_the_same_way_and_initialized():
    opt = RowSparseOptimizer(SparseOptimSpec(name="adagrad", lr=0.1, initial_accumulator_value=0.5), 40_000, 16)
    assert torch.all(opt.state["sum"] == 0.5)
    adam = RowSparseOptimizer(SparseOptimSpec(name="adam", lr=0.1), 40_000, 16)
    assert all(torch.all(v == 0) for v in adam.state.values())
    if memory.huge_pages_available():
        assert opt.state["sum"].data_ptr() % memory.HUGE_PAGE == 0


@pytest.mark.skipif(memory.thp_mode() != "madvise", reason="only under 'madvise' does an un-asked mapping stay out")
def test_switched_off_or_small_tables_are_plain_torch_empty():
    small = memory.table_tensor(10, 4).zero_()
    assert small.shape == (10, 4)
    big = memory.table_tensor(100_000, 32, huge_pages=False).zero_()
    assert big.shape == (100_000, 32)
    assert _mapping_flags(big.data_ptr()).get("THPeligible") == "0"
    assert _mapping_flags(memory.table_tensor(100_000, 32).zero_().data_ptr()).get("THPeligible") == "1"
