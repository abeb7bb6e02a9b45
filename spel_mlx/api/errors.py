"""The API's argument error."""


class GenerationError(ValueError):
    """A bad argument; `param` names it (as the HTTP server reports it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
