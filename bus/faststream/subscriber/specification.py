"""The AsyncAPI description of a BusSubscriber."""

from __future__ import annotations

from faststream.specification.asyncapi.utils import resolve_payloads
from faststream.specification.schema import Message as SpecMessage
from faststream.specification.schema import Operation, SubscriberSpec

from bus.faststream._compat import SubscriberSpecification
from bus.faststream.configs import BusBrokerConfig
from bus.faststream.subscriber.config import BusSubscriberSpecificationConfig


class BusSubscriberSpecification(SubscriberSpecification[BusBrokerConfig, BusSubscriberSpecificationConfig]):
    @property
    def channel_labels(self) -> list[str]:
        return [f"{self._outer_config.prefix}{self.config.topic}"]

    @property
    def name(self) -> str:
        if self.config.title_:
            return self.config.title_
        group = f":{self.config.group}" if self.config.group else ""
        return f"{self._outer_config.prefix}{self.config.topic}{group}:{self.call_name}"

    def get_schema(self) -> dict[str, SubscriberSpec]:
        payloads = self.get_payloads()
        return {
            self.name: SubscriberSpec(
                address=f"{self._outer_config.prefix}{self.config.topic}",
                description=self.description,
                operation=Operation(
                    message=SpecMessage(title=f"{self.name}:Message", payload=resolve_payloads(payloads)),
                    bindings=None,
                ),
                bindings=None,
            )
        }
