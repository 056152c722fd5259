"""Every use of FastStream's private API by `bus.faststream`, in one place.

Checked against FastStream 0.7.8 (the package allows `faststream>=0.7,<0.8`). FastStream's brokers
are built on classes it keeps under `faststream._internal` (the broker, registrator and router
bases, the subscriber and publisher usecases, their configs, the test broker), so a broker of its
own kind imports them as `faststream.redis` does; a FastStream release may move or change any of
them, and this module is the one to read against its changelog.

Beside the imports, two private names are reached here: `SubscriberUsecase`'s name-mangled
`__build__middlewares_stack` and `FastDependsConfig._serializer`. What the bus's classes override
or call on these bases through their underscore names (`_outer_config`, `_basic_publish`,
`_post_start`, `_fake_start`, `_patch_producer`, ...) stays with the class that overrides it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from faststream._internal.basic_types import LoggerProto, SendableMessage
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
from faststream._internal.context import ContextRepo
from faststream._internal.di import FastDependsConfig
from faststream._internal.endpoint.publisher import PublisherSpecification, PublisherUsecase
from faststream._internal.endpoint.publisher.fake import FakePublisher
from faststream._internal.endpoint.subscriber import SubscriberSpecification, SubscriberUsecase
from faststream._internal.endpoint.subscriber.call_item import CallsCollection
from faststream._internal.endpoint.subscriber.mixins import TasksMixin
from faststream._internal.fastapi.router import StreamRouter
from faststream._internal.logger import DefaultLoggerStorage, make_logger_state
from faststream._internal.logger.logging import get_broker_logger
from faststream._internal.parser import DefaultCodec
from faststream._internal.producer import ProducerProto
from faststream._internal.testing.broker import TestBroker, change_producer
from faststream._internal.utils.functions import return_input

if TYPE_CHECKING:
    from fast_depends.library.serializer import SerializerProto

__all__ = [
    "EMPTY",
    "BrokerConfig",
    "BrokerRouter",
    "BrokerUsecase",
    "CallsCollection",
    "ContextRepo",
    "DefaultCodec",
    "DefaultLoggerStorage",
    "FakePublisher",
    "FastDependsConfig",
    "LoggerProto",
    "ProducerProto",
    "PublisherSpecification",
    "PublisherSpecificationConfig",
    "PublisherUsecase",
    "PublisherUsecaseConfig",
    "Registrator",
    "SendableMessage",
    "StreamRouter",
    "SubscriberRoute",
    "SubscriberSpecification",
    "SubscriberSpecificationConfig",
    "SubscriberUsecase",
    "SubscriberUsecaseConfig",
    "TasksMixin",
    "TestBroker",
    "change_producer",
    "fd_serializer",
    "get_broker_logger",
    "make_logger_state",
    "middlewares_stack",
    "return_input",
]


def middlewares_stack(subscriber: SubscriberUsecase[Any]) -> tuple[Any, ...]:
    """The subscriber's middleware factories as FastStream builds them (its private,
    name-mangled `SubscriberUsecase.__build__middlewares_stack`)."""
    return tuple(subscriber._SubscriberUsecase__build__middlewares_stack())  # type: ignore[attr-defined]


def fd_serializer(config: FastDependsConfig) -> SerializerProto | None:
    """The serializer FastDepends uses (`FastDependsConfig`'s private `_serializer`)."""
    return config._serializer
