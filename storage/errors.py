"""Every error the bus raises.

They live at the bottom layer so storage, actors and the public API raise the
same classes; `bus.errors` re-exports them. Each message says what to do.
"""

from __future__ import annotations

import msgspec


class BusError(Exception):
    """Base of every error raised by the bus."""


class ValidationError(BusError, ValueError):
    """Bad input (a name, a size, a type): nothing was written."""


class TopicNotFoundError(BusError, LookupError):
    """The topic does not exist."""


class TopicConflictError(BusError):
    """A topic with this name exists with a different configuration."""


class GroupNotFoundError(BusError, LookupError):
    """The consumer group does not exist."""


class StaleGenerationError(BusError):
    """The group moved on (new generation or lease epoch): the commit was refused and nothing applied."""


class LeaseLostError(BusError):
    """The lease expired and another worker holds it now."""


class RebalanceInProgressError(BusError):
    """The group is rebalancing; retry after the new assignment is known."""


class ConcurrentAppendError(BusError):
    """An event matching the guard was appended after the guard's position."""


class GroupStoppedError(BusError):
    """The group is stopped (or dead/cancelled) and cannot be used until started again."""


class StorageUnavailableError(BusError):
    """PostgreSQL cannot be reached or refused the operation; the operation did not complete."""


class ConfigurationError(BusError, ValueError):
    """A setting is wrong (a malformed DSN, an unknown scheme or option): fix it, a retry cannot help.

    Never raised for an outage: a server that cannot be reached is a StorageUnavailableError.
    """


class MessageDecodeError(BusError, msgspec.ValidationError):
    """A message's payload does not decode as the type asked for (`m.value(T)`).

    `topic`, `partition`, `offset` name the message; `field` the path of the field
    that did not match (`$.amount`, `$.items[1]`; None when the payload is not JSON or
    a required field is missing: then `missing` names it). Also a msgspec.ValidationError,
    so code catching msgspec's error keeps working.
    """

    def __init__(
        self,
        message: str,
        *,
        topic: str,
        partition: str,
        offset: int,
        field: str | None = None,
        missing: str | None = None,
    ) -> None:
        super().__init__(message)
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.field = field
        self.missing = missing


class OffsetOutOfRangeError(BusError, IndexError):
    """The requested offset is below the partition's log start (history was archived or compacted)."""

    def __init__(self, message: str, *, log_start: int = 0) -> None:
        super().__init__(message)
        self.log_start = log_start


class GroupHasMembersError(BusError):
    """An admin operation needs the group to have no live members."""


class JobFailedError(BusError):
    """A queue job will never succeed: it was dead-lettered or cancelled.

    `status` is "failed" (dead-lettered) or "cancelled"; `errors` the job's error history
    (one dict per failed attempt: attempt, error, at).
    """

    def __init__(
        self, message: str, *, status: str = "failed", errors: list[dict[str, object]] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.errors = errors if errors is not None else []


class SchemaVersionError(BusError):
    """The schema and this library do not fit: the library is older than the schema's minimum
    compatible release, or an applied migration's file changed after it was applied."""


class ActorStoppedError(BusError, RuntimeError):
    """An actor of the bus stopped (it was stopped, or failed for good): nothing will answer.

    Through a Bus it means one of its actors gave up after repeated failures
    that were not the database being away (those are retried for as long as
    it lasts); `b.health()` names it. Close the Bus and connect again.
    """
