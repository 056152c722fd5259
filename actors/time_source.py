"""Where a Bus and its actors get time from.

One object answers the three questions time poses here: how long since
(`monotonic`: restart intensity, commit coalescing, full-scan periods), wait
this long (`sleep`: every actor timer and restart backoff), and what time a
lease or expiry statement judges by (`now`: None means the server's
`clock_timestamp()`). Each Bus has one `BusTime`, handed to its actors through
their supervisors and to its statements through its context, so a test that
moves it (`bus.testing.Clock`) moves what the statements judge and what the
timers wait for together, and waits out a lease or a session without sleeping.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol

from storage.names import validate_seconds

__all__ = ["BusTime", "RealTime", "TimeSource"]


class TimeSource(Protocol):
    """Where actors and statements get time from; injected so tests can control timers, backoff and expiry."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on this clock."""
        ...

    def now(self) -> datetime | None:
        """The time lease and expiry statements judge by; None: the server's clock."""
        ...


class RealTime:
    """Real time: the process's monotonic clock, :func:`asyncio.sleep`, and the server's clock for statements."""

    __slots__ = ()

    def monotonic(self) -> float:
        """Seconds on the process's monotonic clock (the event loop's)."""
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on the running event loop."""
        await asyncio.sleep(seconds)

    def now(self) -> datetime | None:
        """None: statements judge by the server's clock."""
        return None


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


class BusTime:
    """The time of one Bus: real time, plus however far it was moved forward (only a test moves it).

    Unmoved, it is :class:`RealTime`: sleeps end when the event loop's timer
    says, and statements judge by the server's clock. :meth:`advance` moves
    the monotonic clock and the statements' time forward together and wakes
    every sleep, each of which ends if its deadline has now passed and sleeps
    on for what is left otherwise; real time keeps flowing on top.
    :meth:`judge_by_server` hands the statements back to the server's clock;
    the monotonic clock never goes back, so timers are not set back either.
    """

    __slots__ = ("_ahead", "_judged", "_sleepers")

    def __init__(self) -> None:
        self._ahead = 0.0  # seconds every advance added to the monotonic clock
        # How far the statements' time is ahead of this host's wall clock; None: the server's clock.
        self._judged: timedelta | None = None
        self._sleepers: set[asyncio.Future[None]] = set()

    def monotonic(self) -> float:
        """Seconds on the process's monotonic clock, plus every advance."""
        return time.monotonic() + self._ahead

    async def sleep(self, seconds: float) -> None:
        """Wait until this clock has moved on ``seconds``, by real time or by :meth:`advance`."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        deadline = self.monotonic() + seconds
        while (left := deadline - self.monotonic()) > 0:
            woken = loop.create_future()
            handle = loop.call_later(left, _wake, woken)
            self._sleepers.add(woken)
            try:
                await woken
            finally:
                handle.cancel()
                self._sleepers.discard(woken)

    def now(self) -> datetime | None:
        """The moved time (this host's wall clock plus every advance), or None (the server's) unmoved."""
        judged = self._judged
        return None if judged is None else datetime.now(UTC) + judged

    def advance(self, seconds: timedelta | float) -> None:
        """Move forward ``seconds``: statements judge by the moved time, sleeps whose end it passed end."""
        seconds = validate_seconds(seconds, "advance (time only moves forward)", allow_zero=True)
        self._ahead += seconds
        self._judged = (self._judged or timedelta()) + timedelta(seconds=seconds)
        for woken in list(self._sleepers):
            _wake(woken)

    def judge_by_server(self) -> None:
        """Statements judge by the server's clock again (the monotonic clock stays where it was moved)."""
        self._judged = None
