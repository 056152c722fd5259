"""The publish pipeline of a Bus: topic and partition lookups, preparing a call's messages, writing them.

`Bus.publish` and `Bus.publish_many` hand their call to the Bus's :class:`Publisher`, as
aiokafka's consumer hands fetching to its `Fetcher`. The Publisher validates and encodes the
messages (a message that fails validation fails alone and writes nothing), resolves their
partitions (cached: a topic's configuration never changes in place, and a partition keeps its
id), then writes the call: through the Producer (which batches concurrent calls into one
statement) or directly, in the caller's transaction (outbox) or on the pool.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import zlib
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import asyncpg
import msgspec

from actors import metrics as _metrics
from actors.producer import Publish, Vanished
from bus import tracing
from bus.codec import PLAIN_VALUES, encode_headers, encode_json, encode_payload, validate_key
from bus.types import Outgoing, Record, TopicInfo
from storage import db
from storage import messages as log_sql
from storage import topics as topic_sql
from storage.errors import TopicNotFoundError, ValidationError
from storage.idempotency import validate_idempotency_key
from storage.messages import Placed
from storage.names import validate_int, validate_name, validate_partition, validate_seconds

if TYPE_CHECKING:
    from actors.runtime import ActorRef
    from bus.context import BusContext

__all__ = ["Prepared", "Publisher", "key_partition", "topic_info"]

T = TypeVar("T")


def topic_info(row: asyncpg.Record) -> TopicInfo:
    """A topic's configuration from its `topics` row."""
    return TopicInfo(
        name=row["name"],
        partitions=row["partitions"],
        semantics=row["semantics"],
        cleanup=row["cleanup"],
        retention=None if row["retention_seconds"] is None else timedelta(seconds=row["retention_seconds"]),
        tombstone_retention=None
        if row["tombstone_retention_seconds"] is None
        else timedelta(seconds=row["tombstone_retention_seconds"]),
        namespace=row["namespace"],
        task=row["task"],
        max_message_bytes=row["max_message_bytes"],
        created_at=row["created_at"],
        dedupe_window=None
        if row["dedupe_window_seconds"] is None
        else timedelta(seconds=row["dedupe_window_seconds"]),
    )


class Prepared(log_sql.Batch):
    """One call's validated, encoded messages with their partitions resolved: the batch a flush
    writes (alone, or joined with the calls beside it), and the topic it goes to.

    `Publisher._prepare` makes it and sets `topic` and `window` (the topic's dedupe window in
    seconds; None: for ever) itself: one constructor call on the path of every publish.
    """

    __slots__ = ("topic", "window")

    topic: str
    window: float | None


@functools.lru_cache(maxsize=65536)
def key_partition(key: str, count: int) -> str:
    """The fixed partition a key maps to: a stable hash (CRC-32), the same in every process."""
    return str(zlib.crc32(key.encode("utf-8")) % count)


