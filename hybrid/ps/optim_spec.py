"""Names and state sizes of the server-side (row-sparse) optimizers; shared by the plan
validation and report, and by the servers."""

from __future__ import annotations

SPARSE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


def state_floats_per_row(name: str, dim: int) -> int:
    """float32 values of optimizer state kept per table row."""
    return {
        "sgd": 0,
        "adagrad": dim,  # one accumulator per element
        "rowwise_adagrad": 1,  # one accumulator per row, as FBGEMM
        "adam": 2 * dim + 1,  # exp_avg, exp_avg_sq and the row's own step count
    }[name]
