"""Where a statement's `now` comes from.

Lease and expiry statements judge by a time they are given, or by the server's
`clock_timestamp()` when given None (production's).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TypeAlias

#: Where a lease or expiry statement's `now` comes from: a time, or None for the server's clock
#: (`server_clock`, production's). A test's `bus.testing.Clock` moves it for one Bus.
Now: TypeAlias = Callable[[], datetime | None]


def server_clock() -> datetime | None:
    """The server's clock: None, so the statements judge by `clock_timestamp()`."""
    return None
