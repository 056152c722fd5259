"""What a take statement needs of its consumer's expiry bound (`bus.queue_expiry.ExpiryBound`).

The bound is an in-memory policy of the consumer's side; the statements of
`storage.queues` only ask it where their scan starts and tell it what the scan found.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol


class ExpiryBound(Protocol):
    """Where a consumer's takes start looking for range leases that ran out (see `bus.queue_expiry`)."""

    def for_take(self, now: datetime | None) -> datetime | None:
        """The start of the next take's expiry scan, judged at `now` (None: the server's clock); None: full."""
        ...

    def scanned(self, started_at: datetime | None, reclaimed: int, judged_at: datetime) -> None:
        """A take whose scan started at `started_at` (None: full) reclaimed `reclaimed` leases judged at `judged_at`."""
        ...

    def for_read(self, now: datetime | None) -> datetime | None:
        """The start of a look for the next lease's end; None: from the start."""
        ...

    def lease_look(self, now: datetime | None) -> bool:
        """Whether an idle look at `now` (None: the server's clock) must look at the range leases."""
        ...

    def clock(self) -> float:
        """The bound's clock, in seconds."""
        ...

    def looked(
        self, now: datetime | None, started: float, lease_in: float | None, within: float | None
    ) -> None:
        """A look begun at clock time `started` found the next lease running out `lease_in` seconds on."""
        ...
