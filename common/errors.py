"""The one error tree of datagen.

    DatagenError
    ├── ConfigError            bad settings, flags or manifest: the command cannot start
    │   └── StoreMismatch      Redis holds the queues and ledgers of another database
    ├── InputError             a prompt file or dataset name that cannot be used
    ├── UnknownDatasetError    a command named a dataset the store does not know
    ├── ServiceUnavailable     Redis or the database does not answer
    └── GenerationError        one /generate call went wrong
        ├── TransientError     worth retrying after ``delay_s`` (timeouts, 5xx, 503 queue full)
        │   └── ServerUnreachable  no connection at all: the server, not the sample, is at fault
        └── PermanentError     retrying cannot help (4xx, malformed response)
            ├── IncompatibleServer   the server lacks output_ids or miscounts them
            └── UnstorableResult     the database refused the sample's result row
"""

from __future__ import annotations


class DatagenError(Exception):
    """Root of every error datagen raises on purpose."""


class ConfigError(DatagenError):
    pass


class StoreMismatch(ConfigError):
    pass


class InputError(DatagenError):
    pass


class UnknownDatasetError(DatagenError):
    def __init__(self, name: str, known: list[str]) -> None:
        listing = ", ".join(known) if known else "(none yet)"
        super().__init__(f"unknown dataset {name!r}; known datasets: {listing}")
        self.name = name
        self.known = known


class ServiceUnavailable(DatagenError):
    pass


class GenerationError(DatagenError):
    def __init__(self, message: str, *, server: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.server = server
        self.status = status


class TransientError(GenerationError):
    def __init__(
        self, message: str, *, server: str = "", status: int | None = None, delay_s: float = 0.0
    ) -> None:
        super().__init__(message, server=server, status=status)
        self.delay_s = delay_s


class ServerUnreachable(TransientError):
    """Retried without counting against the sample's attempts: a restart must not fail it."""


class PermanentError(GenerationError):
    pass


class IncompatibleServer(PermanentError):
    pass


class UnstorableResult(PermanentError):
    """The sample was generated, but its row is one the database refuses: sent again, it
    would be refused again, so the sample is recorded as failed with this message."""
