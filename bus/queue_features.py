"""Queue features shared by every process: limits, pause, cancel, job results.

The settings live in the database (storage/queue_controls.py) and the take
statements read them, so they hold across every consumer of every process:

- `max_in_flight_per_key=N`: at most N jobs of one key taken and not yet
  acked (or run out) at once; `rate_limit=bus.Rate(100, per=1.0)`: at most 100
  jobs taken in any second. A limited queue's takes run one at a time under
  its settings row's lock, which is what makes the counts exact; each is still
  one statement that leases fresh jobs by range, as long as no key would go
  over its limit (see TAKE_WITHIN_LIMITS in storage/queues.py).
- `pause_queue`: every take of the queue hands out nothing from the next
  statement on; taken jobs finish and ack normally. `resume_queue` wakes the
  waiting consumers.
- `cancel_job`: a job nobody holds is deleted; a taken one keeps its lease (its
  ack still works) and is never handed out again.
- `q.ack(job, result=...)` keeps the result for the topic's `result_ttl`;
  `b.job_result(topic, rec)` waits for it (LISTEN on the results channel).
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import msgspec

from bus.types import Rate, Record, decode_error
from storage import db
from storage import queue_controls as sql
from storage.errors import JobFailedError, TopicNotFoundError, ValidationError
from storage.names import validate_int, validate_name, validate_seconds

if TYPE_CHECKING:
    from bus.context import BusContext


class _Unset:
    """ "Not given" for update_topic's arguments (None means: remove the limit)."""

    def __repr__(self) -> str:
        return "UNSET"


#: "Not given" for update_topic's arguments (None means: remove the limit).
UNSET: Any = _Unset()

_errors_decoder = msgspec.json.Decoder(list[dict[str, Any]])
_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()

# A job_result looks again this often even without a NOTIFY (an ack without a result sends none).
_RECHECK = 0.5


def limits(max_in_flight_per_key: Any, rate_limit: Any) -> tuple[int | None, int | None, float | None]:
    """Validated (max_in_flight_per_key, rate limit, rate period)."""
    per_key = None
    if max_in_flight_per_key is not None:
        per_key = validate_int(max_in_flight_per_key, "max_in_flight_per_key (None: no limit)", 1, 1 << 30)
    if rate_limit is None:
        return per_key, None, None
    if not isinstance(rate_limit, Rate):
        raise ValidationError(
            "rate_limit must be a bus.Rate(limit, per=seconds), e.g. bus.Rate(100, per=1.0)"
        )
    count = validate_int(rate_limit.limit, "rate_limit's limit (jobs per period)", 1, 1 << 30)
    per = validate_seconds(rate_limit.per, "rate_limit's per (seconds)")
    return per_key, count, per


def result_ttl(value: Any) -> float:
    return validate_seconds(value, "result_ttl (how long job results are kept)")


async def apply(
    ctx: BusContext,
    topic: str,
    *,
    paused: bool | None = None,
    limited: tuple[int | None, int | None, float | None] | None = None,
    ttl: float | None = None,
    fair: bool | None = None,
) -> None:
    """Write the given settings of a queue topic (after checking it is one)."""
    info = await ctx.topic(topic)
    if info.semantics != "queue":
        raise ValidationError(
            f"topic {topic!r} is a pubsub topic; limits, pause and results are for queue topics "
            "(create it with semantics='queue')"
        )
    with db.translate_errors():
        await sql.upsert(ctx.pool, topic, paused=paused, limits=limited, result_ttl=ttl, fair=fair)
        if paused is False:
            await sql.announce_topic(ctx.pool, topic, ctx.channels.messages)


async def check_queue(ctx: BusContext, topic: str, what: str) -> None:
    """A ValidationError unless `topic` is a queue topic: `what` (a feature) is for queue topics only."""
    if (await ctx.topic(topic)).semantics != "queue":
        raise ValidationError(f"{what} is for queue topics; {topic!r} is a pubsub topic (semantics='queue')")


async def job_of(ctx: BusContext, topic: str, rec: Any) -> tuple[int, int]:
    """(partition id, offset) of the queue job `rec` (a Record of a publish to `topic`)."""
    validate_name(topic, "topic name")
    if not isinstance(rec, Record):
        raise ValidationError("pass the Record that publish returned for the job")
    if rec.topic != topic:
        raise ValidationError(f"the record is of topic {rec.topic!r}, not {topic!r}")
    with db.translate_errors():
        pid = await sql.partition_id(ctx.pool, topic, rec.partition)
    if pid is None:
        raise TopicNotFoundError(f"topic {topic!r} has no partition {rec.partition!r}")
    return pid, rec.offset


