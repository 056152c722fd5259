"""Library logging: structlog on top of the standard `logging` module.

The library never configures logging globally. Its loggers are structlog
loggers wrapped around stdlib loggers named after the module, so a service's
own `logging` setup decides what is shown (by default: warnings and errors),
and a service that configures structlog gets our events with their bound
context (group, member, generation, topic, partition). The CLI configures both.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog


def get_logger(name: str, **context: Any) -> Any:
    """A structlog logger for module `name`, bound to `context`.

    Lazy on purpose: module-level loggers are made at import time, before the
    service configures structlog; the configuration is looked up when an event
    is logged, so the service's processors apply to our events too.
    """
    return structlog.wrap_logger(logging.getLogger(name), **context)
