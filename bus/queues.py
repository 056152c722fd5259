"""Competing consumers on `semantics="queue"` topics (no group name, Queen's queue mode).

    async with b.queue_consumer("jobs", visibility_timeout=30.0, max_attempts=5) as q:
        for job in await q.take(max_messages=10, timeout=1.0):
            try:
                work(job)
            except Exception as exc:
                await q.nack(job, delay=2.0, error=repr(exc))
            else:
                await q.ack(job)

- Each message is leased to one consumer at a time (FOR UPDATE SKIP LOCKED).
- A message not acked within `visibility_timeout` seconds comes back; so does
  a nacked one, after its `delay`.
- A message delivered `max_attempts` times and still not acked is moved to the
  dead-letter topic (default `"<topic>.dlq"`; created as a one-partition queue
  topic if missing, so it can be drained with a queue consumer too). Its
  headers keep the original ones plus `dead_letter.topic`, `.partition`,
  `.offset`, `.attempts`, `.last_error` and `.errors` (the JSON list of every
  attempt's error: nack reasons and expired visibility timeouts).
- `ordered_by_key=True`: a key's jobs go out one at a time, in offset order
  (the next one only once the previous is acked or dead-lettered).
- Acks and nacks are fenced: if a job's lease ran out and another consumer
  took it, acking the old copy raises LeaseLostError and changes nothing. An
  expired lease nobody took yet still accepts the ack.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec

from actors import metrics as _metrics
from bus.client import to_message
from bus.types import Message, Outgoing
from storage import db
from storage import queues as sql
from storage.errors import LeaseLostError, TopicNotFoundError, ValidationError
from storage.logs import get_logger
from storage.names import MAX_SECONDS, validate_name

if TYPE_CHECKING:
    from bus.client import Bus

__all__ = ["QueueConsumer"]

log = get_logger(__name__)

_errors_decoder = msgspec.json.Decoder(list[dict[str, Any]])
_encoder = msgspec.json.Encoder()

# Idle polling backs off from the first to the last delay while nothing comes.
_POLL_FIRST = 0.01
_POLL_MAX = 0.25


def _seconds(value: Any, what: str, *, allow_zero: bool = False) -> float:
    if (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_SECONDS
        or (value == 0 and not allow_zero)
    ):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValidationError(f"{what} must be a number of seconds {bound}, got {value!r}")
    return float(value)


class QueueConsumer:
    """One competing consumer of a queue topic. Use as `async with b.queue_consumer(...) as q`."""

    def __init__(
        self,
        bus: Bus,
        topic: str,
        *,
        visibility_timeout: float = 30.0,
        max_attempts: int = 5,
        dead_letter: str | None = None,
        ordered_by_key: bool = False,
    ) -> None:
        validate_name(topic, "topic name")
        self.visibility_timeout = _seconds(visibility_timeout, "visibility_timeout")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValidationError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        self.topic = topic
        self.max_attempts = max_attempts
        self.dead_letter = validate_name(dead_letter if dead_letter is not None else f"{topic}.dlq", "dead_letter topic")
        if self.dead_letter == topic:
            raise ValidationError("dead_letter must be another topic than the queue itself")
        self.ordered_by_key = bool(ordered_by_key)
        self.consumer_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._bus = bus
        # (partition_id, offset) -> lease epoch, for every job taken and not yet acked/nacked.
        self._in_flight: dict[tuple[str, int], tuple[int, int]] = {}
        self._partition_ids: dict[tuple[str, int], int] = {}
        self._open = False
        self._log = log.bind(topic=topic, consumer=self.consumer_id)

    async def __aenter__(self) -> QueueConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Check the topic is a queue and make sure the dead-letter topic exists."""
        info = await self._bus.topic(self.topic)
        if info.semantics != "queue":
            raise ValidationError(
                f"topic {self.topic!r} has semantics={info.semantics!r}; queue consumers need a topic created with "
                "semantics='queue' (use b.consumer(...) or b.claim(...) for pubsub topics)"
            )
        try:
            await self._bus.topic(self.dead_letter)
        except TopicNotFoundError:
            await self._bus.create_topic(self.dead_letter, partitions=1, semantics="queue")
            self._log.info("dead_letter_topic_created", dead_letter=self.dead_letter)
        self._open = True

    async def close(self) -> None:
        """Give back every job taken and not acked (immediately visible, the attempt not counted)."""
        if not self._open:
            return
        self._open = False
        if self._in_flight:
            jobs = [(self._partition_ids[k], k[1], v[1]) for k, v in self._in_flight.items()]
            self._in_flight.clear()
            try:
                with db.translate_errors():
                    await sql.return_unacked(self._bus.pool, jobs)
            except Exception:  # closing must not fail; the jobs come back by timeout anyway
                self._log.warning("queue_return_unacked_failed", exc_info=True)

    def _check_open(self) -> None:
        if not self._open:
            raise ValidationError("the queue consumer is not open: use `async with b.queue_consumer(...) as q`")

    async def take(self, max_messages: int = 10, timeout: float = 1.0) -> list[Message]:  # noqa: ASYNC109 - the public API's shape
        """Lease up to `max_messages` jobs to this consumer, waiting up to `timeout` seconds for the first."""
        self._check_open()
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or not 1 <= max_messages <= 10_000:
            raise ValidationError(f"max_messages must be an integer from 1 to 10000, got {max_messages!r}")
        deadline = time.monotonic() + _seconds(timeout, "timeout", allow_zero=True)
        delay = _POLL_FIRST
        while True:
            got = await self._take_once(max_messages)
            remaining = deadline - time.monotonic()
            if got or remaining <= 0:
                return got
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX)

    async def _take_once(self, limit: int) -> list[Message]:
        out: list[Message] = []
        with db.translate_errors():
            async with self._bus.pool.acquire() as conn:
                for _ in range(10):  # each round dead-letters what it found exhausted
                    async with conn.transaction():
                        rows = await sql.take(
                            conn, self.topic, limit - len(out), self.visibility_timeout, self.consumer_id,
                            ordered=self.ordered_by_key,
                        )
                        exhausted = [r for r in rows if r["attempts"] > self.max_attempts]
                        if exhausted:
                            await self._dead_letter_rows(conn, exhausted, None)
                    for r in rows:
                        if r["attempts"] <= self.max_attempts:
                            key = (r["partition"], r["offset"])
                            self._partition_ids[key] = r["partition_id"]
                            self._in_flight[key] = (r["partition_id"], r["lease_epoch"])
                            out.append(to_message(self.topic, r["partition"], r, attempt=r["attempts"]))
                    if not exhausted or len(out) >= limit or len(rows) < limit:
                        break
        _metrics.queue_taken(self.topic, len(out))
        return out

    def _lease(self, msg: Message) -> tuple[int, int] | None:
        if msg.topic != self.topic:
            raise ValidationError(f"message of topic {msg.topic!r} does not belong to this consumer of {self.topic!r}")
        return self._in_flight.get((msg.partition, msg.offset))

    async def ack(self, msg: Message) -> None:
        """Done: remove the job. LeaseLostError if it came back and another consumer took it meanwhile.

        Acking a message this consumer already acked is a no-op.
        """
        lease = self._lease(msg)
        if lease is None:
            return
        pid, epoch = lease
        with db.translate_errors():
            ok = await sql.ack(self._bus.pool, pid, msg.offset, epoch)
        del self._in_flight[(msg.partition, msg.offset)]
        _metrics.queue_acked(self.topic, int(bool(ok)))
        if not ok:
            raise self._lost(msg, "ack")

    async def ack_many(self, msgs: list[Message]) -> None:
        """Ack several jobs in one round trip; LeaseLostError (after acking the others) if any was lost."""
        leases = [(m, self._lease(m)) for m in msgs]
        jobs = [(lease[0], m.offset, lease[1]) for m, lease in leases if lease is not None]
        if not jobs:
            return
        with db.translate_errors():
            done = await sql.ack_many(self._bus.pool, jobs)
        _metrics.queue_acked(self.topic, len(done))
        lost = []
        for m, lease in leases:
            if lease is None:
                continue
            self._in_flight.pop((m.partition, m.offset), None)
            if (lease[0], m.offset) not in done:
                lost.append(m)
        if lost:
            raise self._lost(lost[0], f"ack of {len(lost)} message(s), first")

    async def nack(self, msg: Message, delay: float = 0.0, error: str | None = None) -> None:
        """Not done: back to the queue after `delay` seconds, `error` kept in its history.

        On its last attempt (`msg.attempt >= max_attempts`) the message goes to
        the dead-letter topic instead.
        """
        delay = _seconds(delay, "delay", allow_zero=True)
        reason = error if error is not None else "nacked"
        if not isinstance(reason, str):
            raise ValidationError("error must be a str (a short description of what went wrong)")
        lease = self._lease(msg)
        if lease is None:
            raise ValidationError(
                f"message {msg.partition}@{msg.offset} is not held by this consumer (already acked or nacked?)"
            )
        pid, epoch = lease
        del self._in_flight[(msg.partition, msg.offset)]
        with db.translate_errors():
            async with self._bus.pool.acquire() as conn:
                if msg.attempt >= self.max_attempts:
                    async with conn.transaction():
                        row = {"partition_id": pid, "offset": msg.offset, "lease_epoch": epoch, "attempts": msg.attempt,
                               "partition": msg.partition, "key": msg.key, "payload": msg.payload,
                               "headers": msg.headers}
                        moved = await self._dead_letter_rows(conn, [row], reason)
                    if not moved:
                        raise self._lost(msg, "nack")
                    return
                ok = await sql.nack(conn, pid, msg.offset, epoch, delay, reason)
                _metrics.queue_nacked(self.topic)
        if not ok:
            raise self._lost(msg, "nack")

    async def _dead_letter_rows(self, conn: Any, rows: list[Any], error: str | None) -> int:
        """Move jobs to the dead-letter topic (caller's transaction); how many were still ours.

        `error` is this attempt's failure (a nack); None when the rows come from
        a take, whose statement already recorded the expired timeout.
        """
        outgoing = []
        for r in rows:
            removed = await sql.delete_job(conn, r["partition_id"], r["offset"], r["lease_epoch"])
            if removed is None:
                continue
            errors = _errors_decoder.decode(removed["errors"]) if removed["errors"] else []
            if error is not None:
                errors.append({"attempt": r["attempts"], "error": error})
            last_error = str(errors[-1].get("error", "")) if errors else "unknown"
            raw = r["headers"]
            headers = dict(raw) if isinstance(raw, dict) else (msgspec.json.decode(raw) if raw else {})
            headers.update(
                {
                    "dead_letter.topic": self.topic,
                    "dead_letter.partition": r["partition"],
                    "dead_letter.offset": str(r["offset"]),
                    "dead_letter.attempts": str(min(r["attempts"], self.max_attempts)),
                    "dead_letter.last_error": last_error,
                    "dead_letter.errors": _encoder.encode(errors).decode(),
                }
            )
            outgoing.append(Outgoing(r["payload"] if r["payload"] is not None else b"", key=r["key"], headers=headers))
        if outgoing:
            await self._bus.publish_many(self.dead_letter, outgoing, connection=conn)
            self._log.warning("dead_lettered", count=len(outgoing), dead_letter=self.dead_letter)
            _metrics.dead_lettered("", self.topic, len(outgoing))
        return len(outgoing)

    def _lost(self, msg: Message, what: str) -> LeaseLostError:
        return LeaseLostError(
            f"{what} of {self.topic}/{msg.partition}@{msg.offset} refused: its visibility timeout ran out and "
            "another consumer took it (or it was dead-lettered); nothing was applied. Use a longer "
            "visibility_timeout for slow jobs"
        )
