"""User errors of the runtime and CLI. The CLI prints them without a traceback and
exits with code 2; ``field`` is the offending config path when there is one."""


class UserError(Exception):
    def __init__(self, message: str, field: str | None = None):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)
