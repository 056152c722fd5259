"""Library logging: structlog on top of the standard `logging` module.

The library never configures logging globally. Its loggers are structlog
loggers wrapped around stdlib loggers named after the module, all under one
tree, `bus` (`bus.client`, `bus.storage.migrate`, `bus.actors.worker`, ...), so
`logging.getLogger("bus")` sets the level of every event, and a service's
own `logging` setup decides what is shown (by default: warnings and errors),
and a service that configures structlog gets our events with their bound
context (group, member, generation, topic, partition). The CLI configures both.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Protocol, cast


class Logger(Protocol):
    """What the library's code calls on a logger (a structlog BoundLogger over a stdlib logger)."""

    def bind(self, **context: object) -> Logger:
        """A logger that adds `context` to every event."""

    def debug(self, event: str, **kw: object) -> None:
        """Log `event` at DEBUG level with `kw` as key/value context."""

    def info(self, event: str, **kw: object) -> None:
        """Log `event` at INFO level with `kw` as key/value context."""

    def warning(self, event: str, **kw: object) -> None:
        """Log `event` at WARNING level with `kw` as key/value context."""

    def error(self, event: str, **kw: object) -> None:
        """Log `event` at ERROR level with `kw` as key/value context."""

    def exception(self, event: str, **kw: object) -> None:
        """Log `event` at ERROR level with the current exception's traceback."""


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
}


def _drop(event: str, **kw: object) -> None:
    """An event no handler would show."""


class _Logger:
    """A module logger whose structlog logger is made on first use.

    `import bus` then costs no structlog import (nor what structlog imports
    itself, such as rich when it is installed): the first logged event pays.

    While the service has not configured structlog, events go to the stdlib
    logger as plain `key=value` text with plain tracebacks, not through
    structlog's development defaults: those render exceptions with rich and
    their locals, which can hold a busy event loop for seconds (after a
    database restart every actor logs at once). Once the service configures
    structlog, its processors apply to our events.
    """

    __slots__ = ("_name", "_context", "_logger", "_configured")

    def __init__(self, name: str, context: dict[str, Any]) -> None:
        self._name = name
        self._context = context
        self._logger: Any = None
        self._configured = False

    def __getattr__(self, attribute: str) -> Any:
        level = _LEVELS.get(attribute)
        if (
            level is not None
            and "structlog" not in sys.modules  # not imported: nobody configured it
            and not logging.getLogger(self._name).isEnabledFor(level)
        ):
            return _drop  # an event below the stdlib level costs no structlog import (CLI start-up)
        import structlog

        configured = structlog.is_configured()
        if self._logger is None or configured != self._configured:
            stdlib_logger = logging.getLogger(self._name)
            if configured:
                self._logger = structlog.wrap_logger(stdlib_logger, **self._context)
            else:
                self._logger = structlog.wrap_logger(
                    stdlib_logger,
                    processors=[
                        structlog.stdlib.filter_by_level,
                        # exc_info is passed on: the stdlib handler prints the plain traceback.
                        structlog.processors.KeyValueRenderer(key_order=["event"], drop_missing=True),
                    ],
                    wrapper_class=structlog.stdlib.BoundLogger,
                    **self._context,
                )
            self._configured = configured
        return getattr(self._logger, attribute)


def get_logger(name: str, **context: Any) -> Logger:
    """A structlog logger for module `name`, bound to `context`.

    Lazy on purpose: module-level loggers are made at import time, before the
    service configures structlog; the configuration is looked up when an event
    is logged, so the service's processors apply to our events too.
    """
    # _Logger forwards every attribute to the structlog logger it makes on first use.
    return cast(Logger, _Logger(logger_name(name), context))


def logger_name(module: str) -> str:
    """The stdlib logger name of a library module: every one is under `bus` (`storage.db` -> `bus.storage.db`)."""
    return module if module == "bus" or module.startswith("bus.") else f"bus.{module}"
