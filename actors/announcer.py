"""The Announcer: tells listeners which partitions got new messages, after the publish committed.

A NOTIFY sent inside the publishing transaction makes PostgreSQL take a
database-wide lock at commit and hold it through the WAL flush, so every
notifying commit waits for the previous one: publishers stop sharing disk
flushes. Publishes from the Bus's own pool therefore commit without a NOTIFY
and hand the partition id to this actor, which sends one batched NOTIFY per
loop turn on a connection of its own. A notification is only a wake-up hint
(every reader also polls), so one lost in a crash costs at most one poll
interval. Outbox publishes (the caller's transaction) still notify inside
the transaction, because only the commit tells when the message exists.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import asyncpg

from actors.runtime import Actor, Message
from storage import messages as log_sql
from storage.db import TRANSIENT_ERRORS
from storage.logs import get_logger


class Announce(Message, frozen=True):
    """Partition `partition_id` has new committed messages."""

    partition_id: int


class Flush(Message, frozen=True):
    """Send what has been announced so far."""


class Announcer(Actor[Announce | Flush]):
    """Batches post-commit wake-ups into one NOTIFY statement per event-loop turn."""

    mailbox_size = 100_000

    def __init__(self, connect: Callable[[], Awaitable[asyncpg.Connection]], channel: str) -> None:
        self._connect = connect
        self._channel = channel
        self._conn: asyncpg.Connection | None = None
        self._dirty: set[int] = set()
        self._scheduled = False
        self._log = get_logger(__name__, actor="announcer")

    async def on_stop(self) -> None:
        if self._dirty:
            await self._flush()
        if self._conn is not None and not self._conn.is_closed():
            await self._conn.close()

    async def receive(self, message: Announce | Flush) -> None:
        match message:
            case Announce(partition_id=pid):
                self._dirty.add(pid)
                if not self._scheduled:
                    self._scheduled = True
                    # Everything announced until the loop comes round again goes in one statement.
                    self.self_ref.schedule_once(0.0, Flush())
            case Flush():
                self._scheduled = False
                await self._flush()

    async def _flush(self) -> None:
        if not self._dirty:
            return
        ids, self._dirty = sorted(self._dirty), set()
        try:
            if self._conn is None or self._conn.is_closed():
                self._conn = await self._connect()
            await log_sql.announce(self._conn, self._channel, ids)
        except TRANSIENT_ERRORS as exc:
            # Readers poll anyway; drop the hint rather than queue behind a dead connection.
            self._log.info("announce_dropped", partitions=len(ids), error=repr(exc))
            self._conn = None
