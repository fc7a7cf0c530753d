"""Throughput and memory benchmarks of hybrid against its baselines.

``python -m benchmarks.run`` trains one synthetic DLRM, from the same initial weights and on the
same batches, under several systems (plain local PyTorch, the PyTorch RPC+DDP tutorial pattern,
TorchRec ``DistributedModelParallel``, and hybrid in sync/async/FSDP modes), one after another,
each in fresh processes, and prints one JSON line per system. ``python -m benchmarks.memory``
compares per-trainer memory of DDP and FSDP on a dense-heavy model.
"""
