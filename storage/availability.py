"""Whether a Bus reaches its database: outages told from bugs, and said once.

A server that is away (stopped for a restart, a minor upgrade, a managed
maintenance window, a network cut) is not a bug of the bus: everything
that waits on it retries, with backoff, for as long as it lasts. What is
an outage is decided by :func:`is_unavailable`; the :class:`Availability`
of a Bus records its outages and logs each one twice: a warning
(`database_unavailable`) when the server cannot be reached, and one
(`database_recovered`, with how long it lasted) when it can again. Both
are warnings so that a service that shows only warnings (the stdlib's
default) sees the end of what it was told about.

asyncpg's pool, meanwhile, tries to open its minimum of connections again
and logs a full traceback at every attempt ("Failed to restore the pool
connection floor"); :func:`quiet_pool_floor_retries` drops those records
when the cause is the server being away (other causes stay).
"""

from __future__ import annotations

import errno
import logging
import socket
import time
import weakref
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg

from storage.errors import BusError, StorageUnavailableError
from storage.logs import get_logger

log = get_logger(__name__)

# SQLSTATE classes of a server that is away: 08 connection exceptions, 57P01-57P03 shutdowns and
# start-ups (admin_shutdown, crash_shutdown, cannot_connect_now).
_UNAVAILABLE_STATES = ("08", "57P01", "57P02", "57P03")


# What a socket says when the server or the way to it is away: refused, reset, unreachable, a name
# that does not resolve (a service's DNS entry during a failover), a unix socket's file gone with the
# server that made it. Other OSErrors (a permission, a full disk) are the caller's own.
_UNAVAILABLE_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ENOTCONN,
        errno.ESHUTDOWN,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.ENETRESET,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.ETIMEDOUT,
        errno.ENOENT,
    }
)


def is_unavailable(exc: BaseException) -> bool:
    """Whether `exc` means the server is away (or its connection was lost), as opposed to a bug.

    A StorageUnavailableError, a socket error of a server that is away (refused, reset,
    unreachable, unresolvable; not a bare timeout), a connection or shutdown SQLSTATE, or asyncpg's
    own "connection is closed"; directly, as the cause of what was raised, or as what the driver or
    the bus was handling when it raised (a bug raised while handling an outage stays a bug).
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _unavailable_itself(current):
            return True
        if current.__cause__ is not None:
            current = current.__cause__
        elif _wraps_what_it_handled(current):
            current = current.__context__
        else:
            current = None
    return False


def _wraps_what_it_handled(exc: BaseException) -> bool:
    """The driver's and the bus's own errors stand for what they were raised while handling."""
    if exc.__suppress_context__:
        return False
    return isinstance(
        exc, asyncpg.PostgresError | asyncpg.InterfaceError | asyncpg.InternalClientError | BusError
    )


def _unavailable_itself(exc: BaseException) -> bool:
    if isinstance(exc, StorageUnavailableError | asyncpg.ConnectionDoesNotExistError):
        return True
    if isinstance(exc, socket.gaierror):
        return True
    if isinstance(exc, ConnectionError):
        return True
    if isinstance(exc, OSError) and not isinstance(exc, TimeoutError):
        if exc.errno is None:
            # asyncio's connect to a name with several addresses: every attempt failed
            return str(exc).startswith("Multiple exceptions")
        return exc.errno in _UNAVAILABLE_ERRNOS
    if isinstance(exc, asyncpg.PostgresError):
        state = getattr(exc, "sqlstate", None) or ""
        return state.startswith(_UNAVAILABLE_STATES)
    if isinstance(exc, asyncpg.InterfaceError):
        text = str(exc)
        return "connection is closed" in text or "connection was closed" in text
    if isinstance(exc, asyncpg.InternalClientError):
        # What asyncpg raises, about one time in three, for the first statement on a connection
        # whose server process was terminated while it was idle (its protocol is left mid-state).
        return "cannot switch to state" in str(exc)
    return False


class Availability:
    """One Bus's view of its database: reachable or not, since when, and its past outages.

    Fed by the actors that open connections of their own (the Notifier, the
    HeartbeatMonitor): `lost` when opening one fails because the server is
    away, `reached` when one opens or a statement succeeds. A dropped
    connection that opens again at once (a terminated backend) is no outage.
    Read by `Bus.health()`, the metrics and the dashboard.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool, bool], None] | None = None,
    ) -> None:
        self._clock = clock
        #: Called with (available, whether an outage just ended) at each change (the metrics).
        self.on_change = on_change
        self._since: float | None = None  # on `clock`, while the server is away
        self.unavailable_since: datetime | None = None
        self.error: str | None = None
        #: Outages that ended since the Bus opened, and how long the last one lasted.
        self.outages = 0
        self.last_outage: float | None = None
        _watching.add(self)

    @property
    def available(self) -> bool:
        """False from the first failed connection attempt of an outage until a connection opens again."""
        return self._since is None

    @property
    def unavailable_for(self) -> float | None:
        """Seconds the current outage has lasted (None while the database is reachable)."""
        return None if self._since is None else self._clock() - self._since

    def close(self) -> None:
        """Its Bus is closed: an outage it saw no longer quiets anyone's warnings (`said`)."""
        _watching.discard(self)

    def lost(self, exc: BaseException) -> None:
        """A connection could not be opened because the server is away (the first time: logged)."""
        if self._since is not None:
            return
        self._since = self._clock()
        self.unavailable_since = datetime.now(UTC)
        self.error = f"{type(exc).__name__}: {exc}"
        if self.on_change is not None:
            self.on_change(False, False)
        log.warning(
            "database_unavailable",
            error=self.error,
            hint="the bus retries with backoff until it is back; b.health() says degraded meanwhile",
        )

    def reached(self) -> None:
        """A connection opened, or a statement succeeded: the outage (if any) is over (logged)."""
        if self._since is None:
            return
        lasted = self._clock() - self._since
        self._since = None
        self.unavailable_since = None
        self.error = None
        self.outages += 1
        self.last_outage = lasted
        if self.on_change is not None:
            self.on_change(True, True)
        log.warning("database_recovered", outage_seconds=round(lasted, 1))


# Every Availability of the process, for `said`.
_watching: weakref.WeakSet[Availability] = weakref.WeakSet()


def said(exc: BaseException) -> bool:
    """Whether a failure of `exc` is an outage a Bus of this process has already logged.

    The actors that retry a statement at every tick log such a failure at debug
    instead of as a warning (`warn_unless_said`): during an outage they would
    otherwise log the same news several times a second until it ends.
    """
    return is_unavailable(exc) and any(not a.available for a in list(_watching))


def warn_unless_said(logger: Any, event: str, exc: BaseException, **context: object) -> None:
    """Log a failure as a warning, or at debug when it is an outage already said (`said`)."""
    (logger.debug if said(exc) else logger.warning)(event, error=repr(exc), **context)


class _PoolFloorRetries(logging.Filter):
    """Drops asyncpg's "Failed to restore the pool connection floor" record when the server is away."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Failed to restore the pool connection floor"):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or not is_unavailable(exc)


_floor_filter = _PoolFloorRetries()


def quiet_pool_floor_retries() -> None:
    """Install the filter on asyncpg's pool logger (once; the Availability says it instead)."""
    logger = logging.getLogger("asyncpg.pool")
    if _floor_filter not in logger.filters:
        logger.addFilter(_floor_filter)
