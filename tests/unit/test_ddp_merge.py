"""Which ddp modules of a plan share one DistributedDataParallel (``merge_groups``): only those
with ``merge: true`` and equal options, and only where one DDP on their common ancestor takes
exactly their parameters. (The merged DDP itself trains on real processes in
tests/distributed/test_dense.py.)"""

import torch
from torch import nn

from hybrid.dense.ddp import merge_groups
from hybrid.plan.schema import DDPOptions


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        self.c = nn.Linear(2, 2)


class Net(nn.Module):
    def __init__(self, own_param: bool = False) -> None:
        super().__init__()
        self.bottom = Tower()
        self.top = Tower()
        if own_param:
            self.scale = nn.Parameter(torch.ones(1))


M = DDPOptions()


def test_equal_options_merge_on_the_common_ancestor():
    assert merge_groups(Net(), [("bottom", M), ("top", M)]) == [("", ["bottom", "top"], M)]
    assert merge_groups(Net(), [("bottom.a", M), ("bottom.b.0", M)]) == [("bottom", ["bottom.a", "bottom.b.0"], M)]


def test_different_options_or_merge_false_keep_one_ddp_each():
    other = DDPOptions(bucket_cap_mb=5)
    assert merge_groups(Net(), [("bottom", M), ("top", other)]) == [("bottom", ["bottom"], M), ("top", ["top"], other)]
    off = DDPOptions(merge=False)
    assert merge_groups(Net(), [("bottom", off), ("top", off)]) == [("bottom", ["bottom"], off), ("top", ["top"], off)]
    # Three modules, two of them alike: those two merge, the third stays alone.
    assert merge_groups(Net(), [("bottom.a", M), ("top", other), ("bottom.c", M)]) == [
        ("bottom", ["bottom.a", "bottom.c"], M), ("top", ["top"], other)]


def test_an_ancestor_with_parameters_of_its_own_is_not_merged_over():
    # The root's own ``scale`` belongs to no ddp module: a DDP on the root would take it.
    assert merge_groups(Net(own_param=True), [("bottom", M), ("top", M)]) == [
        ("bottom", ["bottom"], M), ("top", ["top"], M)]
    # Under ``bottom`` (no parameters of its own) the root's parameter does not matter.
    assert merge_groups(Net(own_param=True), [("bottom.a", M), ("bottom.c", M)]) == [
        ("bottom", ["bottom.a", "bottom.c"], M)]


def test_a_module_inside_another_is_not_merged():
    assert merge_groups(Net(), [("bottom.b", M), ("bottom", M)]) == [("bottom.b", ["bottom.b"], M), ("bottom", ["bottom"], M)]
