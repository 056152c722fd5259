"""The IdlePoller: one per Bus, the poll fallback of every PartitionWorker of the process.

NOTIFYs wake workers when their partition gets messages; the fallback covers a
NOTIFY that was lost (connection down, full mailbox) and an idle worker's lease
that was taken or ran out. Done by each worker on its own, that is a fetch and a
lease check per partition per `max_poll_interval`: at thousands of partitions
the idle group alone keeps the database busy. Here it is one statement per
interval for the whole process: each worker that went idle tells this actor
where it stands (`Watch`: partition, lease epoch, position), and each interval
one query finds which of them have messages past their position (those get a
`Wake`) and which lost their lease (those get a `CheckLease`). A worker that
waits to take a lease or to hand on a batch is woken at every interval, as it
would wake itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import asyncpg

from actors.messages import CheckLease, PollDue, PollerMessage, Unwatch, Wake, Watch, WorkerMessage
from actors.runtime import Actor, ActorRef, Timer
from storage import leases
from storage.availability import warn_unless_said
from storage.db import TRANSIENT_ERRORS, Conn, Now, server_clock
from storage.logs import get_logger

# What the poll may meet and survive (anything else is a bug, and fails the actor).
_POLL_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, asyncpg.PostgresError)


@dataclass(frozen=True)
class _Watched:
    group: str
    member_id: str
    partition_id: int
    epoch: int | None
    position: int
    always: bool


class IdlePoller(Actor[PollerMessage]):
    """Owns the table of idle workers and the one periodic statement that looks at all of them."""

    # Every worker of the process may report at once (a rebalance starting hundreds of them).
    mailbox_size = 100_000

    def __init__(self, conn: Conn, now: Now = server_clock) -> None:
        self._conn = conn  # the Bus's Lender: one short statement, no pool acquire and reset
        self._now = now  # when leases are judged (a test's Clock; None from it: the server's)
        self._watched: dict[ActorRef[WorkerMessage], _Watched] = {}
        self._interval: float | None = None
        self._timer: Timer | None = None
        self._log = get_logger(__name__, actor="poller")

    @property
    def watched(self) -> int:
        return len(self._watched)

    async def receive(self, message: PollerMessage) -> Any:
        match message:
            case Watch(ref=ref, interval=interval):
                self._watched[ref] = _Watched(
                    message.group,
                    message.member_id,
                    message.partition_id,
                    message.epoch,
                    message.position,
                    message.always,
                )
                if self._interval is None or interval < self._interval:
                    self._every(interval)
            case Unwatch(ref=ref):
                self._watched.pop(ref, None)
            case PollDue():
                await self._poll()
        return None

    def _every(self, interval: float) -> None:
        """Poll every `interval` seconds (the shortest any worker asked for)."""
        if self._timer is not None:
            self._timer.cancel()
        self._interval = interval
        self._timer = self.self_ref.schedule_every(interval, PollDue())

    async def _poll(self) -> None:
        refs: list[ActorRef[WorkerMessage]] = []
        entries: list[tuple[str, str, int, int | None, int]] = []
        for ref, w in list(self._watched.items()):
            if not ref.is_alive:  # its Unwatch was lost
                del self._watched[ref]
            elif w.always:
                ref.signal(Wake())
            else:
                refs.append(ref)
                entries.append((w.group, w.member_id, w.partition_id, w.epoch, w.position))
        if not entries:
            return
        try:
            found = await leases.idle_check(self._conn, entries, self._now())
        except _POLL_ERRORS as exc:
            # The database is away (or refused the statement): the next interval looks again, and
            # the workers meet an outage themselves on their next NOTIFY. Never a failure of this
            # actor: a restarted one would start with an empty table, and the idle workers, whose
            # state did not change, would not tell it again.
            warn_unless_said(self._log, "idle_poll_failed", exc)
            return
        for index, _more, held in found:  # back only when there is more, or the lease is gone
            refs[index].signal(Wake() if held else CheckLease())
