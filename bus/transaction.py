"""Effectively-once with retries and dead letters: one transaction, a savepoint per message.

A `Transaction` is an open transaction on a pool connection, with PostgreSQL's
default search_path (the service's tables, not the bus's). The offsets of what
it covers commit in it (fenced by each partition's lease epoch), so the
service's writes, what it publishes on `tx.connection` and the offsets are one
unit: nothing applies twice, nothing is lost.

Each message's work runs under its own savepoint (`async with tx.message(m):`,
which a transactional handler gets for free). A message that fails rolls back
alone: the messages before it stay applied and commit; its failed attempt is
counted in `handler_attempts` in the same transaction, so the count survives a
crash or a move of the partition; the offsets stop at it and it comes again
after the retry's backoff. After its last attempt it is published to the
dead-letter topic (its error history in the headers) in the same transaction
that commits past it: dead-lettered once, never lost.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import msgspec

from actors.worker import RetryPolicy
from bus.types import Message, Outgoing
from storage import db
from storage import handler_attempts as attempts_sql
from storage.errors import BusError, TopicNotFoundError
from storage.logs import get_logger

if TYPE_CHECKING:
    import asyncpg

    from bus.context import BusContext
    from bus.types import TopicInfo

log = get_logger(__name__)

#: PostgreSQL's default search_path: a transaction's connection sees the service's tables.
USER_SEARCH_PATH = '"$user", public'


@dataclass
class Stuck:
    """A partition's message that failed in this transaction: the offsets stop at it."""

    offset: int
    attempts: int
    error: BaseException
    stopped: bool  # its last attempt failed and there is no dead-letter topic


@dataclass
class Retries:
    """What a Transaction needs for retries and dead letters (None: no retries, the first error fails it)."""

    ctx: BusContext
    group: str
    policy: RetryPolicy
    dead_letter: TopicInfo | None
    partition_id: Callable[[Message], int]
    loaded: dict[int, attempts_sql.Attempts | None] = field(default_factory=dict)


class Transaction:
    """An open transaction for effectively-once work: write through `connection`.

    `connection` has PostgreSQL's default search_path (`"$user", public`), so the
    service's unqualified table names resolve as on its own connections; publish
    on it with `b.publish(..., connection=tx.connection)`.
    """

    def __init__(self, connection: db.Connection, retries: Retries | None = None) -> None:
        self.connection = connection
        self._retries = retries
        #: partition id -> the message that failed in this transaction
        self.stuck: dict[int, Stuck] = {}
        self.dead_lettered = 0

    @asynccontextmanager
    async def message(self, m: Message) -> AsyncIterator[int]:
        """Run one message's work under its own savepoint; yields its attempt number (1 on first delivery).

        An error inside rolls back this message's writes alone and is counted: the
        messages before it still commit, and it comes again (from this offset, after
        the retry's backoff). After its last attempt it goes to the dead-letter topic
        in this transaction. Without a dead-letter topic the last attempt's error
        propagates (the whole transaction rolls back and the partition does not
        move past the message). A later message of a partition whose message failed
        runs, but its writes are rolled back: it comes again after that one.
        """
        r = self._retries
        if r is None:
            raise BusError(
                "tx.message(m) needs retries: open the transaction with "
                "`c.transaction(retry=bus.Retry(...), dead_letter=...)`"
            )
        pid = r.partition_id(m)
        prior = await self._prior(r, pid)
        attempt = (prior.attempts if prior is not None and prior.offset == m.offset else 0) + 1
        conn = self.connection
        savepoint = conn.transaction()
        await savepoint.start()
        try:
            yield attempt
        except Exception as exc:  # the service's work: anything may come out
            await savepoint.rollback()
            if conn.is_closed():
                raise
            if not await self.failed(m, pid, attempt, exc):
                raise
        except BaseException:
            await savepoint.rollback()
            raise
        else:
            if pid in self.stuck:
                await savepoint.rollback()  # after a failed message of its partition: it comes again
            else:
                await savepoint.commit()

    async def _prior(self, r: Retries, pid: int) -> attempts_sql.Attempts | None:
        if pid not in r.loaded:
            async with db.on_schema(self.connection, r.ctx.config.schema):
                r.loaded[pid] = await attempts_sql.load(self.connection, r.group, pid)
        return r.loaded[pid]

    async def failed(self, m: Message, pid: int, attempt: int, exc: BaseException) -> bool:
        """Count a failed attempt of `m` (its writes already rolled back); False: let the error propagate."""
        r = self._retries
        assert r is not None
        if pid in self.stuck:
            return True  # a later message of a stuck partition: its writes are undone, it comes again
        async with db.on_schema(self.connection, r.ctx.config.schema):
            errors = await attempts_sql.record(
                self.connection, r.group, pid, m.offset, attempt, repr(exc)[:2000]
            )
        r.loaded[pid] = attempts_sql.Attempts(m.offset, attempt, errors)
        if attempt < r.policy.max_attempts:
            self.stuck[pid] = Stuck(m.offset, attempt, exc, stopped=False)
            log.info("handler_retry", group=r.group, topic=m.topic, partition=m.partition,
                     offset=m.offset, attempt=attempt, error=repr(exc))  # fmt: skip
            return True
        if r.dead_letter is None:
            self.stuck[pid] = Stuck(m.offset, attempt, exc, stopped=True)
            return False
        out = dead_letter_outgoing(m, r.dead_letter, r.group, exc, attempt, errors)
        await r.ctx.publish_many(
            r.dead_letter.name, [out], connection=cast("asyncpg.Connection", self.connection)
        )
        self.dead_lettered += 1
        log.warning("dead_lettered", group=r.group, topic=m.topic, partition=m.partition,
                    offset=m.offset, attempts=attempt, error=repr(exc))  # fmt: skip
        return True

    async def settle(self, partition_id: int, position: int) -> None:
        """With the offsets committed up to `position`: forget the attempts of messages passed."""
        r = self._retries
        if r is None:
            return
        prior = r.loaded.get(partition_id)
        if prior is not None and prior.offset < position:
            await attempts_sql.clear(self.connection, r.group, partition_id, position)


def dead_letter_outgoing(
    m: Message,
    info: TopicInfo,
    group: str,
    error: BaseException,
    attempts: int,
    errors: list[dict[str, Any]] | None = None,
) -> Outgoing:
    """The dead-letter copy of `m`: its payload and key, the error and where it came from in the headers.

    `bus.errors` is the JSON list of every failed attempt (attempt, error, at) when it is known.
    """
    headers = dict(m.headers)
    headers.update(
        {
            "bus.error": repr(error)[:2000],
            "bus.attempts": str(attempts),
            "bus.source.topic": m.topic,
            "bus.source.partition": m.partition,
            "bus.source.offset": str(m.offset),
            "bus.group": group,
        }
    )
    if errors:
        headers["bus.errors"] = msgspec.json.encode(errors).decode()[:8000]
    out_partition = m.partition if info.dynamic else None
    payload = m.payload if m.payload is not None else b""
    return Outgoing(payload, key=m.key, partition=out_partition, headers=headers)


async def dead_letter_topic(ctx: BusContext, name: str) -> TopicInfo:
    """The dead-letter topic, created (dynamic partitions, named after the source's) if missing."""
    try:
        return await ctx.topic(name)
    except TopicNotFoundError:
        await ctx.create_topic(name, partitions=None)
        return await ctx.topic(name)
