"""Which of the driver's errors mean PostgreSQL is away, and their translation into `StorageUnavailableError`."""

from __future__ import annotations

from typing import Any, Literal

import asyncpg

from storage.errors import StorageUnavailableError

#: A lost, refused or dropped connection (asyncpg's own state errors included).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)

#: Errors an actor outlives by retrying on its next tick: a lost or refused
#: connection, a server restarting, a deadlock victim. Anything else is a bug
#: and goes to the supervisor.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    *CONNECTION_ERRORS,
    asyncpg.DeadlockDetectedError,
    asyncpg.SerializationError,
    asyncpg.QueryCanceledError,
    StorageUnavailableError,
    TimeoutError,
)


class translate_errors:
    """Turn lost connections and server shutdowns into StorageUnavailableError (a context manager)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is None:
            return False
        if isinstance(exc, CONNECTION_ERRORS):
            raise StorageUnavailableError(
                f"PostgreSQL is unavailable ({type(exc).__name__}: {exc}); the operation did not complete, retry it"
            ) from exc
        return False
