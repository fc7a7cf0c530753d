"""Native operators of the sparse path (temporary: plain-torch reference only)."""

from hybrid.ops.reference import (
    NonFinite,
    Route,
    RowOutOfRange,
    gather_rows,
    optimizer_rows,
    route,
    scatter_rows_,
    sgd_rows_,
    sum_rows,
)

AVAILABLE = False

__all__ = ["AVAILABLE", "NonFinite", "Route", "RowOutOfRange", "gather_rows", "optimizer_rows", "route",
           "scatter_rows_", "sgd_rows_", "sum_rows"]
