"""`TestBusBroker`: FastStream's TestBroker for a BusBroker, in memory or against a real schema."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from faststream.exceptions import SubscriberNotFound
from faststream.message import gen_cor_id

import bus as _bus
from bus.faststream._compat import DefaultCodec, TestBroker, change_producer, fd_serializer
from bus.faststream.broker.broker import BusBroker
from bus.faststream.publisher.producer import REPLY_TOPIC, BusProducer, _destination, _wire, _wire_batch
from bus.faststream.response import BusPublishCommand
from bus.faststream.subscriber.usecase import BusSubscriber, InMemoryConnection
from bus.types import Message

if TYPE_CHECKING:
    from bus.client import Bus


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


class _InMemoryBus(InMemoryConnection):
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
        payload, headers = await _wire(cmd, self.codec, fd_serializer(self.broker.config.fd_config))
        topic, _ = _destination(cmd.destination, cmd.partition)
        await self.memory.deliver([self.memory.message(topic, cmd, payload, headers)])
        return None

    async def publish_batch(self, cmd: BusPublishCommand) -> Any:
        cmd = BusPublishCommand.from_cmd(cmd)
        wired = await _wire_batch(cmd, self.codec, fd_serializer(self.broker.config.fd_config))
        raws = [self.memory.message(cmd.destination, cmd, p, h) for p, h in wired]
        if raws:
            await self.memory.deliver(raws)
        return None

    async def request(self, cmd: BusPublishCommand) -> Any:
        cmd = BusPublishCommand.from_cmd(cmd)
        cmd.correlation_id = cmd.correlation_id or gen_cor_id()
        payload, headers = await _wire(cmd, self.codec, fd_serializer(self.broker.config.fd_config))
        raw = self.memory.message(cmd.destination, cmd, payload, headers)
        handlers = [s for s in self.memory.subscribers(cmd.destination) if s.calls]
        if not handlers:
            raise SubscriberNotFound(f"no subscriber on {cmd.destination!r} to answer the request")
        async with asyncio.timeout(cmd.timeout):
            response = await handlers[0].process_message(raw)
        reply = BusPublishCommand.from_cmd(response.as_publish_command())
        reply.correlation_id = reply.correlation_id or cmd.correlation_id
        body, reply_headers = await _wire(reply, self.codec, fd_serializer(self.broker.config.fd_config))
        return Message(
            topic=REPLY_TOPIC,
            partition="0",
            offset=0,
            key=None,
            headers=reply_headers,
            payload=body,
            created_at=datetime.now(UTC),
        )
