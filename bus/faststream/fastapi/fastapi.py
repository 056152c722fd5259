"""`BusRouter`: FastStream's FastAPI integration on a BusBroker (`app.include_router(router)`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi.datastructures import Default

from bus.faststream._compat import ContextRepo, StreamRouter
from bus.faststream.broker.broker import BusBroker
from bus.faststream.publisher.usecase import BusPublisher
from bus.faststream.subscriber.usecase import BusSubscriber
from bus.types import Message

__all__ = ["BusRouter"]


class BusRouter(StreamRouter[Message]):
    """A FastAPI router whose lifespan starts a BusBroker; handlers take FastAPI's `Depends`.

    `BusRouter(dsn, **settings)` takes `bus.connect()`'s arguments, like `BusBroker`.
    """

    broker_class = BusBroker
    broker: BusBroker

    def __init__(self, dsn: str | None = None, *, context: ContextRepo | None = None, **kwargs: Any) -> None:
        """`dsn` and `bus.connect()`'s settings, BusBroker's and FastAPI router's keyword arguments."""
        super().__init__(dsn, context=context, **kwargs)

    def subscriber(  # type: ignore[override]
        self,
        topic: str,
        *,
        dependencies: Iterable[Any] = (),
        response_model: Any = Default(None),  # noqa: B008 - FastAPI's sentinel
        response_model_include: Any = None,
        response_model_exclude: Any = None,
        response_model_by_alias: bool = True,
        response_model_exclude_unset: bool = False,
        response_model_exclude_defaults: bool = False,
        response_model_exclude_none: bool = False,
        **broker_kwargs: Any,
    ) -> BusSubscriber:
        """`BusBroker.subscriber`'s arguments (topic, group=, retry=, ...), handlers with FastAPI's DI."""
        sub: BusSubscriber = super().subscriber(  # type: ignore[assignment]
            topic,
            dependencies=dependencies,
            response_model=response_model,
            response_model_include=response_model_include,
            response_model_exclude=response_model_exclude,
            response_model_by_alias=response_model_by_alias,
            response_model_exclude_unset=response_model_exclude_unset,
            response_model_exclude_defaults=response_model_exclude_defaults,
            response_model_exclude_none=response_model_exclude_none,
            **broker_kwargs,
        )
        return sub

    def publisher(self, topic: str, **kwargs: Any) -> BusPublisher:  # type: ignore[override]
        """`BusBroker.publisher`."""
        return self.broker.publisher(topic, **kwargs)
