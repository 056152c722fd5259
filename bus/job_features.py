"""Job features of queue topics: unique jobs, job status and progress, groups with a completion callback.

- `b.publish(topic, payload, unique=bus.Unique("report:42", period=600))`:
  while a job published with that key is waiting or running (or was
  published less than `period` seconds ago), the publish returns that job's
  Record and adds nothing. Publishes of one key run one at a time in every
  process (an advisory lock of the key, held by the publishing transaction).
- `await q.progress(job, {"done": 40})`: kept with the job and renewing its
  lease (a long job that reports progress is not handed out again).
- `await b.job_status(topic, rec)`: state, attempts, progress, result or errors.
- `await b.publish_group(topic, jobs, on_complete=bus.Outgoing(...))`: the
  callback is published in the transaction that removes the group's last job
  (acked, dead-lettered or cancelled), so exactly once, whatever dies when.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import asyncpg
import msgspec

from bus import queue_features
from bus.types import JobGroup, JobStatus, Outgoing, Record, Unique
from storage import db
from storage import job_features as sql
from storage.errors import TopicNotFoundError, ValidationError
from storage.names import validate_name, validate_seconds

if TYPE_CHECKING:
    from bus.context import BusContext

# A bus.client.Bus (named as Any: bus.client imports this module on first use).
Bus = Any

_decoder = msgspec.json.Decoder()
_errors_decoder = msgspec.json.Decoder(list[dict[str, Any]])
_encoder = msgspec.json.Encoder()


def unique_of(unique: Any) -> tuple[str, float]:
    """(key, period seconds) of a bus.Unique; ValidationError says what to pass."""
    if not isinstance(unique, Unique):
        raise ValidationError('unique must be a bus.Unique("a key", period=seconds or timedelta)')
    if not isinstance(unique.key, str) or not unique.key:
        raise ValidationError("bus.Unique's key must be a non-empty str")
    if len(unique.key) > 1024:
        raise ValidationError("bus.Unique's key is longer than 1024 characters")
    return unique.key, validate_seconds(unique.period, "bus.Unique's period", allow_zero=True)


class _UniqueGate:
    """A Bus's unique publishes: one at a time per key, and at most half the pool at once.

    Each holds a pooled connection while it waits for its key's advisory lock; the one holding
    the lock may need another for a lookup while it publishes, so waiters never take them all.
    """

    def __init__(self, pool_size: int) -> None:
        self.slots = asyncio.Semaphore(max(1, pool_size // 2))
        self.keys: dict[tuple[str, str], asyncio.Lock] = {}

    def lock(self, topic: str, key: str) -> asyncio.Lock:
        found = self.keys.get((topic, key))
        if found is None:
            found = self.keys[(topic, key)] = asyncio.Lock()
        return found

    def forget(self, topic: str, key: str, lock: asyncio.Lock) -> None:
        if not lock.locked() and self.keys.get((topic, key)) is lock:
            del self.keys[(topic, key)]


async def publish_unique(
    b: Bus,
    topic: str,
    payload: Any,
    unique: Any,
    connection: asyncpg.Connection | None,
    publish: dict[str, Any],
) -> Record:
    """Publish unless the unique key is held; the Record of the job that holds it either way."""
    key, period = unique_of(unique)
    await queue_features.check_queue(b.context, topic, "unique=")
    if connection is not None:
        return await _publish_unique(b, connection, topic, payload, key, period, publish)
    gate = b.context.state(_UniqueGate, lambda: _UniqueGate(b.config.pool_max_size))
    lock = gate.lock(topic, key)
    try:
        async with lock, gate.slots:
            with db.translate_errors():
                async with b.pool.acquire() as conn, conn.transaction():
                    return await _publish_unique(
                        b, cast("asyncpg.Connection", conn), topic, payload, key, period, publish
                    )
    finally:
        gate.forget(topic, key, lock)


async def _publish_unique(
    b: Bus,
    conn: asyncpg.Connection,
    topic: str,
    payload: Any,
    key: str,
    period: float,
    publish: dict[str, Any],
) -> Record:
    now = b.context.now()
    await sql.lock_unique(conn, topic, key)
    found = await sql.find_unique(conn, topic, key, period, now)
    if found is not None:
        return Record(topic, found["partition"], found["offset"], found["created_at"])
    rec: Record = await b.publish(topic, payload, connection=conn, **publish)
    await sql.record_unique(conn, topic, key, rec.partition, rec.offset, now)
    return rec


async def job_status(ctx: BusContext, topic: str, rec: Any) -> JobStatus:
    """What became of the job `rec` of queue topic `topic` (see bus.JobStatus)."""
    validate_name(topic, "topic name")
    await queue_features.check_queue(ctx, topic, "job_status")
    pid, offset = await queue_features.job_of(ctx, topic, rec)
    with db.translate_errors():
        row = await sql.status(ctx.pool, pid, offset, ctx.now())
    errors = _errors_decoder.decode(row["errors"] or row["job_errors"] or "[]")
    if not row["present"]:
        outcome = row["status"]
        state = {"done": "done", "failed": "failed", "cancelled": "cancelled"}.get(outcome, "gone")
        result = None if row["result"] is None else _decoder.decode(row["result"])
        return JobStatus(state=state, attempts=len(errors), result=result, errors=errors)
    attempts = int(row["attempts"])
    if row["cancelled"]:
        state = "cancelled"
    elif row["detached"]:
        state = ("running" if row["leased"] else "delayed") if row["later"] else "waiting"
    elif row["range_leased"] and row["passed"]:
        state, attempts = "running", max(attempts, 1)
    else:
        state = "waiting"
    progress = None if row["progress"] is None else _decoder.decode(row["progress"])
    return JobStatus(
        state=state, attempts=attempts, progress=progress, progress_at=row["progress_at"], errors=errors
    )


def encode_progress(data: Any) -> str:
    """A job's progress as JSON text (a ValidationError names what cannot be stored)."""
    return queue_features.encode_value(data, "progress")


