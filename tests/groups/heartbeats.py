"""Heartbeats on a moved clock: a test advances a Bus's Clock by a heartbeat interval and waits for that beat."""

from __future__ import annotations

import pytest

from bus.testing import Clock, eventually
from storage import membership


class Beats:
    """Every heartbeat statement this process wrote, with the members it carried.

    With a heartbeat interval far longer than the test, a Bus beats only when
    its clock is advanced: `await beats.after(clock, interval)` is one beat.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[str]] = []
        real = membership.heartbeat

        async def counting(conn, groups, members, lease_time, now=None):  # type: ignore[no-untyped-def]
            rows = await real(conn, groups, members, lease_time, now)
            self.calls.append(list(members))  # once written: what the test reads next sees it
            return rows

        monkeypatch.setattr(membership, "heartbeat", counting)

    async def after(self, clock: Clock, seconds: float) -> list[str]:
        """Advance `clock` by `seconds` (a heartbeat interval) and wait for the beat; the members it carried."""
        seen = len(self.calls)
        clock.advance(seconds)
        await eventually(lambda: len(self.calls) > seen)
        return self.calls[-1]
