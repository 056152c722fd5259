"""The configs of a `@broker.subscriber`: its topic, group, retry and reading settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from faststream.middlewares import AckPolicy

from bus.consumer import Retry
from bus.faststream._compat import EMPTY, SubscriberSpecificationConfig, SubscriberUsecaseConfig
from bus.faststream.configs import BusBrokerConfig


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
