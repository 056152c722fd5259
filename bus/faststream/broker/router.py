"""`BusRouter` and `BusRoute`: the broker-level router, as FastStream's `RedisRouter` is for Redis."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from faststream.exceptions import IncorrectState
from faststream.middlewares import AckPolicy

from bus.faststream._compat import EMPTY, BrokerConfig, BrokerRouter, SubscriberRoute
from bus.faststream.broker.registrator import BusRegistrator
from bus.faststream.publisher.usecase import BusPublisher
from bus.types import Message

if TYPE_CHECKING:
    from collections.abc import Callable

    from bus.client import Bus


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
