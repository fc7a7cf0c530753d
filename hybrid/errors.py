"""The one error class for plan mistakes, with a category (as torchrec's ``PlannerError``).

Every message names the plan key (``modules.dense_arch.bucket_cap_mb``), the bad value and
what is allowed or how to fix it. Where the plan came from a file, ``where`` says which file and
line (``conf/plans/dlrm.yaml:14``) or which command-line override set the value.
"""

from __future__ import annotations

import difflib
import os
import sys
import types
from collections.abc import Iterable
from typing import Literal, NoReturn, get_args

Category = Literal[
    "yaml_syntax",  # the file is not valid YAML (or has a duplicate key)
    "unsafe_yaml",  # a tag such as !!python/object that would construct objects
    "io",  # the plan file cannot be read
    "bad_override",  # a command-line override that is not key=value
    "unknown_key",  # a key the schema does not know
    "bad_value",  # a value of the wrong type or out of range, or a missing required value
    "unknown_optimizer",  # a sparse optimizer name that the servers do not implement
    "unknown_module",  # a module path or glob that matches no module of the model
    "unknown_model",  # a model name that finds no model (hybrid.train.spec.resolve_model)
    "conflicting_rules",  # two equally specific rules give one module different settings
    "not_an_embedding",  # parameter_server on a module that holds no embedding tables
    "unsupported_table",  # an embedding table the servers cannot serve (e.g. max pooling)
    "fsdp_under_ddp",  # an fsdp rule inside a ddp-ruled module
    "ddp_under_fsdp",  # a ddp rule inside an fsdp-ruled module
    "nested_rules",  # any other rule inside a ruled module (only fsdp may nest in fsdp)
    "no_parameters",  # a rule on a module without parameters
    "own_parameters",  # a module's own parameters would be left without a rule
    "no_rule",  # a module with parameters that no rule covers and there is no "*" rule
    "topology",  # process counts or server indices that do not fit
    "memory",  # tables and optimizer state that do not fit a server's memory
]
CATEGORIES: tuple[str, ...] = get_args(Category)


class PlanError(ValueError):
    """A mistake in a plan, its overrides, or its fit to a model and a world size.

    ``category`` says which kind of mistake (see :data:`Category`), ``key`` is the plan key
    path it concerns (``""`` for the whole plan), ``detail`` the explanation, and ``where`` the
    file position or override it came from, when known.
    """

    def __init__(self, detail: str, *, category: Category, key: str = "", where: str = "") -> None:
        assert category in CATEGORIES, f"unknown PlanError category {category!r}"
        self.detail = detail
        self.category = category
        self.key = key
        self.where = where
        super().__init__(self._render())

    def _render(self) -> str:
        return ": ".join(p for p in (self.where, self.key, self.detail) if p)

    def under(self, prefix: str) -> PlanError:
        """The same error with ``prefix`` put in front of its key path."""
        key = join_key(prefix, self.key)
        return PlanError(self.detail, category=self.category, key=key, where=self.where)

    def at(self, where: str) -> PlanError:
        """The same error located at ``where`` (``file:line``, an override) unless already so."""
        where = self.where or where
        return PlanError(self.detail, category=self.category, key=self.key, where=where)


def join_key(*parts: str) -> str:
    """``join_key("modules", "dense_arch", "")`` -> ``"modules.dense_arch"``."""
    return ".".join(p for p in parts if p)


def did_you_mean(word: str, choices: Iterable[str], n: int = 3) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


def one_of(choices: Iterable[object]) -> str:
    """``one of 'a', 'b', 'c'`` for a message."""
    return "one of " + ", ".join(repr(c) for c in choices)


class InputError(ValueError):
    """Input data a user can fix, found while a run reads it: a malformed line, a missing column,
    NaN in a batch. The message names the file, the line and the field (or the step). A run ends
    with one ``error:`` line and exit code 2, as for a plan mistake."""


class UserCodeError(Exception):
    """Code of the user's that hybrid called (a model builder named by ``--model`` or
    ``model.name``) raised. That is not bad input but a failure of the user's code, which needs its
    traceback: :func:`print_error` prints the traceback of the user's frames (hybrid's own under
    ``hybrid --debug``), then one ``error:`` line naming what failed; the command exits with 1, as
    a failing process does. ``error`` is the user's exception, ``user_tb`` its traceback from the
    first frame of the user's code."""

    def __init__(self, what: str, error: BaseException, user_tb: types.TracebackType | None) -> None:
        text = str(error).strip()
        first = f": {text.splitlines()[0]}" if text else ""
        super().__init__(f"{what} failed: {type(error).__name__}{first}")
        self.error, self.user_tb = error, user_tb


EXIT_FAILED, EXIT_USAGE = 1, 2
"""Exit codes: a failure (a process, the user's code), and a mistake the user can fix (one line)."""


_REMOVE_AT_EXIT: list[str] = []


def remove_at_exit(folder: str) -> None:
    """Have :func:`exit_now` remove ``folder``: a process that ends at once skips the ``with``
    blocks and ``atexit`` handlers that would."""
    _REMOVE_AT_EXIT.append(folder)


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` at once, its output flushed: no interpreter teardown (of
    torch, torchrec and their modules: a second or two of CPU a process) and no waiting in RPC's,
    the process groups' or torchrun's teardown. For a process whose work is done or given up.
    The folders given to :func:`remove_at_exit` are removed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _REMOVE_AT_EXIT:
        import shutil

        for folder in _REMOVE_AT_EXIT:
            shutil.rmtree(folder, ignore_errors=True)
    os._exit(code)


def exit_status(e: BaseException) -> int:
    """The exit code of a command that stops on ``e``: the user's code failing
    (:class:`UserCodeError`) is a failure; anything else reported this way is a mistake to fix."""
    return EXIT_FAILED if isinstance(e, UserCodeError) else EXIT_USAGE


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its class name when it has none): what a one-line
    report of a failure quotes."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


DEBUG_ENV = "HYBRID_DEBUG"
"""Set (to 1) by ``hybrid --debug`` for every process of the command: user errors show their traceback."""


def print_error(e: BaseException) -> None:
    """``error: <e>`` on stderr in one line, the traceback before it only under ``hybrid --debug``;
    for a :class:`UserCodeError`, the traceback of the user's code always."""
    import os
    import sys
    import traceback

    if os.environ.get(DEBUG_ENV) == "1":
        traceback.print_exception(e, file=sys.stderr)
    elif isinstance(e, UserCodeError):
        traceback.print_exception(type(e.error), e.error, e.user_tb, file=sys.stderr)
    # One write: print() writes the text and its newline apart, and a line another thread logs
    # between the two (a server's background fill) would be glued to this one.
    sys.stderr.write(f"error: {e}\n")
    sys.stderr.flush()
