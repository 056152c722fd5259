"""`BusBrokerConfig`: what a BusBroker's subscribers and publishers share (producer, connection)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from faststream.exceptions import IncorrectState

from bus.faststream._compat import BrokerConfig
from bus.faststream.publisher.producer import BusProducer

if TYPE_CHECKING:
    from bus.client import Bus


@dataclass(kw_only=True)
class BusBrokerConfig(BrokerConfig):
    producer: BusProducer = field(default_factory=BusProducer)
    bus: Bus | None = None
    create_topics: bool = False

    @property
    def connection(self) -> Bus:
        if self.bus is None:
            raise IncorrectState(
                "BusBroker is not connected: `await broker.connect()` or `async with broker`"
            )
        return self.bus
