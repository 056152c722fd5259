"""`BusPublisher`: `@broker.publisher(topic)`, and a `BusRoute`'s publisher."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from faststream.response.publish_type import PublishType
from faststream.response.response import PublishCommand

from bus.faststream._compat import PublisherSpecification, PublisherUsecase
from bus.faststream.configs import BusBrokerConfig
from bus.faststream.message import BusMessage
from bus.faststream.publisher.config import BusPublisherConfig
from bus.faststream.publisher.specification import BusPublisherSpecification
from bus.faststream.response import BusPublishCommand

if TYPE_CHECKING:
    from bus.faststream._compat import SendableMessage


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

    def _command(
        self,
        message: SendableMessage,
        topic: str,
        key: str | None,
        headers: dict[str, str] | None,
        correlation_id: str | None,
        **fields: Any,
    ) -> BusPublishCommand:
        """A command with this publisher's topic, key and headers where the call gives none of its own."""
        return BusPublishCommand(
            message,
            topic=topic or self.topic,
            key=key or self.key,
            headers=self.headers | (headers or {}),
            correlation_id=correlation_id or self._outer_config.id_generator(),
            **fields,
        )

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
        cmd = self._command(
            message,
            topic,
            key,
            headers,
            correlation_id,
            partition=partition,
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
        cmd = self._command(
            message,
            topic,
            key,
            headers,
            correlation_id,
            partition=partition,
            timeout=timeout,
            _publish_type=PublishType.REQUEST,
        )
        request: Any = self._outer_config.producer.request
        for pub_m in self._build_middlewares_stack():
            request = functools.partial(pub_m, request)
        published = await request(cmd)
        context = self._outer_config.context
        return await self._outer_config.producer.reply(
            published,
            (m(published, context=context) for m in reversed(self._outer_config.broker_middlewares)),
        )
