"""User-facing input errors. Each names the offending field, what is wrong and what
is allowed; the CLI prints them without a traceback and exits with code 2.

One hierarchy for the whole project: :class:`UserError` is any bad input (the
runtime re-exports it as :class:`realign.errors.UserError`), :class:`PlanError` is bad
planning input, :class:`InfeasibleError` a plan that fits nowhere.
"""


class UserError(Exception):
    """Bad user input: ``field`` is the offending config path (or flag) when there is one."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class PlanError(UserError):
    """A user error in planning input: the message says how to fix it."""


class InfeasibleError(PlanError):
    """No allocation fits in GPU memory; the message names what does not fit and
    the smallest cluster that would."""


class NonFiniteError(UserError):
    """A reward, loss or gradient that is not a finite number: the run stops before the
    optimizer applies it (exit code 1, naming the step and the value)."""
