"""The AsyncAPI description of a BusPublisher."""

from __future__ import annotations

from faststream.specification.asyncapi.utils import resolve_payloads
from faststream.specification.schema import Message as SpecMessage
from faststream.specification.schema import Operation, PublisherSpec

from bus.faststream._compat import PublisherSpecification
from bus.faststream.configs import BusBrokerConfig
from bus.faststream.publisher.config import BusPublisherSpecificationConfig


class BusPublisherSpecification(PublisherSpecification[BusBrokerConfig, BusPublisherSpecificationConfig]):
    @property
    def name(self) -> str:
        return self.config.title_ or f"{self._outer_config.prefix}{self.config.topic}:Publisher"

    def get_schema(self) -> dict[str, PublisherSpec]:
        payloads = self.get_payloads()
        return {
            self.name: PublisherSpec(
                address=f"{self._outer_config.prefix}{self.config.topic}",
                description=self.config.description_,
                operation=Operation(
                    message=SpecMessage(
                        title=f"{self.name}:Message", payload=resolve_payloads(payloads, "Publisher")
                    ),
                    bindings=None,
                ),
                bindings=None,
            )
        }
