"""The public value types: what goes in and comes out of the bus."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any, TypeVar

import msgspec

from storage.errors import MessageDecodeError

T = TypeVar("T")


class TopicPartition(msgspec.Struct, frozen=True, order=True):
    """Names one partition of one topic (partition names are strings; fixed ones are "0", "1", …)."""

    topic: str
    partition: str


class TopicInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A topic's configuration."""

    name: str
    partitions: int | None
    semantics: str = "pubsub"
    cleanup: str = "delete"
    retention: timedelta | None = None
    tombstone_retention: timedelta | None = None
    namespace: str | None = None
    task: str | None = None
    max_message_bytes: int = 1024 * 1024
    created_at: datetime | None = None
    dedupe_window: timedelta | None = timedelta(hours=24)

    @property
    def dynamic(self) -> bool:
        """True when publishers name the partitions (created on first publish)."""
        return self.partitions is None


class Health(msgspec.Struct, frozen=True, kw_only=True):
    """What `Bus.health()` says: can this Bus do its work now, and if not, why and what to do.

    `status` is "healthy"; "degraded" while the database cannot be reached
    (the bus retries for as long as that lasts and comes back by itself:
    publishes and acks raise StorageUnavailableError meanwhile, consumers
    wait); "failed" once a system actor stopped for good (a bug, not an
    outage: close the Bus and connect again) or the Bus is closed.
    `problems` says each reason in words.
    """

    status: str
    database_available: bool
    #: When the current outage began (None while the database is reachable), and its length so far.
    unavailable_since: datetime | None = None
    unavailable_seconds: float | None = None
    #: Outages this Bus rode out since it opened, and how long the last one lasted.
    outages: int = 0
    last_outage_seconds: float | None = None
    #: The system actors that stopped for good (their supervisor gave up on them).
    failed_actors: list[str] = msgspec.field(default_factory=list)
    problems: list[str] = msgspec.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the status is "healthy"."""
        return self.status == "healthy"


class Record(msgspec.Struct, frozen=True, gc=False):
    """Where a published message landed."""

    topic: str
    partition: str
    offset: int
    created_at: datetime


class Outgoing(msgspec.Struct, frozen=True):
    """One message for `publish_many`."""

    payload: Any
    key: str | None = None
    partition: str | None = None
    headers: dict[str, str] | None = None
    idempotency_key: str | None = None
    # Queue topics only (a ValidationError on a pubsub topic): not taken before `delay` (seconds or a
    # timedelta from the write) or `deliver_at`; among due jobs, a higher `priority` is taken first.
    delay: timedelta | float | None = None
    deliver_at: datetime | None = None
    priority: int | None = None
    # The topic of a group's completion callback (`publish_group(..., on_complete=...)`); publish and
    # publish_many take the topic they are called with.
    topic: str | None = None


class Rate(msgspec.Struct, frozen=True):
    """A rate limit: at most `limit` jobs taken in any `per` seconds (across every consumer and process)."""

    limit: int
    per: float = 1.0


class Unique(msgspec.Struct, frozen=True):
    """A unique job: while a job published with `key` is waiting or running (or was published
    less than `period` ago), a publish with the same key returns that job's Record and adds nothing."""

    key: str
    period: timedelta | float = 0.0


class JobStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What became of a queue job (`b.job_status`).

    `state`: "waiting" (free to take), "delayed" (not before its time, or nacked with a delay),
    "running" (leased to a consumer), "done" (acked; `result` if it was acked with one),
    "failed" (dead-lettered), "cancelled", or "gone" (acked without a result, or its
    outcome expired). `progress`: what the job last reported through `q.progress` while it ran.
    """

    state: str
    attempts: int
    progress: Any = None
    progress_at: datetime | None = None
    result: Any = None
    errors: list[dict[str, Any]] = []


class JobGroup(msgspec.Struct, frozen=True):
    """A group of jobs published by `b.publish_group`: its id and the jobs' Records."""

    id: int
    records: list[Record]


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """A message read from the log. `payload` is always the stored bytes (JSON text for structured payloads)."""

    topic: str
    partition: str
    offset: int
    key: str | None
    headers: dict[str, str]
    payload: bytes | None
    created_at: datetime
    attempt: int = 1

    @property
    def tp(self) -> TopicPartition:
        """The topic and partition the message was read from."""
        return TopicPartition(self.topic, self.partition)

    def value(self, type: type[T] = Any) -> T:  # type: ignore[assignment]
        """Decode the JSON payload into `type` (any msgspec-supported type).

        A payload of another shape raises `bus.errors.MessageDecodeError` naming the
        message (topic, partition, offset) and the field that did not match.
        """
        if self.payload is None:
            raise ValueError(
                f"message {self.topic}/{self.partition}@{self.offset} is a tombstone (no payload)"
            )
        try:
            return msgspec.json.decode(self.payload, type=type)
        except msgspec.DecodeError as exc:
            raise _decode_error(self, type, exc) from exc


_FIELD_AT = re.compile(r" - at `(\$[^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def _decode_error(m: Message, wanted: Any, exc: msgspec.DecodeError) -> MessageDecodeError:
    return decode_error(
        f"message {m.topic}/{m.partition}@{m.offset}",
        (m.topic, m.partition, m.offset),
        wanted,
        exc,
        "the publisher sent another shape: fix the type or the publisher, or dead-letter the message",
    )


def decode_error(
    where: str, message: tuple[str, str, int], wanted: Any, exc: msgspec.DecodeError, fix: str
) -> MessageDecodeError:
    """The MessageDecodeError for JSON of `message` (topic, partition, offset) that is not a `wanted`.

    `where` names what did not decode, `fix` says what to do about it.
    """
    text = str(exc)
    at = _FIELD_AT.search(text)
    missing = _MISSING.search(text)
    name = getattr(wanted, "__name__", None) or repr(wanted)
    what = f"field {at.group(1)}" if at else f"field {missing.group(1)!r}" if missing else "its payload"
    topic, partition, offset = message
    return MessageDecodeError(
        f"{where} does not decode as {name}: {text} ({what}); {fix}",
        topic=topic,
        partition=partition,
        offset=offset,
        field=at.group(1) if at else None,
        missing=missing.group(1) if missing else None,
    )


class PartitionStats(msgspec.Struct, frozen=True, kw_only=True):
    """Size and bounds of one partition (`admin.topic_stats`)."""

    partition: str
    log_start: int
    end_offset: int
    size: int
    oldest: datetime | None
    newest: datetime | None
