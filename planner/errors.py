"""User-facing planning errors. Each names what is wrong and what is allowed."""


class PlanError(Exception):
    """A user error in planning input: the message says how to fix it."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class InfeasibleError(PlanError):
    """No allocation fits in GPU memory; the message names what does not fit and
    the smallest cluster that would."""