async def publish_group(
    b: Bus,
    topic: str,
    jobs: Sequence[Outgoing | Any],
    on_complete: Any,
    connection: asyncpg.Connection | None,
) -> JobGroup:
    """Publish the jobs and their group in one transaction; `on_complete` goes out when the last is removed."""
    if not isinstance(on_complete, Outgoing) or not on_complete.topic:
        raise ValidationError(
            'on_complete must be a bus.Outgoing with its topic, e.g. bus.Outgoing({"batch": 7}, topic="jobs.done")'
        )
    if not isinstance(jobs, Sequence) or isinstance(jobs, (str, bytes)) or not jobs:
        raise ValidationError("publish_group takes a non-empty list of bus.Outgoing (or plain payloads)")
    callback_topic = validate_name(on_complete.topic, "on_complete topic")
    await queue_features.check_queue(b.context, topic, "publish_group")
    try:
        await b.topic(callback_topic)
    except TopicNotFoundError:
        raise TopicNotFoundError(
            f"on_complete's topic {callback_topic!r} does not exist: create it before publishing the group"
        ) from None
    payload = on_complete.payload
    if isinstance(payload, (bytes, bytearray, memoryview)) or isinstance(payload, msgspec.Raw):
        raise ValidationError(
            "on_complete's payload must be JSON-encodable (dict, list, str, numbers), not bytes"
        )
    callback = (
        callback_topic,
        encode_progress(payload),
        on_complete.key,
        None if not on_complete.headers else _encoder.encode(on_complete.headers).decode(),
    )
    if connection is not None:
        return await _publish_group(b, connection, topic, jobs, callback)
    with db.translate_errors():
        async with b.pool.acquire() as conn, conn.transaction():
            return await _publish_group(b, cast("asyncpg.Connection", conn), topic, jobs, callback)


async def _publish_group(
    b: Bus,
    conn: asyncpg.Connection,
    topic: str,
    jobs: Sequence[Outgoing | Any],
    callback: tuple[str, str, str | None, str | None],
) -> JobGroup:
    records: list[Record] = await b.publish_many(topic, jobs, connection=conn)
    group_id = await sql.create_group(
        conn, topic, [r.partition for r in records], [r.offset for r in records], callback
    )
    return JobGroup(group_id, records)
