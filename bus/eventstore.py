"""The event store: one globally ordered log per store, attribute partitions, guards.

    class CourseCreated(bus.Event, tag="course.created"):
        course_name: str

    store = b.event_store("courses")
    await store.append(CourseCreated(course_name="Algebra"))
    await store.register_group("enrollment")
    c = await store.claim_next("enrollment", partition_by=["course_name", "user_id"],
                               handled_types=[CourseCreated, UserJoinedCourse], worker_id="w-1")
    await store.append(decide(c.messages), guard=c.guard)     # ConcurrentAppendError on conflict
    await store.ack("enrollment", offset_id=c.offset_id, position=c.messages[-1].position)

Every scalar attribute of an event (str, int, float, bool, and values msgspec
turns into one: datetime, UUID, enums...) is indexed as a (name, value) pair in
the append's transaction; values are compared as text (`42`, `true`, ISO
dates). Strings longer than 1000 characters and None are not indexed.

Partition identity is AND: a partition exists for each combination of
`partition_by` values found together on one event. Fetching is conditional
AND: an event belongs to a partition when every partition attribute it
carries has the partition's value (events with only some of the attributes
are included on those). A group's `partition_by` is passed on each call and
is expected to stay the same for the group's life (change it with
`reset_group`, or use a new group).

A group remembers the union of the `handled_types` its calls passed, and
partitions are pending by that union, whichever call discovered them: when a
deploy adds a handled type, the new workers find the events of that type
(the log is scanned again, incrementally, to lower the cursors' hints); old
workers still running skip partitions where only the new type is pending.
The union only grows: after removing a handled type, `reset_group` (or a new
group) stops workers from passing over partitions where only it is pending.

Discovery is incremental and bounded: a call scans at most
`discovery_budget` seconds of not yet scanned log (steps of at most
`discovery_batch` positions), so the first claim on a long existing log
returns quickly and the following calls go on; `discover()` runs it ahead.

Claims on a stopped or failed group return None (as in the seed), they do not
raise. A claim whose worker stops heartbeating for `claim_ttl` (config,
default 120 s) can be taken by another worker; pass `worker_id=` to `ack`,
`release` and `nack` to have them refused (LeaseLostError) once that happened.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from bus import tracing
from bus.context import context_of
from storage import db
from storage import eventstore as es_storage
from storage.errors import (
    ConcurrentAppendError,
    GroupNotFoundError,
    LeaseLostError,
    ValidationError,
)
from storage.logs import get_logger
from storage.names import validate_int, validate_name, validate_offset, validate_seconds, validate_worker_id

if TYPE_CHECKING:
    from bus.context import BusContext, Connected

log = get_logger(__name__)

_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@=-]{0,199}")
_MAX_INDEXED_CHARS = 1000
_MAX_REMEMBERED_CLAIMS = 10_000
# Discovery steps: the first window (positions) a store object tries, the
# smallest it adapts down to, and the time a step aims at.
_FIRST_WINDOW = 1000
_MIN_WINDOW = 50
_STEP_SECONDS = 0.05
# ... and the time a step aims at when nothing waits for it (discover() without a budget).
_BULK_STEP_SECONDS = 1.0

_registry: dict[str, type[Event]] = {}
_encoder = msgspec.json.Encoder()
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


class QueryCondition(msgspec.Struct, frozen=True):
    """Events of type `message_type` whose attribute `key` has the value `value` (as text)."""

    message_type: str
    key: str
    value: str


class _EventMeta(msgspec.StructMeta):
    """Reads the `tag` class keyword, caches the attribute names, and registers the class."""

    def __new__(
        mcls,
        name: str,
        bases: tuple[type, ...],
        namespace: dict[str, Any],
        tag: str | None = None,
        **kwargs: Any,
    ) -> _EventMeta:
        if tag is not None and (not isinstance(tag, str) or _TAG.fullmatch(tag) is None):
            raise ValidationError(
                f"invalid event tag {tag!r} for {name}: use 1 to 200 ASCII letters, digits or '._:/@=-', "
                "starting with a letter or digit (e.g. 'course.created')"
            )
        cls = super().__new__(mcls, name, bases, namespace, **kwargs)
        if tag is not None:
            existing = _registry.get(tag)
            if existing is not None and (existing.__module__, existing.__qualname__) != (
                cls.__module__,
                cls.__qualname__,
            ):
                raise ValidationError(
                    f"event tag {tag!r} is already used by {existing.__module__}.{existing.__qualname__}; "
                    f"give {name} another tag"
                )
            _registry[tag] = cls  # type: ignore[assignment]
        cls.__event_tag__ = tag  # type: ignore[attr-defined]
        # Cached once at class creation, as a tuple (immutable, like the seed's frozen array).
        cls.__payload_attributes__ = tuple(cls.__struct_fields__)  # type: ignore[attr-defined]
        return cls


class Event(msgspec.Struct, metaclass=_EventMeta):
    """Base of event classes: `class CourseCreated(bus.Event, tag="course.created"): course_name: str`.

    The tag names the event type in the store (and decodes stored events back
    to their class); two classes may not share a tag.
    """

    __event_tag__: ClassVar[str | None]
    __payload_attributes__: ClassVar[tuple[str, ...]]

    @classmethod
    def event_tag(cls) -> str | None:
        """The class's tag (None for untagged bases)."""
        return cls.__event_tag__

    @classmethod
    def payload_attribute_names(cls) -> tuple[str, ...]:
        """The attributes the class declares, in declaration order (cached at class creation)."""
        return cls.__payload_attributes__

    @classmethod
    def to_conditions(cls, **values: object) -> list[QueryCondition]:
        """Conditions for the given attribute values, only for attributes this class declares.

        `CourseCreated.to_conditions(course_name="Algebra", user_id="joe")` is
        `[QueryCondition("course.created", "course_name", "Algebra")]`.
        """
        tag = cls.__event_tag__
        wanted = [name for name in cls.__payload_attributes__ if name in values]
        if not wanted:
            return []
        if tag is None:
            raise ValidationError(
                f"{cls.__name__} has no tag; declare it as class {cls.__name__}(bus.Event, tag=...)"
            )
        conditions = []
        for name in wanted:
            text = attribute_text(values[name])
            if text is None:
                raise ValidationError(
                    f"condition value for {name!r} must be a scalar (str, int, float, bool, date, UUID...), "
                    f"not {type(values[name]).__name__}"
                )
            conditions.append(QueryCondition(tag, name, text))
        return conditions