class Publisher:
    """Publishing for one Bus: the topic and partition caches, preparation, and the write.

    Built by the Bus from its context (pool, config, channels, clock, actor system); the Bus
    hands it its Producer once the actors start (until then, and for outbox and timed
    publishes, calls are written directly).
    """

    def __init__(self, context: BusContext) -> None:
        self.context = context
        self.config = context.config
        self.pool = context.pool
        self.channels = context.channels
        self.topics: dict[str, TopicInfo] = {}  # by name: a topic's configuration never changes in place
        self._partition_ids: dict[tuple[str, str], int] = {}
        self._round_robin: dict[str, itertools.count[int]] = {}
        self._lookups: dict[tuple[str, ...], asyncio.Future[Any]] = {}
        self._producer: ActorRef[Publish] | None = None  # pool publishes go through it, once started

    def attach_producer(self, producer: ActorRef[Publish]) -> None:
        """Send pool publishes through `producer` (the Bus's Producer actor) from now on."""
        self._producer = producer

    async def topic(self, name: str) -> TopicInfo:
        """The topic's configuration (cached: topic configuration never changes in place)."""
        validate_name(name, "topic name")
        info = self.topics.get(name)
        if info is None:
            with db.translate_errors():
                row = await topic_sql.get_topic(self.pool, name)
            if row is None:
                raise TopicNotFoundError(
                    f"topic {name!r} does not exist; create it with create_topic({name!r}, ...)"
                )
            info = self.topics[name] = topic_info(row)
        return info

    def forget_topic(self, name: str) -> None:
        """Drop what is cached of topic `name` (deleted here, or found gone while publishing)."""
        self.topics.pop(name, None)
        for key in [k for k in self._partition_ids if k[0] == name]:
            del self._partition_ids[key]

    async def partition_id(self, topic: TopicInfo, partition: str, *, create: bool) -> int | None:
        """The internal id of a partition; dynamic partitions are created when `create`."""
        cache_key = (topic.name, partition)
        pid = self._partition_ids.get(cache_key)
        if pid is None:
            with db.translate_errors():
                if topic.dynamic and create:
                    pid = await topic_sql.ensure_partition(self.pool, topic.name, partition)
                else:
                    pid = await topic_sql.partition_id(self.pool, topic.name, partition)
            if pid is None:
                return None
            self._partition_ids[cache_key] = pid
        return pid

    def _choose_partition(self, topic: TopicInfo, partition: Any, key: str | None) -> str:
        if partition is not None:
            if isinstance(partition, int) and not isinstance(partition, bool):
                partition = str(partition)
            name = validate_partition(partition)
            if not topic.dynamic and not (
                name.isdigit() and int(name) < (topic.partitions or 0) and str(int(name)) == name
            ):
                raise ValidationError(
                    f"topic {topic.name!r} has {topic.partitions} fixed partitions named '0'..'{(topic.partitions or 1) - 1}'; "
                    f"{name!r} is not one of them"
                )
            return name
        if topic.dynamic:
            return key if key is not None and _is_partition_name(key) else "default"
        assert topic.partitions is not None
        if key is not None:
            return key_partition(key, topic.partitions)
        counter = self._round_robin.setdefault(topic.name, itertools.count())
        return str(next(counter) % topic.partitions)

    # -- publishing ----------------------------------------------------------------

    async def _prepare(
        self, info: TopicInfo, messages: Sequence[Outgoing | Any], dedupe: float | None
    ) -> Prepared:
        """Validate and encode one call's messages and resolve their partitions (nothing is written)."""
        out = Prepared(info.semantics == "queue")
        out.topic, out.window = info.name, dedupe
        self._encode(info, messages, out)
        datas, heads, keys = out.payloads, out.headers, out.keys
        if len(out.names) == 1:  # a single publish: the common case
            out.nbytes = len(datas[0] or b"") + len(heads[0] or "") + len(keys[0] or "")
            pid = self._partition_ids.get((info.name, out.names[0]))
            if pid is not None:
                out.pids = [pid]
                return out
        else:  # what the call weighs (for the Producer's max_batch_bytes), summed at C speed
            out.nbytes = (
                sum(map(len, filter(None, datas)))
                + sum(map(len, filter(None, heads)))
                + sum(map(len, filter(None, keys)))
            )
        out.pids = await self._partition_ids_of(info, out.names)
        return out

    def _encode(self, info: TopicInfo, messages: Sequence[Outgoing | Any], out: Prepared) -> None:
        """Validate and encode `messages` into `out`: partition names, keys, headers, payloads, options."""
        tombstones, limit = info.cleanup == "compact", info.max_message_bytes
        # Services often pass one headers dict for a whole batch: encode it once.
        last_headers: Any = None
        last_encoded: str | None = None
        # The per-message loop of publish_many: local names, few calls of our own per message.
        names, keys, heads, datas = out.names, out.keys, out.headers, out.payloads
        choose = self._choose_partition
        hashed = None if info.dynamic else info.partitions  # a keyed message's partition is its key's hash
        for item in messages:
            msg = item if type(item) is Outgoing else Outgoing(item)
            key = msg.key
            if key is not None and (type(key) is not str or not key.isascii() or "\x00" in key):
                key = validate_key(key)  # refuses it, or checks the text of a non-ASCII key
            given = msg.headers
            if given is None:
                head = None
            elif given is last_headers:
                head = last_encoded
            else:
                head = last_encoded = encode_headers(given)
                last_headers = given
            if (
                out.ikeys is not None
                or out.timing is not None
                or msg.idempotency_key is not None
                or msg.delay is not None
                or msg.deliver_at is not None
                or msg.priority is not None
            ):
                _options(info, msg, out, len(names))
            if hashed and key is not None and msg.partition is None:
                names.append(key_partition(key, hashed))
            else:
                names.append(choose(info, msg.partition, key))
            keys.append(key)
            heads.append(head)
            datas.append(_encoded_payload(msg.payload, tombstones, limit))

    async def _partition_ids_of(self, info: TopicInfo, names: list[str]) -> list[int]:
        """The partition ids of `names` (dynamic partitions created), looked up once per name."""
        ids: dict[str, int] = {}
        for name in dict.fromkeys(names):
            pid = self._partition_ids.get((info.name, name))
            if pid is None:
                pid = await self._shared(
                    ("partition", info.name, name),
                    functools.partial(self.partition_id, info, name, create=True),
                )
            if pid is None:
                self.forget_topic(info.name)
                raise TopicNotFoundError(f"topic {info.name!r} (partition {name!r}) no longer exists")
            ids[name] = pid
        return [ids[n] for n in names]

    async def _shared(self, key: tuple[str, ...], lookup: Callable[[], Awaitable[T]]) -> T:
        """One lookup for every concurrent caller that needs it; they resume in the order they asked.

        Callers of publish reach the Producer in call order even when the first ones had to look a
        topic or partition up: without this, whichever lookup answered first would go first.
        """
        shared = self._lookups.get(key)
        if shared is None:
            shared = self._lookups[key] = asyncio.ensure_future(lookup())
            shared.add_done_callback(lambda _: self._lookups.pop(key, None))
        return await asyncio.shield(shared)

    async def resolve(self, topic: str, partition: str = "0") -> None:
        """Look `topic` and its `partition` up now (cached, dynamic partitions created).

        A publish on a caller's connection (`connection=`) looks up what it does not know yet on
        the pool: a caller that holds one of the Bus's own connections in a transaction while
        doing so needs a second one, and many such callers at once can hold every connection of
        the pool while each waits for one more. Resolving first takes that lookup out of the
        transaction.
        """
        info = await self.shared_topic(topic)
        await self._partition_ids_of(info, [partition])

    async def shared_topic(self, topic: str) -> TopicInfo:
        """`topic(topic)`, looked up once for every concurrent caller (publishes keep their call order)."""
        validate_name(topic, "topic name")  # before the cache: an unhashable value is bad input too
        info = self.topics.get(topic)
        return info if info is not None else await self._shared(("topic", topic), lambda: self.topic(topic))

    async def _write(self, call: Prepared, connection: asyncpg.Connection | None) -> list[Record]:
        """Append one prepared call: through the Producer, or directly (outbox, or no Producer)."""
        if connection is None and self._producer is not None and call.timing is None:
            reply: asyncio.Future[list[Placed | None]] = asyncio.get_running_loop().create_future()
            message = Publish(call, reply)
            if not self._producer.try_tell(message):  # the mailbox is full: wait for room (back-pressure)
                await self._producer.tell(message)
            placed = await reply
        else:
            with db.translate_errors():
                if connection is not None:
                    # In the caller's transaction, one statement of it; the wake-up is sent by its commit.
                    placed = await log_sql.append_outbox(
                        connection,
                        self.config.schema,
                        call,
                        notify=self.channels.messages,
                        now=self.context.now(),
                    )
                elif call.ikeys is not None:
                    async with self.pool.acquire() as conn, conn.transaction():
                        placed = await call.append(conn, now=self.context.now())
                else:
                    placed = await call.append(self.pool)
            system = self.context.system
            if connection is None and system is not None:
                for pid in set(call.pids):
                    system.announce(pid)
        return _records(call, placed)

    async def publish(
        self,
        topic: str,
        payload: Any,
        key: Any,
        partition: Any,
        headers: Any,
        connection: asyncpg.Connection | None,
        idempotency_key: Any,
        trace: dict[str, str] | None,
        timed: tuple[Any, Any, Any] | None = None,
    ) -> Record:
        """`Bus.publish` inside its PRODUCER span (`trace`: the headers that carry it on; None: not traced)."""
        # _choose_partition takes an int partition as well (Outgoing does not check its fields).
        one = Outgoing(
            payload,
            key,
            partition,
            tracing.with_trace_headers(_plain_headers(headers), trace),
            idempotency_key,
            *(timed or ()),
        )
        for attempt in range(2):
            info = await self.shared_topic(topic)
            call = await self._prepare(info, (one,), _window(info))
            try:
                records = await self._write(call, connection)
            except Vanished:
                # The partition vanished (topic deleted elsewhere): forget and look again once.
                self.forget_topic(topic)
                if attempt == 0 and connection is None:
                    continue
                raise TopicNotFoundError(
                    f"topic {topic!r} no longer exists (or lost the partition)"
                ) from None
            _metrics.published(topic, 1)
            return records[0]
        raise AssertionError("unreachable")

    async def publish_many(
        self, topic: str, messages: Sequence[Outgoing | Any], *, connection: asyncpg.Connection | None = None
    ) -> list[Record]:
        """`Bus.publish_many`: append many messages atomically (all or none), records in input order."""
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise ValidationError("publish_many takes a list of bus.Outgoing (or plain payloads)")
        with tracing.publishing(topic, len(messages)) as trace:
            if trace:
                messages = [_traced(m, trace) for m in messages]
            info = await self.shared_topic(topic)
            call = await self._prepare(info, messages, _window(info))
            if not call.pids:
                return []
            try:
                records = await self._write(call, connection)
            except Vanished:
                self.forget_topic(topic)
                raise TopicNotFoundError(
                    f"topic {topic!r} no longer exists (or lost partitions) while publishing"
                ) from None
            _metrics.published(topic, len(records))
            return records