async def cancel_job(ctx: BusContext, topic: str, rec: Any) -> bool:
    """Cancel a job: True if it was still there (now never handed out again)."""
    info = await ctx.topic(topic)
    if info.semantics != "queue":
        raise ValidationError(f"topic {topic!r} is a pubsub topic; only queue jobs can be cancelled")
    pid, offset = await job_of(ctx, topic, rec)
    with db.translate_errors():
        async with ctx.pool.acquire() as conn, conn.transaction():
            return await sql.cancel(conn, topic, pid, offset, ctx.channels.results, ctx.now())


async def job_result(
    ctx: BusContext,
    topic: str,
    rec: Any,
    timeout: float | timedelta,  # noqa: ASYNC109 - the public API's shape
    type: Any = Any,
) -> Any:
    """The result of a job's ack decoded as `type` (None: acked without one), waiting up to `timeout` seconds for it."""
    wait = validate_seconds(timeout, "timeout", allow_zero=True)
    decoder = _result_decoder(type)
    pid, offset = await job_of(ctx, topic, rec)
    deadline = time.monotonic() + wait
    rung = asyncio.Event()
    wanted = f"{pid}:{offset}"

    def heard(_c: Any, _pid: int, _channel: str, payload: object) -> None:
        if payload == wanted:
            rung.set()

    with db.translate_errors():
        async with ctx.pool.acquire() as conn:
            await sql.expire(conn, now=ctx.now())
            # LISTEN needs a session of its own: through a transaction pooler the result is polled for.
            listens = ctx.config.pooler != "transaction"
            if listens:
                await conn.add_listener(ctx.channels.results, heard)
            try:
                while True:
                    rung.clear()
                    row = await sql.outcome(conn, pid, offset, ctx.now())
                    status = row["status"]
                    if status == "done":
                        return _result(decoder, topic, rec.partition, offset, row["result"])
                    if status is not None:
                        errors = _errors_decoder.decode(row["errors"]) if row["errors"] else []
                        what = "was cancelled" if status == "cancelled" else "was dead-lettered"
                        last = f" (last error: {errors[-1].get('error')})" if errors else ""
                        raise JobFailedError(
                            f"job {topic}/{rec.partition}@{offset} {what}{last}; see the error history in .errors",
                            status=status,
                            errors=errors,
                        )
                    if not row["pending"]:
                        return _result(
                            decoder, topic, rec.partition, offset, None
                        )  # acked without one, or expired
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        await asyncio.wait_for(rung.wait(), min(remaining, _RECHECK))
                    except TimeoutError:
                        pass
            finally:
                if listens:
                    await conn.remove_listener(ctx.channels.results, heard)
    raise TimeoutError(f"job {topic}/{rec.partition}@{offset} has no result after {wait:g}s")


def _result_decoder(wanted: Any) -> msgspec.json.Decoder[Any]:
    """The decoder of job results as `wanted` (a ValidationError if msgspec cannot decode into it)."""
    if wanted is Any:
        return _decoder
    try:
        return msgspec.json.Decoder(wanted)
    except TypeError as exc:
        raise ValidationError(
            f"type={wanted!r} is not a type a result decodes into: pass one msgspec supports "
            f"(int, str, a msgspec.Struct, dict[str, int], MyStruct | None...): {exc}"
        ) from None


def _result(
    decoder: msgspec.json.Decoder[Any], topic: str, partition: str, offset: int, text: str | None
) -> Any:
    """A stored result decoded; none (acked without one, or expired) is None, or JSON null for a given type."""
    if decoder is _decoder:
        return None if text is None else _decoder.decode(text)
    try:
        return decoder.decode("null" if text is None else text)
    except msgspec.DecodeError as exc:
        raise decode_error(
            f"the result of job {topic}/{partition}@{offset}" + ("" if text else " (it has none)"),
            (topic, partition, offset),
            decoder.type,
            exc,
            "the job's handler returned another shape: fix the type or the handler "
            "(ask for `T | None` where a job may be acked without a result)",
        ) from exc


def encode_result(result: Any) -> str:
    """A job's result as JSON text (a ValidationError names what cannot be stored)."""
    return encode_value(result, "a job result")


def encode_value(value: Any, what: str) -> str:
    """`value` as JSON text for a job's row; a ValidationError says `what` must be JSON-encodable."""
    try:
        return _encoder.encode(value).decode()
    except (TypeError, msgspec.EncodeError) as exc:
        raise ValidationError(f"{what} must be JSON-encodable (dict, list, str, numbers...): {exc}") from None
