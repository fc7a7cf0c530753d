"""Plan errors (:class:`hybrid.errors.PlanError`), where the plan code imports them from."""

from hybrid.errors import CATEGORIES, Category, PlanError, did_you_mean, join_key, one_of

__all__ = ["CATEGORIES", "Category", "PlanError", "did_you_mean", "join_key", "one_of"]