def _encoded_payload(payload: Any, tombstones: bool, limit: int) -> bytes | None:
    """A message's payload as stored: a flat dict of plain values takes the short way (only its size to check)."""
    if type(payload) is dict and PLAIN_VALUES.issuperset(map(type, payload.values())):
        data = encode_json(payload)
        if len(data) <= limit:
            return data
    return encode_payload(payload, allow_tombstone=tombstones, limit=limit)


def _options(info: TopicInfo, msg: Outgoing, out: Prepared, index: int) -> None:
    """Record message `index`'s idempotency key and queue timing in `out` (None where it has none)."""
    if msg.idempotency_key is not None:
        if out.ikeys is None:
            out.ikeys = [None] * index
        key = cast("str", validate_idempotency_key(msg.idempotency_key))  # a str, as it is not None
        out.ikeys.append((out.topic, key, out.window))
    elif out.ikeys is not None:
        out.ikeys.append(None)
    if msg.delay is not None or msg.deliver_at is not None or msg.priority is not None:
        out.timing = _timing(info, msg, out.timing, index)
    elif out.timing is not None:
        out.timing.delays.append(None)
        out.timing.times.append(None)
        out.timing.priorities.append(None)


def _records(call: Prepared, placed: list[Placed | None]) -> list[Record]:
    """The call's Records; Vanished when a message's partition (so its topic) is gone."""
    records = []
    for name, place in zip(call.names, placed, strict=True):
        if place is None:
            raise Vanished(call.topic)
        records.append(Record(call.topic, place[3] or name, place[1], place[2]))
    return records


