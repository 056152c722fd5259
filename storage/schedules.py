"""Periodic jobs: schedule definitions, the scheduler's lease and the fenced advance of a tick.

The leader (the holder of `scheduler_lease`) fires ticks. A tick's publish and
its schedule's `last_tick` advance run in one transaction; the advance is a
compare-and-set on the `last_tick` read before and on a live lease of the
same epoch, so a tick fired twice (a leader whose lease ran out) commits once.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg
import msgspec

from storage.db import Conn

# A new name is inserted; an existing one is replaced only when its definition
# differs (the same definition again writes nothing and keeps its last tick).
DEFINE = """
INSERT INTO schedules AS s (name, cron, topic, payload, timezone, catch_up, last_tick)
VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp())
ON CONFLICT (name) DO UPDATE
   SET cron = EXCLUDED.cron, topic = EXCLUDED.topic, payload = EXCLUDED.payload,
       timezone = EXCLUDED.timezone, catch_up = EXCLUDED.catch_up,
       last_tick = EXCLUDED.last_tick, defined_at = EXCLUDED.defined_at
 WHERE (s.cron, s.topic, s.payload, s.timezone, s.catch_up)
       IS DISTINCT FROM (EXCLUDED.cron, EXCLUDED.topic, EXCLUDED.payload, EXCLUDED.timezone, EXCLUDED.catch_up)
RETURNING (xmax = 0) AS inserted
"""

DELETE = "DELETE FROM schedules WHERE name = $1 RETURNING name"

LIST = """
SELECT name, cron, topic, payload, timezone, catch_up, last_tick, defined_at
FROM schedules ORDER BY name
"""

# Take the lease if it is free, expired or already ours; the epoch grows on every new holder.
ACQUIRE = """
INSERT INTO scheduler_lease AS l (id, owner, epoch, expires_at)
VALUES (true, $1, 1, clock_timestamp() + make_interval(secs => $2))
ON CONFLICT (id) DO UPDATE
   SET owner = $1,
       epoch = CASE WHEN l.owner = $1 AND l.expires_at > clock_timestamp() THEN l.epoch ELSE l.epoch + 1 END,
       expires_at = clock_timestamp() + make_interval(secs => $2)
 WHERE l.owner = $1 OR l.expires_at <= clock_timestamp()
RETURNING epoch
"""

RELEASE = "UPDATE scheduler_lease SET expires_at = clock_timestamp() WHERE owner = $1 AND epoch = $2"

# The tick's advance: applies only from the last tick read, under a live lease of this epoch.
ADVANCE = """
UPDATE schedules s SET last_tick = $3
 WHERE s.name = $1 AND s.last_tick = $2
   AND EXISTS (SELECT 1 FROM scheduler_lease l
               WHERE l.owner = $4 AND l.epoch = $5 AND l.expires_at > clock_timestamp())
RETURNING s.name
"""


class DefineParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A schedule's definition, validated by the caller."""

    name: str
    cron: str
    topic: str
    #: The encoded payload each tick publishes (None: a tombstone).
    payload: bytes | None
    #: The IANA time zone `cron` is read in.
    timezone: str
    #: What a scheduler does with ticks missed while none ran: one, none or all.
    catch_up: str


async def define(conn: Conn, params: DefineParams) -> bool:
    """Insert or replace a schedule; False when the same definition was already there."""
    p = params
    return await conn.fetchrow(DEFINE, p.name, p.cron, p.topic, p.payload, p.timezone, p.catch_up) is not None


async def delete(conn: Conn, name: str) -> bool:
    return await conn.fetchval(DELETE, name) is not None


async def list_all(conn: Conn) -> list[asyncpg.Record]:
    return list(await conn.fetch(LIST))


async def acquire(conn: Conn, owner: str, lease_time: float) -> int | None:
    """The lease's epoch if this owner now holds it; None while another holder's lease lasts."""
    epoch = await conn.fetchval(ACQUIRE, owner, lease_time)
    return None if epoch is None else int(epoch)


async def release(conn: Conn, owner: str, epoch: int) -> None:
    await conn.execute(RELEASE, owner, epoch)


async def advance(conn: Conn, name: str, last_tick: datetime, tick: datetime, owner: str, epoch: int) -> bool:
    """Move `name`'s last tick from `last_tick` to `tick`; False if it moved already or the lease is lost."""
    return await conn.fetchval(ADVANCE, name, last_tick, tick, owner, epoch) is not None
