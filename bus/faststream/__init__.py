"""A FastStream broker on the bus: `BusBroker`, and `TestBusBroker` for FastStream's testing pattern.

`@broker.subscriber(topic, group=...)` on a pubsub topic runs a handler-style member of the consumer
group (`Bus.subscribe`: order within a partition, retries with backoff, dead letters); on a queue
topic it runs competing consumers (`Bus.queue_consumer`). FastStream's ack policies map onto the
bus: an ack commits (pubsub) or acks the job (queue); a nack retries the message (the group's
`Retry`, or the queue's nack); a reject moves on without it (pubsub commits past it, a queue job
goes to its dead-letter topic as a last attempt would).

Beside subscribers, what FastStream's other brokers have: `broker.request` (the reply comes back
through the broker's partition of the topic `faststream.replies`), `publish_batch`, `get_one` and
iteration of a subscriber without a handler, the broker-level `BusRouter` with `BusRoute` and
`BusPublisher`, FastStream 0.7's broker arguments (`codec`, `id_generator`, `context`, ...), and
`create_topics=True` for topics made on first use.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
import sys
import typing
import uuid
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AsyncExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

import msgspec
from fast_depends import dependency_provider
from fast_depends.msgspec import MsgSpecSerializer
from fast_depends.pydantic import PydanticSerializer
from faststream._internal.broker import BrokerUsecase
from faststream._internal.broker.registrator import Registrator
from faststream._internal.broker.router import BrokerRouter, SubscriberRoute
from faststream._internal.configs import (
    BrokerConfig,
    PublisherSpecificationConfig,
    PublisherUsecaseConfig,
    SubscriberSpecificationConfig,
    SubscriberUsecaseConfig,
)
from faststream._internal.constants import EMPTY
from faststream._internal.context.repository import ContextRepo
from faststream._internal.di import FastDependsConfig
from faststream._internal.endpoint.publisher import PublisherSpecification, PublisherUsecase
from faststream._internal.endpoint.publisher.fake import FakePublisher
from faststream._internal.endpoint.subscriber import SubscriberSpecification, SubscriberUsecase
from faststream._internal.endpoint.subscriber.call_item import CallsCollection
from faststream._internal.endpoint.subscriber.mixins import TasksMixin
from faststream._internal.logger import DefaultLoggerStorage, make_logger_state
from faststream._internal.logger.logging import get_broker_logger
from faststream._internal.parser import DefaultCodec
from faststream._internal.producer import ProducerProto
from faststream._internal.testing.broker import TestBroker, change_producer
from faststream._internal.utils.functions import return_input
from faststream.exceptions import IncorrectState, SubscriberNotFound
from faststream.message import SourceType, StreamMessage, decode_message, gen_cor_id
from faststream.middlewares import AckPolicy
from faststream.middlewares.logging import CriticalLogMiddleware
from faststream.response import Response, ensure_response
from faststream.response.publish_type import PublishType
from faststream.response.response import BatchPublishCommand, PublishCommand
from faststream.specification.asyncapi.utils import resolve_payloads
from faststream.specification.schema import BrokerSpec, Operation, PublisherSpec, SubscriberSpec
from faststream.specification.schema import Message as SpecMessage

import bus as _bus
from bus.config import Config
from bus.consumer import Retry
from bus.types import Message, Outgoing

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from fast_depends.library.serializer import OptionItem, Serializer
    from faststream._internal.basic_types import LoggerProto, SendableMessage

    from bus.client import Bus
    from bus.consumer import Consumer
    from bus.queues import QueueConsumer

__all__ = [
    "BusBroker",
    "BusMessage",
    "BusPublishCommand",
    "BusPublisher",
    "BusRoute",
    "BusRouter",
    "BusSerializer",
    "BusSubscriber",
    "TestBusBroker",
]

_CORRELATION = "correlation_id"
_CONTENT_TYPE = "content-type"
_REPLY_TO = "reply_to"
_JSON = "application/json"
_JSON_STARTS = (b"{", b"[", b'"')
_json_decode = msgspec.json.Decoder().decode
_TAKE = 10  # jobs a queue subscriber takes at a time
_ACK_AFTER = frozenset({AckPolicy.ACK, AckPolicy.NACK_ON_ERROR, AckPolicy.REJECT_ON_ERROR})
REPLY_TOPIC = "faststream.replies"  # requests' replies: one partition per requesting broker


async def _process_msg(
    msg: Any,
    *,
    middlewares: Iterable[Any],
    parser: Callable[[Any], Any],
    decoder: Callable[[Any], Any],
    source_type: SourceType = SourceType.CONSUME,
) -> Any:
    """FastStream's `process_msg` (a message read outside a handler: a reply, `get_one`), parsing
    the message as the middlewares' `on_receive` left it (a bus Message is frozen: a middleware
    replaces it rather than changing it in place)."""
    if msg is None:
        return None
    async with AsyncExitStack() as stack:
        return_msg: Callable[[Any], Any] = return_input
        for m in middlewares:
            await stack.enter_async_context(m)
            msg = getattr(m, "msg", msg)
            return_msg = functools.partial(m.consume_scope, return_msg)
        parsed = await parser(msg)
        parsed.source_type = source_type
        parsed.set_decoder(decoder)
        return await return_msg(parsed)


def _names_struct(annotation: Any) -> bool:
    """Whether a type annotation is, or contains, a msgspec.Struct."""
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return True
    return any(_names_struct(a) for a in typing.get_args(annotation))


class BusSerializer:
    """The default serializer of a BusBroker: a handler with a `msgspec.Struct` argument (or return
    type) is decoded by msgspec, any other by pydantic as FastStream decodes by default."""

    def __init__(self) -> None:
        self.pydantic = PydanticSerializer(use_fastdepends_errors=False)
        self.msgspec = MsgSpecSerializer(use_fastdepends_errors=False)

    def __call__(self, *, name: str, options: list[OptionItem], response_type: Any) -> Serializer:
        if any(_names_struct(o.field_type) for o in options) or _names_struct(response_type):
            return self.msgspec(name=name, options=options, response_type=response_type)
        return self.pydantic(name=name, options=options, response_type=response_type)

    @staticmethod
    def encode(message: Any) -> bytes:
        if isinstance(message, msgspec.Struct):
            return msgspec.json.encode(message)
        return PydanticSerializer.encode(message)


class _Retried(Exception):
    """A nacked pubsub message: raised to the group's worker so its Retry policy runs."""


# The subscriber whose handler the current task runs (a stop called from a handler, FastStream's
# StopConsume, must not wait for that handler).
_handling: contextvars.ContextVar[BusSubscriber | None] = contextvars.ContextVar(
    "bus_faststream_handling", default=None
)


# -- messages -------------------------------------------------------------------------------


# The queue consumer that leased the message in hand, the list its verdict goes to and the list of
# queue jobs waiting for their ack (set by the subscriber around each message, read by the parser),
# so an ack reaches the consumer that leased it.
_current: contextvars.ContextVar[tuple[QueueConsumer | None, list[str], list[Message] | None] | None] = (
    contextvars.ContextVar("bus_faststream_current", default=None)
)


class BusMessage(StreamMessage[Message]):
    """A bus Message as FastStream sees it; ack/nack/reject decide what the subscriber does next."""

    queue: QueueConsumer | None = None
    verdicts: list[str] | None = None
    acks: list[Message] | None = None

    def _note(self, verdict: str) -> None:
        if self.verdicts is not None:
            self.verdicts.append(verdict)

    async def _settle(self, verdict: str) -> None:
        """Record the verdict once; a queue job is nacked for "nack", acked for "ack" and "reject".

        A queue subscriber's acks wait in `acks` and go out with the other acks of the jobs it took
        together, in one statement, once their handlers are done (see `BusSubscriber._queue_loop`).
        """
        if self.committed is None:
            self._note(verdict)
            if self.queue is not None:
                if verdict == "nack":
                    await self.queue.nack(self.raw_message)
                elif self.acks is not None:
                    self.acks.append(self.raw_message)
                else:
                    await self.queue.ack(self.raw_message)

    async def ack(self) -> None:
        await self._settle("ack")
        await super().ack()

    async def nack(self) -> None:
        await self._settle("nack")
        await super().nack()

    async def reject(self) -> None:
        await self._settle("reject")
        await super().reject()


