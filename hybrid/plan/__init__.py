"""The plan file: which submodule of a model trains under which strategy, with what options.

``load_plan`` reads and type-checks a plan YAML (with ``key=value`` overrides), ``resolve`` matches
it to a model and a world size, ``format_plan`` prints the result as a table. Every mistake is a
:class:`PlanError` naming the key, the bad value and the fix.
"""

from hybrid.plan.errors import CATEGORIES, PlanError
from hybrid.plan.load import load_plan, plan_from_dict
from hybrid.plan.match import ResolvedModule, ResolvedPlan, resolve
from hybrid.plan.report import (
    ModuleEstimate,
    check_server_memory,
    estimate_memory,
    format_plan,
    log_plan,
    server_table_bytes,
    summarize,
)
from hybrid.plan.schema import (
    DEFAULT_RULE,
    STRATEGY_OPTIONS,
    DDPOptions,
    FSDPOptions,
    LocalOptions,
    MixedPrecision,
    Plan,
    PSOptions,
    Rule,
    SparseOptimizer,
    SyncOptions,
    Topology,
)

__all__ = [
    "CATEGORIES",
    "DDPOptions",
    "DEFAULT_RULE",
    "FSDPOptions",
    "LocalOptions",
    "MixedPrecision",
    "ModuleEstimate",
    "PSOptions",
    "Plan",
    "PlanError",
    "ResolvedModule",
    "ResolvedPlan",
    "Rule",
    "STRATEGY_OPTIONS",
    "SparseOptimizer",
    "SyncOptions",
    "Topology",
    "check_server_memory",
    "estimate_memory",
    "format_plan",
    "load_plan",
    "log_plan",
    "plan_from_dict",
    "resolve",
    "server_table_bytes",
    "summarize",
]
