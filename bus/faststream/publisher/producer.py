"""`BusProducer`: FastStream's publishes through `Bus.publish`, and requests' replies on `REPLY_TOPIC`."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import msgspec
from faststream.exceptions import IncorrectState
from faststream.message import SourceType, gen_cor_id

import bus as _bus
from bus.faststream._compat import EMPTY, DefaultCodec, ProducerProto
from bus.faststream.parser import _CONTENT_TYPE, _CORRELATION, _REPLY_TO, _process_msg, decode, parse_message
from bus.faststream.response import BusPublishCommand
from bus.types import Message, Outgoing

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from bus.client import Bus
    from bus.faststream.message import BusMessage


REPLY_TOPIC = "faststream.replies"  # requests' replies: one partition per requesting broker


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

    async def reply(self, published: Any, middlewares: Iterable[Any]) -> BusMessage:
        """A request's reply as its requester gets it: through `middlewares`, parsed and decoded."""
        reply: BusMessage = await _process_msg(
            msg=published,
            middlewares=middlewares,
            parser=self._parser,
            decoder=self._decoder,
            source_type=SourceType.RESPONSE,
        )
        return reply


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