class UnknownEvent(Event):
    """A stored event whose tag has no class in this process (define the class to decode it)."""

    type_tag: str
    data: dict[str, Any]


class PositionedEvent(msgspec.Struct):
    """An event with its position in the store's log."""

    position: int
    message: Event
    created_at: datetime

    @property
    def tag(self) -> str | None:
        """The event's type tag."""
        if isinstance(self.message, UnknownEvent):
            return self.message.type_tag
        return type(self.message).event_tag()


class Guard(msgspec.Struct):
    """Optimistic concurrency: an append under this guard fails if any event matching
    one of `conditions` was appended after `position`."""

    conditions: list[QueryCondition]
    position: int


class EventClaim(msgspec.Struct):
    """A claimed partition: its pending events (in order) and the guard for appending decisions."""

    offset_id: int
    partition_key: str
    partition_value: dict[str, str]
    messages: list[PositionedEvent]
    guard: Guard
    attempts: int = 0  # failed attempts (nack) on this partition since its last ack


class PartitionCursor(msgspec.Struct):
    """A group's cursor on one partition (for inspection)."""

    offset_id: int
    partition_key: str
    partition_value: dict[str, str]
    position: int
    claimed_by: str | None
    claimed_at: datetime | None
    attempts: int
    retry_at: datetime | None
    last_error: str | None


