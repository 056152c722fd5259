"""The `start=` argument of consumers, subscriptions and claims.

A group's subscription start is recorded once, by the first subscriber
(invariant 6). This module only turns what the user passed into the values
`storage.groups.record_group` stores; it never looks at the database, so
parsing can happen (and fail with a ValidationError) before anything is written.

Accepted forms:

- ``None``: the Bus's ``default_start`` ("earliest" or "latest");
- ``"earliest"``: everything still in the log (Queen's ``all``);
- ``"latest"``: messages created after the group is recorded, minus
  ``new_lookback`` (Queen's ``new``);
- a ``datetime``: messages created at or after it (naive means local time,
  as ``datetime.astimezone`` reads it);
- ``{(topic, partition): offset, ...}`` (``TopicPartition`` keys work too):
  explicit offsets; partitions not named start at the log start.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, TypeAlias

import msgspec

from bus.types import TopicPartition
from storage.errors import ValidationError
from storage.names import validate_name, validate_offset, validate_partition

__all__ = ["START_MODES", "StartInput", "StartSpec", "parse_start"]

#: The modes `groups.start_mode` can hold.
START_MODES = ("earliest", "latest", "timestamp", "offsets")

_encoder = msgspec.json.Encoder()

#: What `start=` accepts: None (the Bus's default_start), "earliest", "latest", a datetime,
#: or committed offsets keyed by TopicPartition or (topic, partition) tuples.
StartInput: TypeAlias = (
    str
    | datetime
    | Mapping[TopicPartition, int]
    | Mapping[tuple[str, str], int]
    | Mapping[tuple[str, int], int]
    | None
)


class StartSpec(msgspec.Struct, frozen=True):
    """What `record_group` stores for a group's start.

    ``start_mode`` is one of :data:`START_MODES`; ``start_time`` is set for
    ``timestamp`` (``latest`` computes its time in the database, at the moment
    the group row is inserted, from the server's clock); ``start_offsets_json``
    is ``{"topic": {"partition": offset}}`` for ``offsets``.
    """

    start_mode: str
    start_time: datetime | None = None
    start_offsets_json: str | None = None

    def describe(self) -> str:
        """A short human form, for logs and admin output."""
        if self.start_mode == "timestamp" and self.start_time is not None:
            return f"timestamp {self.start_time.isoformat()}"
        if self.start_mode == "offsets":
            return f"offsets {self.start_offsets_json}"
        return self.start_mode


def parse_start(start: object, default: str) -> StartSpec:
    """Turn a `start=` argument into a :class:`StartSpec`; ``None`` means ``default``.

    Raises ValidationError (nothing written) for anything else than the forms
    listed in the module docstring.
    """
    if start is None:
        if default not in ("earliest", "latest"):
            raise ValidationError(f"default_start must be 'earliest' or 'latest', not {default!r}")
        return StartSpec(default)
    if isinstance(start, str):
        if start in ("earliest", "latest"):
            return StartSpec(start)
        raise ValidationError(
            f"start={start!r} is not understood: use 'earliest', 'latest', a datetime, "
            "or a dict {(topic, partition): offset}"
        )
    if isinstance(start, datetime):
        # Naive datetimes are local time (Python's convention); store an aware one.
        aware = start if start.tzinfo is not None else start.astimezone()
        return StartSpec("timestamp", start_time=aware)
    if isinstance(start, Mapping):
        return StartSpec("offsets", start_offsets_json=_offsets_json(start))
    raise ValidationError(
        f"start of type {type(start).__name__} is not understood: use 'earliest', 'latest', "
        "a datetime, or a dict {(topic, partition): offset}"
    )


def _offsets_json(start: Mapping[Any, Any]) -> str:
    if not start:
        raise ValidationError("start={} names no partition: give at least one {(topic, partition): offset}")
    nested: dict[str, dict[str, int]] = {}
    for key, offset in start.items():
        if isinstance(key, TopicPartition):
            topic, partition = key.topic, key.partition
        elif isinstance(key, tuple) and len(key) == 2:
            topic, partition = key
        else:
            raise ValidationError(
                f"start offsets are keyed by (topic, partition) tuples or bus.TopicPartition, not {key!r}"
            )
        if isinstance(partition, int) and not isinstance(partition, bool):
            partition = str(partition)
        validate_name(topic, "topic name")
        validate_partition(partition)
        validate_offset(offset, f"start offset for {topic}/{partition}")
        nested.setdefault(topic, {})[partition] = offset
    return _encoder.encode(nested).decode()
