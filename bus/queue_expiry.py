"""Where a queue consumer's takes start their scan for range leases that ran out.

An in-memory policy with its own clock, one per (Bus, topic): the take
statements of `storage.queues` are handed its bound as a parameter and report
back what their scans reclaimed (`storage.expiry.ExpiryBound` is what they
need of it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from storage.queues import EXPIRY_BATCH

# How far below the time a take judged leases by its consumer's bound may move (see
# ExpiryBound.scanned). A lease the take's snapshot did not see was inserted by a take not yet
# committed when the scan began, and runs out at that take's clock at the insert plus its
# visibility timeout (a lease's end only moves later: nothing updates it, a new one starts at
# its insert). Only a take that inserted before the scan began and committed after it can hold
# a lease ending below the scan's time: the margin covers that take's rest after its insert
# (its last reads and a commit that does not wait for the WAL flush: milliseconds), whatever
# its timeout. A slower one is found by the next full scan.
EXPIRY_MARGIN = timedelta(seconds=2)
# Seconds between the full scans of a bound: they find the leases a take that failed or rolled
# back had locked (every other scan skipped them), and any the margin missed. A full scan walks
# every lease acked since a snapshot held elsewhere began (the index keeps them all), so while
# full scans find nothing, each waits twice as long as the one before, up to
# EXPIRY_FULL_SCAN_LONGEST; one that reclaims a lease brings the period back to the shortest.
EXPIRY_FULL_SCAN_EVERY = 10.0
EXPIRY_FULL_SCAN_LONGEST = 60.0
# The least time a bound's scans are apart, by the time they judge leases by: a lease that ran
# out is taken again that much later at most. Busy consumers take many times a second, and each
# scan walks the leases acked within the margin, which a snapshot held elsewhere keeps in the
# index; a take in between passes SKIP_SCAN, which makes its scan empty.
EXPIRY_SCAN_EVERY = timedelta(seconds=0.25)
SKIP_SCAN = datetime(9999, 1, 1, tzinfo=UTC)


class ExpiryBound:
    """Where a consumer's takes start looking for range leases that ran out: below it none is left.

    A lease whose jobs were acked stays in its slot of the lease table,
    holding nothing, until a rotation truncates the slot (and the previous
    release's acks delete theirs, which a long transaction holding the xmin
    horizon keeps): a scan from the topic's start (index
    `queue_leases_expiry`) visits each of them before the first that still
    holds a job. The bound starts the scan past them. It moves up only after a take
    whose scan, from the bound up to the time it judged leases by, reclaimed
    fewer than EXPIRY_BATCH leases (so none it could see was left): to that
    time less EXPIRY_MARGIN. The first take, one every `full_every` seconds
    of `clock` (doubled after each full scan that reclaimed nothing, up to
    `longest`), and one whose `now` is below the bound scan fully (NULL)
    until a full scan leaves nothing behind. The time a take reports is
    never past the server's clock at its start: a Bus whose test clock runs
    ahead does not lift its bound over the leases that Buses on the
    server's clock write meanwhile.

    One per (Bus, topic): owned by the event loop of the Bus's queue writer,
    which sends every take of the topic, and read by its consumers' idle waits.
    """

    __slots__ = (
        "_clock",
        "_full_due",
        "_full_every",
        "_full_period",
        "_last",
        "_longest",
        "_quiet_until",
        "_shortest",
        "bound",
    )

    def __init__(
        self,
        full_every: float = EXPIRY_FULL_SCAN_EVERY,
        clock: Callable[[], float] = time.monotonic,
        longest: float = EXPIRY_FULL_SCAN_LONGEST,
    ) -> None:
        self.bound: datetime | None = None  # None: no bound yet (a full scan)
        self._full_every = full_every
        self._longest = max(longest, full_every)
        self._full_period = full_every  # until the next full scan: doubled while they find nothing
        self._clock = clock  # seconds, for the full scans' period (leases are judged by `now`)
        self._full_due = float("-inf")  # `clock` time of the next full scan
        # The time the last scan that left nothing behind judged by, and `clock` then: a take
        # judged less than EXPIRY_SCAN_EVERY after it skips its scan.
        self._last: tuple[datetime, float] | None = None
        # `clock` time before which no range lease the idle looks could see runs out: a look on
        # the server's clock that found none ending within the time its consumer sleeps anyway
        # spares the looks after it the walk (see lease_look).
        self._quiet_until = float("-inf")
        self._shortest = float("inf")  # the shortest visibility timeout a take of this Bus leased for

    def _usable(self, now: datetime | None) -> datetime | None:
        bound = self.bound
        if bound is not None and now is not None and now < bound:
            # The judged time went back (a test's clock): new leases may end below the bound.
            self.bound = bound = None
            self._full_due = float("-inf")
            self._full_period = self._full_every
        return bound

    def for_take(self, now: datetime | None) -> datetime | None:
        """The start of the next take's expiry scan, judged at `now` (None: the server's clock); None: full."""
        bound = self._usable(now)
        if self._clock() >= self._full_due:
            return None
        if bound is not None and self._last is not None:
            judged, at = self._last
            # With the server's clock the take judges by it, about as far on as `clock` moved.
            judging = now if now is not None else judged + timedelta(seconds=self._clock() - at)
            if judged <= judging < judged + EXPIRY_SCAN_EVERY:
                return SKIP_SCAN
        return bound

    def for_read(self, now: datetime | None) -> datetime | None:
        """The start of a look for the next lease's end (seconds_until_visible); None: from the start."""
        bound = self._usable(now)
        return None if self._full_due == float("-inf") else bound

    def clock(self) -> float:
        """The bound's clock (seconds; monotonic unless a test gave another)."""
        return self._clock()

    def lease_look(self, now: datetime | None) -> bool:
        """Whether an idle look at `now` (None: the server's clock) must look at the range leases.

        Not while an earlier look on the server's clock found none running out before the
        time its consumer slept out, and no take of this Bus leased for less since (`leasing`):
        on a busy queue the idle looks come one per empty take, and each would walk the leases
        acked within that time, which a snapshot held elsewhere keeps in the index. A lease
        another process takes for less than that is noticed when this one ends (at most the
        consumer's fallback poll later), or by the next take's expiry scan. Looks judged by a
        test's clock always look.
        """
        return now is not None or self._clock() >= self._quiet_until

    def looked(
        self, now: datetime | None, started: float, lease_in: float | None, within: float | None
    ) -> None:
        """A look at the range leases begun at `clock` time `started` found the next one running out
        `lease_in` seconds on (None: none within `within` seconds).

        A lease a take of this Bus makes after the look's snapshot runs out no sooner than its
        shortest visibility timeout after it.
        """
        if now is None and lease_in is None and within is not None:
            self._quiet_until = started + min(within, self._shortest)
        else:
            self._quiet_until = float("-inf")

    def leasing(self, visibility_timeout: float) -> None:
        """A take of this Bus is about to lease for `visibility_timeout` seconds."""
        self._shortest = min(self._shortest, visibility_timeout)
        self._quiet_until = min(self._quiet_until, self._clock() + visibility_timeout)

    def scanned(self, started_at: datetime | None, reclaimed: int, judged_at: datetime) -> None:
        """A take whose scan started at `started_at` (None: full) reclaimed `reclaimed` leases judged at `judged_at`."""
        if started_at == SKIP_SCAN:
            return  # no scan
        if reclaimed >= EXPIRY_BATCH:
            self._last = None  # the next take scans again at once
            return  # more may have run out behind them: the next scan starts from the same place
        self._last = (judged_at, self._clock())
        if started_at is None:
            if reclaimed:
                self._full_period = self._full_every
            self._full_due = self._clock() + self._full_period
            if not reclaimed:
                self._full_period = min(self._full_period * 2, self._longest)
        moved = judged_at - EXPIRY_MARGIN
        if self.bound is None or moved > self.bound:
            self.bound = moved
