"""User errors of the runtime and CLI: the planner's :class:`~planner.errors.UserError`
(one hierarchy for the project; :class:`~planner.errors.PlanError` is a kind of it).
The CLI prints them without a traceback and exits with code 2; ``field`` is the
offending config path when there is one."""
from planner.errors import NonFiniteError, UserError

__all__ = ["NonFiniteError", "UserError"]