def attribute_text(value: object) -> str | None:
    """The text under which a scalar attribute is indexed; None for values that are not indexed."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _encoder.encode(value).decode()
    try:
        builtin = msgspec.to_builtins(value)
    except (TypeError, msgspec.EncodeError):
        return None
    if isinstance(builtin, (str, bool, int, float)):
        return attribute_text(builtin)
    return None


def event_class(tag: str) -> type[Event] | None:
    """The class registered for `tag`, if any."""
    return _registry.get(tag)


def decode_event(tag: str, payload: str | bytes) -> Event:
    """A stored event back as its class (UnknownEvent when no class has the tag)."""
    cls = _registry.get(tag)
    if cls is None:
        return UnknownEvent(type_tag=tag, data=msgspec.json.decode(payload))
    decoder = _decoders.get(cls)
    if decoder is None:
        decoder = _decoders[cls] = msgspec.json.Decoder(cls)
    return decoder.decode(payload)  # type: ignore[no-any-return]


def _encode_events(
    events: Sequence[Event], limit: int
) -> tuple[list[str], list[str], tuple[list[int], list[str], list[str], list[str]]]:
    tags: list[str] = []
    payloads: list[str] = []
    idx: list[int] = []
    names: list[str] = []
    values: list[str] = []
    attr_tags: list[str] = []
    for i, event in enumerate(events, start=1):
        if not isinstance(event, Event) or isinstance(event, UnknownEvent):
            raise ValidationError(
                f"append takes bus.Event instances (or a list of them), not {type(event).__name__}"
            )
        cls = type(event)
        tag = cls.__event_tag__
        if tag is None:
            raise ValidationError(
                f"{cls.__name__} has no tag; declare it as class {cls.__name__}(bus.Event, tag=...)"
            )
        try:
            data = _encoder.encode(event)
        except (TypeError, msgspec.EncodeError, OverflowError) as exc:
            raise ValidationError(f"{cls.__name__} cannot be encoded as JSON ({exc})") from exc
        if b"\\u0000" in data:
            raise ValidationError(f"{cls.__name__} contains a NUL character, which PostgreSQL cannot store")
        if len(data) > limit:
            raise ValidationError(
                f"{cls.__name__} is {len(data)} bytes encoded, more than max_message_bytes={limit}; "
                "store large content elsewhere and append a reference"
            )
        tags.append(tag)
        payloads.append(data.decode())
        for name in cls.__payload_attributes__:
            text = attribute_text(getattr(event, name))
            if text is None or len(text) > _MAX_INDEXED_CHARS:
                continue
            idx.append(i)
            names.append(name)
            values.append(text)
            attr_tags.append(tag)
    return tags, payloads, (idx, names, values, attr_tags)


def _condition_arrays(conditions: Iterable[QueryCondition]) -> tuple[list[str], list[str], list[str]]:
    tags: list[str] = []
    keys: list[str] = []
    values: list[str] = []
    if not isinstance(conditions, (list, tuple)):
        raise ValidationError("conditions must be a list of bus.QueryCondition (or None for every event)")
    for c in conditions:
        if not isinstance(c, QueryCondition) or not all(
            isinstance(v, str) for v in (c.message_type, c.key, c.value)
        ):
            raise ValidationError(
                "conditions must be bus.QueryCondition(message_type: str, key: str, value: str); "
                "build them with EventClass.to_conditions(...)"
            )
        tags.append(c.message_type)
        keys.append(c.key)
        values.append(c.value)
    return tags, keys, values


def _validate_attribute_names(partition_by: str | Sequence[str]) -> list[str]:
    if not isinstance(partition_by, (str, list, tuple)):
        raise ValidationError(
            "partition_by must be an attribute name or a list of them, e.g. ['course_name']"
        )
    names = [partition_by] if isinstance(partition_by, str) else list(partition_by)
    if not names:
        raise ValidationError("partition_by needs at least one attribute name, e.g. ['course_name']")
    for name in names:
        if not isinstance(name, str) or not name.isidentifier() or len(name) > 200:
            raise ValidationError(
                f"partition_by attribute {name!r} is not an attribute name (a Python identifier)"
            )
    if len(set(names)) != len(names):
        raise ValidationError(f"partition_by lists an attribute twice: {names}")
    return sorted(names)  # canonical order: the same partition whatever order the caller uses


def _handled_classes(handled_types: Sequence[type[Event] | str]) -> list[type[Event]]:
    if isinstance(handled_types, (str, type)):
        handled_types = [handled_types]
    if not isinstance(handled_types, (list, tuple, set, frozenset)):
        raise ValidationError("handled_types must be a list of tagged bus.Event classes (or their tags)")
    classes: list[type[Event]] = []
    for item in handled_types:
        if isinstance(item, str):
            cls = _registry.get(item)
            if cls is None:
                raise ValidationError(f"no event class has the tag {item!r}; define it before claiming")
        elif isinstance(item, type) and issubclass(item, Event) and item.__event_tag__ is not None:
            cls = item
        else:
            raise ValidationError(
                f"handled_types takes tagged bus.Event classes (or their tags), not {item!r}"
            )
        if cls not in classes:
            classes.append(cls)
    if not classes:
        raise ValidationError("handled_types needs at least one event class")
    return classes


class _UnsureClaims(dict[str, set[tuple[str, str, int]]]):
    """Per Bus, per store: the claims whose commit went unanswered (see EventStore._unsure)."""


class EventStore:
    """One store: an ordered log of events with attribute partitions and consumer groups.

    Get it with `b.event_store(name)`; the store exists once something is appended.
    """

    #: Most log positions one discovery step scans (one transaction).
    discovery_batch: int = 100_000
    #: Seconds of discovery one claim_next may spend before it claims; the
    #: rest of a long log is discovered by the following calls.
    discovery_budget: float = 0.2

    def __init__(self, ctx: BusContext | Connected, name: str) -> None:
        self._ctx = ctx = context_of(ctx)
        # (worker, group, offset_id) of claims whose commit went unanswered (a lost connection):
        # they may be held by the worker without its knowing, and its heartbeats would keep them
        # forever. Released before the worker's next claim or heartbeat. Shared by every
        # EventStore object of the Bus for this store.
        self._unsure = ctx.state(_UnsureClaims).setdefault(name, set())
        # (group, partition_by, bulk) -> the discovery window that last took about its step time.
        self._windows: dict[tuple[str, tuple[str, ...], bool], int] = {}
        self.name = validate_name(name, "event store name")
        self._log = log.bind(store=name)
        # offset_id -> (last fetched position, fetch cut short) of the claims this
        # object handed out, so ack can tell "nothing more pending" without a
        # write at claim time.
        self._claims: dict[int, tuple[int, bool]] = {}

    @property
    def _db(self) -> db.Lender:
        """What the store's statements run on: connections the Lender lends, with generic plans.

        With the default plan_cache_mode PostgreSQL re-planned a claim's read of the store on
        every call once the store was large (see storage.db.GENERIC_PLANS). Discovery runs on a
        pool connection of its own (`_discover`), where PostgreSQL still chooses its plans.
        """
        return self._ctx.lender

    def __repr__(self) -> str:
        return f"EventStore({self.name!r})"

    # -- the log -------------------------------------------------------------------

    async def append(
        self, events: Event | Sequence[Event], guard: Guard | None = None
    ) -> list[PositionedEvent]:
        """Append one event or a list atomically; their positions come back in order.

        With a guard: raises ConcurrentAppendError (nothing written) if an event
        matching any of its conditions was appended after its position. The check
        runs while holding the store's position counter, so two conflicting
        guarded appends can never both succeed.
        """
        items: list[Event]
        if isinstance(events, Event):
            items = [events]
        elif isinstance(events, Sequence) and not isinstance(events, (str, bytes)):
            items = list(events)
        else:
            raise ValidationError("append takes a bus.Event or a list of them")
        if guard is not None and not isinstance(guard, Guard):
            raise ValidationError(
                "guard must be a bus.Guard (from claim_next, or Guard(conditions, position))"
            )
        tags, payloads, attrs = _encode_events(items, self._ctx.config.max_message_bytes)
        if not items:
            return []
        with db.translate_errors():
            if guard is None or not guard.conditions:
                rows = await es_storage.append(self._db, self.name, tags, payloads, attrs)
            else:
                validate_offset(guard.position, "guard position")
                conditions = _condition_arrays(guard.conditions)
                rows, conflict = await es_storage.append_guarded(
                    self._db,
                    es_storage.AppendGuardedParams(
                        store=self.name,
                        tags=tags,
                        payloads=payloads,
                        attrs=attrs,
                        conditions=conditions,
                        after=guard.position,
                    ),
                )
                if conflict is not None:
                    raise _conflict_error(conflict, guard.position)
        return [PositionedEvent(p, e, t) for (p, t), e in zip(rows, items, strict=True)]

    async def read(
        self, conditions: Sequence[QueryCondition] | None = None, after: int = 0, limit: int | None = None
    ) -> list[PositionedEvent]:
        """Events after position `after`, in order: all of them (conditions None), or those matching any condition."""
        validate_offset(after, "after")
        if limit is not None:
            validate_int(limit, "limit", 1)
        with db.translate_errors():
            if conditions is None:
                rows = await es_storage.read_all(self._db, self.name, after, limit)
            else:
                arrays = _condition_arrays(conditions)
                if not arrays[0]:
                    return []
                rows = await es_storage.read_matching(self._db, self.name, after, arrays, limit)
        return [_positioned(r) for r in rows]

    async def last_position(self) -> int:
        """The position of the last committed event (0 when the store is empty)."""
        with db.translate_errors():
            return await es_storage.last_position(self._db, self.name)

    async def clear(self) -> None:
        """Delete the whole store: events, attribute index, groups, cursors. Not undoable."""
        with db.translate_errors():
            await es_storage.clear(self._db, self.name)
        self._log.info("event_store_cleared")

    # -- consumer groups -----------------------------------------------------------

    async def register_group(self, group: str, *, max_attempts: int = 5, retry_backoff: float = 1.0) -> None:
        """Create the group (active) if it does not exist; registering again changes nothing.

        `max_attempts`: failed attempts (nack) on one partition before the group is
        marked failed; `retry_backoff`: seconds before the first retry, doubled each time.
        """
        validate_name(group, "group name")
        validate_int(max_attempts, "max_attempts", 1)
        backoff = validate_seconds(retry_backoff, "retry_backoff", allow_zero=True)
        with db.translate_errors():
            await es_storage.register_group(self._db, self.name, group, max_attempts, backoff)

    async def group_active(self, group: str) -> bool:
        """True if the group exists and is active (False when stopped, failed, or unknown)."""
        return await self.group_status(group) == "active"

    async def group_status(self, group: str) -> str | None:
        """'active', 'stopped' or 'failed'; None if the group does not exist."""
        validate_name(group, "group name")
        with db.translate_errors():
            row = await es_storage.group_row(self._db, self.name, group)
        return None if row is None else row.status

    async def group_error(self, group: str) -> dict[str, Any] | None:
        """Why the group failed (partition, error, attempts, when); None unless it failed."""
        validate_name(group, "group name")
        with db.translate_errors():
            row = await es_storage.group_row(self._db, self.name, group)
        if row is None:
            raise _group_not_found(self.name, group)
        return None if row.error_context is None else msgspec.json.decode(row.error_context)

    async def stop_group(self, group: str) -> None:
        """Stop the group: claim_next returns None until start_group. Claims already out stay valid."""
        await self._group_update(es_storage.stop_group, group)
        self._log.info("event_group_stopped", group=group)

    async def start_group(self, group: str) -> None:
        """(Re)activate the group; a failed group's error is cleared and its partitions' attempts restart."""
        await self._group_update(es_storage.start_group, group)
        self._log.info("event_group_started", group=group)

    async def reset_group(self, group: str) -> None:
        """Delete every cursor of the group: it reprocesses the store from the beginning."""
        await self._group_update(es_storage.reset_group, group)
        self._log.info("event_group_reset", group=group)

    async def delete_group(self, group: str) -> None:
        """Delete the group and its cursors."""
        await self._group_update(es_storage.delete_group, group)
        self._log.info("event_group_deleted", group=group)

    async def _group_update(self, change: Callable[[db.Conn, str, str], Awaitable[bool]], group: str) -> None:
        validate_name(group, "group name")
        with db.translate_errors():
            found = await change(self._db, self.name, group)
        if not found:
            raise _group_not_found(self.name, group)

    async def partitions(self, group: str) -> list[PartitionCursor]:
        """The group's cursors, one per discovered partition (inspection and tests)."""
        validate_name(group, "group name")
        with db.translate_errors():
            rows = await es_storage.group_offsets(self._db, self.name, group)
        return [
            PartitionCursor(
                offset_id=r.offset_id,
                partition_key=r.partition_key,
                partition_value=dict(zip(r.names, r.vals, strict=True)),
                position=r.position,
                claimed_by=r.claimed_by,
                claimed_at=r.claimed_at,
                attempts=r.attempts,
                retry_at=r.retry_at,
                last_error=r.last_error,
            )
            for r in rows
        ]

    # -- claiming ------------------------------------------------------------------

    async def claim_next(
        self,
        group: str,
        partition_by: str | Sequence[str],
        handled_types: Sequence[type[Event] | str],
        worker_id: str,
        *,
        max_messages: int = 1000,
    ) -> EventClaim | None:
        """Claim the unclaimed partition with the earliest pending handled event.

        Discovers partitions first (AND over `partition_by`, incrementally: only
        events appended since the last call are scanned, for at most
        `discovery_budget` seconds per call, so the first call on a long log
        returns quickly and later calls go on). Returns up to `max_messages`
        events (conditional AND) of the `handled_types` and a guard built from
        every handled type's own attributes; None when nothing is pending (or,
        while a long log is still being discovered, nothing was found within
        this call's budget), or the group is stopped or failed. Raises
        GroupNotFoundError for an unregistered group.
        """
        validate_name(group, "group name")
        worker = validate_worker_id(worker_id)
        names = _validate_attribute_names(partition_by)
        classes = _handled_classes(handled_types)
        validate_int(max_messages, "max_messages", 1)
        tags = [str(c.__event_tag__) for c in classes]
        ttl = float(self._ctx.config.claim_ttl)
        started = time.monotonic()
        with db.translate_errors():
            await self._release_unsure(worker)
            state = await es_storage.claim_state(self._db, self.name, group, names)
            if state.status is None:
                raise _group_not_found(self.name, group)
            if state.status != "active":
                return None
            union = state.handled_tags
            left = 0
            if union is None or not set(tags).issubset(union):
                union = await self._add_handled_tags(group, names, tags)
                left = await self._discover(group, names, budget=self.discovery_budget)
            elif state.upto > state.scanned:
                left = await self._discover(group, names, budget=self.discovery_budget)
            claimed = await self._claim(group, names, worker, ttl, set(tags), union, max_messages)
            # Nothing claimable among the partitions found so far, and the log is
            # not fully discovered yet: go on discovering while the budget lasts.
            while claimed is None and left > 0:
                remaining = self.discovery_budget - (time.monotonic() - started)
                if remaining <= 0:
                    break
                left = await self._discover(group, names, budget=remaining)
                claimed = await self._claim(group, names, worker, ttl, set(tags), union, max_messages)
        if claimed is None:
            return None
        value = dict(zip(names, claimed.vals, strict=True))
        messages = [_positioned(r) for r in claimed.events]
        conditions = [c for cls in classes for c in cls.to_conditions(**value)]
        tracing.claimed_events(self.name, group, claimed.partition_key, len(messages))
        return EventClaim(
            offset_id=claimed.offset_id,
            partition_key=claimed.partition_key,
            partition_value=value,
            messages=messages,
            guard=Guard(conditions, messages[-1].position),
            attempts=claimed.attempts,
        )

    async def _claim(
        self,
        group: str,
        names: list[str],
        worker: str,
        ttl: float,
        handled: set[str],
        union: list[str],
        max_messages: int,
    ) -> es_storage.ClaimedPartition | None:
        """Take the partition with the earliest pending event of the group (see storage's `claim`).

        Remembers the bounds of what the claim read, for its ack.
        """
        unsure: list[int] = []
        try:
            claimed = await es_storage.claim(
                self._db,
                es_storage.ClaimParams(
                    store=self.name,
                    group=group,
                    names=names,
                    worker=worker,
                    ttl=ttl,
                    handled=handled,
                    union=union,
                    max_messages=max_messages,
                    now=self._ctx.now(),
                ),
                unsure=unsure,
            )
        except BaseException:
            self._unsure.update((worker, group, offset_id) for offset_id in unsure)
            raise
        if claimed is not None:
            self._remember_claim(claimed.offset_id, claimed.last_read, claimed.more)
        return claimed

    def _remember_claim(self, offset_id: int, last: int, more: bool) -> None:
        self._claims.pop(offset_id, None)
        if len(self._claims) >= _MAX_REMEMBERED_CLAIMS:  # claims never acked: forget the oldest
            del self._claims[next(iter(self._claims))]
        self._claims[offset_id] = (last, more)

    async def _add_handled_tags(self, group: str, names: list[str], tags: list[str]) -> list[str]:
        """Add a call's handled types to the group's union (a new type makes discovery rescan); the union."""
        union = await es_storage.add_handled_tags(self._db, self.name, group, names, tags)
        if union is None:
            raise _group_not_found(self.name, group)
        self._log.info("event_group_handled_types", group=group, partition_by=names, handled=union)
        return union

    async def discover(
        self,
        group: str,
        partition_by: str | Sequence[str],
        handled_types: Sequence[type[Event] | str],
        *,
        budget: float | None = None,
    ) -> int:
        """Run partition discovery for the group without claiming; how many log positions are left to scan.

        claim_next does this too, `discovery_budget` seconds per call; call it
        (budget None: until caught up) to find every partition of a long log
        ahead of the first claims. Raises GroupNotFoundError for an unknown group.
        """
        validate_name(group, "group name")
        names = _validate_attribute_names(partition_by)
        tags = [str(c.__event_tag__) for c in _handled_classes(handled_types)]
        seconds = None if budget is None else validate_seconds(budget, "budget", allow_zero=True)
        with db.translate_errors():
            state = await es_storage.claim_state(self._db, self.name, group, names)
            if state.status is None:
                raise _group_not_found(self.name, group)
            union = state.handled_tags
            if union is None or not set(tags).issubset(union):
                await self._add_handled_tags(group, names, tags)
            return await self._discover(group, names, budget=seconds)

    async def _discover(self, group: str, names: list[str], *, budget: float | None) -> int:
        """Scan events appended since the last discovery (new partitions, lowered hints); positions left.

        Steps of at most `discovery_batch` positions (one transaction each, the
        window adapted so a step takes about `_STEP_SECONDS`, or
        `_BULK_STEP_SECONDS` when there is no budget) until caught up or
        `budget` seconds are spent (None: no limit). At least one step runs, so
        every call makes progress.
        """
        started = time.monotonic()
        step_seconds = _STEP_SECONDS if budget is not None else _BULK_STEP_SECONDS
        key = (group, tuple(names), budget is None)
        # One connection for every step (a pool connection's release costs a round trip).
        async with self._ctx.pool.acquire() as conn:
            while True:
                step_started = time.monotonic()
                window = min(self._windows.get(key, _FIRST_WINDOW), self.discovery_batch)
                step = await es_storage.discover_step(conn, self.name, group, names, window)
                if step is None:  # caught up (or the group was reset or deleted meanwhile)
                    return 0
                now = time.monotonic()
                # Keep a step near _STEP_SECONDS: its cost grows with the window
                # (mostly with the new partitions in it) over a fixed overhead.
                took = now - step_started
                if took < step_seconds / 2 and step.upto - step.scanned == window:
                    window *= 2
                elif took > step_seconds * 2:
                    window //= 2
                self._windows[key] = max(_MIN_WINDOW, min(self.discovery_batch, window))
                if step.created:
                    self._log.debug(
                        "event_partitions_discovered", group=group, count=step.created, scanned=step.upto
                    )
                if step.upto >= step.last:
                    return 0
                if budget is not None and now - started >= budget:
                    return step.last - step.upto

    async def ack(self, group: str, offset_id: int, position: int, *, worker_id: str | None = None) -> None:
        """Advance the partition's cursor to `position` (never backwards) and release the claim.

        With `worker_id`, refused with LeaseLostError if that worker no longer holds the claim.
        """
        validate_name(group, "group name")
        validate_int(offset_id, "offset_id", 1)
        validate_offset(position, "position")
        worker = None if worker_id is None else validate_worker_id(worker_id)
        last, more = self._claims.pop(offset_id, (None, None))
        with db.translate_errors():
            done = await es_storage.ack(
                self._db,
                es_storage.AckParams(
                    store=self.name,
                    group=group,
                    offset_id=offset_id,
                    position=position,
                    worker=worker,
                    last_read=last,
                    more=more,
                ),
            )
        if not done:
            await self._explain_missing(group, offset_id, worker)

    async def release(self, group: str, offset_id: int, *, worker_id: str | None = None) -> None:
        """Release the claim without advancing: the same events come back on the next claim."""
        validate_name(group, "group name")
        validate_int(offset_id, "offset_id", 1)
        worker = None if worker_id is None else validate_worker_id(worker_id)
        self._claims.pop(offset_id, None)
        with db.translate_errors():
            done = await es_storage.release(self._db, self.name, group, offset_id, worker)
        if not done:
            await self._explain_missing(group, offset_id, worker)

    async def nack(
        self,
        group: str,
        offset_id: int,
        error: BaseException | str,
        *,
        retry_delay: float | None = None,
        worker_id: str | None = None,
    ) -> bool:
        """Record a failed attempt on the claimed partition and release it for a retry later.

        The partition is retried after `retry_delay` seconds (default: the group's
        `retry_backoff` doubled per attempt, at most 5 minutes). After the group's
        `max_attempts` the group is marked failed (claim_next returns None,
        `group_error` says why) and True is returned; `start_group` resumes it.
        """
        validate_name(group, "group name")
        validate_int(offset_id, "offset_id", 1)
        delay = None if retry_delay is None else validate_seconds(retry_delay, "retry_delay", allow_zero=True)
        worker = None if worker_id is None else validate_worker_id(worker_id)
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        text = text.replace("\x00", "")
        self._claims.pop(offset_id, None)
        with db.translate_errors():
            outcome = await es_storage.nack(
                self._db,
                es_storage.NackParams(
                    store=self.name,
                    group=group,
                    offset_id=offset_id,
                    error=text,
                    delay=delay,
                    worker=worker,
                    now=self._ctx.now(),
                ),
            )
        if outcome is None:
            await self._explain_missing(group, offset_id, worker)
            return False
        if outcome.failed:
            self._log.error("event_group_failed", group=group, partition=outcome.partition_key, error=text)
        else:
            self._log.warning(
                "event_partition_retry",
                group=group,
                partition=outcome.partition_key,
                attempts=outcome.attempts,
            )
        return outcome.failed

    async def heartbeat(self, worker_id: str) -> int:
        """Keep every claim of this worker in this store alive; returns how many it holds."""
        worker = validate_worker_id(worker_id)
        with db.translate_errors():
            await self._release_unsure(worker)
            return await es_storage.heartbeat(self._db, self.name, worker, self._ctx.now())

    async def _release_unsure(self, worker: str) -> None:
        """Release the worker's claims whose commit went unanswered: it never saw their events."""
        for key in [k for k in self._unsure if k[0] == worker]:
            _, group, offset_id = key
            if await es_storage.release(self._db, self.name, group, offset_id, worker):
                self._log.info(
                    "event_unanswered_claim_released", group=group, offset_id=offset_id, worker=worker
                )
            self._unsure.discard(key)
            self._claims.pop(offset_id, None)

    async def release_stale_claims(self, ttl: float | None = None) -> int:
        """Release claims not heartbeaten for `ttl` seconds (default config `claim_ttl`); returns how many."""
        seconds = (
            float(self._ctx.config.claim_ttl)
            if ttl is None
            else validate_seconds(ttl, "ttl", allow_zero=True)
        )
        with db.translate_errors():
            released = await es_storage.release_stale(self._db, self.name, seconds, self._ctx.now())
        if released:
            self._log.info("event_stale_claims_released", count=released, ttl=seconds)
        return released

    async def _explain_missing(self, group: str, offset_id: int, worker: str | None) -> None:
        with db.translate_errors():
            state = await es_storage.offset_state(self._db, self.name, group, offset_id)
        if state.exists:
            raise LeaseLostError(
                f"worker {worker!r} no longer holds partition {offset_id} of group {group!r} "
                f"(now held by {state.claimed_by!r}: its claim expired); claim again"
            )
        if not state.group_exists:
            raise _group_not_found(self.name, group)
        raise ValidationError(
            f"group {group!r} of store {self.name!r} has no partition cursor {offset_id} "
            "(was the group reset?); claim again"
        )


def _positioned(row: es_storage.StoredEvent) -> PositionedEvent:
    return PositionedEvent(row.position, decode_event(row.tag, row.payload), row.created_at)


def _group_not_found(store: str, group: str) -> GroupNotFoundError:
    return GroupNotFoundError(
        f"event store {store!r} has no group {group!r}; create it with store.register_group({group!r})"
    )


def _conflict_error(conflict: dict[str, Any], after: int) -> ConcurrentAppendError:
    error = ConcurrentAppendError(
        f"event {conflict.get('tag')!r} with {conflict.get('name')}={conflict.get('value')!r} was appended at "
        f"position {conflict.get('position')}, after the guard's position {after}; nothing was written: "
        "read (or claim) again and decide on the new events"
    )
    error.position = conflict.get("position")  # type: ignore[attr-defined]
    return error
