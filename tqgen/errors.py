"""Errors tqgen reports to its users.

Every error a user can cause (a bad config, a bad command line, a build that
cannot proceed) is a `TqgenError` whose message is one line that names what is
wrong. The CLI prints that line and exits 2; nothing else is shown.
"""


class TqgenError(Exception):
    """A user-facing error: the message is one complete line."""


class ConfigError(TqgenError):
    """A config file or config mapping that tqgen refuses."""

    def __init__(self, source: str, field: str, message: str):
        self.source = source
        self.field = field
        super().__init__(f"{source}: {field}: {message}")
