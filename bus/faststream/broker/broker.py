"""`BusBroker`: a FastStream broker on the bus."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from fast_depends import dependency_provider
from faststream.message import gen_cor_id
from faststream.middlewares import AckPolicy
from faststream.response.publish_type import PublishType
from faststream.specification.schema import BrokerSpec

import bus as _bus
from bus.config import Config
from bus.faststream._compat import (
    EMPTY,
    BrokerUsecase,
    ContextRepo,
    FastDependsConfig,
    fd_serializer,
    make_logger_state,
)
from bus.faststream.broker.logging import _LoggerStorage
from bus.faststream.broker.registrator import BusRegistrator
from bus.faststream.configs import BusBrokerConfig
from bus.faststream.message import BusMessage
from bus.faststream.publisher.producer import BusProducer
from bus.faststream.response import BusPublishCommand
from bus.faststream.serializer import BusSerializer
from bus.types import Message

if TYPE_CHECKING:
    from collections.abc import Callable

    from bus.client import Bus
    from bus.faststream._compat import LoggerProto, SendableMessage


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
        config.producer.connect(connection, fd_serializer(config.fd_config), config.broker_codec)

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

    async def _command(
        self, *messages: SendableMessage, correlation_id: str | None, **fields: Any
    ) -> BusPublishCommand:
        """A command of this broker, connected first (a script that only publishes needs no app)."""
        if self._connection is None:
            await self.connect()
        return BusPublishCommand(
            *messages, correlation_id=correlation_id or self.config.id_generator(), **fields
        )

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
        cmd = await self._command(
            message,
            topic=topic,
            key=key,
            partition=partition,
            headers=headers,
            correlation_id=correlation_id,
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
        cmd = await self._command(
            *(messages or (None,)),
            topic=topic,
            key=key,
            partition=partition,
            headers=headers,
            correlation_id=correlation_id,
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
        cmd = await self._command(
            message,
            topic=topic,
            key=key,
            partition=partition,
            headers=headers,
            correlation_id=correlation_id,
            timeout=timeout,
            _publish_type=PublishType.REQUEST,
        )
        producer = self.config.broker_config.producer
        request: Any = producer.request
        context = self.context
        for m in self.middlewares[::-1]:
            request = functools.partial(m(None, context=context).publish_scope, request)
        published = await request(cmd)
        return await producer.reply(published, (m(published, context=context) for m in self.middlewares))
