"""`BusRegistrator`: `subscriber` and `publisher` of a BusBroker and of its routers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from faststream.middlewares import AckPolicy

import bus as _bus
from bus.consumer import Retry
from bus.faststream._compat import EMPTY, CallsCollection, Registrator
from bus.faststream.configs import BusBrokerConfig
from bus.faststream.publisher.config import BusPublisherConfig, BusPublisherSpecificationConfig
from bus.faststream.publisher.specification import BusPublisherSpecification
from bus.faststream.publisher.usecase import BusPublisher
from bus.faststream.subscriber.config import BusSubscriberConfig, BusSubscriberSpecificationConfig
from bus.faststream.subscriber.specification import BusSubscriberSpecification
from bus.faststream.subscriber.usecase import BusSubscriber
from bus.types import Message


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