async def parse_message(msg: Message) -> BusMessage:
    """FastStream's view of a bus Message (headers carry correlation id, content type, reply_to)."""
    headers = dict(msg.headers)
    return _parsed(msg, msg.payload or b"", headers, f"{msg.topic}/{msg.partition}@{msg.offset}")


async def parse_batch(msgs: Sequence[Message]) -> BusMessage:
    """FastStream's view of a batch (FastStream's Kafka batch shape): the bodies in order, each
    message's headers in `batch_headers`, the first message's metadata for the batch."""
    batch_headers = [dict(m.headers) for m in msgs]
    first, last = msgs[0], msgs[-1]
    message_id = (
        f"{first.topic}/{first.partition}@{first.offset}..{last.topic}/{last.partition}@{last.offset}"
    )
    body = [m.payload or b"" for m in msgs]
    # A batch's raw message is the messages in order.
    return _parsed(cast("Message", msgs), body, batch_headers[0], message_id, batch_headers=batch_headers)


def _parsed(raw: Message, body: Any, headers: dict[str, str], message_id: str, **extra: Any) -> BusMessage:
    """The BusMessage of `raw`, with the settling state of the delivery under way (if any)."""
    parsed = BusMessage(
        raw_message=raw,
        body=body,
        headers=headers,
        reply_to=headers.get(_REPLY_TO, ""),
        content_type=headers.get(_CONTENT_TYPE),
        message_id=message_id,
        # A message published without one is its own correlation: its id names it as well as a
        # random one would, without drawing one per message.
        correlation_id=headers.get(_CORRELATION) or message_id,
        **extra,
    )
    current = _current.get()
    if current is not None:
        parsed.queue, parsed.verdicts, parsed.acks = current
    return parsed


def _decode_body(body: bytes, content_type: str | None) -> tuple[Any, str | None]:
    """(the decoded body, its content type): JSON by msgspec, anything else as FastStream decodes it."""
    if content_type is None and body[:1] in _JSON_STARTS:
        content_type = _JSON
    if content_type is not None and content_type.startswith(_JSON):
        try:
            return _json_decode(body), content_type
        except msgspec.DecodeError:
            pass
    return decode_message(cast("StreamMessage[Any]", _Body(body, content_type))), content_type


@dataclass(frozen=True)
class _Body:
    """What FastStream's `decode_message` reads of a message: its body and content type."""

    body: bytes
    content_type: str | None


async def decode(msg: StreamMessage[Any]) -> Any:
    """The body decoded by its content type (JSON when the bus stored a structure).

    JSON is decoded by msgspec (the bus's own codec, several times faster than the standard
    library's); a body it refuses (NaN, numbers beyond a double) goes to FastStream's decoder,
    which decides as it always does.
    """
    decoded, msg.content_type = _decode_body(msg.body, msg.content_type)
    return decoded


async def decode_batch(msg: StreamMessage[Any]) -> Any:
    """Each body of a batch decoded by its own content type, in order."""
    types = [h.get(_CONTENT_TYPE) for h in msg.batch_headers] or [msg.content_type] * len(msg.body)
    return [_decode_body(body, ct)[0] for body, ct in zip(msg.body, types, strict=True)]


# -- publishing -----------------------------------------------------------------------------


class BusPublishCommand(BatchPublishCommand):
    """A publish to a bus topic: FastStream's command with the bus's key, partition and idempotency key."""

    def __init__(
        self,
        message: SendableMessage,
        /,
        *messages: SendableMessage,
        topic: str = "",
        key: str | None = None,
        partition: str | int | None = None,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        headers: dict[str, Any] | None = None,
        reply_to: str = "",
        timeout: float | None = 30.0,
        _publish_type: PublishType,
    ) -> None:
        super().__init__(
            message,
            *messages,
            destination=topic,
            correlation_id=correlation_id,
            headers=headers,
            reply_to=reply_to,
            _publish_type=_publish_type,
        )
        self.key = key
        self.partition = partition
        self.idempotency_key = idempotency_key
        self.timeout = timeout

    @classmethod
    def from_cmd(cls, cmd: PublishCommand, *, batch: bool = False) -> BusPublishCommand:
        if isinstance(cmd, BusPublishCommand):
            return cmd
        body, extra = cls._parse_bodies(cmd.body, batch=batch)
        return cls(
            body,
            *extra,
            topic=cmd.destination,
            correlation_id=cmd.correlation_id,
            headers=cmd.headers,
            reply_to=cmd.reply_to,
            _publish_type=cmd.publish_type,
        )


async def _wire(
    cmd: BusPublishCommand, codec: Any, serializer: Any, body: Any = EMPTY, encoded: Any = None
) -> tuple[bytes, dict[str, str]]:
    body = cmd.body if body is EMPTY else body
    if encoded is not None:
        payload, content_type = encoded
    elif isinstance(body, msgspec.Struct) and type(codec) is DefaultCodec:
        # the bus's own payloads, whatever the broker's serializer
        payload, content_type = msgspec.json.encode(body), "application/json"
    else:
        payload, content_type = await codec.encode(body, serializer)
    headers = {str(k): str(v) for k, v in (cmd.headers or {}).items()}
    if content_type:
        headers[_CONTENT_TYPE] = content_type
    if cmd.correlation_id:
        headers[_CORRELATION] = cmd.correlation_id
    if cmd.reply_to:
        headers[_REPLY_TO] = cmd.reply_to
    return bytes(payload), headers


class BusProducer(ProducerProto[BusPublishCommand]):
    """Publishes FastStream commands with `Bus.publish`; requests wait for their reply on `REPLY_TOPIC`."""

    def __init__(self, *, create_topics: bool = False) -> None:
        self.bus: Bus | None = None
        self.serializer: Any = None
        self.codec: Any = DefaultCodec()
        self.create_topics = create_topics
        self._parser = parse_message
        self._decoder = decode
        self._replies: _Replies | None = None

    def connect(self, connection: Bus, serializer: Any, codec: Any = None) -> None:
        self.bus = connection
        self.serializer = serializer
        self.codec = codec or DefaultCodec()

    def disconnect(self) -> None:
        self.bus = None

    async def close(self) -> None:
        """Stop waiting for replies (the broker's stop)."""
        if self._replies is not None:
            replies, self._replies = self._replies, None
            await replies.close()

    def _connection(self) -> Bus:
        if self.bus is None:
            raise IncorrectState(
                "BusBroker is not connected: `await broker.connect()` or `async with broker`"
            )
        return self.bus

    async def _on_topic(self, topic: str, publish: Callable[[], Any]) -> Any:
        """`publish()`; with `create_topics`, a missing topic is created (pubsub, 1 partition) first."""
        try:
            return await publish()
        except _bus.TopicNotFoundError:
            if not self.create_topics:
                raise
        await _ensure_topic(self._connection(), topic, 1)
        return await publish()

    async def publish(self, cmd: BusPublishCommand) -> Any:
        connection = self._connection()
        cmd = BusPublishCommand.from_cmd(cmd)
        payload, headers = await _wire(cmd, self.codec, self.serializer)
        topic, partition = _destination(cmd.destination, cmd.partition)
        return await self._on_topic(
            topic,
            lambda: connection.publish(
                topic,
                payload,
                key=cmd.key,
                partition=partition,
                headers=headers,
                idempotency_key=cmd.idempotency_key,
            ),
        )

    async def publish_batch(self, cmd: BusPublishCommand) -> Any:
        connection = self._connection()
        cmd = BusPublishCommand.from_cmd(cmd)
        out = [
            Outgoing(
                payload,
                key=cmd.key,
                partition=None if cmd.partition is None else str(cmd.partition),
                headers=headers,
            )
            for payload, headers in await _wire_batch(cmd, self.codec, self.serializer)
        ]
        return await self._on_topic(cmd.destination, lambda: connection.publish_many(cmd.destination, out))

    async def request(self, cmd: BusPublishCommand) -> Any:
        connection = self._connection()
        if self._replies is None:
            self._replies = _Replies(connection)
        replies = self._replies
        cmd = BusPublishCommand.from_cmd(cmd)
        cmd.correlation_id = cmd.correlation_id or gen_cor_id()
        waiter = await replies.expect(cmd.correlation_id)
        try:
            cmd.reply_to = replies.reply_to
            async with asyncio.timeout(cmd.timeout):
                await self.publish(cmd)
                return await waiter
        finally:
            replies.forget(cmd.correlation_id)