def _timing(info: TopicInfo, msg: Outgoing, timing: log_sql.Timing | None, index: int) -> log_sql.Timing:
    """`timing` (created for a call's first delayed or prioritized message) with `msg`'s appended."""
    if info.semantics != "queue":
        raise ValidationError(
            f"delay, deliver_at and priority are for queue topics; {info.name!r} is a pubsub topic, whose "
            "groups read a partition in offset order (create the topic with semantics='queue')"
        )
    if msg.delay is not None and msg.deliver_at is not None:
        raise ValidationError("give delay or deliver_at, not both")
    delay = None if msg.delay is None else validate_seconds(msg.delay, "delay", allow_zero=True)
    at = msg.deliver_at
    if at is not None and (not isinstance(at, datetime) or at.tzinfo is None):
        raise ValidationError(
            "deliver_at must be a timezone-aware datetime (e.g. datetime.now(timezone.utc))"
        )
    priority = msg.priority
    if priority is not None:
        validate_int(priority, "priority", -(1 << 31), (1 << 31) - 1)
    if timing is None:
        timing = log_sql.Timing([None] * index, [None] * index, [None] * index)
    timing.delays.append(delay)
    timing.times.append(at)
    timing.priorities.append(priority)
    return timing


def _window(info: TopicInfo) -> float | None:
    return None if info.dedupe_window is None else info.dedupe_window.total_seconds()


def _plain_headers(headers: Any) -> Any:
    """`headers` unchanged if None or a dict; anything else is refused before the trace context is merged
    in (merging would turn a list of pairs into a dict and accept it)."""
    if headers is not None and not isinstance(headers, dict):
        encode_headers(headers)  # raises the ValidationError that says what to pass
    return headers


def _traced(message: Outgoing | Any, trace: dict[str, str]) -> Outgoing:
    """`message` (an Outgoing or a bare payload) carrying the publisher's trace context in its headers."""
    if isinstance(message, Outgoing):
        traced: Outgoing = msgspec.structs.replace(
            message, headers=tracing.with_trace_headers(_plain_headers(message.headers), trace)
        )
        return traced
    return Outgoing(message, headers=dict(trace))


def _is_partition_name(value: str) -> bool:
    try:
        validate_partition(value)
    except ValidationError:
        return False
    return True
