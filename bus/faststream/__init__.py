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

from fast_depends.msgspec import MsgSpecSerializer as MsgSpecSerializer

from bus.faststream.broker.broker import BusBroker
from bus.faststream.broker.logging import _LoggerStorage as _LoggerStorage
from bus.faststream.broker.registrator import BusRegistrator as BusRegistrator
from bus.faststream.broker.router import BusRoute, BusRouter
from bus.faststream.broker.router import BusRouterConfig as BusRouterConfig
from bus.faststream.configs import BusBrokerConfig as BusBrokerConfig
from bus.faststream.message import BusMessage
from bus.faststream.parser import decode as decode
from bus.faststream.parser import decode_batch as decode_batch
from bus.faststream.parser import parse_batch as parse_batch
from bus.faststream.parser import parse_message as parse_message
from bus.faststream.publisher.config import BusPublisherConfig as BusPublisherConfig
from bus.faststream.publisher.config import BusPublisherSpecificationConfig as BusPublisherSpecificationConfig
from bus.faststream.publisher.producer import REPLY_TOPIC as REPLY_TOPIC
from bus.faststream.publisher.producer import BusProducer as BusProducer
from bus.faststream.publisher.specification import BusPublisherSpecification as BusPublisherSpecification
from bus.faststream.publisher.usecase import BusPublisher
from bus.faststream.response import BusPublishCommand
from bus.faststream.serializer import BusSerializer
from bus.faststream.subscriber.config import BusSubscriberConfig as BusSubscriberConfig
from bus.faststream.subscriber.config import (
    BusSubscriberSpecificationConfig as BusSubscriberSpecificationConfig,
)
from bus.faststream.subscriber.specification import BusSubscriberSpecification as BusSubscriberSpecification
from bus.faststream.subscriber.usecase import BusSubscriber
from bus.faststream.testing import TestBusBroker
from bus.faststream.testing import _FakeProducer as _FakeProducer
from bus.faststream.testing import _InMemoryBus as _InMemoryBus

# `__all__` is the public surface; the names imported `as` themselves are importable from here too
# (`from bus.faststream import BusProducer`), as from the modules that define them.
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