def _destination(destination: str, partition: str | int | None) -> tuple[str, str | int | None]:
    """(topic, partition) of a destination: a reply address is "topic/partition"."""
    if "/" in destination:
        topic, _, name = destination.partition("/")
        return topic, name
    return destination, partition


async def _ensure_topic(connection: Bus, topic: str, partitions: int | None) -> None:
    """Create `topic` (pubsub) if it is missing; one made meanwhile by anyone else is kept as it is."""
    try:
        await connection.create_topic(topic, partitions=partitions)
    except _bus.TopicConflictError:
        pass


async def _wire_batch(
    cmd: BusPublishCommand, codec: Any, serializer: Any
) -> list[tuple[bytes, dict[str, str]]]:
    """Each body of a batch publish encoded (`encode_batch` of a batch codec, else one by one)."""
    bodies = list(cmd.batch_bodies)
    encode_batch = getattr(codec, "encode_batch", None)
    encoded: list[Any] = (
        list(await encode_batch(bodies, serializer)) if encode_batch is not None else [None] * len(bodies)
    )
    return [await _wire(cmd, codec, serializer, body, e) for body, e in zip(bodies, encoded, strict=True)]


class _Replies:
    """The replies to a broker's requests: one partition of `REPLY_TOPIC`, read from its start.

    A responder publishes its reply to the partition named in the request's `reply_to`
    ("faststream.replies/<partition>"); a reader task reads the partition whenever the bus's
    wake-up for it comes (LISTEN on a connection of the Bus's pool; through a transaction pooler,
    every `poll_interval`), and hands each reply to the request waiting for its correlation id (a
    reply nobody waits for any more is dropped). The topic keeps replies for an hour.
    """

    def __init__(self, connection: Bus) -> None:
        self.connection = connection
        self.partition = uuid.uuid4().hex
        self.reply_to = f"{REPLY_TOPIC}/{self.partition}"
        self._waiting: dict[str, asyncio.Future[Message]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._started = asyncio.Lock()
        self._wake = asyncio.Event()
        self._listening: Any = None  # the pool connection LISTENing for the partition's wake-ups
        self._pid = ""

    async def expect(self, correlation_id: str) -> asyncio.Future[Message]:
        async with self._started:
            if self._reader is None:
                await self._start()
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[correlation_id] = waiter
        self._wake.set()
        return waiter

    async def _start(self) -> None:
        connection = self.connection
        try:
            info = await connection.topic(REPLY_TOPIC)
        except _bus.TopicNotFoundError:
            with suppress(_bus.TopicConflictError):
                await connection.create_topic(REPLY_TOPIC, partitions=None, retention=3600.0)
            info = await connection.topic(REPLY_TOPIC)
        if not info.dynamic:
            raise _bus.ValidationError(
                f"topic {REPLY_TOPIC!r} must have dynamic partitions (partitions=None) to carry replies"
            )
        self._pid = str(await connection.partition_id(info, self.partition, create=True))
        if connection.config.pooler != "transaction":
            listening = await connection.pool.acquire()
            await listening.add_listener(connection.channels.messages, self._heard)
            self._listening = listening
        self._reader = asyncio.create_task(self._read())

    def _heard(self, _conn: Any, _pid: int, _channel: str, payload: object) -> None:
        if payload == self._pid:
            self._wake.set()

    def forget(self, correlation_id: str) -> None:
        self._waiting.pop(correlation_id, None)

    async def _read(self) -> None:
        offset = 0
        fallback = (
            self.connection.config.fallback_poll if self._listening else self.connection.config.poll_interval
        )
        while True:
            self._wake.clear()
            try:
                got = await self.connection.read(REPLY_TOPIC, self.partition, offset)
            except _bus.BusError:
                got = []
            for msg in got:
                offset = msg.offset + 1
                waiter = self._waiting.pop(msg.headers.get(_CORRELATION, ""), None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)
            if not got:
                with suppress(TimeoutError):
                    async with asyncio.timeout(fallback if self._waiting else None):
                        await self._wake.wait()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with suppress(asyncio.CancelledError):
                await self._reader
        if self._listening is not None:
            listening, self._listening = self._listening, None
            with suppress(Exception):
                await listening.remove_listener(self.connection.channels.messages, self._heard)
                await self.connection.pool.release(listening)
        for waiter in self._waiting.values():
            waiter.cancel()


# -- configs --------------------------------------------------------------------------------


class _LoggerStorage(DefaultLoggerStorage):
    def __init__(self) -> None:
        super().__init__()
        self.logger_log_level = logging.INFO

    def set_level(self, level: int) -> None:
        self.logger_log_level = level

    def register_subscriber(self, params: dict[str, Any]) -> None:
        return None

    def get_logger(self, *, context: Any) -> LoggerProto:
        if not (lg := self._get_logger_ref()):
            lg = get_broker_logger(  # FastStream's own access log format
                name="bus",
                default_context={"topic": "", "group": ""},
                message_id_ln=10,
                fmt="%(asctime)s %(levelname)-8s - %(topic)s | %(group)s | %(message_id)-10s - %(message)s",
                context=context,
                log_level=self.logger_log_level,
            )
            self._logger_ref.add(lg)
        return lg


@dataclass(kw_only=True)
class BusBrokerConfig(BrokerConfig):
    producer: BusProducer = field(default_factory=BusProducer)
    bus: Bus | None = None
    create_topics: bool = False

    @property
    def connection(self) -> Bus:
        if self.bus is None:
            raise IncorrectState(
                "BusBroker is not connected: `await broker.connect()` or `async with broker`"
            )
        return self.bus


@dataclass(kw_only=True)
class BusSubscriberConfig(SubscriberUsecaseConfig):
    _outer_config: BusBrokerConfig = field(default_factory=BusBrokerConfig)
    topic: str
    group: str | None
    retry: Retry | None
    dead_letter: str | None
    start: Any
    visibility_timeout: float
    batch: bool = False
    max_records: int = 500
    partitions: int | None = None

    @property
    def ack_policy(self) -> AckPolicy:
        if self._ack_policy is EMPTY:
            if self._outer_config.ack_policy is not EMPTY:
                return self._outer_config.ack_policy
            return AckPolicy.NACK_ON_ERROR
        return self._ack_policy


@dataclass(kw_only=True)
class BusSubscriberSpecificationConfig(SubscriberSpecificationConfig):
    topic: str
    group: str | None


@dataclass(kw_only=True)
class BusPublisherConfig(PublisherUsecaseConfig):
    _outer_config: BusBrokerConfig = field(default_factory=BusBrokerConfig)
    topic: str
    key: str | None
    headers: dict[str, str] | None


@dataclass(kw_only=True)
class BusPublisherSpecificationConfig(PublisherSpecificationConfig):
    topic: str


# -- subscriber -----------------------------------------------------------------------------


class BusSubscriberSpecification(SubscriberSpecification[BusBrokerConfig, BusSubscriberSpecificationConfig]):
    @property
    def channel_labels(self) -> list[str]:
        return [f"{self._outer_config.prefix}{self.config.topic}"]

    @property
    def name(self) -> str:
        if self.config.title_:
            return self.config.title_
        group = f":{self.config.group}" if self.config.group else ""
        return f"{self._outer_config.prefix}{self.config.topic}{group}:{self.call_name}"

    def get_schema(self) -> dict[str, SubscriberSpec]:
        payloads = self.get_payloads()
        return {
            self.name: SubscriberSpec(
                address=f"{self._outer_config.prefix}{self.config.topic}",
                description=self.description,
                operation=Operation(
                    message=SpecMessage(title=f"{self.name}:Message", payload=resolve_payloads(payloads)),
                    bindings=None,
                ),
                bindings=None,
            )
        }


class BusSubscriber(TasksMixin, SubscriberUsecase[Message]):
    """One `@broker.subscriber`: a group member on a pubsub topic, competing consumers on a queue topic."""

    _outer_config: BusBrokerConfig

    def __init__(
        self,
        config: BusSubscriberConfig,
        specification: BusSubscriberSpecification,
        calls: CallsCollection[Message],
    ) -> None:
        config.parser = parse_batch if config.batch else parse_message
        config.decoder = decode_batch if config.batch else decode
        super().__init__(config, specification, calls)
        self._topic = config.topic
        self.group = config.group
        self._retry = config.retry
        self._dead_letter = config.dead_letter
        self._start = config.start
        self._visibility = config.visibility_timeout
        self.batch = config.batch
        self._max_records = config.max_records
        self._partitions = config.partitions
        self._consumer: Consumer | None = None
        self._subscription: Any = None
        self._queue: QueueConsumer | None = None
        self._acks: list[Message] = []  # queue jobs handled, their acks not written yet
        self._pipeline_key: Any = None
        self._stopping: asyncio.Future[None] | None = None
        self._abandoned = False  # stopped past graceful_timeout, or from a handler: give back the rest
        self._scopes: set[asyncio.Timeout] = set()  # the group's handlers under way
        self._pipeline_built: tuple[tuple[Any, ...], tuple[tuple[str, Any], ...]] = ((), ())

    @property
    def topic(self) -> str:
        return f"{self._outer_config.prefix}{self._topic}"

    def get_log_context(self, message: StreamMessage[Message] | None) -> dict[str, str]:
        return {
            "topic": self.topic,
            "group": self.group or "",
            "message_id": getattr(message, "message_id", ""),
        }

    def _make_response_publisher(self, message: StreamMessage[Any]) -> Sequence[Any]:
        return (_ReplyPublisher(self._outer_config.producer, message.reply_to),)

    # -- the per-message pipeline --------------------------------------------------------------
    #
    # FastStream's `SubscriberUsecase.process_message`, step for step: the subscriber's lock and
    # context scope, the middlewares entered in order and left in reverse (an error one of them
    # handles goes no further out), the first suitable call, its result published to the reply
    # topic and the handler's publishers. What stays the same from one message to the next (the
    # middleware factories, the scope's items) is built once, the middlewares nest as `async with`
    # blocks instead of an AsyncExitStack, the message's scope is left without an ExitStack, and a
    # broker without a logger (`logger=None`) leaves out FastStream's error-logging middleware,
    # which would only log to nothing. Each of these is work FastStream's own does per message, on
    # top of calling the handler, where `subscribe` pays the handler call alone.

    def _pipeline(self) -> tuple[tuple[Any, ...], tuple[tuple[str, Any], ...]]:
        """(middleware factories, context scope items), built again only if the broker's changed."""
        config = self._outer_config
        logger = config.logger.logger.logger
        key = (config.broker_middlewares, self.ack_policy, logger)
        if self._pipeline_key != key:
            self._pipeline_key = key
            factories = tuple(self._SubscriberUsecase__build__middlewares_stack())  # type: ignore[attr-defined]
            if logger is None:
                factories = tuple(f for f in factories if not isinstance(f, CriticalLogMiddleware))
            self._pipeline_built = (
                factories,
                (("handler_", self), ("logger", logger), *config.extra_context.items()),
            )
        return self._pipeline_built

    async def process_message(self, msg: Message) -> Response:
        context = self._outer_config.context
        factories, scope = self._pipeline()
        message_scope: list[Any] = []  # the message's own context scope, once a call took it
        with self.lock, context.scopes(scope):
            try:
                return await self._enter(msg, context, factories, 0, [], message_scope)
            finally:
                for entered in message_scope:
                    entered.__exit__(None, None, None)

    async def _enter(
        self,
        msg: Message,
        context: ContextRepo,
        factories: tuple[Any, ...],
        index: int,
        middlewares: list[Any],
        message_scope: list[Any],
    ) -> Response:
        if index == len(factories):
            return await self._call(msg, context, middlewares, message_scope)
        middleware = factories[index](msg, context=context)
        middlewares.append(middleware)
        async with middleware:
            # A middleware's `on_receive` may replace the message it was given (`self.msg =
            # msgspec.structs.replace(self.msg, ...)`: a bus Message is frozen); the next sees that.
            msg = getattr(middleware, "msg", msg)
            return await self._enter(msg, context, factories, index + 1, middlewares, message_scope)
        return ensure_response(None)  # the error was handled by a middleware

    async def _call(
        self, msg: Message, context: ContextRepo, middlewares: list[Any], message_scope: list[Any]
    ) -> Response:
        cache: dict[Any, Any] = {}
        for h in self.calls:
            message = await h.is_suitable(msg, cache)  # a parsing error goes out through the middlewares
            if message is None:
                continue
            entered = context.scopes((("log_context", self.get_log_context(message)), ("message", message)))
            entered.__enter__()
            message_scope.append(entered)
            result = ensure_response(
                await h.call(message=message, _extra_middlewares=(m.consume_scope for m in middlewares[::-1]))
            )
            if not result.correlation_id:
                result.correlation_id = message.correlation_id
            replies = () if not message.reply_to or self._no_reply else self._make_response_publisher(message)
            for p in (*replies, *h.handler._publishers):
                await p._publish(
                    result.as_publish_command(),
                    _extra_middlewares=(m.publish_scope for m in middlewares[::-1]),
                )
            return result
        raise SubscriberNotFound(f"There is no suitable handler for {msg=}")

    async def start(self) -> None:
        self._stopping = None
        self._abandoned = False
        await super().start()
        connection = self._outer_config.connection
        if isinstance(connection, _InMemoryBus):
            connection.check(self)  # refuses what the database would
            self._post_start()  # TestBusBroker: publishes are routed to the subscriber in memory
            return
        info = await self._topic_info(connection)
        if info.semantics == "queue" and self.batch:
            raise _bus.ValidationError(
                f"batch=True reads a pubsub topic; {self.topic!r} is a queue: "
                "subscribe without batch (each job is acked on its own)"
            )
        if info.semantics == "queue":
            self._queue = connection.queue_consumer(
                self.topic,
                visibility_timeout=self._visibility,
                max_attempts=(self._retry or Retry()).max_attempts,
                dead_letter=self._dead_letter,
            )
            await self._queue.start()
            if self.calls:
                self.add_task(self._queue_loop)
            self._post_start()
            return
        if self.group is None:
            raise _bus.ValidationError(
                f"subscriber on pubsub topic {self.topic!r} needs group=...: each group reads every message once"
            )
        if self.batch or not self.calls:  # a batch subscriber, or one read by get_one and iteration
            self._consumer = connection.consumer(
                self.group,
                topics=[self.topic],
                start=self._start,
                auto_commit=False,
                max_poll_records=self._max_records if self.batch else 1,
            )
            await self._consumer.start()
            if self.calls:
                self.add_task(self._batch_loop)
            self._post_start()
            return
        self._subscription = await connection.subscribe(
            self.group,
            self._handle,
            topics=[self.topic],
            start=self._start,
            retry=self._retry,
            dead_letter=self._dead_letter,
        )
        self._post_start()

    async def _topic_info(self, connection: Bus) -> Any:
        """The topic's info; with `create_topics` a missing topic is created (pubsub)."""
        try:
            return await connection.topic(self.topic)
        except _bus.TopicNotFoundError:
            if not self._outer_config.create_topics:
                raise
        await _ensure_topic(connection, self.topic, self._partitions or 1)
        return await connection.topic(self.topic)

    # -- get_one and iteration: a subscriber without a handler -----------------------------------

    async def get_one(self, *, timeout: float = 5.0) -> BusMessage | None:  # noqa: ASYNC109 - FastStream's signature
        """The next message (None after `timeout` seconds), acknowledged as it is handed out.

        A pubsub subscriber's group commits past it; a queue subscriber acks the job.
        """
        assert not self.calls, "You can't use `get_one` method if subscriber has registered handlers."
        raw = await self._take_one(timeout)
        if raw is None:
            return None
        return await self._parsed_one(raw)

    async def __aiter__(self) -> AsyncIterator[BusMessage]:
        assert not self.calls, "You can't use iterator if subscriber has registered handlers."
        while True:
            raw = await self._take_one(5.0)
            if raw is not None:
                yield await self._parsed_one(raw)

    async def _take_one(self, timeout: float) -> Message | None:  # noqa: ASYNC109
        connection = self._outer_config.connection
        if isinstance(connection, _InMemoryBus):
            return await connection.take(self, timeout)
        if self._queue is not None:
            taken = await self._queue.take(max_messages=1, timeout=timeout)
            if taken:
                await self._queue.ack(taken[0])
            return taken[0] if taken else None
        if self._consumer is None:
            raise IncorrectState(f"subscriber on {self.topic!r} is not started: `await broker.start()`")
        got = await self._consumer.poll(timeout=timeout, max_records=1)
        if not got:
            return None
        await self._consumer.commit()
        return got[0]

    async def _parsed_one(self, raw: Message) -> BusMessage:
        context = self._outer_config.context
        parser, decoder = self._get_parser_and_decoder()
        msg: BusMessage = await _process_msg(
            msg=raw,
            middlewares=(m(raw, context=context) for m in self._broker_middlewares),
            parser=parser,
            decoder=decoder,
        )
        return msg

    async def stop(self) -> None:
        """Stop consuming; waits up to the broker's `graceful_timeout` for the handlers under way.

        Called from a handler (FastStream's `StopConsume`), it returns at once: the subscriber stops
        once that handler has returned, and nothing after it is handed to a handler or committed.
        """
        if self._stopping is None:
            self._abandoned = self._abandoned or _handling.get() is self
            self._stopping = asyncio.ensure_future(self._stop())
        if _handling.get() is self:
            return
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        # A group member stops as `Subscription.stop` does: its workers hand the rest of what they
        # fetched to the handler, commit what it handled and release their partitions. The subscriber
        # is marked stopped only then: a message FastStream skipped as "not running" would count as
        # handled, and be committed unseen. After `graceful_timeout` the handlers still running are
        # cancelled (FastStream neither acks nor nacks a cancelled message) and what the workers
        # still hold is given back uncommitted: the group's next member gets it.
        if self._subscription is not None:
            stopping = asyncio.ensure_future(self._subscription.stop())
            timeout = self._outer_config.graceful_timeout
            if not self._abandoned and timeout:
                await asyncio.wait({stopping}, timeout=timeout)
            if not stopping.done():
                self._abandon()
            with suppress(Exception):
                await stopping
            self._subscription = None
        # Waits for the message (or batch) in hand, handled and committed or acked, then ends the loops.
        await super().stop()
        if self._consumer is not None:
            with suppress(Exception):
                await self._consumer.close()
            self._consumer = None
        if self._queue is not None:
            await self._write_acks(self._queue)  # handled before the stop: acked, not given back
            with suppress(Exception):
                await self._queue.close()
            self._queue = None

    def _abandon(self) -> None:
        """Give back what the group's workers hold: cancel the handlers, hand nothing more to one.

        A message given back raises in the worker as a nack would; its retries are made unlimited
        first, so it is neither dead-lettered nor stops its partition: the worker stops with it
        uncommitted.
        """
        self._abandoned = True
        if self._subscription is not None:
            handoff = self._subscription._h
            handoff.retry = dataclasses.replace(handoff.retry, max_attempts=sys.maxsize)
        now = asyncio.get_running_loop().time()
        for scope in list(self._scopes):
            scope.reschedule(now)

    async def _handle(self, raw: Message) -> None:
        """The group worker's handler: a nacked message raises so the group's Retry runs."""
        if self._abandoned:
            raise _Retried(f"{raw.topic}/{raw.partition}@{raw.offset} given back: the subscriber stopped")
        token = _handling.set(self)
        scope = asyncio.timeout(None)  # cancelled by a stop once graceful_timeout has passed
        self._scopes.add(scope)
        try:
            async with scope:
                verdict = await self._run(raw, None)
        except TimeoutError:
            if not scope.expired():
                raise
            raise _Retried(
                f"{raw.topic}/{raw.partition}@{raw.offset} cancelled: the subscriber stopped"
            ) from None
        finally:
            self._scopes.discard(scope)
            _handling.reset(token)
        if verdict == "nack" or self._abandoned:
            raise _Retried(f"{raw.topic}/{raw.partition}@{raw.offset} nacked by its handler")

    async def _batch_loop(self) -> None:
        """`batch=True`: poll a batch, hand it to the pipeline once, commit it after the handler.

        A nacked batch is rewound and comes again (with what joined it since) after the Retry's
        backoff; after its last attempt it goes to the dead-letter topic and is committed, or,
        without one, the subscriber stops there with nothing committed past it (as a group's
        partition does).
        """
        consumer = self._consumer
        assert consumer is not None
        policy = (self._retry or Retry()).policy()
        failed: dict[tuple[str, str, int], int] = {}  # the attempts of a nacked batch's messages
        while self.running:
            batch = await consumer.poll(timeout=1.0)
            if not batch or not self.running:
                continue
            attempt = 1 + max(failed.get((m.topic, m.partition, m.offset), 0) for m in batch) if failed else 1
            with self.lock:  # a stop waits for the batch in hand: handled, then committed or rewound
                nacked = await self._run(batch, None) == "nack"
                if nacked and attempt < policy.max_attempts:
                    failed = {(m.topic, m.partition, m.offset): attempt for m in batch}
                    await consumer.rewind()
                else:
                    if nacked and not await self._dead_letter_batch(batch, attempt):
                        self._outer_config.logger.log(
                            f"{self.topic} group {self.group}: a batch from {batch[0].partition}@"
                            f"{batch[0].offset} was nacked {attempt} times and there is no dead_letter "
                            "topic; stopped before it",
                            logging.CRITICAL,
                        )
                        return
                    failed = {}
                    try:
                        await consumer.commit()
                    except _bus.StaleGenerationError:
                        await consumer.rewind()  # partitions moved: their new owner reads from the commit
                    continue
            await asyncio.sleep(policy.delay(attempt))

    async def _dead_letter_batch(self, batch: Sequence[Message], attempts: int) -> bool:
        """Publish every message of a batch to the dead-letter topic (created if missing), as a group does."""
        if self._dead_letter is None:
            return False
        connection = self._outer_config.connection
        try:
            info = await connection.topic(self._dead_letter)
        except _bus.TopicNotFoundError:
            await connection.create_topic(self._dead_letter, partitions=None)
            info = await connection.topic(self._dead_letter)
        error = f"batch nacked by its handler ({attempts} attempts)"
        await connection.publish_many(
            self._dead_letter,
            [
                Outgoing(
                    m.payload if m.payload is not None else b"",
                    key=m.key,
                    partition=m.partition if info.dynamic else None,
                    headers={
                        **m.headers,
                        "bus.error": error,
                        "bus.attempts": str(attempts),
                        "bus.source.topic": m.topic,
                        "bus.source.partition": m.partition,
                        "bus.source.offset": str(m.offset),
                        "bus.group": self.group or "",
                    },
                )
                for m in batch
            ],
        )
        return True

    async def _queue_loop(self) -> None:
        """Take jobs, hand each to the pipeline in turn, then ack the handled ones in one statement.

        An ack is written after its handler returned, as the bus's own `ack_many` does for a batch: a
        crash before it gives the jobs back after their visibility timeout (at-least-once). The acks
        go out before the next take, and sooner when the jobs in hand have held their lease for a
        quarter of the visibility timeout, so a slow handler never lets a finished job's lease run out.
        """
        queue = self._queue
        assert queue is not None
        loop = asyncio.get_running_loop()
        while self.running:
            taken = await queue.take(max_messages=_TAKE, timeout=1.0)
            due = loop.time() + self._visibility / 4
            for raw in taken:
                await self._run(raw, queue)
                if self._acks and loop.time() >= due:
                    await self._write_acks(queue)
            await self._write_acks(queue)

    async def _write_acks(self, queue: QueueConsumer) -> None:
        """Ack the handled jobs in one statement; a failed ack is logged as FastStream logs one."""
        if not self._acks:
            return
        acks = list(self._acks)
        self._acks.clear()
        try:
            await queue.ack_many(acks)
        except Exception as exc:  # a lease lost meanwhile: the job comes again, as after any lost ack
            self._outer_config.logger.log(repr(exc), logging.CRITICAL, exc_info=exc)

    async def _run(self, raw: Any, queue: QueueConsumer | None) -> str:
        verdicts: list[str] = []
        # Acks wait for the take's statement only when the ack policy writes them after the handler;
        # ACK_FIRST and MANUAL acks are written when they are made.
        deferred = queue is not None and self.ack_policy in _ACK_AFTER
        _current.set((queue, verdicts, self._acks if deferred else None))
        await self.consume(raw)
        return verdicts[-1] if verdicts else "ack"


class _ReplyPublisher(FakePublisher):
    def __init__(self, producer: Any, topic: str) -> None:
        super().__init__(producer=producer)
        self.topic = topic

    def patch_command(self, cmd: Any) -> BusPublishCommand:
        cmd = super().patch_command(cmd)
        real = BusPublishCommand.from_cmd(cmd)
        real.destination = self.topic
        return real


# -- publisher ------------------------------------------------------------------------------


class BusPublisherSpecification(PublisherSpecification[BusBrokerConfig, BusPublisherSpecificationConfig]):
    @property
    def name(self) -> str:
        return self.config.title_ or f"{self._outer_config.prefix}{self.config.topic}:Publisher"

    def get_schema(self) -> dict[str, PublisherSpec]:
        payloads = self.get_payloads()
        return {
            self.name: PublisherSpec(
                address=f"{self._outer_config.prefix}{self.config.topic}",
                description=self.config.description_,
                operation=Operation(
                    message=SpecMessage(
                        title=f"{self.name}:Message", payload=resolve_payloads(payloads, "Publisher")
                    ),
                    bindings=None,
                ),
                bindings=None,
            )
        }


class BusPublisher(PublisherUsecase):
    """`@broker.publisher(topic)`: publishes what the handler returns, or `await pub.publish(...)`."""

    _outer_config: BusBrokerConfig

    def __init__(
        self,
        config: BusPublisherConfig | str,
        specification: BusPublisherSpecification | None = None,
        **kwargs: Any,
    ) -> None:
        """A broker's publisher; `BusPublisher(topic, key=..., ...)` is one for a `BusRoute`.

        As FastStream's routes take their publishers (`RedisPublisher` for a `RedisRoute`), a
        `BusPublisher` built from a topic and `BusRegistrator.publisher`'s keyword arguments is
        registered with its route's subscriber when a `BusRouter` takes the route.
        """
        if isinstance(config, str):
            self.args: tuple[Any, ...] = (config,)
            self.kwargs: dict[str, Any] = kwargs
            return
        assert specification is not None
        super().__init__(config, cast("PublisherSpecification[Any, Any]", specification))
        self._topic = config.topic
        self.key = config.key
        self.headers = config.headers or {}

    @property
    def topic(self) -> str:
        return f"{self._outer_config.prefix}{self._topic}"

    async def publish(
        self,
        message: SendableMessage,
        topic: str = "",
        *,
        key: str | None = None,
        partition: str | int | None = None,
        headers: dict[str, str] | None = None,
        correlation_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> Any:
        cmd = BusPublishCommand(
            message,
            topic=topic or self.topic,
            key=key or self.key,
            partition=partition,
            headers=self.headers | (headers or {}),
            correlation_id=correlation_id or self._outer_config.id_generator(),
            idempotency_key=idempotency_key,
            _publish_type=PublishType.PUBLISH,
        )
        return await self._basic_publish(cmd, producer=self._outer_config.producer, _extra_middlewares=())

    async def _publish(self, cmd: PublishCommand, *, _extra_middlewares: Iterable[Any]) -> None:
        real = BusPublishCommand.from_cmd(cmd)
        real.destination = real.destination or self.topic
        real.key = real.key or self.key
        real.add_headers(self.headers, override=False)
        await self._basic_publish(
            real, producer=self._outer_config.producer, _extra_middlewares=_extra_middlewares
        )

    async def request(
        self,
        message: SendableMessage = None,
        topic: str = "",
        *,
        key: str | None = None,
        partition: str | int | None = None,
        headers: dict[str, str] | None = None,
        correlation_id: str | None = None,
        timeout: float | None = 30.0,  # noqa: ASYNC109 - FastStream's signature
    ) -> BusMessage:
        """Publish to the publisher's topic and wait for the reply (see `BusBroker.request`)."""
        cmd = BusPublishCommand(
            message,
            topic=topic or self.topic,
            key=key or self.key,
            partition=partition,
            headers=self.headers | (headers or {}),
            correlation_id=correlation_id or self._outer_config.id_generator(),
            timeout=timeout,
            _publish_type=PublishType.REQUEST,
        )
        request: Any = self._outer_config.producer.request
        for pub_m in self._build_middlewares_stack():
            request = functools.partial(pub_m, request)
        published = await request(cmd)
        context = self._outer_config.context
        reply: BusMessage = await _process_msg(
            msg=published,
            middlewares=(
                m(published, context=context) for m in reversed(self._outer_config.broker_middlewares)
            ),
            parser=self._outer_config.producer._parser,
            decoder=self._outer_config.producer._decoder,
            source_type=SourceType.RESPONSE,
        )
        return reply


# -- registrator and broker -----------------------------------------------------------------


class BusRegistrator(Registrator[Message, BusBrokerConfig]):
    """`subscriber` and `publisher` of a BusBroker (and of its routers)."""

    def subscriber(  # type: ignore[override]
        self,
        topic: str,
        *,
        group: str | None = None,
        start: Any = None,
        retry: Retry | None = None,
        dead_letter: str | None = None,
        visibility_timeout: float = 30.0,
        batch: bool = False,
        max_records: int = 500,
        partitions: int | None = None,
        ack_policy: AckPolicy = EMPTY,
        no_reply: bool = False,
        dependencies: Sequence[Any] = (),
        parser: Any = None,
        decoder: Any = None,
        codec: Any = None,
        persistent: bool = True,
        title: str | None = None,
        description: str | None = None,
        include_in_schema: bool = True,
    ) -> BusSubscriber:
        """Handle `topic`: as consumer group `group` on a pubsub topic, as a competing consumer on a queue.

        `batch=True` (pubsub): the handler takes a list, up to `max_records` messages at a time.
        `partitions=`: the partitions of the topic `BusBroker(create_topics=True)` creates if missing.
        A subscriber without a handler is read with `await sub.get_one()` and `async for msg in sub`.
        """
        if partitions is not None and (
            isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1
        ):
            raise _bus.ValidationError(f"partitions must be a positive int, not {partitions!r}")
        if not isinstance(batch, bool):
            raise _bus.ValidationError(f"batch must be True or False, not {batch!r}")
        if batch and (
            isinstance(max_records, bool)
            or not isinstance(max_records, int)
            or not 1 <= max_records <= 10_000
        ):
            raise _bus.ValidationError(f"max_records must be an int from 1 to 10000, not {max_records!r}")
        config = cast("BusBrokerConfig", self.config)
        calls = CallsCollection[Message]()
        spec = BusSubscriberSpecification(
            config,
            BusSubscriberSpecificationConfig(
                topic=topic,
                group=group,
                title_=title,
                description_=description,
                include_in_schema=include_in_schema,
            ),
            calls,
        )
        sub = BusSubscriber(
            BusSubscriberConfig(
                topic=topic,
                group=group,
                retry=retry,
                dead_letter=dead_letter,
                start=start,
                visibility_timeout=visibility_timeout,
                batch=batch,
                max_records=max_records,
                partitions=partitions,
                no_reply=no_reply,
                _outer_config=config,
                _ack_policy=ack_policy,
            ),
            spec,
            calls,
        )
        super().subscriber(sub, persistent=persistent)
        return sub.add_call(
            parser_=parser or self._parser,
            decoder_=decoder or self._decoder,
            dependencies_=dependencies,
            codec_=codec,
        )

    def publisher(  # type: ignore[override]
        self,
        topic: str,
        *,
        key: str | None = None,
        headers: dict[str, str] | None = None,
        persistent: bool = True,
        title: str | None = None,
        description: str | None = None,
        schema: Any = None,
        include_in_schema: bool = True,
    ) -> BusPublisher:
        """A publisher to `topic` (decorating a handler publishes what it returns)."""
        config = cast("BusBrokerConfig", self.config)
        pub = BusPublisher(
            BusPublisherConfig(topic=topic, key=key, headers=headers, _outer_config=config),
            BusPublisherSpecification(
                _outer_config=config,
                specification_config=BusPublisherSpecificationConfig(
                    topic=topic,
                    schema_=schema,
                    title_=title,
                    description_=description,
                    include_in_schema=include_in_schema,
                ),
            ),
        )
        super().publisher(pub, persistent=persistent)
        return pub


class BusBroker(BusRegistrator, BrokerUsecase[Message, "Bus", BusBrokerConfig]):
    """A FastStream broker on the bus. Takes `bus.connect()`'s arguments (`dsn`, then its settings)."""

    def __init__(
        self,
        dsn: str | None = None,
        *,
        create_topics: bool = False,
        middlewares: Sequence[Any] = (),
        dependencies: Sequence[Any] = (),
        parser: Any = None,
        decoder: Any = None,
        codec: Any = None,
        ack_policy: AckPolicy = EMPTY,
        graceful_timeout: float | None = 15.0,
        routers: Iterable[Any] = (),
        description: str | None = None,
        tags: Iterable[Any] = (),
        specification_url: str | None = None,
        protocol: str | None = None,
        protocol_version: str | None = None,
        security: Any = None,
        logger: LoggerProto | None = EMPTY,
        log_level: int = logging.INFO,
        apply_types: bool = True,
        serializer: Any = EMPTY,
        provider: Any = None,
        context: ContextRepo | None = None,
        id_generator: Callable[[], str] = gen_cor_id,
        underlying_driver_annotations: dict[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        """`dsn` and `bus.connect()`'s settings, then FastStream's broker arguments.

        `create_topics=True`: a topic missing when a subscriber starts or a publish goes to it is
        created (pubsub, 1 partition unless the subscriber says `partitions=`). A setting neither
        FastStream nor `bus.connect()` knows raises `bus.ValidationError` here, not at connect.
        """
        Config.load(settings)  # a ValidationError naming the unknown or invalid setting
        if not isinstance(create_topics, bool):
            raise _bus.ValidationError(f"create_topics must be True or False, not {create_topics!r}")
        super().__init__(
            dsn=dsn,
            settings=settings,
            routers=routers,
            config=BusBrokerConfig(
                producer=BusProducer(create_topics=create_topics),
                create_topics=create_topics,
                broker_middlewares=middlewares,
                broker_parser=parser,
                broker_decoder=decoder,
                broker_codec=codec,
                logger=make_logger_state(
                    logger=logger, log_level=log_level, default_storage_cls=_LoggerStorage
                ),
                fd_config=FastDependsConfig(
                    use_fastdepends=apply_types,
                    serializer=BusSerializer() if serializer is EMPTY else serializer,
                    provider=provider or dependency_provider,
                    context=context or ContextRepo(),
                ),
                broker_dependencies=dependencies,
                graceful_timeout=graceful_timeout,
                ack_policy=ack_policy,
                id_generator=id_generator,
                extra_context={"broker": self},
                underlying_driver_annotations=underlying_driver_annotations or {},
            ),
            specification=BrokerSpec(
                description=description,
                url=[specification_url or "postgresql://"],
                protocol=protocol or "postgresql",
                protocol_version=protocol_version or "pgactorbus",
                tags=tags,
                security=security,
            ),
        )

    @property
    def bus(self) -> Bus:
        """The connected Bus (IncorrectState before `connect()`)."""
        return self.config.broker_config.connection

    async def _connect(self) -> Bus:
        kwargs = dict(self._connection_kwargs)
        connection = await _bus.connect(kwargs["dsn"], **kwargs["settings"])
        self._attach(connection)
        return connection

    def _attach(self, connection: Any) -> None:
        config = self.config.broker_config
        config.bus = connection
        config.producer.connect(connection, config.fd_config._serializer, config.broker_codec)

    async def start(self) -> None:
        await self.connect()
        await super().start()

    async def stop(self, exc_type: Any = None, exc_val: Any = None, exc_tb: Any = None) -> None:
        await super().stop(exc_type, exc_val, exc_tb)
        config = self.config.broker_config
        if isinstance(config.producer, BusProducer):
            await config.producer.close()
        if self._connection is not None:
            connection, self._connection = self._connection, None
            config.bus = None
            if isinstance(config.producer, BusProducer):
                config.producer.disconnect()
            with suppress(AttributeError):
                await connection.close()

    async def ping(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109 - FastStream's signature
        if self._connection is None:
            return False
        try:
            async with asyncio.timeout(timeout or 5.0):
                await self._connection.list_topics()
        except Exception:
            return False
        return True

    async def publish(
        self,
        message: SendableMessage = None,
        topic: str = "",
        *,
        key: str | None = None,
        partition: str | int | None = None,
        headers: dict[str, str] | None = None,
        correlation_id: str | None = None,
        idempotency_key: str | None = None,
        reply_to: str = "",
    ) -> Any:
        """Publish to `topic` (the bus's Record back; None under the in-memory TestBusBroker).

        A broker not connected yet connects first (a script that only publishes needs no app).
        """
        if self._connection is None:
            await self.connect()
        cmd = BusPublishCommand(
            message,
            topic=topic,
            key=key,
            partition=partition,
            headers=headers,
            correlation_id=correlation_id or self.config.id_generator(),
            idempotency_key=idempotency_key,
            reply_to=reply_to,
            _publish_type=PublishType.PUBLISH,
        )
        return await self._basic_publish(cmd, producer=self.config.producer)

    async def publish_batch(  # type: ignore[override]
        self,
        *messages: SendableMessage,
        topic: str,
        key: str | None = None,
        partition: str | int | None = None,
        headers: dict[str, str] | None = None,
        correlation_id: str | None = None,
        reply_to: str = "",
    ) -> Any:
        """Publish `messages` to `topic` in one statement (`Bus.publish_many`): the bus's Records back."""
        if self._connection is None:
            await self.connect()
        cmd = BusPublishCommand(
            *(messages or (None,)),
            topic=topic,
            key=key,
            partition=partition,
            headers=headers,
            correlation_id=correlation_id or self.config.id_generator(),
            reply_to=reply_to,
            _publish_type=PublishType.PUBLISH,
        )
        return await self._basic_publish_batch(cmd, producer=self.config.producer)

    async def request(  # type: ignore[override]
        self,
        message: SendableMessage = None,
        topic: str = "",
        *,
        key: str | None = None,
        partition: str | int | None = None,
        headers: dict[str, str] | None = None,
        correlation_id: str | None = None,
        timeout: float | None = 30.0,  # noqa: ASYNC109 - FastStream's signature
    ) -> BusMessage:
        """Publish to `topic` and wait up to `timeout` seconds for the handler's reply (TimeoutError).

        The request carries its correlation id and a `reply_to` header naming this broker's
        partition of the reply topic; the reply is the handler's return value, as a BusMessage
        (`await reply.decode()`).
        """
        if self._connection is None:
            await self.connect()
        cmd = BusPublishCommand(
            message,
            topic=topic,
            key=key,
            partition=partition,
            headers=headers,
            correlation_id=correlation_id or self.config.id_generator(),
            timeout=timeout,
            _publish_type=PublishType.REQUEST,
        )
        producer = self.config.producer
        request = producer.request
        context = self.context
        for m in self.middlewares[::-1]:
            request = functools.partial(m(None, context=context).publish_scope, request)
        published = await request(cmd)
        reply: BusMessage = await _process_msg(
            msg=published,
            middlewares=(m(published, context=context) for m in self.middlewares),
            parser=producer._parser,
            decoder=producer._decoder,
            source_type=SourceType.RESPONSE,
        )
        return reply


# -- routers --------------------------------------------------------------------------------


@dataclass(kw_only=True)
class BusRouterConfig(BrokerConfig):
    @property
    def connection(self) -> Bus:
        raise IncorrectState("a BusRouter has no connection of its own: include it in a BusBroker")


class BusRoute(SubscriberRoute):
    """A subscriber registered later, by the `BusRouter` that takes it (FastStream's `RedisRoute`)."""

    def __init__(
        self,
        call: Callable[..., Any],
        topic: str,
        *,
        publishers: Iterable[BusPublisher] = (),
        **kwargs: Any,
    ) -> None:
        """`call` subscribed to `topic` with `BusRegistrator.subscriber`'s keyword arguments."""
        super().__init__(call, topic, publishers=cast("Iterable[Any]", publishers), **kwargs)


class BusRouter(BusRegistrator, BrokerRouter[Message, BusRouterConfig]):
    """A router to include in a BusBroker (`broker.include_router(router)`), as FastStream's
    `RedisRouter` is for its broker: a topic prefix, middlewares, dependencies and routes.

    (`bus.faststream.fastapi.BusRouter` is FastAPI's router, which starts a broker of its own.)
    """

    def __init__(
        self,
        prefix: str = "",
        handlers: Iterable[BusRoute] = (),
        *,
        dependencies: Sequence[Any] = (),
        middlewares: Sequence[Any] = (),
        routers: Iterable[Any] = (),
        parser: Any = None,
        decoder: Any = None,
        include_in_schema: bool | None = None,
        ack_policy: AckPolicy = EMPTY,
    ) -> None:
        super().__init__(
            handlers=handlers,
            config=BusRouterConfig(
                prefix=prefix,
                ack_policy=ack_policy,
                broker_dependencies=dependencies,
                broker_middlewares=middlewares,
                broker_parser=parser,
                broker_decoder=decoder,
                include_in_schema=include_in_schema,
            ),
            routers=routers,
        )


# -- testing --------------------------------------------------------------------------------


class TestBusBroker(TestBroker[BusBroker, Any], broker=BusBroker):
    """FastStream's TestBroker for BusBroker: in memory, or `with_real=True` against a real schema.

    In memory it refuses what the database would: a subscriber without a group on a topic not
    declared a queue (`topics={"jobs": "queue"}`), `batch=True` on a queue. With `topics=` (the
    topics the database has: names, or names to "pubsub"/"queue") a subscriber or publish on any
    other topic raises TopicNotFoundError unless the broker has `create_topics=True`.
    """

    def __init__(
        self,
        *brokers: BusBroker,
        topics: Mapping[str, str] | Iterable[str] | None = None,
        with_real: bool = False,
        connect_only: bool | None = None,
    ) -> None:
        super().__init__(*brokers, with_real=with_real, connect_only=connect_only)
        if topics is None:
            self.topics: dict[str, str] | None = None
        elif isinstance(topics, Mapping):
            self.topics = {str(k): str(v) for k, v in topics.items()}
        else:
            self.topics = dict.fromkeys(topics, "pubsub")
        for name, semantics in (self.topics or {}).items():
            if semantics not in ("pubsub", "queue"):
                raise _bus.ValidationError(
                    f"topic {name!r}: semantics must be 'pubsub' or 'queue', not {semantics!r}"
                )

    def create_publisher_fake_subscriber(self, broker: BusBroker, publisher: Any) -> tuple[Any, bool]:
        for handler in (s for b in self.brokers for s in b.subscribers):
            if cast("BusSubscriber", handler).topic == publisher.topic:
                return handler, True
        return broker.subscriber(publisher.topic, group="test", persistent=False), False

    @contextmanager
    def _patch_producer(self, broker: BusBroker) -> Any:
        memory = _InMemoryBus(broker, self.brokers, self.topics)
        broker.config.broker_config.bus = cast("Bus", memory)  # subscribers started later see it
        with change_producer(broker.config.broker_config, _FakeProducer(broker, memory)):
            yield

    def _fake_close(self, broker: BusBroker, *args: Any, **kwargs: Any) -> None:
        super()._fake_close(broker, *args, **kwargs)
        config = broker.config.broker_config
        if isinstance(config.bus, _InMemoryBus):
            config.bus = None

    async def _fake_connect(self, broker: BusBroker, *args: Any, **kwargs: Any) -> Any:
        return broker.config.broker_config.bus

    def _fake_start(self, broker: BusBroker, *args: Any, **kwargs: Any) -> None:
        memory = broker.config.broker_config.bus
        if isinstance(memory, _InMemoryBus):
            for sub in broker.subscribers:
                memory.check(cast("BusSubscriber", sub))
        super()._fake_start(broker, *args, **kwargs)


class _InMemoryBus:
    """The connection of a BusBroker under the in-memory TestBusBroker: publishes are routed, not stored.

    It knows the topics the test declared (None: any topic is taken for an existing pubsub topic),
    and holds what a subscriber without a handler (`get_one`, iteration) has not taken yet.
    """

    def __init__(
        self, broker: BusBroker, brokers: Sequence[BusBroker], topics: dict[str, str] | None
    ) -> None:
        self.broker = broker
        self.brokers = brokers
        self.topics = dict(topics) if topics is not None else None
        self.create_topics = broker.config.broker_config.create_topics
        self.offsets: dict[str, int] = {}
        self.held: dict[BusSubscriber, list[Message]] = {}
        self.arrived = asyncio.Condition()

    def semantics(self, topic: str, partitions: int | None = None) -> str:
        """The topic's semantics; TopicNotFoundError for one the database would not have."""
        if self.topics is None:
            return "pubsub"
        if topic not in self.topics:
            if not self.create_topics:
                raise _bus.TopicNotFoundError(
                    f"topic {topic!r} does not exist; create it with create_topic({topic!r}, ...) "
                    "(declared to TestBusBroker as topics=...), or BusBroker(create_topics=True)"
                )
            self.topics[topic] = "pubsub"
        return self.topics[topic]

    def check(self, sub: BusSubscriber) -> None:
        """Refuse a subscriber the real broker would refuse at start."""
        semantics = self.semantics(sub.topic, sub._partitions)
        if sub.group is None and (semantics != "queue" or self.topics is None):
            raise _bus.ValidationError(
                f"subscriber on pubsub topic {sub.topic!r} needs group=...: each group reads every message once "
                "(a queue topic's competing consumers have none: declare it, TestBusBroker(broker, "
                f"topics={{{sub.topic!r}: 'queue'}}))"
            )
        if semantics == "queue" and sub.batch:
            raise _bus.ValidationError(f"batch=True reads a pubsub topic; {sub.topic!r} is a queue")

    def subscribers(self, topic: str) -> list[BusSubscriber]:
        """One subscriber of each group on `topic` (a queue topic's consumers are one group)."""
        groups: set[str | None] = set()
        chosen = []
        for sub in (cast("BusSubscriber", s) for b in self.brokers for s in b.subscribers):
            if sub.topic == topic and sub.group not in groups:
                groups.add(sub.group)
                chosen.append(sub)
        return chosen

    def message(self, topic: str, cmd: BusPublishCommand, payload: bytes, headers: dict[str, str]) -> Message:
        self.semantics(topic)
        offset = self.offsets.get(topic, 0)
        self.offsets[topic] = offset + 1
        return Message(
            topic=topic,
            partition=str(cmd.partition or "0"),
            offset=offset,
            key=cmd.key,
            headers=headers,
            payload=payload,
            created_at=datetime.now(UTC),
        )

    async def deliver(self, raws: list[Message]) -> Any:
        """Hand messages to each group's subscriber (a handler, or the queue `get_one` reads)."""
        result: Any = None
        for sub in self.subscribers(raws[0].topic):
            if not sub.calls:
                async with self.arrived:
                    self.held.setdefault(sub, []).extend(raws)
                    self.arrived.notify_all()
            elif sub.batch:
                result = await sub.process_message(cast("Message", raws))
            else:
                for raw in raws:
                    result = await sub.process_message(raw)
        return result

    async def take(self, sub: BusSubscriber, timeout: float) -> Message | None:  # noqa: ASYNC109
        async with self.arrived:
            with suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.arrived.wait_for(lambda: bool(self.held.get(sub)))
            held = self.held.get(sub)
            return held.pop(0) if held else None


class _FakeProducer(BusProducer):
    """Routes a publish straight to the subscribers of its topic, as the bus would deliver it."""

    def __init__(self, broker: BusBroker, memory: _InMemoryBus) -> None:
        super().__init__()
        self.broker = broker
        self.memory = memory
        self.codec = broker.config.broker_codec or DefaultCodec()

    async def publish(self, cmd: BusPublishCommand) -> Any:
        cmd = BusPublishCommand.from_cmd(cmd)
        payload, headers = await _wire(cmd, self.codec, self.broker.config.fd_config._serializer)
        topic, _ = _destination(cmd.destination, cmd.partition)
        await self.memory.deliver([self.memory.message(topic, cmd, payload, headers)])
        return None

    async def publish_batch(self, cmd: BusPublishCommand) -> Any:
        cmd = BusPublishCommand.from_cmd(cmd)
        wired = await _wire_batch(cmd, self.codec, self.broker.config.fd_config._serializer)
        raws = [self.memory.message(cmd.destination, cmd, p, h) for p, h in wired]
        if raws:
            await self.memory.deliver(raws)
        return None

    async def request(self, cmd: BusPublishCommand) -> Any:
        cmd = BusPublishCommand.from_cmd(cmd)
        cmd.correlation_id = cmd.correlation_id or gen_cor_id()
        payload, headers = await _wire(cmd, self.codec, self.broker.config.fd_config._serializer)
        raw = self.memory.message(cmd.destination, cmd, payload, headers)
        handlers = [s for s in self.memory.subscribers(cmd.destination) if s.calls]
        if not handlers:
            raise SubscriberNotFound(f"no subscriber on {cmd.destination!r} to answer the request")
        async with asyncio.timeout(cmd.timeout):
            response = await handlers[0].process_message(raw)
        reply = BusPublishCommand.from_cmd(response.as_publish_command())
        reply.correlation_id = reply.correlation_id or cmd.correlation_id
        body, reply_headers = await _wire(reply, self.codec, self.broker.config.fd_config._serializer)
        return Message(
            topic=REPLY_TOPIC,
            partition="0",
            offset=0,
            key=None,
            headers=reply_headers,
            payload=body,
            created_at=datetime.now(UTC),
        )
