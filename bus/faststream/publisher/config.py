"""The configs of a `@broker.publisher`: its topic, key and headers."""

from __future__ import annotations

from dataclasses import dataclass, field

from bus.faststream._compat import PublisherSpecificationConfig, PublisherUsecaseConfig
from bus.faststream.configs import BusBrokerConfig


@dataclass(kw_only=True)
class BusPublisherConfig(PublisherUsecaseConfig):
    _outer_config: BusBrokerConfig = field(default_factory=BusBrokerConfig)
    topic: str
    key: str | None
    headers: dict[str, str] | None


@dataclass(kw_only=True)
class BusPublisherSpecificationConfig(PublisherSpecificationConfig):
    topic: str
